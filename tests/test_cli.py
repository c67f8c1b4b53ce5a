import subprocess
import sys

import pytest

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


def _caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: /proc/PID/status, SigCgt)."""
    status = open(f"/proc/{pid}/status").read()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask & (1 << (signum - 1)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_in_a_commands_first_seconds_is_one_line(tmp_path, signame):
    """The commands took the stop signals over only after they had imported torch (~3 s): a SIGTERM
    then ended `largebatch experiment` silently, a Ctrl-C in a KeyboardInterrupt traceback. The
    dispatcher takes them before it imports a command: here the signal is sent as soon as the
    process catches SIGTERM, which is before it has loaded torch, and the command ends in one line."""
    import signal
    import time

    from processes import src_env

    signum = getattr(signal, signame)
    proc = subprocess.Popen([sys.executable, "-m", "largebatch", "experiment", "noise-scale", "--smoke",
                             "--out", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=src_env(OMP_NUM_THREADS="1"), text=True)
    try:
        deadline = time.monotonic() + 60
        while not _caught(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.002)
        torch_loaded = "libtorch" in open(f"/proc/{proc.pid}/maps").read()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not torch_loaded, "the stop signals were taken over only after torch was imported"
    assert proc.returncode == 128 + signum, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"largebatch experiment: stopped by {signame}"), err
    assert not (tmp_path / "out").exists()


def test_a_stop_signal_while_the_handlers_are_put_in_is_one_line(monkeypatch, capsys):
    """The dispatcher's handlers go in one signal at a time, and the first is live before the last:
    a SIGTERM in between raised from the context manager's entry, outside every handler of it, and
    ended the command in a traceback (the test above met it once in a full test run). Here the signal is
    delivered by the real handler while the second is being put in."""
    import os
    import signal

    import largebatch.signals as signals
    from largebatch.cli import main

    put_in = signals.take_signals

    def interrupted(handler, sigs=signals.SIGNALS):
        first, *rest = [s for s in sigs if signal.getsignal(s) != signal.SIG_IGN]
        previous = put_in(handler, (first,))
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: inside take_signals
            previous.update(put_in(handler, tuple(rest)))
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        raise AssertionError("the signal was not delivered")

    monkeypatch.setattr(signals, "take_signals", interrupted)
    code = main(["schedule", "--total-tokens", "1e6", "--seq-len", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM and err == ["largebatch schedule: stopped by SIGTERM while starting; "
                                                    "nothing was written"], err
