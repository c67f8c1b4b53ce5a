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


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """``largebatch train --help-config | head -1``: the reader closes the pipe, the next write raised
    BrokenPipeError and the command ended in a traceback. It ends quietly, with 141 (128 + SIGPIPE)."""
    from processes import src_env

    proc = subprocess.Popen([sys.executable, "-m", "largebatch", "train", "--help-config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=src_env(OMP_NUM_THREADS="1"))
    assert proc.stdout.readline().startswith(b"Every field of a training config")
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
