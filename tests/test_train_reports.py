"""Honest reports: tokens/s and MFU measure the optimizer steps only (an evaluation and a checkpoint
before every step, made slow, stay out of the window), an MFU above 100% is flagged with the source
of its peak, and `experiment --jobs 2` stopped by a real SIGTERM starts no more arms and leaves no
arm process behind."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from largebatch.experiments.runner import Arm, Execution, base_overrides, run_arms
from largebatch.train.cli import format_summary, resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError
from test_train import tiny_overrides

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
    [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def test_throughput_excludes_evaluation_and_checkpoints(reference_run, tmp_path):
    """Evaluate 16,384 tokens (64x a step's, so the evaluation outlasts a step even on a loaded
    machine) and checkpoint before every step. The log line of an evaluation is
    written after it ends and the step's record after the step: a step's window (its tokens / its
    tokens/s) must fit between the two, by the wall clock. Counting the evaluation breaks that bound
    by the evaluation's length, which the test checks is longer than a step."""
    cache, _, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "run", **{
        "run.eval_every_tokens": 1, "run.eval_tokens": 32 * 512, "run.checkpoint_every_tokens": 1,
        "run.total_tokens": 32 * 8 * 3, "schedule.batch_policy": "constant", "run.peak_flops": 1e3})
    stamps: list[tuple[float, str]] = []
    trainer = Trainer(load_config(resolve_config(None), o), o["run.out_dir"],
                      log=lambda line: stamps.append((time.perf_counter(), line)))
    started = time.time()
    summary = trainer.fit()
    ended = time.time()
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3
    eval_at = [t for t, line in stamps if line.startswith("  eval")]
    step_at = [t for t, line in stamps if line.startswith("step ")]
    assert len(step_at) == 3 and len(eval_at) == 4  # before each step, and the final one
    tokens_before = 0
    for k, record in enumerate(train):
        window = (record["tokens"] - tokens_before) / record["tokens_per_s"]
        tokens_before = record["tokens"]
        assert 0 < window <= step_at[k] - eval_at[k], (k, window, step_at[k] - eval_at[k])
        if k:  # the evaluation (and checkpoint) between two steps outlasts a step
            assert eval_at[k] - step_at[k - 1] > window
    assert abs(sum((r["tokens"] - p) / r["tokens_per_s"] for r, p in
                   zip(train, [0] + [r["tokens"] for r in train])) - summary["train_seconds"]) < 1e-6
    # every record carries the wall clock it was written at (evaluations and steps in file order), and
    # a step's the optimizer steps' seconds so far: loss against time, the evaluations left out or not
    walls = [r["wall_time"] for r in records]
    assert started <= walls[0] and walls == sorted(walls) and walls[-1] <= ended, (started, walls, ended)
    assert [r["kind"] for r in records] == ["val", "train"] * 3 + ["val"]
    seconds, tokens = 0.0, 0
    for record in train:  # each step's window, added up
        seconds += (record["tokens"] - tokens) / record["tokens_per_s"]
        tokens = record["tokens"]
        assert record["train_seconds"] == pytest.approx(seconds)
    assert train[-1]["train_seconds"] == pytest.approx(summary["train_seconds"])
    assert walls[-1] - walls[0] > train[-1]["train_seconds"]  # the evaluations' time is the difference
    # a peak of 1 kFLOP/s makes the MFU absurd: it is flagged once, naming the peak's source
    warnings = [line for _, line in stamps if line.startswith("warning: MFU")]
    assert len(warnings) == 1 and "was declared" in warnings[0] and "--run.peak_flops" in warnings[0]
    assert train[0]["mfu"] > 1 and "above 100%: the peak of 1e-09 TFLOP/s" in format_summary(summary, tmp_path)



def test_summary_lists_only_the_outputs_the_run_wrote(tmp_path):
    """run.plots = false writes no PNG and run.tensorboard = false no tensorboard/: the summary's
    run-directory line names what is there."""
    summary = {"final_val_loss": 5.0, "final_val_ppl": 148.4, "unigram_val_loss": 5.2, "steps": 8, "tokens": 2048,
               "train_seconds": 0.1, "tokens_per_s": 20480.0, "mfu": 0.05, "peak_flops": 8e10,
               "peak_flops_source": "measured fp32 matmul", "memory_bytes": 2 ** 20}
    (tmp_path / "metrics.jsonl").write_text("")
    line = format_summary(summary, tmp_path).splitlines()[-1]
    assert line == f"run directory     {tmp_path}  (metrics.jsonl)"
    (tmp_path / "loss.png").write_bytes(b"")
    (tmp_path / "schedule.png").write_bytes(b"")
    (tmp_path / "tensorboard").mkdir()
    line = format_summary(summary, tmp_path).splitlines()[-1]
    assert line == f"run directory     {tmp_path}  (metrics.jsonl, loss.png, schedule.png, tensorboard/)"

def test_the_summary_gives_the_throughput_after_the_first_step_too(reference_run, tmp_path):
    """The summary's tokens/s counts the first step, whose warm-up (allocations; compilation under
    run.compile: 362 against ~3,200 tokens/s at steady state in a short compiled run) it includes; it
    now also gives the rate over the steps after it: the records' own windows, summed, agree."""
    cache, out, summary = reference_run
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))  # every step logged
    windows = [(r["tokens"] - p) / r["tokens_per_s"] for r, p in zip(train, [0] + [r["tokens"] for r in train])]
    expected = (train[-1]["tokens"] - train[0]["tokens"]) / sum(windows[1:])
    assert summary["tokens_per_s_after_first_step"] == pytest.approx(expected, rel=1e-6)
    text = format_summary({**summary, "tokens_per_s": expected / 2}, out)
    assert f"{expected:,.0f} tokens/s after this launch's first step" in text
    assert "after this launch's first step" not in format_summary({**summary, "tokens_per_s": expected}, out)


def test_the_summary_gives_the_wall_clock_time_of_every_launch_too(reference_run, tmp_path):
    """The summary's seconds were the optimizer steps' alone (0.4 s of a 4 s run here: setup,
    evaluations and checkpoints left out, rightly for tokens/s and MFU). It now also gives the
    wall-clock seconds of the run -- each launch's from its trainer's setup to its last checkpoint,
    summed over a stop and resume -- and the tokens/s over them, bounded here by the wall clock read
    around each launch."""
    cache = reference_run[0]
    out = tmp_path / "run"
    o = tiny_overrides(cache, out, **{"run.eval_every_tokens": 32 * 8 * 2, "run.checkpoint_every_tokens": 32 * 8 * 4})
    started = time.perf_counter()
    Trainer(load_config(resolve_config(None), {**o, "run.max_steps": 6}), out, log=lambda *_: None).fit()
    first_launch = time.perf_counter() - started
    import torch

    extra = torch.load(sorted((out / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)
    kept = extra["progress"]["wall_seconds"]  # the first launch, to its last checkpoint
    assert 0 < extra["progress"]["train_seconds"] < kept <= first_launch
    started = time.perf_counter()
    trainer = Trainer(load_config(resolve_config(None), o), out, resume=True, log=lambda *_: None)
    trainer.fit()
    second_launch = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    assert kept + 0.5 * second_launch < summary["wall_seconds"] <= kept + second_launch
    assert summary["wall_seconds"] > summary["train_seconds"]
    assert summary["tokens_per_s_wall"] == pytest.approx(summary["tokens"] / summary["wall_seconds"])
    text = format_summary(summary, out)
    assert (f"tokens in {summary['train_seconds']:.1f} s of steps; {summary['wall_seconds']:.1f} s in all with "
            f"setup, evaluations and checkpoints ({summary['tokens_per_s_wall']:,.0f} tokens/s)") in text


def test_a_seesaw_grown_past_the_noise_scale_is_noted_in_the_summary(reference_run):
    """Seesaw's loss-for-loss match with the LR schedule holds below the critical batch; the default
    recipe ended at batch 128 against a B_simple of ~56 and the summary said nothing. The summary
    now records the batch the schedule reached and notes an uncapped Seesaw that passed the
    estimate (the reference run: Seesaw 8 -> 16 -> 32 in micro-batches of 4)."""
    cache, out, summary = reference_run
    batches = [r["batch_size"] for r in read_metrics(out) if r["kind"] == "train"]
    # the schedule's batch at the last token: 32 (8 doubled twice), though the last step, cut to the
    # budget, ran 24
    assert summary["final_batch_size"] == 32 and batches[-1] == 24 and summary["uncapped_seesaw"]
    assert summary["noise_scale"] is not None
    text = format_summary(summary, out)
    assert ("note: Seesaw's schedule reached a batch of" in text) == (32 > summary["noise_scale"])
    for noise_scale, policy_uncapped, noted in ((8.0, True, True), (40.0, True, False), (8.0, False, False)):
        text = format_summary({**summary, "noise_scale": noise_scale, "uncapped_seesaw": policy_uncapped}, out)
        assert ("note: Seesaw's schedule reached a batch of 32 sequences, 4.0x this estimate" in text) == noted, text
        if noted:
            assert "schedule.noise_scale_multiple = 1" in text



def test_the_noted_batch_is_one_a_step_took(reference_run, tmp_path):
    """A milestone inside the budget's last step (linear decay, ratio 1/2): the summary named the
    schedule's batch at the last token, 64, a batch no step took (the largest was 32). It now names
    the batch of the last step's start, as metrics.jsonl records it."""
    cache = reference_run[0]
    seq = 32
    for total in range(seq * 8 * 16, seq * 8 * 40, seq):  # a budget whose last milestone no step reaches
        o = tiny_overrides(cache, tmp_path / "run", **{"schedule.lr_schedule": "linear", "run.total_tokens": total})
        cfg = load_config(resolve_config(None), o)
        schedule = cfg.schedule.build(total, seq, cfg.run.micro_batch, 1)
        starts, t = [], 0
        while t < total:
            starts.append(t)
            t += schedule.batch_size(t) * seq
        if schedule.batch_size(starts[-1]) < schedule.batch_size(total - 1):
            break
    else:
        pytest.fail("no budget puts a milestone inside the last step")
    summary = Trainer(cfg, o["run.out_dir"], log=lambda *_: None).fit()
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    largest = schedule.batch_size(starts[-1])
    assert summary["final_batch_size"] == largest < schedule.batch_size(total - 1)
    assert max(r["batch_size"] for r in records) <= largest and len(records) == len(starts)


DRIVER = """
import json, sys
from pathlib import Path
from largebatch.experiments.runner import Arm, ArmsInterrupted, Execution, base_overrides, run_arms

if __name__ == "__main__":  # the arms' processes are spawned: they import this file
    cache, out = sys.argv[1], Path(sys.argv[2])
    base = {**base_overrides("smoke"), "data.cache_dir": cache, "run.total_tokens": 10_000_000}
    arms = [Arm(f"arm{i}", {"run.seed": i}) for i in range(3)]
    try:
        run_arms(arms, base, out, log=lambda _: None, execution=Execution(jobs=2))
    except ArmsInterrupted as exc:
        print(json.dumps({"signum": exc.signum, "stopped": exc.stopped, "not_started": exc.not_started}))
        sys.exit(128 + exc.signum)
"""


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_experiment_jobs_sigterm_stops_arms_and_leaves_no_process(reference_run, tmp_path):
    cache, _, _ = reference_run
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    out = tmp_path / "exp"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(cache), str(out)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = [out / "runs" / f"arm{i}" / "metrics.jsonl" for i in (0, 1)]
    while not all(m.is_file() and '"train"' in m.read_text() for m in metrics):  # both arms training
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    arm_pids = [p for p in _children(proc.pid)
                if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(arm_pids) == 2
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == {"signum": 15, "stopped": ["arm0", "arm1"], "not_started": ["arm2"]}
    assert not (out / "runs" / "arm2").exists()
    for pid in arm_pids:  # reaped by the parent: gone, not orphaned and training on
        assert not Path(f"/proc/{pid}").exists(), pid
    for run in ("arm0", "arm1"):  # each arm took the SIGTERM as a trainer does: checkpoint, exit
        assert list((out / "runs" / run / "checkpoints").glob("step_*.pt")), run


def test_an_arm_stopped_by_a_signal_to_its_worker_alone_is_named(reference_run, tmp_path):
    """A SIGTERM that reaches one worker of `--jobs 2` and not the experiment (its trainer checkpoints
    and the worker exits cleanly without a result) ends the experiment with one line naming the arm
    and the command to continue, and stops the other worker; it does not wait forever."""
    cache, _, _ = reference_run
    base = {**base_overrides("smoke"), "data.cache_dir": str(cache), "run.total_tokens": 10_000_000}
    arms = [Arm(f"arm{i}", {"run.seed": i}) for i in range(2)]
    # an arm the trainer would refuse is named before any arm starts (no worker, no run directory)
    with pytest.raises(ConfigError, match=r"arm 'arm1': run.micro_batch = 0"):
        run_arms([arms[0], Arm("arm1", {"run.micro_batch": 0})], base, tmp_path, execution=Execution(jobs=2))
    assert not (tmp_path / "runs").exists()
    metrics = tmp_path / "runs" / "arm0" / "metrics.jsonl"

    def stop_the_first_worker():
        deadline = time.time() + 240
        while not (metrics.is_file() and '"train"' in metrics.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        worker = next(p for p in multiprocessing.active_children() if p.name == "arms-0")
        os.kill(worker.pid, signal.SIGTERM)

    threading.Thread(target=stop_the_first_worker, daemon=True).start()
    with pytest.raises(RuntimeError, match=r"arm 'arm0' was stopped by (SIGTERM sent to its worker process "
                                           r"alone|a signal to its worker process); run the same command with "
                                           r"--resume"):
        run_arms(arms, base, tmp_path, log=lambda _: None, execution=Execution(jobs=2))
    assert list((tmp_path / "runs" / "arm0" / "checkpoints").glob("step_*.pt"))  # it checkpointed
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("arms-")]


def test_an_arm_that_raises_in_its_worker_raises_its_own_error(reference_run, tmp_path):
    """An arm whose training raises (here: a corpus that is not there, which only building the data
    finds) ends `--jobs 2` with the exception the serial path raises, the worker's traceback as a
    note, and no worker left behind."""
    from largebatch.data.corpus import CorpusError

    cache, _, _ = reference_run
    base = {**base_overrides("smoke"), "data.cache_dir": str(cache)}
    bad = Arm("missing", {"data.corpus": str(tmp_path / "no-such-corpus.txt")})
    with pytest.raises(CorpusError) as serial:
        run_arms([bad], base, tmp_path / "serial", log=lambda _: None)
    with pytest.raises(CorpusError) as parallel:
        run_arms([Arm("fine", {}), bad], base, tmp_path / "parallel", log=lambda _: None,
                 execution=Execution(jobs=2))
    assert str(parallel.value) == str(serial.value) and "no-such-corpus.txt" in str(serial.value)
    note = "\n".join(parallel.value.__notes__)
    assert "arm 'missing' failed in its worker process" in note and "Traceback" in note and "CorpusError" in note
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("arms-")]


def test_a_sample_that_fails_leaves_the_finished_runs_summary(reference_run, tmp_path, monkeypatch):
    """The end-of-run sample is a convenience: one process whose sample raises (a model kind of the
    user's that cannot generate) writes its summary with the reason, and the run is complete."""
    from largebatch.models import GPT

    def broken(self, *args, **kwargs):
        raise RuntimeError("this kind cannot generate\nsecond line")

    monkeypatch.setattr(GPT, "generate", broken)
    cache, _, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "run", **{"run.total_tokens": 32 * 8 * 2, "run.sample_tokens": 8,
                                                   "schedule.batch_policy": "constant"})
    lines = []
    summary = Trainer(load_config(resolve_config(None), o), o["run.out_dir"], log=lines.append).fit()
    assert summary["sample"] == "(no sample: RuntimeError: this kind cannot generate)"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["sample"] == summary["sample"]
    assert any("the end-of-run sample failed (RuntimeError: this kind cannot generate)" in str(line)
               for line in lines)


def test_a_token_array_run_without_a_tokenizer_ends_with_a_summary(reference_run, tmp_path):
    """A GPT run on a .npy token array and no tokenizer: the final sample cannot be encoded or
    decoded, and says so, instead of crashing after training and leaving no summary.json."""
    import numpy as np

    from largebatch.data import build_data

    cache, _, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "run", **{"run.total_tokens": 32 * 8 * 2, "run.sample_tokens": 8,
                                                   "schedule.batch_policy": "constant"})
    data = build_data(load_config(resolve_config(None), o).data, seq_len=32, objective="causal")
    np.save(tmp_path / "tokens.npy", np.asarray(data.train.tokens).astype(np.uint16))
    o.update({"data.corpus": str(tmp_path / "tokens.npy"), "data.tokenizer_file": None})
    summary = Trainer(load_config(resolve_config(None), o), o["run.out_dir"], log=lambda *_: None).fit()
    assert "no sample" in summary["sample"] and "data.tokenizer_file" in summary["sample"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == summary["steps"] == 2
    # a resume on a replaced array says the corpus changed, as on changed text (it was silent)
    np.save(tmp_path / "tokens.npy", np.asarray(data.train.tokens)[::-1].astype(np.uint16))
    logs = []
    Trainer(load_config(resolve_config(None), o), o["run.out_dir"], resume=True, log=logs.append)
    assert any(line.startswith("warning: the corpus's token arrays changed since") for line in logs), logs


PEAK_SCRIPT = '''
import json, os, sys
import torch
from largebatch.memory.measure import memory_bytes
from largebatch.parallel import ParallelConfig, init_distributed
from largebatch.train.report import Reporting

state = init_distributed(ParallelConfig(dp=2))
if state.rank == 1:  # the busier rank (a pipeline's last stage, with the output layer and logits)
    held = torch.ones(64 * 1024 * 1024)  # 256 MiB, touched
own = [None, None]
torch.distributed.all_gather_object(own, memory_bytes(torch.device("cpu")))


class Report(Reporting):
    device, par = torch.device("cpu"), state


peak = Report().peak_memory()
if state.rank == 0:
    print("RESULT " + json.dumps({"own": own, "peak": peak}), flush=True)
torch.distributed.barrier()
sys.stdout.flush()
os._exit(0)
'''


@pytest.mark.distributed
def test_memory_reported_is_the_busiest_ranks(tmp_path):
    """The logged and summarised memory is the peak of the busiest process of the job: rank 0's alone
    was read, so a pipeline run's last stage (820 MiB against rank 0's 576 MiB in one measurement)
    was never shown. Two real ranks, rank 1 holding 256 MiB more."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out["own"][1] > out["own"][0] + 200 * 2**20
    assert out["peak"] >= out["own"][1] and out["peak"] < out["own"][1] + 50 * 2**20


def test_a_long_runs_plots_draw_bin_means_with_their_range(tmp_path):
    """Past MAX_POINTS train records the loss is drawn as the mean of equal bins of consecutive steps
    with the bins' least and greatest loss (computed here by hand, in float64), a bin of skipped
    (non-finite) steps only is a gap, and the schedule's points keep the last step; the phase
    boundary is found in a stream of records."""
    import math

    import numpy as np

    from largebatch.train import plots

    n = 2 * plots.MAX_POINTS + 5  # bins of 3 steps, the last one of 2 (its third a NaN pad)
    loss = [5.0 + math.sin(s) for s in range(1, n + 1)]
    loss[9:12] = [float("nan")] * 3  # steps 10-12, the 4th bin
    x, mean, least, greatest = plots._binned(list(range(1, n + 1)), loss)
    assert len(x) == -(-n // 3) <= plots.MAX_POINTS
    for i in (0, 1, len(x) - 1):
        chunk = loss[3 * i: 3 * i + 3]
        assert x[i] == pytest.approx(sum(range(3 * i + 1, min(3 * i + 4, n + 1))) / len(chunk))
        assert (mean[i], least[i], greatest[i]) == pytest.approx((sum(chunk) / len(chunk), min(chunk), max(chunk)))
    assert np.isnan(mean[3]) and np.isnan(least[3]) and x[3] == 11.0
    assert plots._binned([1, 2], [3.0, None])[1][1] != plots._binned([1, 2], [3.0, None])[1][1]  # None: NaN
    xs, ys = plots._sampled(list(range(n)), list(range(n)))
    assert len(xs) <= plots.MAX_POINTS + 1 and xs[-1] == n - 1 and xs == ys
    records = [{"kind": "train", "step": s, "tokens": 64 * s, "loss": loss[s - 1], "lr": 1e-3, "batch_size": 8,
                "phase": int(s > 3000), "seq_len": 32 if s <= 3000 else 64} for s in range(1, n + 1)]
    records += [{"kind": "val", "step": s, "tokens": 64 * s, "val_loss": 5.0} for s in range(0, n, 500)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plots.phase_boundaries(r for r in records if r["kind"] == "train") == [(3000 * 64, 3000, 1, 64)]
    assert [p.name for p in plots.plot_run(tmp_path)] == ["loss.png", "schedule.png"]
    assert all((tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in ("loss.png", "schedule.png"))


def test_tokens_axes_are_labelled_as_token_counts_are_written(tmp_path, monkeypatch):
    """A 400k-token run's loss.png printed every digit of its tokens ticks (100000150000200000...
    ran together); the tokens axes of loss.png and schedule.png now read 0, 100k, 200k, ... -- each
    tick label a count the CLI reads back as that tick's value."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from largebatch.arguments import token_count, token_label, token_labels
    from largebatch.train import plots

    assert [token_label(v) for v in (0, 512, 150_000, 1_500_000, 2e9, 3.5e12, 1234)] == \
        ["0", "512", "150k", "1.5M", "2B", "3.5T", "1.23k"]
    # rounded before the unit is chosen (999999 read '1e+03k'); no '-0'; past the last unit, digits
    assert [token_label(v) for v in (999_999, 999.6, 999_500_000, -0.0, 1e15, -50_000)] == \
        ["1M", "1k", "1B", "0", "1,000T", "-50k"]
    # an axis that does not start at 0: ticks 1 k apart showed '102k' twice
    assert token_labels([100_500, 101_500, 102_500]) == ["100.5k", "101.5k", "102.5k"]
    assert token_labels([0, 100_000, 200_000]) == ["0", "100k", "200k"]  # (3 digits where they suffice)
    records = [{"kind": "train", "step": s, "tokens": 4096 * s, "loss": 6.0 - s / 100, "lr": 1e-3,
                "batch_size": 8} for s in range(1, 101)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kw: figures.append(fig) or save(fig, *args, **kw))
    plots.plot_run(tmp_path)
    loss, schedule = figures
    for ax in (loss.axes[0], schedule.axes[0]):
        FigureCanvasAgg(ax.figure).draw()
        ticks = [(t.get_text(), t.get_position()[0]) for t in ax.get_xticklabels() if t.get_text()]
        assert len(ticks) >= 3 and ticks[-1][1] >= 200_000, ticks
        for text, value in ticks:
            assert len(text) <= 5 and (value <= 0 or token_count(text) == value), ticks
            assert value >= 0 or text == token_label(value)  # (a margin before 0: "-50k")


def test_the_eta_counts_the_wall_clock_between_steps():
    """Steps train at 100 tokens/s, but each 100-token record also waits 1 s (an evaluation, a
    checkpoint, logging): the tokens go by at 50 per wall-clock second, and the ETA says so; with no
    time between the steps it is the training rate's."""
    import io

    from largebatch.train.progress import Progress, format_seconds

    for between, per_wall_second in ((1.0, 50.0), (0.0, 100.0)):
        clock = [0.0]
        stream = io.StringIO()
        progress = Progress(10_000, enabled=True, stream=stream, clock=lambda: clock[0])
        for tokens in range(100, 3_100, 100):
            clock[0] += 1.0 + between
            progress.update(tokens, 100.0)
        assert f"ETA {format_seconds((10_000 - 3_000) / per_wall_second)}" in stream.getvalue().rsplit("\r", 1)[-1]


def test_time_to_a_target_loss_is_recorded_and_can_end_the_run(reference_run, tmp_path, capsys):
    """run.target_val_loss set to the reference run's 3rd evaluation loss (the first at or below it):
    the summary's target is that evaluation's step and tokens, with the steps' seconds the records
    give up to it; the run goes on to its budget, every step the reference's. With stop_at_target
    the run ends there (checkpoint at that step, summary.json saying so, that evaluation logged once)
    and the same command finds it ended. A target never reached is said so; bad values are one line."""
    from largebatch.checkpoint import list_checkpoints
    from largebatch.train.cli import main
    from test_train import _run, _train_losses, tiny_overrides

    cache, ref_dir, _ = reference_run
    vals = [r for r in read_metrics(ref_dir) if r["kind"] == "val"]
    hit = next(i for i, r in enumerate(vals) if i >= 2 and all(v["val_loss"] > r["val_loss"] for v in vals[:i]))
    target = vals[hit]["val_loss"]
    out = tmp_path / "recorded"
    summary = _run(tiny_overrides(cache, out, **{"run.target_val_loss": target}))
    assert _train_losses(out) == _train_losses(ref_dir)
    step = vals[hit]["step"]
    t = summary["target"]
    assert (t["step"], t["tokens"], t["val_loss"]) == (step, vals[hit]["tokens"], target)
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert t["train_seconds"] == pytest.approx(next(r for r in train if r["step"] == step)["train_seconds"])
    assert 0 < t["train_seconds"] < t["wall_seconds"] < summary["wall_seconds"]
    assert summary["stopped_at_target"] is False and summary["steps"] == len(train)
    marked = [r["step"] for r in read_metrics(out) if r["kind"] == "val" and r.get("target_reached")]
    assert marked == [step]

    ended = tmp_path / "ended"
    o = tiny_overrides(cache, ended, **{"run.target_val_loss": target, "run.stop_at_target": True})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    log = capsys.readouterr().out
    assert f"target val loss {target} reached at step {step}," in log and "the run ends here" in log
    done = json.loads((ended / "summary.json").read_text())
    assert done["stopped_at_target"] is True and done["steps"] == step and done["final_val_loss"] == target
    assert int(list_checkpoints(ended)[-1].stem.split("_")[1]) == step
    assert [r["step"] for r in read_metrics(ended) if r["kind"] == "val"] == [r["step"] for r in vals[:hit + 1]]
    before = (ended / "summary.json").read_text()
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0  # the same command: ended, nothing changed
    assert f"already complete ({step} steps" in capsys.readouterr().out
    assert len([r for r in read_metrics(ended) if r["kind"] == "train"]) == step
    assert (ended / "summary.json").read_text() == before
    o["run.stop_at_target"] = False  # (a restart field) the same run goes on to its budget, as the reference
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    assert _train_losses(ended) == _train_losses(ref_dir)
    assert json.loads((ended / "summary.json").read_text())["target"]["step"] == step

    never = _run(tiny_overrides(cache, tmp_path / "never", **{"run.target_val_loss": 0.5}))
    assert never["target"] is None and never["steps"] == len(train)
    assert "target            val loss 0.5 not reached by the end of the run" in format_summary(never, tmp_path)
    for bad, says in ((["--run.target_val_loss=-1"], "must be a positive finite loss"),
                      (["--run.stop_at_target=true"], "set run.target_val_loss too")):
        assert main([*bad, "--check"]) == 2
        assert says in capsys.readouterr().err
