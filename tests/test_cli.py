import subprocess
import sys

from largebatch.cli import main


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "schedule", "memory"):
        assert name in out


def test_unknown_command_suggests(capsys):
    assert main(["trian"]) == 2
    assert "Did you mean 'train'" in capsys.readouterr().err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "largebatch", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("largebatch ")
