"""largebatch experiment: its report directory (one experiment at a time, of one kind) and its worker
processes (none outlives the experiment; one stopped alone ends it in one line)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from largebatch.experiments import cli

ROOT = Path(__file__).resolve().parents[1]


def _refused(capsys, argv: list[str]) -> str:
    """The one line on stderr of a command line refused with exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_report_directory_holds_one_experiment_at_a_time(tmp_path, capsys, monkeypatch):
    """--out is checked before any arm: not empty, not another experiment's or size's directory, not
    a directory that is no experiment's; and locked while an experiment runs in it."""
    monkeypatch.chdir(tmp_path)  # an --out '' that fell back to the default would write here
    err = _refused(capsys, ["seesaw", "--smoke", "--out", "", "--check"])
    assert "--out ''" in err and "empty" in err
    assert not (tmp_path / "runs").exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / cli.MARKER).write_text(json.dumps({"experiment": "optimizers", "size": "smoke"}))
    err = _refused(capsys, ["seesaw", "--smoke", "--out", str(other), "--check"])
    assert f"--out {other} holds the experiment optimizers at smoke size, not seesaw at smoke size" in err
    assert "choose another --out" in err
    err = _refused(capsys, ["optimizers", "--quick", "--out", str(other), "--check"])
    assert "optimizers at smoke size, not optimizers at quick size" in err
    assert cli.main(["optimizers", "--smoke", "--out", str(other), "--check"]) == 0  # its own: accepted
    err = _refused(capsys, ["all", "--smoke", "--out", str(other), "--check"])  # not one subdirectory each
    assert f"--out {other} is the report directory of one experiment" in err

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("")
    err = _refused(capsys, ["seesaw", "--smoke", "--out", str(foreign), "--check"])
    assert f"--out {foreign} is not empty (thesis.tex) and is not an experiment's report directory" in err
    older = tmp_path / "older"  # an earlier version's report directory: runs/, no marker
    (older / "runs").mkdir(parents=True)
    assert cli.main(["seesaw", "--smoke", "--out", str(older), "--check"]) == 0

    # a second experiment into a directory that one is running in: refused at once, naming the holder
    from largebatch.train.rundir import RunLock

    class NeverTrains:
        def run(self, *args, **kwargs):
            raise AssertionError("an arm was started in a directory another experiment holds")

    monkeypatch.setattr(cli, "_module", lambda name: NeverTrains())
    busy = tmp_path / "busy"
    held = RunLock(busy)  # another open file: flock refuses it as it would another process
    try:
        err = _refused(capsys, ["seesaw", "--smoke", "--out", str(busy), "--check"])  # --check too
        assert f"seesaw: experiment directory {busy} is in use by another experiment (pid {os.getpid()} " in err
        capsys.readouterr()
        assert cli.main(["seesaw", "--smoke", "--out", str(busy)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("largebatch experiment: error: seesaw: experiment directory ")
        assert f"{busy} is in use by another experiment (pid {os.getpid()} " in err and "--out" in err
    finally:
        held.release()
    assert not (busy / cli.MARKER).exists()

    # --jobs above the CPU count: one line of warning, not a refusal
    capsys.readouterr()
    assert cli.main(["seesaw", "--smoke", "--jobs", "4096", "--out", str(tmp_path / "j"), "--check"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("largebatch experiment: warning: --jobs 4096 is more than the ") and "\n" not in err


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (a zombie no one has reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _workers(pid: int, count: int, timeout_s: float = 60.0) -> list[int]:
    """The worker processes of ``pid`` (its children but the resource tracker), once ``count`` run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [k for k in _children(pid)
                   if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]
        if len(workers) >= count:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"process {pid} did not start {count} workers in {timeout_s} s")


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _experiment(out: Path, ignore: tuple[int, ...] = (), slow_start: bool = False) -> subprocess.Popen:
    """A smoke experiment of 3 arms in 2 worker processes, its arms given a budget they never reach
    (so a signal always lands while they train, however loaded the machine); its stderr goes to
    OUT.err (a file: a pipe would stay open as long as a worker outlived it). ``ignore``: signals the
    process starts ignoring (nohup: SIGHUP; a shell script's background job: SIGINT).
    ``slow_start``: 120 KiB of (absent) directories on sys.path, which multiprocessing sends each
    new worker in its start-up data: more than a pipe holds (64 KiB), so the experiment waits in
    that write until the new worker's interpreter is up and reads it, ~0.1 s after the worker
    appears in /proc -- where a signal once cut the write short."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    bulk = "sys.path += [f'/absent/{i:04d}/' + 'x' * 1000 for i in range(120)]\n" if slow_start else ""
    code = ("import sys\n" + bulk +
            "from largebatch.experiments import runner\n"
            "runner.SIZE_OVERRIDES['smoke']['run.total_tokens'] = 50_000_000\n"
            "from largebatch.experiments.cli import main\n"
            "sys.argv[0] = 'largebatch experiment'\n"
            f"sys.exit(main(['noise-scale', '--smoke', '--seeds', '1', '--jobs', '2', '--out', {str(out)!r}]))\n")
    with open(f"{out}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=(lambda: [signal.signal(s, signal.SIG_IGN) for s in ignore]) if ignore
                                else None)


def _stop_and_read(experiment: subprocess.Popen, out: Path, timeout_s: float = 400.0) -> str:
    """The experiment's stderr once it ends (``timeout_s``: past the runner's 120 s grace for a
    stopped worker's checkpoint, with room for a loaded machine; the test suite's own arms share
    the cores)."""
    try:
        experiment.wait(timeout_s)
    finally:
        if experiment.poll() is None:
            experiment.kill()
            experiment.wait()
    return Path(f"{out}.err").read_text()


def _training(out: Path, timeout_s: float = 300.0) -> None:
    """Wait until an arm trains (its train.log has a line). Beside the test suite on 2 cores, with
    the data cache still to build, that took more than 90 s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(log.stat().st_size for log in out.glob("runs/*/train.log")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no arm started training in {out} in {timeout_s} s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_worker_outlives_the_experiment(tmp_path):
    """The parent SIGKILLed (or OOM-killed) while its workers train: they stop too, instead of
    waiting for work forever. An idle worker whose parent dies exits as well."""
    idle = subprocess.Popen([sys.executable, "-c", (
        "import multiprocessing, time\n"
        "from largebatch.experiments import runner\n"
        "ctx = multiprocessing.get_context('spawn')\n"
        "pipes = [ctx.Pipe() for _ in range(2)]  # held: a pipe closed here ends its worker\n"
        "for mine, theirs in pipes:\n"
        "    ctx.Process(target=runner._arm_worker, args=(theirs, 1)).start()\n"
        "time.sleep(600)\n")], env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    experiment = _experiment(tmp_path / "out")
    workers = []
    try:
        idle_workers = _workers(idle.pid, 2)
        workers += idle_workers
        time.sleep(1.0)  # past their start-up: waiting for a task
        idle.kill()
        idle.wait()
        _training(tmp_path / "out")
        busy_workers = _workers(experiment.pid, 2)
        workers += busy_workers
        experiment.kill()
        experiment.wait()
        assert not _gone(idle_workers, 10.0), "idle workers outlived their parent"
        assert not _gone(busy_workers, 60.0), "training workers outlived their parent"
    finally:
        for process in (idle, experiment):
            if process.poll() is None:
                process.kill()
                process.wait()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _signalled(out: Path, send, ignore: tuple[int, ...] = ()) -> tuple[subprocess.Popen, str, list[int], float]:
    """Start an experiment (``ignore``: signals it starts ignoring), wait until its 2 workers train,
    ``send(experiment, workers)`` signals, and wait for the end: (the experiment, its stderr, the
    workers left alive 5 s later -- killed, the seconds from the last signal to the end)."""
    experiment = _experiment(out, ignore)
    workers, sent = [], None
    try:
        _training(out)
        workers = _workers(experiment.pid, 2)
        send(experiment, workers)
        sent = time.monotonic()
    finally:
        err = _stop_and_read(experiment, out)
        took = time.monotonic() - sent if sent is not None else math.inf
        left = _gone(workers, 5.0)
        for pid in left:  # the old behaviour: orphans
            os.kill(pid, signal.SIGKILL)
    return experiment, err, left, took


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_workers_start_ends_in_one_line(tmp_path):
    """SIGINT to the experiment as soon as its workers exist, while they import torch and build
    their first arm (before the trainer takes SIGINT over): the parent passes it on, and each worker
    ended in a KeyboardInterrupt traceback (60-100 lines) before the one-line summary. The SIGINT
    lands while the experiment writes the second worker its start-up data (``slow_start``): raised
    there, it cut the write short and that worker died in multiprocessing's own start-up code with
    an EOFError traceback; the runner now holds a signal until a worker's start is over."""
    out = tmp_path / "early"
    experiment = _experiment(out, slow_start=True)
    workers = []
    try:
        workers = _workers(experiment.pid, 2)
        experiment.send_signal(signal.SIGINT)
    finally:
        err = _stop_and_read(experiment, out)
        for pid in _gone(workers, 5.0):
            os.kill(pid, signal.SIGKILL)
    assert experiment.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "error: SIGINT: noise-scale stopped" in err.strip().splitlines()[-1], err[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_signal_to_one_worker_or_sighup_ends_the_experiment_in_one_line(tmp_path):
    """SIGTERM to one worker alone: its arm checkpoints and the experiment ends with one line saying
    so (exit 128 + the signal), no traceback, within seconds (a worker killed while it held a lock
    shared with the others once kept them from exiting for the runner's 120 s grace). SIGHUP to the
    experiment (its terminal closed) stops it as SIGTERM does; a signal it was started ignoring
    stays ignored. SIGUSR1 to the experiment and its workers at once (Slurm's warning before the time
    limit reaches every process of the job step) stops it with every training arm checkpointed."""
    experiment, err, left, took = _signalled(tmp_path / "out", lambda experiment, workers:
                                             os.kill(workers[0], signal.SIGTERM))
    lines = [line for line in err.splitlines() if line.strip() and "[largebatch]" not in line]
    assert experiment.returncode == 128 + signal.SIGTERM, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("largebatch experiment: error: noise-scale: arm ") and "SIGTERM" in lines[0]
    assert "run the same command with --resume" in lines[0]
    assert not left, "workers outlived the experiment"
    assert took < 60.0, f"the experiment ended {took:.0f} s after the signal"

    def ignored_then_hangup(experiment, workers):
        experiment.send_signal(signal.SIGINT)  # ignored since its start (a script's background job)
        time.sleep(3.0)
        assert experiment.poll() is None and all(_alive(pid) for pid in workers), "an ignored SIGINT stopped it"
        experiment.send_signal(signal.SIGHUP)

    experiment, err, left, took = _signalled(tmp_path / "hup", ignored_then_hangup, ignore=(signal.SIGINT,))
    lines = [line for line in err.splitlines() if line.strip() and "[largebatch]" not in line]
    assert experiment.returncode == 128 + signal.SIGHUP, err
    assert len(lines) == 1 and lines[0].startswith("largebatch experiment: error: SIGHUP: noise-scale stopped"), err
    assert not left, "workers outlived the experiment"
    assert took < 60.0, f"the experiment ended {took:.0f} s after the signal"

    def slurm_warning(experiment, workers):  # --signal=USR1@T: every process of the job step, at once
        for pid in (experiment.pid, *workers):
            os.kill(pid, signal.SIGUSR1)

    experiment, err, left, took = _signalled(tmp_path / "usr1", slurm_warning)
    lines = [line for line in err.splitlines() if line.strip() and "[largebatch]" not in line]
    assert experiment.returncode == 128 + signal.SIGUSR1, err
    assert len(lines) == 1 and lines[0].startswith("largebatch experiment: error: SIGUSR1: noise-scale stopped"), err
    # the runner passes on the signal it got: to a worker stopping on its own SIGUSR1, a SIGTERM
    # would have been a second signal (exit at once, no checkpoint)
    assert "without a checkpoint" not in err, err
    begun = [arm for arm in (tmp_path / "usr1" / "runs").iterdir() if (arm / "train.log").stat().st_size]
    stepped = [arm for arm in begun if (arm / "metrics.jsonl").is_file()
               and '"kind": "train"' in (arm / "metrics.jsonl").read_text()]
    # every arm that had finished a step checkpointed (one in its setup or its first step has nothing
    # to keep: a signal between a step's micro-batches drops that step)
    assert begun and all(list((arm / "checkpoints").glob("step_*")) for arm in stepped), err
    assert not left, "workers outlived the experiment"
    assert took < 60.0, f"the experiment ended {took:.0f} s after the signal"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_signal_while_the_arms_checkpoint_kills_them_and_says_so(tmp_path):
    """SIGTERM, then SIGINT while the stopped arms checkpoint: the parent's setup handler took the
    second one, left the workers unwaited and said "stopped between arms" with two arms running.
    Now the running arms are killed and the one line names them as killed before their checkpoint.
    A repeat of the first signal (0.1 s later: a cluster signals every process, a terminal twice)
    is still that signal: the arms checkpoint and nothing is said of killing."""
    def repeat_then_other(experiment, workers):
        experiment.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        experiment.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # well before a worker has checkpointed and exited (a process's exit alone takes longer)
        experiment.send_signal(signal.SIGINT)

    experiment, err, left, took = _signalled(tmp_path / "out", repeat_then_other)
    lines = [line for line in err.splitlines() if line.strip() and "[largebatch]" not in line]
    assert experiment.returncode == 128 + signal.SIGTERM, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("largebatch experiment: error: SIGTERM: noise-scale stopped; arms interrupted: "), err
    assert "(a second signal killed them before they checkpointed" in lines[0], err
    assert not left, "workers outlived the experiment"
    assert took < 30.0, f"the experiment ended {took:.0f} s after the second signal"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_closed_pipe_stops_the_experiment_in_one_line(tmp_path):
    """``largebatch experiment ... | head``: when the reader has gone, the next line (an arm that
    finished) stops the experiment as a signal does -- no arm started after it, the running one
    checkpoints, exit 141, one line -- where it used to end in "could not write a file: Broken pipe
    ... Free space" (exit 1). Its lines are flushed as printed: the first one is read while arms
    train."""
    out = tmp_path / "piped"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    with open(f"{out}.err", "w") as err:
        experiment = subprocess.Popen(
            [sys.executable, "-m", "largebatch", "experiment", "noise-scale", "--smoke", "--seeds", "1",
             "--jobs", "2", "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    workers = []
    try:
        assert "val loss" in experiment.stdout.readline()  # the first arm's line, as it finished
        workers = _workers(experiment.pid, 2)
        experiment.stdout.close()  # the reader exits (`| head -1`) while the other two arms train
    finally:
        stderr = _stop_and_read(experiment, out)
        left = _gone(workers, 5.0)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert experiment.returncode == 128 + signal.SIGPIPE, stderr[-3000:]
    assert "Traceback" not in stderr and "standard output was closed by its reader" in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("largebatch experiment: error: standard output was closed by "
                                               "its reader: noise-scale stopped. Run the same command with "
                                               "--resume to keep the finished arms"), stderr[-3000:]
    assert not left, "workers outlived the experiment"
    # an arm that had finished a step when the line met the closed pipe checkpointed (one still
    # starting, or in its first step, which the stop drops, has nothing to keep); how many had
    # finished by then depends on the machine's speed
    for arm in (out / "runs").iterdir():
        stepped = (arm / "metrics.jsonl").is_file() and '"kind": "train"' in (arm / "metrics.jsonl").read_text()
        assert (arm / "summary.json").is_file() or not stepped or list((arm / "checkpoints").glob("step_*")), arm


def test_a_signal_while_a_worker_starts_is_raised_once_the_start_is_over():
    """The runner's handler holds a signal that arrives while a worker process is being started and
    raises it after, once (the first signal's number when two came); an error in the start itself
    is raised as it is, not replaced by the held signal."""
    from largebatch.experiments.runner import ArmsInterrupted, _Interrupt

    interrupt = _Interrupt(lambda signum: ArmsInterrupted(signum, [], []))
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        reached = []
        with pytest.raises(ArmsInterrupted) as caught:
            with interrupt.held():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
                reached.append("the start went on")
        assert reached and caught.value.signum == signal.SIGTERM
        with pytest.raises(OSError, match="no such worker"):
            with interrupt.held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise OSError("no such worker")
        with interrupt.held():  # nothing held over from before
            pass
        with pytest.raises(ArmsInterrupted):  # and not held outside
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


SETUP_SIGNAL = """
import os, signal, sys
import largebatch.experiments.runner as runner
peak = runner._peak_flops
def signalled():  # SIGTERM while the experiment sets up (before any arm trains)
    os.kill(os.getpid(), signal.SIGTERM)
    return peak()
runner._peak_flops = signalled
from largebatch.experiments.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_before_any_arm_trains_is_one_line(tmp_path):
    """SIGTERM while an experiment set up (or between arms of `--jobs 1`) ended it at once, saying
    nothing (exit 143 and an empty stderr); it stops with one line, as a signal during an arm does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SETUP_SIGNAL, "noise-scale", "--smoke", "--seeds", "1",
                           "--out", str(tmp_path / "setup")], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 143, done.stderr[-2000:]
    assert lines == ["largebatch experiment: error: SIGTERM: noise-scale stopped outside the arms' training "
                     "(setup, fine-tuning, a report). Run the same command with --resume to keep the finished "
                     "arms"], done.stderr[-2000:]
    assert not (tmp_path / "setup" / "runs").exists() or not any((tmp_path / "setup" / "runs").iterdir())
