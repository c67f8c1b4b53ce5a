"""`torchrun -m largebatch train` for real (gloo, 2 processes): data parallel (DDP), tensor +
sequence parallel, and FSDP stopped on 2 ranks and resumed on 1, each against one process. Every
run clips the gradient norm (optim.grad_clip binds on most steps) and evaluates between steps, so
the clipping norm must cover every parameter as each parallel mode holds it (FSDP2 leaves its root
unsharded after a no-grad evaluation)."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from largebatch import LONG_WAIT_GROUP
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics

pytestmark = pytest.mark.distributed
CLIP = 0.5


def _overrides(cache: Path, out: Path, **extra) -> dict:
    o = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
         "data.vocab_size": 512, "data.cache_dir": str(cache), "schedule.batch_policy": "seesaw",
         "schedule.batch_size": 8, "schedule.peak_lr": 3e-2, "schedule.final_lr": 0.2,
         "run.micro_batch": 2, "run.total_tokens": 6144, "run.eval_tokens": 512,
         "run.progress": "off", "run.sample_tokens": 0, "run.peak_flops": 1e11,
         "run.tensorboard": False, "run.out_dir": str(out), "optim.grad_clip": CLIP,
         "run.plots": False}  # matplotlib: ~1.5 s of each process
    o.update(extra)
    return o


def _torchrun(overrides: dict, nproc: int = 2) -> None:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}" for k, v in overrides.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def _noise(run_dir: Path) -> list[float | None]:
    return [r.get("noise_scale") for r in read_metrics(run_dir) if r["kind"] == "train"]


def _grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def _val(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_val_loss"]


@pytest.fixture(scope="module")
def single(tiny_data_cache, tmp_path_factory):
    cache = tiny_data_cache  # (keyed on content: shared with the other modules of this worker)
    out = tmp_path_factory.mktemp("runs") / "single"
    o = _overrides(cache, out)
    Trainer(load_config(resolve_config(None), o), out, log=lambda *_: None).fit()
    assert sum(g > CLIP for g in _grad_norms(out)) >= 3  # clipping binds on several steps
    return cache, out


@pytest.fixture(scope="module")
def ddp_run(single, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank DDP run: the reference of the stopped-and-continued 2-rank runs."""
    out = tmp_path_factory.mktemp("runs") / "ddp"
    _torchrun(_overrides(single[0], out))
    return out


def test_a_ddp_run_of_three_replicas_resumes_to_the_bit(single, tmp_path):
    """DDP all-reduces its first backward in one bucket, then rebuilds the buckets in the order the
    gradients arrived; a resumed process's first step used the first layout, and with 3 replicas or
    more the summation order moved: losses left the uninterrupted run's by ~1e-7 from the step after
    the resume on (2 replicas add two numbers, the same either way). The resumed process now lays
    its buckets out as the run did (parallelize.settle_ddp_buckets): every loss, gradient norm and
    noise-scale estimate equal, with dropout drawing on."""
    extra = {"schedule.batch_policy": "constant", "schedule.batch_size": 6, "run.total_tokens": 32 * 6 * 7,
             "model.dropout": 0.1, "run.eval_every_tokens": 32 * 6 * 7}
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _torchrun(_overrides(single[0], full, **extra), nproc=3)
    _torchrun(_overrides(single[0], resumed, **extra, **{"run.max_steps": 3}), nproc=3)
    _torchrun(_overrides(single[0], resumed, **extra), nproc=3)

    def records(run):
        return [(r["step"], r["loss"], r["grad_norm"], r.get("noise_scale"))
                for r in read_metrics(run) if r["kind"] == "train"]

    assert len(records(full)) == 7 and records(resumed) == records(full)
    assert _val(resumed) == _val(full)


@pytest.mark.parametrize("mode", ["dp2-ddp", "tp2-sp", "tp2-loss-parallel"])
def test_torchrun_matches_one_process(single, request, tmp_path, mode):
    """Losses, clipped gradient norms and every evaluation's loss and accuracy as one process's; the
    accuracy under the vocabulary-parallel loss too (its logits stay split over the vocabulary; SP
    with it: the uneven-vocabulary test below).

    tp = 2 without SP under the vocabulary-parallel loss: every step and the final checkpoint ran,
    then the end-of-run sample failed on both ranks (the logits were a DTensor split over the
    vocabulary: "aten.cat.default got mixed torch.Tensor and DTensor"), exit 1 without summary.json,
    and again on every relaunch. The sample is now drawn from the gathered logits."""
    cache, ref = single
    if mode == "dp2-ddp":
        out = request.getfixturevalue("ddp_run")
    else:
        out = tmp_path / "run"
        sample = {"run.sample_tokens": 12, "run.sample_prompt": "ROMEO:"} if mode == "tp2-loss-parallel" else {}
        profile = {"run.profile_steps": "2-3"} if mode == "tp2-sp" else {}  # (it changes no number)
        _torchrun(_overrides(cache, out, **{"parallel.tp": 2, "parallel.sequence_parallel": mode == "tp2-sp",
                                            "parallel.loss_parallel": mode == "tp2-loss-parallel"},
                             **sample, **profile))
        if profile:  # each rank writes its own trace of the window's steps
            for rank in (0, 1):
                with gzip.open(out / "profile" / "steps_2-3" / f"rank{rank}.pt.trace.json.gz", "rt") as file:
                    names = {e.get("name", "") for e in json.load(file)["traceEvents"]}
                assert {"ProfilerStep#2", "ProfilerStep#3", "aten::mm"} <= names
                assert (out / "profile" / "steps_2-3" / f"rank{rank}.txt").is_file()
        if sample:
            text = json.loads((out / "summary.json").read_text())["sample"]
            assert text.startswith("ROMEO:") and len(text) > len("ROMEO:"), text
    accuracies = [[r["val_accuracy"] for r in read_metrics(run) if r["kind"] == "val"] for run in (out, ref)]
    assert None not in accuracies[0] and accuracies[0] == pytest.approx(accuracies[1], abs=2.5e-3)  # 1 in ~500
    ours, theirs = _losses(out), _losses(ref)
    assert len(ours) == len(theirs) and ours[-1] < ours[0] - 0.3  # it learned, same step count
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-5)     # the same algorithm, step by step
    assert _grad_norms(out) == pytest.approx(_grad_norms(ref), rel=1e-5)  # the norm that was clipped
    assert _val(out) == pytest.approx(_val(ref), abs=1e-5)
    # before the first step the models are equal: the validation split over the dp ranks (each
    # evaluates every dp-th micro-batch, sums all-reduced) gives the one-process mean
    first_val = [[r["val_loss"] for r in read_metrics(run) if r["kind"] == "val"][0] for run in (out, ref)]
    assert first_val[0] == pytest.approx(first_val[1], rel=1e-6)


@pytest.mark.parametrize("mode", ["dp2-ddp", "dp2-fsdp", "pp2"])
def test_fp16_loss_scaling_matches_one_process(single, tmp_path, mode):
    """run.dtype = 'fp16' started at a loss scale of 2**30, far above what fp16 holds: its first steps
    overflow. Every rank must decide each overflow alike (the step taken back everywhere, the scale
    halved everywhere) and unscale its own gradients (DDP's replicas, FSDP2's shards, the pipeline's
    stages): the losses, the scale and the overflow count of every step and the final evaluation are
    one process's. The FSDP2 run stops at step 5, in the middle of the descent, and continues from its
    distributed checkpoint with the scale it had."""
    cache, _ = single
    fp16 = {"run.dtype": "fp16", "run.loss_scale": 2.0**30, "run.log_every_steps": 1,
            **({"model.tie_embeddings": False} if mode == "pp2" else {})}
    ref = tmp_path / "one"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **fp16)), ref, log=lambda *_: None).fit()
    out = tmp_path / "run"
    layout = {"dp2-ddp": {}, "dp2-fsdp": {"parallel.dp_mode": "fsdp"}, "pp2": {"parallel.pp": 2}}[mode]
    if mode == "dp2-fsdp":
        _torchrun(_overrides(cache, out, **fp16, **layout, **{"run.max_steps": 5}))
    _torchrun(_overrides(cache, out, **fp16, **layout))

    def scales(run):
        return [(r["step"], r["loss_scale"], r["overflow_steps"], r.get("overflow", False))
                for r in read_metrics(run) if r["kind"] == "train"]

    ours = scales(out)
    assert ours == scales(ref) and ours[0][1:] == (2.0**29, 1, True) and not ours[-1][3]
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-5, abs=1e-5)
    assert _losses(out)[-1] < _losses(out)[0] - 0.1  # it learned once the scale fitted
    assert _val(out) == pytest.approx(_val(ref), abs=1e-5)
    if mode == "dp2-ddp":  # another estimator (the replicas' gradients against the all-reduced one), on the
        # same gradients: the same size, where a scale left in a replica's norm would put it ~2**38 away
        assert 0.25 < _noise(out)[-1] / _noise(ref)[-1] < 4
    if mode == "pp2":  # one replica: the noise scale from the stages' first micro-batch, unscaled as one process's
        noise = [_noise(run) for run in (out, ref)]
        assert [n is None for n in noise[0]] == [n is None for n in noise[1]] and noise[1][-1] is not None
        assert [n for n in noise[0] if n is not None] == pytest.approx([n for n in noise[1] if n is not None], rel=1e-3)


def test_a_vocabulary_tensor_parallel_does_not_divide_is_split_unevenly(single, tmp_path):
    """GPT-2's 50257 ids over tp = 2 was refused ("set model.vocab_size = 50258"), and an init_from
    model cannot change its vocabulary: a published GPT-2 could not run under tensor parallel. The
    embedding and the output layer are now split unevenly (DTensor: 258 and 257 rows of 515 here).
    Under SP and the vocabulary-parallel loss, stopped after 3 steps and continued from its
    distributed checkpoint, every loss, clipped norm and evaluation (accuracy too: each rank's best
    token is offset by where its slice starts) is one process's, and the checkpoint exports."""
    from largebatch.cli import main as cli_main

    cache, _ = single
    odd = {"model.vocab_size": 515, "schedule.batch_policy": "constant", "run.total_tokens": 4096}
    ref = tmp_path / "one"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **odd)), ref, log=lambda *_: None).fit()
    out = tmp_path / "tp"
    tp = {**odd, "parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.loss_parallel": True}
    _torchrun(_overrides(cache, out, **tp, **{"run.max_steps": 3}))
    _torchrun(_overrides(cache, out, **tp))
    ours, theirs = _losses(out), _losses(ref)
    assert len(ours) == len(theirs) > 3 and ours == pytest.approx(theirs, rel=1e-5, abs=1e-5)
    assert _grad_norms(out) == pytest.approx(_grad_norms(ref), rel=1e-5)
    vals = [[(r["val_loss"], r["val_accuracy"]) for r in read_metrics(run) if r["kind"] == "val"]
            for run in (out, ref)]
    assert [v for v, _ in vals[0]] == pytest.approx([v for v, _ in vals[1]], rel=1e-5)
    assert [a for _, a in vals[0]] == pytest.approx([a for _, a in vals[1]], abs=2.5e-3)  # 1 in ~500
    assert cli_main(["export", str(out), str(tmp_path / "hf"), "--format", "hf"]) == 0  # checks its logits


def test_fsdp_checkpoint_resumes_on_one_process(single, tmp_path):
    """...from the newest intact checkpoint: a shard of the newest one overwritten with garbage is
    passed over, with a warning, for the one before (DCP's read error is a BaseException)."""
    cache, ref = single
    out = tmp_path / "fsdp"
    _torchrun(_overrides(cache, out, **{"parallel.dp_mode": "fsdp", "run.max_steps": 7,
                                        "run.checkpoint_every_tokens": 1024}))
    newest = out / "checkpoints" / "step_00000007.dcp"
    assert (newest / ".metadata").is_file()
    assert len(list((out / "checkpoints").glob("step_*.dcp"))) >= 2
    extra = torch.load(newest / "extra.pt", weights_only=True)  # torch.load's default since torch 2.6
    assert len(extra["rng"]) == 2 and extra["progress"]["step"] == 7
    assert _grad_norms(out) == pytest.approx(_grad_norms(ref)[:7], rel=1e-5)  # FSDP's own steps
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(b"not a shard" * (shard.stat().st_size // 11))
    o = _overrides(cache, out, **{"parallel.dp_mode": "fsdp", "run.max_steps": None})
    lines: list[str] = []
    Trainer(load_config(resolve_config(None), o), out, resume=True, log=lines.append).fit()
    assert any("step_00000007.dcp is damaged" in line and "falling back" in line for line in lines), lines
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-5, abs=1e-5)
    assert _val(out) == pytest.approx(_val(ref), abs=1e-5)


def test_one_process_checkpoint_resumes_on_pipeline_stages_and_a_misfit_is_never_a_rollback(single, tmp_path):
    """A one-process .pt checkpoint continues exactly on pp=2 (each stage takes its parameters' state
    by name) and on dp=2 when every remaining batch splits in two; where one does not (the last),
    the intact checkpoint is refused in one line, never passed over for an older one as if damaged."""
    cache, one = single
    untied = {"model.tie_embeddings": False}  # pipeline stages cannot share the embedding
    ref = tmp_path / "ref"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **untied)), ref, log=lambda *_: None).fit()
    out = tmp_path / "pp"
    o = _overrides(cache, out, **untied, **{"run.max_steps": 5, "run.checkpoint_every_tokens": 512})
    Trainer(load_config(resolve_config(None), o), out, log=lambda *_: None).fit()
    assert len(list((out / "checkpoints").glob("step_*.pt"))) >= 2
    _torchrun(_overrides(cache, out, **untied, **{"parallel.pp": 2}))  # the same command continues it
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-6, abs=1e-6)
    assert _val(out) == pytest.approx(_val(ref), abs=1e-6)
    grown = tmp_path / "dp"  # Seesaw's batches of 8, 16, ...: each splits over 2 replicas
    o = _overrides(cache, grown, **{"run.max_steps": 5, "run.checkpoint_every_tokens": 512})
    Trainer(load_config(resolve_config(None), o), grown, log=lambda *_: None).fit()
    _torchrun(_overrides(cache, grown))  # 2 DDP replicas continue it: the one-process run's steps
    assert _losses(grown) == pytest.approx(_losses(one), rel=1e-6, abs=1e-6)
    assert _val(grown) == pytest.approx(_val(one), abs=1e-6)
    # batches of 6 split in two, but 189 sequences end in a step of 3 (trimmed at one replica's
    # granularity): that resume was refused; the last step now takes 4, as a 2-replica run's does,
    # and every step before it is the one-process run's
    last = tmp_path / "last"
    odd = {"schedule.batch_policy": "constant", "schedule.batch_size": 6, "run.micro_batch": 3,
           "run.total_tokens": 189 * 32}
    ref = tmp_path / "last-ref"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **odd)), ref, log=lambda *_: None).fit()
    o = _overrides(cache, last, **odd, **{"run.max_steps": 5, "run.checkpoint_every_tokens": 512})
    Trainer(load_config(resolve_config(None), o), last, log=lambda *_: None).fit()
    _torchrun(_overrides(cache, last, **odd))
    assert _losses(last)[:-1] == pytest.approx(_losses(ref)[:-1], rel=1e-6, abs=1e-6)
    steps = [r for r in read_metrics(last) if r["kind"] == "train"]
    assert [r["batch_size"] for r in steps][-2:] == [6, 4] and steps[-1]["tokens"] == 190 * 32
    misfit = tmp_path / "odd"  # Seesaw grows 6 to 9 sequences (multiples of micro_batch 3): no split in two
    odd = {"schedule.batch_size": 6, "run.micro_batch": 3, "schedule.ratio": "1/1.5"}
    o = _overrides(cache, misfit, **odd, **{"run.max_steps": 5, "run.checkpoint_every_tokens": 512})
    Trainer(load_config(resolve_config(None), o), misfit, log=lambda *_: None).fit()
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}"
                                            for k, v in _overrides(cache, misfit, **odd).items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "cannot resume from" in proc.stderr and "step_00000005.pt (intact" in proc.stderr
    assert "data-parallel degree that divides 1" in proc.stderr and "damaged" not in proc.stderr
    assert ("multiples of micro_batch x 1 = 3 sequences, and the step at" in proc.stderr and
            "takes a batch of 9 sequences, which 2 replicas cannot split evenly") in proc.stderr, proc.stderr[-2000:]
    assert len(_losses(misfit)) == 5  # nothing trained, nothing rolled back


def _rank_pid(rank: int, parent: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (read from /proc, a real process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=%d" % rank in env and int(stat[3]) == parent:
            return int(entry.name)
    return None


def _launch(overrides: dict, *torchrun_args: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *torchrun_args, "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}"
                                                              for k, v in overrides.items()]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _wait_until(proc: subprocess.Popen, ready, timeout: float = 240, poll: float = 0.05) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(poll)
    raise AssertionError(f"never ready (exit {proc.poll()})")


def _train_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"kind": "train"') if path.exists() else 0


def _dcp_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.dcp"))


def _kill_rank_one_after_a_checkpoint(proc, out) -> list[int]:
    """SIGKILL rank 1 of the torchrun job ``proc`` once a DCP checkpoint exists in ``out``; returns
    the killed pid (empty if the job ended first)."""
    victim: list[int] = []

    def kill_rank_one() -> bool:
        if _dcp_steps(out) and (pid := _rank_pid(1, parent=proc.pid)):
            os.kill(pid, signal.SIGKILL)
            victim.append(pid)
            return True
        return False

    _wait_until(proc, kill_rank_one)
    return victim



def _rank_failure_lines(err: str) -> list[str]:
    """Each rank's one-line report of its failure: the command's error line, or -- when torchrun stops
    a rank once another has exited, before that rank printed it -- the line rank_guard prints first.
    Both ranks fail the same way at nearly the same moment, and torchrun stops the slower one as soon
    as the first has exited: on a loaded machine that can come before even rank_guard's line (once
    seen in a fresh-clone run of the suite; torchrun's summary then lists only the first). So at
    least one rank's own line; the other's when it got to print it."""
    lines = [line for line in err.splitlines()
             if line.startswith(("largebatch train: error: rank ", "[largebatch] rank "))]
    assert any(f"rank {rank}/2 " in line for line in lines for rank in (0, 1)), err[-3000:]
    return lines

def test_sigkilled_rank_is_named_and_the_same_command_continues_exactly(single, ddp_run, tmp_path):
    """SIGKILL rank 1 of a 2-rank DDP run after its first checkpoint: torchrun fails naming the rank,
    no temporary is left, and the very same torchrun command line continues from the checkpoint to
    the losses of the uninterrupted 2-rank run, to the bit."""
    out = tmp_path / "killed"
    o = _overrides(single[0], out, **{"run.checkpoint_every_tokens": 32 * 8 * 4})
    proc = _launch(o)
    victim = _kill_rank_one_after_a_checkpoint(proc, out)
    _, err = proc.communicate(timeout=300)
    assert victim and proc.returncode != 0
    assert re.search(r"rank\s*:\s*1\b", err), err[-2000:]  # torchrun's failure summary names it
    # rank 0, whose collective lost its peer, names the rank that reported no error (it said "look for
    # that rank's own 'failed' line", which a killed rank never prints). On a loaded machine torchrun
    # can stop rank 0 (SIGTERM, on seeing rank 1 gone) before gloo reports the lost peer: rank 0 then
    # says it was interrupted and that the checkpoint is intact (seen once in a fresh-clone run)
    assert re.search(r"\[largebatch\] rank 0/2 [^\n]*: \(a collective failed or timed out: rank 1 of 2 reported no "
                     r"error within 3 s -- killed outright \(SIGKILL", err) or re.search(
        r"interrupted outside the training loop \(SIGTERM\); the newest checkpoint \S+ is intact", err), err[-3000:]
    assert not list((out / "checkpoints").glob(".*.tmp"))  # no temporary left behind
    again = _launch(o)
    stdout, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from {out / 'checkpoints'}" in stdout
    assert _losses(out) == _losses(ddp_run)  # same mesh, restored RNG and data position: exact
    # the noise scale too: each replica's local squared norm is summed over DDP's bucket in its layout,
    # which a resumed process had from its first backward (the all-reduce of 2 replicas is the same in
    # any order, the local sum was not: 1 ulp off from the resume on, before the buckets were settled)
    assert _noise(out) == _noise(ddp_run) and any(_noise(ddp_run))


FLAKY_LAUNCHER = """
import os, sys
import torch
from largebatch.cli import main
from largebatch.train.optimizer import register_optimizer

class Flaky(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        if os.environ["RANK"] == "1" and self.steps == 3:
            raise RuntimeError("flaky step 3 on rank 1: its read timed out")  # its own error, not a peer's
        return super().step(closure)

register_optimizer("flaky", lambda groups, cfg: Flaky(groups, lr=0.01), summary="SGD that fails on rank 1",
                   fields=(), adapt_default=None, state_bytes=0)
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_the_rank_that_failed_first_is_named_by_the_ranks_its_failure_took_down(single, tmp_path):
    """A registered optimizer (a user's launcher imports it, then runs the CLI) raises on rank 1 at
    its third step. Rank 0, whose gradient all-reduce then loses its peer, names rank 1 as the first
    failure, with its error: in its own line and in the message torchrun's closing "Root Cause" block
    quotes (that block breaks a tie of the same second toward rank 0, and quoted only its
    "Connection closed by peer")."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(FLAKY_LAUNCHER)
    o = _overrides(single[0], tmp_path / "flaky", **{"optim.name": "flaky", "optim.grad_clip": None})
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(launcher)]
    proc = subprocess.run(args + [f"--{k}={json.dumps(v)}" for k, v in o.items()], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    err = proc.stderr
    assert proc.returncode != 0 and "rank 1/2 (dp 1/2, tp 0/1)" in err, err[-3000:]
    assert "failed: RuntimeError: flaky step 3 on rank 1: its read timed out" in err, err[-3000:]
    consequence = re.search(r"\[largebatch\] rank 0/2 [^\n]*: \(a consequence: rank 1/2 \(dp 1/2, tp 0/1\) on "
                            r"\S+ failed first: RuntimeError: flaky step 3 on rank 1: its read timed out\)", err)
    assert consequence, err[-3000:]
    # rank 1's own error says "timed out" but is no collective's: it neither waits nor blames rank 0
    assert not re.search(r"\[largebatch\] rank 1/2 [^\n]*: \(a ", err) and "reported no error" not in err, err[-3000:]
    closing = [line for line in err.splitlines() if line.startswith("largebatch train: error: rank 0/2")]
    assert len(closing) == 1 and "(a consequence: rank 1/2" in closing[0], err[-3000:]  # its one line says it too
    root = err[err.index("Root Cause"):]
    assert "flaky step 3 on rank 1" in root, root  # whichever rank's error file it quotes


SLOW_LAUNCHER = """
import os, signal, sys, time
from largebatch.train.loop import Trainer
step, save = Trainer.train_step, Trainer.save
def train_step(self):  # rank 1: slow in this launch's first step, stuck in the run's 7th
    if os.environ["RANK"] == "1":
        if not getattr(self, "stepped", False):
            self.stepped = True
            time.sleep(5)
        if self.pos.step == 6:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stuck: torchrun's SIGTERM ends it at once
            time.sleep(60)
    return step(self)
def slow_save(self):  # rank 1: every save starts 5 s late; rank 0 notes each group's timeout then
    if os.environ["RANK"] == "1":
        time.sleep(5)
    else:
        import json, torch
        from torch.distributed import distributed_c10d as c10d
        waits = sorted({(g.group_desc, g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
                        for g in c10d._world.pg_map})
        with open(os.path.join(self.run_dir, "group_timeouts.json"), "w") as f:
            json.dump(waits, f)
    return save(self)
Trainer.train_step, Trainer.save = train_step, slow_save
from largebatch.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("layout", ["ddp", "pp2"])
def test_a_rank_stuck_in_a_step_is_found_after_the_step_timeout(single, tmp_path, layout):
    """parallel.step_timeout_s = 3 with timeout_s = 120: rank 1, 5 s late in its first step and in
    the checkpoint save after step 4 (the start-up, the first step and saves keep timeout_s), trains
    on; stuck in the 7th step, rank 0's collective gives up after 3 s (not 120) and names it. Under
    pipeline parallel rank 0 waits in a receive from rank 1's stage, which gloo bounded by the group's
    first timeout (120 s) whatever was set later: the step's sends and receives run on a copy of the
    pp group made with the step timeout."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_LAUNCHER)
    out = tmp_path / "run"
    extra = {"parallel.step_timeout_s": 3, "parallel.timeout_s": 120, "run.total_tokens": 32 * 8 * 12,
             "schedule.batch_policy": "constant", "run.checkpoint_every_tokens": 32 * 8 * 4}
    if layout == "pp2":
        extra.update({"parallel.pp": 2, "model.tie_embeddings": False})
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(script)] + [f"--{k}={json.dumps(v)}" for k, v in _overrides(single[0], out, **extra).items()]
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path)))
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 50, (took, proc.stderr[-3000:])  # 60 s asleep; 120 s timeout
    assert re.search(r"\[largebatch\] rank 0/2 [^\n]*: \(a collective failed or timed out: rank 1 of 2 "
                     r"reported no error", proc.stderr), proc.stderr[-3000:]
    assert len(_losses(out)) == 6 and _dcp_steps(out) == [4]  # past the slow first step and save
    # at the save, between steps: every group back at timeout_s, the mesh's size-1 groups too (made
    # with torch's 1800 s before), and the data build's wait group still at its 7 days
    waits = json.loads((out / "group_timeouts.json").read_text())
    assert {desc for desc, _ in waits} >= {"default_pg", LONG_WAIT_GROUP, "mesh_tp"}, waits
    assert all(seconds == (7 * 86400 if desc == LONG_WAIT_GROUP else 120) for desc, seconds in waits), waits
    assert ("pp_step" in {desc for desc, _ in waits}) == (layout == "pp2")  # (the copy: gloo, pp > 1 only)


def test_max_restarts_brings_a_killed_rank_back_on_the_uninterrupted_trajectory(single, ddp_run, tmp_path):
    """`torchrun --max-restarts 1`: SIGKILL rank 1 after the first periodic checkpoint; torchrun
    restarts both workers with the same command line, which continue from the newest checkpoint on
    their own (a fresh store key space per attempt: the killed attempt's gloo addresses are stale)
    and finish with the uninterrupted 2-rank run's losses, to the bit."""
    out = tmp_path / "restarted"
    o = _overrides(single[0], out, **{"run.checkpoint_every_tokens": 32 * 8 * 4})
    proc = _launch(o, "--max-restarts", "1")
    victim = _kill_rank_one_after_a_checkpoint(proc, out)
    stdout, err = proc.communicate(timeout=300)
    assert victim and proc.returncode == 0, err[-3000:]
    assert f"resumed from {out / 'checkpoints'}" in stdout, stdout[-2000:]  # the second attempt
    assert not list((out / "checkpoints").glob(".*.tmp"))
    assert _losses(out) == _losses(ddp_run)  # every step once, as the uninterrupted run took it
    # the noise scale too: each replica's local squared norm is summed over DDP's bucket in its layout,
    # which a resumed process had from its first backward (the all-reduce of 2 replicas is the same in
    # any order, the local sum was not: 1 ulp off from the resume on, before the buckets were settled)
    assert _noise(out) == _noise(ddp_run) and any(_noise(ddp_run))


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_full_disk_during_a_distributed_save_is_one_line_and_resumable(single, ddp_run, tmp_path, background):
    """After the first checkpoint both ranks may write no file past 32 KiB (RLIMIT_FSIZE set on the
    live workers, as `prlimit` does): the metrics still fit, the next DCP save's shards do not. Every
    rank stops with one line naming the checkpoint, the cause and the intact one before it (DCP's
    CheckpointException is a BaseException: it used to escape as a traceback per rank); nothing
    half-written is left, and the same command continues the run exactly. With run.async_checkpoint
    the shards are written by DCP's async_save in the background: the failure is agreed on and
    raised at the next save or the run's end, the same line on every rank; and the run that continues
    writes its checkpoints in the background too, each in place once written (every rank's losses the
    uninterrupted synchronous run's)."""
    import resource

    out = tmp_path / "full"
    o = _overrides(single[0], out, **{"run.checkpoint_every_tokens": 32 * 8 * 4, "run.async_checkpoint": background})
    proc, limited = _launch(o), []

    def limit_both_ranks() -> bool:
        pids = [_rank_pid(rank, parent=proc.pid) for rank in (0, 1)]
        if _dcp_steps(out) and all(pids):
            for pid in pids:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1 << 15, 1 << 15))
            limited.append(_dcp_steps(out))
            return True
        return False

    _wait_until(proc, limit_both_ranks)
    _, err = proc.communicate(timeout=300)
    assert limited == [[4]] and proc.returncode != 0, err[-3000:]
    ckdir = out / "checkpoints"
    errors = _rank_failure_lines(err)
    assert "CheckpointException" not in err, err[-3000:]
    for line in errors:
        assert (f"could not write checkpoint {ckdir / 'step_00000008.dcp'}: File too large" in line
                and f"the previous checkpoint {ckdir / 'step_00000004.dcp'} is intact" in line
                and "Raise the file-size limit (ulimit -f" in line), line
    assert _dcp_steps(out) == [4] and not list(ckdir.glob(".*.tmp"))
    again = _launch(o)
    stdout, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from {ckdir / 'step_00000004.dcp'}" in stdout
    assert _losses(out) == _losses(ddp_run)


READ_ONLY_DRIVER = """
import json, os, pathlib, subprocess, sys, time
cmd, ckdir, report = json.loads(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
env = dict(os.environ, OMP_NUM_THREADS="1")
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
while proc.poll() is None and not list(ckdir.glob("step_*.dcp")):
    time.sleep(0.02)
subprocess.run(["mount", "-o", "remount,ro", str(ckdir)], check=True)  # the next save hits it
_, err = proc.communicate()
left = sorted(p.name for p in ckdir.iterdir())
subprocess.run(["mount", "-o", "remount,rw", str(ckdir)], check=True)
again = subprocess.run(cmd, capture_output=True, text=True, env=env)
after = sorted(p.name for p in ckdir.iterdir())
report.write_text(json.dumps({"rc": proc.returncode, "err": err, "left": left, "again_rc": again.returncode,
                              "again_out": again.stdout, "again_err": again.stderr[-3000:], "after": after}))
"""


def test_read_only_disk_during_a_distributed_save_is_one_line_and_resumable(single, ddp_run, tmp_path):
    """The checkpoint directory is a real tmpfs (a private mount namespace) remounted read-only once
    the first DCP checkpoint is in place: the next save fails on every rank with EROFS in one line,
    the first checkpoint stays, and once the disk is writable again the same command continues."""
    import textwrap

    out = tmp_path / "ro"
    ckdir = out / "checkpoints"
    ckdir.mkdir(parents=True)
    o = _overrides(single[0], out, **{"run.checkpoint_every_tokens": 32 * 8 * 4})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "largebatch", "train"] + [f"--{k}={json.dumps(v)}" for k, v in o.items()]
    driver, report = tmp_path / "driver.py", tmp_path / "report.json"
    driver.write_text(textwrap.dedent(READ_ONLY_DRIVER))
    script = (f"mount -t tmpfs -o size=64m tmpfs {ckdir} && "
              f"exec {sys.executable} {driver} '{json.dumps(cmd)}' {ckdir} {report}")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and report.is_file(), done.stderr[-3000:]
    r = json.loads(report.read_text())
    errors = _rank_failure_lines(r["err"])
    assert r["rc"] != 0 and "CheckpointException" not in r["err"], r["err"][-3000:]
    for line in errors:
        assert (f"could not write checkpoint {ckdir / 'step_00000008.dcp'}: Read-only file system" in line
                and f"the previous checkpoint {ckdir / 'step_00000004.dcp'} is intact. Make it writable"
                in line), line
    # the finished checkpoint stays; when the disk turned read-only after the next save had made its
    # staging directory (a fast machine gets there first), that directory stays too, unlisted
    assert [n for n in r["left"] if not n.startswith(".")] == ["step_00000004.dcp"], r["left"]
    assert all(n.startswith(".step_00000008.dcp.tmp") for n in r["left"] if n.startswith(".")), r["left"]
    assert r["again_rc"] == 0, r["again_err"]
    assert f"resumed from {ckdir / 'step_00000004.dcp'}" in r["again_out"]
    assert not [n for n in r["after"] if n.startswith(".")], r["after"]  # the next save removed it
    assert _losses(out) == _losses(ddp_run)


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits, undelivered, on the (stopped) process ``pid``."""
    status = _status(pid)
    return any(int(status[key], 16) >> (sig - 1) & 1 for key in ("SigPnd", "ShdPnd"))


def _signal_held(ranks: list[int], targets: list[int], sig: int, receivers: list[int]) -> None:
    """Send ``sig`` to ``targets`` while the ``ranks`` are held (SIGSTOP: a loaded machine must not let
    the run end first), wait until it is pending on every one of ``receivers`` (torchrun's forwarded
    copy takes >0.5 s on a loaded machine), then let the ranks go on."""
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    while not all(_status(pid)["State"].startswith("T") for pid in ranks):  # (SIGSTOP takes a moment;
        time.sleep(0.01)  # a lower-numbered signal arriving first would be delivered first)
    try:
        for pid in targets:
            os.kill(pid, sig)
        deadline = time.time() + 60
        while not all(_pending(pid, sig) for pid in receivers) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)


def test_signals_stop_both_ranks_at_one_step_and_the_same_command_continues(single, ddp_run, tmp_path):
    """SIGINT to rank 1 alone, then SIGTERM to torchrun (what Kubernetes does), then SIGHUP to
    torchrun (its terminal closed; torchrun forwards it), then SIGUSR1 to torchrun and both ranks at
    once (Slurm's ``--signal=USR1@T`` warning reaches every process of the job step; torchrun told
    to forward it too): both ranks stop after the same step, write one distributed checkpoint and
    exit 130 / 143 / 129 / 138; the same torchrun command line continues each time, and the whole
    trajectory equals the uninterrupted run's.

    Last, under ``torchrun --max-restarts 1``, SIGUSR1 to both workers alone (a forwarding trap,
    `pkill`, a pod whose first process is not torchrun): they checkpoint and exit 138, which torchrun
    takes for a failure and starts them again -- and the restarted workers trained on to the end,
    undoing the stop. Now the restarted attempt sees the job's stop note and exits again at once; a
    new job (the same command) continues on the uninterrupted trajectory."""
    out = tmp_path / "signals"
    o = _overrides(single[0], out)
    stops = []
    forward_usr1 = ("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    restarts = ("--max-restarts", "1")
    for sig, target, after_steps in ((signal.SIGINT, "rank1", 2), (signal.SIGTERM, "torchrun", 2),
                                     (signal.SIGHUP, "torchrun", 2), (signal.SIGUSR1, "all", 2),
                                     (signal.SIGUSR1, "ranks", 1)):  # of 19 steps
        proc = _launch(o, *{"all": forward_usr1, "ranks": restarts}.get(target, ()))
        start = _train_steps(out)
        _wait_until(proc, lambda: None not in (_rank_pid(0, proc.pid), _rank_pid(1, proc.pid)))
        ranks = [_rank_pid(0, parent=proc.pid), _rank_pid(1, parent=proc.pid)]
        # a tight poll: a step takes ~15 ms, and each step run past the target brings the last
        # round closer to the end of the run (19 steps), which would leave it nothing to stop
        _wait_until(proc, lambda: _train_steps(out) >= start + after_steps, poll=0.002)
        targets = {"torchrun": [proc.pid], "rank1": ranks[1:], "all": [proc.pid, *ranks], "ranks": ranks}[target]
        _signal_held(ranks, targets, sig, ranks[1:] if target == "rank1" else ranks)
        stdout, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, err[-3000:]
        steps = [r["step"] for r in read_metrics(out) if r["kind"] == "train"]
        assert _dcp_steps(out)[-1] == steps[-1], (stdout[-2000:], err[-2000:])
        assert f"({sig.name}) at step {steps[-1]}" in stdout and f"--resume {out}" in stdout, stdout[-2000:]
        if target == "rank1":  # torchrun's failure summary: the signalled worker's exit code
            assert re.search(rf"exitcode\s*:\s*{128 + sig}\b", err), err[-3000:]
        if target == "ranks":  # the restarted attempt resumed nothing and trained nothing
            assert stdout.count("resumed from") == 1, stdout[-2000:]
            assert f"this torchrun job stopped on SIGUSR1 at step {steps[-1]} (checkpointed); torchrun " \
                   "started it again (--max-restarts)" in err, err[-3000:]
        stops.append(steps[-1])
    assert stops == sorted(set(stops)) and stops[-1] < 19
    done = _launch(o, *restarts)  # a new job: its run id differs
    stdout, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    assert f"resumed from {out / 'checkpoints'}" in stdout
    assert _losses(out) == _losses(ddp_run)  # every step, to the last bit
    assert not (out / ".stopped").exists()


EVAL_SIGNAL = """
import os, signal, sys
from largebatch.train.loop import Trainer
forward = Trainer._eval_batch
def signalled(self, batch):  # rank 1 alone, in the first evaluation after a step
    if self.pos.step > 0 and self.par.rank == 1 and not getattr(Trainer, "sent", False):
        Trainer.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return forward(self, batch)
Trainer._eval_batch = signalled
from largebatch.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_during_an_evaluation_on_one_rank_checkpoints_both_at_once(single, ddp_run, tmp_path):
    """SIGTERM reaching rank 1 during an evaluation: both ranks abandon it (polled before each of
    its forwards, the same answer on both) and checkpoint that step; the same command evaluates
    there once and continues on the uninterrupted trajectory (losses and validation losses)."""
    out = tmp_path / "eval-signal"
    o = _overrides(single[0], out)
    script = tmp_path / "signalled.py"
    script.write_text(EVAL_SIGNAL)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(script)] + [f"--{k}={json.dumps(v)}" for k, v in o.items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*143\b", proc.stderr), proc.stderr[-3000:]
    step = _dcp_steps(out)[-1]
    assert f"eval  step {step:>5}  interrupted (SIGTERM)" in proc.stdout, proc.stdout[-2000:]
    assert f"(SIGTERM) at step {step}" in proc.stdout
    done = _launch(o)
    stdout, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    val = [(r["step"], r["val_loss"]) for r in read_metrics(out) if r["kind"] == "val"]
    assert val == [(r["step"], r["val_loss"]) for r in read_metrics(ddp_run) if r["kind"] == "val"]
    assert step in [s for s, _ in val]
    assert _losses(out) == _losses(ddp_run)


@pytest.mark.parametrize("local", ["run_dir", "checkpoints"])
def test_nodes_without_a_shared_run_directory_are_refused_before_any_step(single, tmp_path, local):
    """Two torchrun nodes (one process each) whose relative run.out_dir lies on their own disks (each
    node started in its own directory): rank 0 used to report its checkpoints as good although their
    shards lay half on the other node (no process could load them), and the next launch hung in
    mismatched collectives for parallel.timeout_s. Now both ranks refuse at start, naming the rank
    that cannot see rank 0's files, and no step runs. "checkpoints": the run directory is shared but
    its checkpoints/ is node-local (a link resolving per process, as a link or mount to each node's
    local disk does), which the check of the run directory alone let through."""
    import socket

    from processes import src_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if local == "checkpoints":
        shared = tmp_path / "shared" / "run"
        shared.mkdir(parents=True)
        (shared / "checkpoints").symlink_to("/proc/self/cwd/ck")
    # the note never appears on the other node: parallel.shared_fs_wait_s bounds how long rank 1
    # waits for it (15 s by default, for a network filesystem's caches)
    o = _overrides(single[0], Path("run") if local == "run_dir" else shared, **{"parallel.shared_fs_wait_s": 2})
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        (cwd / "ck").mkdir(parents=True)
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}" for k, v in o.items()]
        procs.append(subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=src_env(OMP_NUM_THREADS="1")))  # (cwd: not this checkout)
    outputs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode != 0 for p in procs), outputs
    for _, err in outputs:
        if local == "run_dir":
            assert "run.out_dir='run': rank 1 on " in err and "cannot see the files rank 0 writes" in err, err[-3000:]
            assert "waited parallel.shared_fs_wait_s = 2 s" in err, err[-3000:]
        else:
            assert (f"run.out_dir={str(shared)!r}: rank 1 on " in err and "see the run directory but not the "
                    "files rank 0 writes in its checkpoints/" in err), err[-3000:]
    runs = [tmp_path / f"node{node}" / "run" for node in (0, 1)] if local == "run_dir" else [shared]
    for run in runs:
        assert not (run / "metrics.jsonl").exists() and not list(run.glob("checkpoints/*"))
        assert not (run / ".shared").exists()
    assert not [p for node in (0, 1) for p in (tmp_path / f"node{node}" / "ck").iterdir()]


@pytest.mark.parametrize("case", ["config_on_one_node", "finished_on_one_node"])
def test_a_rank_that_stops_before_the_start_stops_the_others_at_once(single, tmp_path, case):
    """Two torchrun nodes (one process each). One node's checks before the start end the launch (its
    config file is not there; the run it names is finished there only): it used to exit alone while
    the other waited in init_process_group for parallel.timeout_s (600 s) and died with a store
    traceback. Now every rank learns every rank's outcome through torchrun's store and exits at
    once, in one line naming the rank."""
    import socket
    import tomllib

    from processes import src_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    o = _overrides(single[0], Path("run"))
    config = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    if case == "config_on_one_node":
        (tmp_path / "node0" / "my.toml").write_text((single[1] / "config.toml").read_text())
        config = ["my.toml"]
        o = {"run.out_dir": "run"}
    else:  # node 0 holds a finished copy of the run its command names, node 1 nothing
        shutil.copytree(single[1], tmp_path / "node0" / "run")
        saved = tomllib.loads((single[1] / "config.toml").read_text())
        config = [str(single[1] / "config.toml")]
        o = {"run.out_dir": "run"}
        assert saved["run"]["out_dir"] != "run"
    procs = []
    for node in (0, 1):
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "largebatch", "train", *config] + [f"--{k}={v}" for k, v in o.items()]
        procs.append(subprocess.Popen(args, cwd=tmp_path / f"node{node}", stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=src_env(OMP_NUM_THREADS="1")))
    started = time.monotonic()
    outputs = [p.communicate(timeout=180) for p in procs]
    assert time.monotonic() - started < 150  # not parallel.timeout_s (600 s): the others were told
    errs = [err for _, err in outputs]
    # (torchrun's agent prints its own ChildFailedError traceback for a worker that exits non-zero)
    assert "DistStoreError" not in "".join(errs) and "wait timeout" not in "".join(errs), errs
    if case == "config_on_one_node":
        # (torchrun exits 1 when a worker fails; the worker's own exit code is in its report: 2)
        assert procs[1].returncode != 0 and "my.toml' is neither a file" in errs[1], errs[1][-2000:]
        assert procs[0].returncode != 0 and "exitcode  : 2" in errs[0], errs[0][-2000:]
        assert "largebatch train: error: rank 1 on " in errs[0] and "stopped before the start: " in errs[0]
    else:
        assert all(p.returncode != 0 and "exitcode  : 2" in err for p, err in zip(procs, errs)), errs
        for err in errs:
            assert "the ranks disagree on what to do with the run directory (rank 0 on " in err, err[-2000:]
            assert ": finished; rank 1 on " in err and ": go)" in err and "filesystem every node shares" in err
        assert not (tmp_path / "node1" / "run" / "metrics.jsonl").exists()


def test_a_run_whose_micro_batch_is_its_batch_continues_on_two_replicas(single, tmp_path, capsys, monkeypatch):
    """A one-process run of batch 8 with micro_batch 8 (its memory's limit) relaunched on 2 replicas
    (the same command, and --resume): the config's check refused it, batch 8 not being a multiple of
    micro_batch x 2 = 16, and a changed micro_batch is refused as another schedule. The run's batches
    are multiples of micro_batch x its checkpoints' replicas (1): each replica now takes 4 sequences
    a step, and the losses are the one-process run's."""
    cache, _ = single
    same = {"schedule.batch_policy": "constant", "schedule.batch_size": 8, "run.micro_batch": 8}
    ref = tmp_path / "ref"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **same)), ref, log=lambda *_: None).fit()
    for how in ("same command", "--resume"):
        out = tmp_path / how.strip("-").replace(" ", "-")
        o = _overrides(cache, out, **same, **{"run.max_steps": 5, "run.checkpoint_every_tokens": 512})
        Trainer(load_config(resolve_config(None), o), out, log=lambda *_: None).fit()
        if how == "same command":
            _torchrun(_overrides(cache, out, **same))
        else:
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "largebatch", "train", "--resume", str(out)]
            done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert done.returncode == 0, done.stderr[-3000:]
            assert "multiples of micro_batch x 1 (the replicas its checkpoints were written with), split " \
                   "over 2 replicas" in done.stdout + done.stderr
        assert _losses(out) == pytest.approx(_losses(ref), rel=1e-5, abs=1e-5)
        assert len(_losses(out)) == len(_losses(ref))
    # a new run on 2 replicas with that config is still refused, naming the fix (`train --check` as
    # each rank of torchrun runs it: its checks read the world size from the environment)
    from largebatch.cli import main as cli_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    fresh = _overrides(cache, tmp_path / "new", **same)
    assert cli_main(["train", "--check"] + [f"--{k}={json.dumps(v)}" for k, v in fresh.items()]) == 2
    assert "is not a whole number of micro_batch (8) x dp_size (2)" in capsys.readouterr().err


def _average(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's weight average by name (a .pt's, or a .dcp's loaded in one process)."""
    from largebatch.export import load_run

    return {name: p.detach() for name, p in load_run(run_dir, ema=True, log=lambda *_: None).model.named_parameters()}


def _assert_same_average(ours: dict, theirs: dict, rtol: float, atol: float) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        if name.endswith("attn.k.bias"):  # its gradient is 0 in exact arithmetic (a softmax does not see a
            continue  # constant added to every key): LAMB's steps of it follow rounding, the weights differ too
        torch.testing.assert_close(value, theirs[name], rtol=rtol, atol=atol, msg=name)


def test_the_weight_average_across_layouts_and_mesh_changes(single, tmp_path):
    """run.ema_decay under FSDP with checkpoints in the background, stopped at step 5 and continued
    under tp = 2 with sequence parallel (the average resharded from FSDP's shards to tensor-parallel
    DTensors through the distributed checkpoint), and a one-process .pt checkpoint continued on
    pipeline stages (each stage cutting its parameters' averages from the full tensors): every loss
    and every evaluation of the average is one process's, and so is the final average."""
    cache, _ = single
    ema = {"run.ema_decay": 0.8}
    one = tmp_path / "one"
    Trainer(load_config(resolve_config(None), _overrides(cache, one, **ema)), one, log=lambda *_: None).fit()
    out = tmp_path / "fsdp-tp"
    _torchrun(_overrides(cache, out, **ema, **{"parallel.dp_mode": "fsdp", "run.async_checkpoint": True,
                                               "run.max_steps": 5}))
    _torchrun(_overrides(cache, out, **ema, **{"parallel.tp": 2, "parallel.sequence_parallel": True}))

    def ema_vals(run):
        return [r["val_loss_ema"] for r in read_metrics(run) if r["kind"] == "val"]

    assert _losses(out) == pytest.approx(_losses(one), rel=1e-5, abs=1e-5)
    assert len(ema_vals(out)) >= 4 and ema_vals(out) == pytest.approx(ema_vals(one), rel=1e-5)
    _assert_same_average(_average(out), _average(one), rtol=1e-4, atol=1e-5)

    untied = {**ema, "model.tie_embeddings": False}  # pipeline stages cannot share the embedding
    ref = tmp_path / "ref"
    Trainer(load_config(resolve_config(None), _overrides(cache, ref, **untied)), ref, log=lambda *_: None).fit()
    pp = tmp_path / "pp"
    o = _overrides(cache, pp, **untied, **{"run.max_steps": 5})
    Trainer(load_config(resolve_config(None), o), pp, log=lambda *_: None).fit()
    _torchrun(_overrides(cache, pp, **untied, **{"parallel.pp": 2}))
    assert ema_vals(pp) == pytest.approx(ema_vals(ref), rel=1e-6)
    _assert_same_average(_average(pp), _average(ref), rtol=1e-5, atol=1e-6)


LIMITED_LAUNCHER = """
import os, sys, time
from largebatch.train.loop import Trainer
step, setup = Trainer.train_step, Trainer.__init__
def train_step(self):  # rank 1 slow (0.4 s a step): rank 0 waits for it in each step's collectives
    if os.environ["RANK"] == "1":
        time.sleep(0.4)
    return step(self)
def deadline_after_setup(self, *args, **kwargs):  # each rank's own limit, 2.5 s after its own setup
    setup(self, *args, **kwargs)
    self.time_limit.deadline = time.monotonic() + 2.5
Trainer.train_step, Trainer.__init__ = train_step, deadline_after_setup
from largebatch.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_time_limit_stops_both_ranks_at_one_step_and_the_same_command_continues(single, ddp_run, tmp_path):
    """run.time_limit under torchrun, rank 1's steps slowed and each rank measuring its own time: the
    ranks agree on the step to stop at, write one distributed checkpoint there and exit 0; the same
    command without the limit continues to the uninterrupted 2-rank run's losses, to the bit."""
    script = tmp_path / "limited.py"
    script.write_text(LIMITED_LAUNCHER)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)] + \
        [f"--{k}={json.dumps(v)}" for k, v in _overrides(single[0], out, **{"run.time_limit": 3600}).items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = len(_losses(out))
    assert 1 <= steps < len(_losses(ddp_run)) and _dcp_steps(out) == [steps], (steps, _dcp_steps(out))
    assert f"stopped after {steps} steps (run.time_limit) at step {steps}" in proc.stdout, proc.stdout[-2000:]
    assert not (out / "summary.json").exists()
    _torchrun(_overrides(single[0], out))
    assert _losses(out) == _losses(ddp_run)
    again = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}" for k, v in
                                                             _overrides(single[0], out).items()],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert again.returncode == 0 and again.stdout.count("already complete") == 1, again.stdout  # (rank 0's line)
