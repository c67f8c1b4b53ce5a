"""Training phases ([[phases]]): a BERT run at sequence length 32 then 64, each phase with its own
batch, micro-batch and LANS schedule; exact resume across the boundary; bad phase lists refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from largebatch.checkpoint import list_checkpoints, load_checkpoint
from largebatch.train.cli import main
from largebatch.train.metrics import read_metrics
from largebatch.train.plots import phase_boundaries

CONFIG = """
[model]
kind = "bert"
n_layer = 2
n_embd = 32
n_head = 2
seq_len = 64
dropout = 0.1

[data]
corpus = "shakespeare"
vocab_size = 400
cache_dir = "{cache}"

[schedule]
lr_schedule = "lans"
peak_lr = 1e-2
warmup = 0.25
batch_policy = "constant"
batch_size = 8

[optim]
name = "lans"

[run]
micro_batch = 8
eval_tokens = 1024
eval_every_tokens = 1024
tensorboard = false
progress = "off"
peak_flops = 1e11
device = "cpu"
{run_extra}

[[phases]]
seq_len = 32
total_tokens = 2048
schedule = {{ batch_size = 16 }}

[[phases]]
seq_len = 64
total_tokens = 2048
micro_batch = 4
schedule = {{ batch_size = 8, peak_lr = 5e-3 }}
{phase_extra}
"""


def write_config(tmp: Path, cache: Path, run_extra: str = "", phase_extra: str = "") -> Path:
    path = tmp / f"phases-{abs(hash((run_extra, phase_extra)))}.toml"
    path.write_text(CONFIG.format(cache=cache, run_extra=run_extra, phase_extra=phase_extra))
    return path


def train_records(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def lans_lr(peak: float, warmup: float, u: float) -> float:
    """The LANS schedule (docs/papers.md: LANS) with no hold and linear decay, at budget fraction u."""
    return peak * u / warmup if u < warmup else peak * (1 - u) / (1 - warmup)


@pytest.fixture(scope="module")
def reference(tiny_data_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phases")
    config = write_config(tmp, tiny_data_cache)
    run = tmp / "ref"
    assert main([str(config), f"--run.out_dir={run}"]) == 0
    return tmp, config, run


def test_each_phase_runs_at_its_length_batch_and_schedule(reference):
    _, _, run = reference
    records = train_records(run)
    phase0 = [r for r in records if r["phase"] == 0]
    phase1 = [r for r in records if r["phase"] == 1]
    assert [r["seq_len"] for r in phase0] == [32] * 4 and [r["batch_size"] for r in phase0] == [16] * 4
    assert [r["seq_len"] for r in phase1] == [64] * 4 and [r["batch_size"] for r in phase1] == [8] * 4
    assert [r["micro_batches"] for r in phase1] == [2] * 4  # phase micro-batch 4
    assert phase1[0]["tokens"] == 2048 + 8 * 64  # the token clock runs on
    # each phase's LR follows its own schedule from the phase's first token (the LR re-warms)
    for records_, peak, tokens_per_step in ((phase0, 1e-2, 16 * 32), (phase1, 5e-3, 8 * 64)):
        expected = [lans_lr(peak, 0.25, i * tokens_per_step / 2048) for i in range(4)]
        assert [r["lr"] for r in records_] == pytest.approx(expected, rel=1e-6)
    # the plots mark where phase 1 begins: at phase 0's budget, after its last step
    assert phase_boundaries(records) == [(2048, phase0[-1]["step"], 1, 64)]
    assert (run / "loss.png").stat().st_size > 0 and (run / "schedule.png").stat().st_size > 0
    vals = [r for r in read_metrics(run) if r["kind"] == "val"]
    at_boundary = [r for r in vals if r["tokens"] == 2048]
    assert sorted(r["seq_len"] for r in at_boundary) == [32, 64]  # phase 0's last eval, phase 1's first


def test_resume_is_exact_across_the_phase_boundary(reference, tiny_data_cache):
    tmp, config, ref = reference
    run = tmp / "stopped"
    # stop after step 3 (inside phase 0), then after step 5 (the boundary crossed), then finish
    for max_steps in (3, 2, "none"):
        assert main([str(config), f"--run.out_dir={run}", f"--run.max_steps={max_steps}"]) == 0
    got = [(r["step"], r["phase"], r["loss"], r["lr"]) for r in train_records(run)]
    want = [(r["step"], r["phase"], r["loss"], r["lr"]) for r in train_records(ref)]
    assert got == want  # bit for bit, dropout included


def test_a_signal_at_the_phase_boundary_checkpoints_before_the_switch(reference, monkeypatch):
    """SIGTERM in phase 0's last step: the checkpoint is written before the phase switch and its
    two evaluations (a grace period is no time for them); the continued run switches, evaluates
    at both lengths once and repeats the uninterrupted run, losses and validation losses."""
    import signal

    from largebatch.train import loop

    tmp, config, ref = reference
    run = tmp / "signalled-at-boundary"
    clip, calls = loop.clip_grad_norm_, []

    def signalled(*args, **kwargs):  # after a step's micro-batches (between them the step is dropped)
        calls.append(1)
        if len(calls) == 4:  # phase 0 has 4 steps
            os.kill(os.getpid(), signal.SIGTERM)
        return clip(*args, **kwargs)

    monkeypatch.setattr(loop, "clip_grad_norm_", signalled)
    assert main([str(config), f"--run.out_dir={run}"]) == 143
    monkeypatch.setattr(loop, "clip_grad_norm_", clip)
    vals = [(r["tokens"], r["seq_len"]) for r in read_metrics(run) if r["kind"] == "val"]
    assert vals == [(0, 32), (1024, 32)]  # none at the boundary yet
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000004.pt"]
    assert main([str(config), f"--run.out_dir={run}"]) == 0
    got = [(r["step"], r["phase"], r["loss"], r["lr"]) for r in train_records(run)]
    assert got == [(r["step"], r["phase"], r["loss"], r["lr"]) for r in train_records(ref)]
    val = [(r["tokens"], r["seq_len"], r["val_loss"]) for r in read_metrics(run) if r["kind"] == "val"]
    assert val == [(r["tokens"], r["seq_len"], r["val_loss"]) for r in read_metrics(ref) if r["kind"] == "val"]


def test_optimizer_state_reset_starts_the_moments_afresh(reference, tiny_data_cache):
    tmp, _, ref = reference
    config = write_config(tmp, tiny_data_cache, phase_extra='optimizer_state = "reset"')
    run = tmp / "reset"
    assert main([str(config), f"--run.out_dir={run}"]) == 0
    state = load_checkpoint(list_checkpoints(run)[-1])["optimizer"]["state"]
    steps = {int(torch.as_tensor(s["step"]).item()) for s in state.values()}
    assert steps == {4}  # phase 1's four steps only; carried over they would be 8
    carried = load_checkpoint(list_checkpoints(ref)[-1])["optimizer"]["state"]
    assert {int(torch.as_tensor(s["step"]).item()) for s in carried.values()} == {8}
    # identical until phase 1's first update with a non-zero LR (its warmup starts at 0, so the
    # loss of step 7 is the first to see the restarted moments)
    a, b = train_records(ref), train_records(run)
    assert [r["loss"] for r in a[:6]] == [r["loss"] for r in b[:6]]
    assert a[6]["loss"] != b[6]["loss"]


@pytest.mark.parametrize("run_extra, phase_extra, expected", [
    ("", "seq_len = 128", "phases[1].seq_len = 128: longer than model.seq_len = 64"),
    # BERT's samples are [CLS] text [SEP]: --check used to pass this; the run then refused it unnamed
    ("", "seq_len = 2", "phases[1].seq_len = 2: too short for a masked-LM sample ([CLS] text [SEP]); use >= 3"),
    ("", "total_tokens = 0", "total_tokens = 0: must be > 0"),
    ("", "warmup = 0.1", "unknown key 'phases[1].warmup'"),
    ("", "schedule = { batch_sise = 8 }", "unknown key 'phases[1].schedule.batch_sise'"),
    ("total_tokens = 5000", "", "run.total_tokens = 5000 but the phases sum to 4096"),
    # a field the phase's own table sets for another batch policy was accepted and never read
    ("", "schedule = { batch_size = 8, ramp_start = 4 }",
     "phases[1].schedule.ramp_start = 4: only batch_policy ramp reads it, and this phase's is 'constant'"),
    # (the phase was named twice: "phases[1]: phases[1].total_tokens")
    ("", "total_tokens = 100", "error: phases[1].total_tokens = 100 is less than one optimizer step"),
])
def test_bad_phase_lists_are_one_line_errors(run_extra, phase_extra, expected, reference, tiny_data_cache,
                                             capsys):
    tmp, _, _ = reference
    # a repeated key in the second [[phases]] table replaces it (TOML forbids duplicates): rewrite
    text = CONFIG.format(cache=tiny_data_cache, run_extra=run_extra, phase_extra="")
    if phase_extra:
        key = phase_extra.split(" =")[0]
        head, tail = text.rsplit("[[phases]]", 1)
        tail = "\n".join(line for line in tail.splitlines() if not line.startswith(key + " "))
        text = head + "[[phases]]" + tail + "\n" + phase_extra + "\n"
    config = tmp / "bad.toml"
    config.write_text(text)
    assert main([str(config), f"--run.out_dir={tmp / 'bad'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp / "bad").exists()


def test_a_changed_phase_list_is_refused_on_resume(reference, capsys):
    tmp, config, ref = reference
    code = main([str(config), f"--run.out_dir={ref}", "--phases.1.total_tokens=4096"])
    err = capsys.readouterr().err
    assert code == 2 and "phases" in err, err


@pytest.mark.distributed
def test_torchrun_crosses_and_resumes_across_the_boundary(reference, tmp_path):
    """2 data-parallel ranks (DDP), stopped inside phase 0 and again just past the boundary, then
    finished: every step's loss equals one process's (no dropout: replicas draw different masks)."""
    tmp, config, _ = reference
    single = tmp_path / "single"
    assert main([str(config), f"--run.out_dir={single}", "--model.dropout=0.0"]) == 0
    run = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for max_steps in (3, 2, "none"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", "-m", "largebatch", "train", str(config), f"--run.out_dir={run}",
                               "--model.dropout=0.0", f"--run.max_steps={max_steps}"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, want = train_records(run), train_records(single)
    assert [(r["step"], r["phase"], r["seq_len"], r["batch_size"]) for r in got] == \
        [(r["step"], r["phase"], r["seq_len"], r["batch_size"]) for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)


def test_mfu_counts_each_phase_at_its_own_flops_and_the_configured_mask_share(reference, tiny_data_cache,
                                                                              tmp_path):
    """MFU's numerator against what torch's FLOP counter counts on the run's own model and batches:
    per phase (sequence length 32, then 64: the summary weighs each phase's tokens by its own
    FLOPs), with the output layer on the share of positions data.mlm_probability = 0.4 chooses."""
    from torch.utils.flop_counter import FlopCounterMode

    from largebatch.data import DataConfig, build_data
    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    tmp, config, _ = reference
    run = tmp_path / "mask40"
    assert main([str(config), f"--run.out_dir={run}", "--data.mlm_probability=0.4", "--run.plots=false"]) == 0
    extra = load_checkpoint(list_checkpoints(run)[-1])
    model_cfg = from_dict(ModelConfig, extra["config"]["model"])
    data_cfg = from_dict(DataConfig, extra["config"]["data"])
    model = build_model(model_cfg)
    per_token = {}
    for seq_len in (32, 64):
        batch = build_data(data_cfg, seq_len=seq_len, objective="masked").train.get_batch(range(64))
        with FlopCounterMode(display=False) as counter:
            model(batch["input_ids"], batch["labels"])[1].backward()
        per_token[seq_len] = counter.get_total_flops() / batch["input_ids"].numel()
    records = train_records(run)
    summary = json.loads((run / "summary.json").read_text())
    done, flops = 0, 0.0
    for r in records:
        flops += (r["tokens"] - done) * per_token[r["seq_len"]]
        done = r["tokens"]
        assert r["mfu"] == pytest.approx(per_token[r["seq_len"]] * r["tokens_per_s"] / 1e11, rel=0.01)
    assert summary["mfu"] == pytest.approx(flops / summary["train_seconds"] / 1e11, rel=0.01)
    # a checkpoint written before the FLOPs were kept (stopped inside phase 0) resumes and counts its
    # tokens at that phase's rate: the same summary MFU
    legacy = tmp_path / "legacy"
    args = [str(config), f"--run.out_dir={legacy}", "--data.mlm_probability=0.4", "--run.plots=false"]
    assert main([*args, "--run.max_steps=3"]) == 0
    path = list_checkpoints(legacy)[-1]
    state = torch.load(path, weights_only=False)
    del state["progress"]["model_flops"]
    torch.save(state, path)
    assert main(args) == 0
    summary = json.loads((legacy / "summary.json").read_text())
    records = train_records(legacy)
    flops = sum((r["tokens"] - p) * per_token[r["seq_len"]]
                for r, p in zip(records, [0] + [r["tokens"] for r in records]))
    assert summary["mfu"] == pytest.approx(flops / summary["train_seconds"] / 1e11, rel=0.01)


def test_a_log_window_across_the_phase_switch_counts_each_step_at_its_phase(reference, tmp_path):
    """With a record every 3 steps, one window holds phase 0's last step (seq 32) and phase 1's
    first two (seq 64): its MFU took every token at phase 1's FLOPs per token (1.8% high on a
    probe's run); it now counts each step at its own phase's, as the summary does."""
    from largebatch.data.dataset import BERTDataset
    from largebatch.models.flops import flops_per_token
    from largebatch.train.config import load_config

    tmp, config, _ = reference
    run = tmp_path / "every3"
    assert main([str(config), f"--run.out_dir={run}", "--run.log_every_steps=3", "--run.plots=false"]) == 0
    cfg = load_config(run / "config.toml")
    per_token = {s: flops_per_token(cfg.model, seq_len=s, mask_fraction=BERTDataset.predicted_fraction(
        s, cfg.data.mlm_probability)) for s in (32, 64)}
    assert per_token[32] != per_token[64]
    done, crossed = 0, False
    for r in train_records(run):
        first = max(0, min(r["tokens"], 2048) - done)  # phase 0: 2048 tokens at seq 32
        second = r["tokens"] - done - first
        crossed |= first > 0 and second > 0
        seconds = (r["tokens"] - done) / r["tokens_per_s"]
        expected = (first * per_token[32] + second * per_token[64]) / seconds / 1e11
        assert r["mfu"] == pytest.approx(expected, rel=1e-9), r["step"]
        done = r["tokens"]
    assert crossed


def test_masked_lm_accuracy_is_logged_per_phase_and_recomputes_from_the_checkpoint(reference, tiny_data_cache):
    """The last evaluation's accuracy equals argmax-vs-label counted here from the final weights, on the
    same validation sequences at the last phase's length (the masking depends only on the index)."""
    from largebatch.data import DataConfig, build_data
    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    _, _, run = reference
    vals = [r for r in read_metrics(run) if r["kind"] == "val"]
    assert all(0 <= r["val_accuracy"] <= 1 for r in vals) and {r["phase"] for r in vals} == {0, 1}
    extra = load_checkpoint(list_checkpoints(run)[-1])
    model = build_model(from_dict(ModelConfig, extra["config"]["model"])).eval()
    model.load_state_dict(extra["model"])
    data = build_data(from_dict(DataConfig, extra["config"]["data"]), seq_len=64, objective="masked")
    n = 1024 // 64
    correct = total = 0
    with torch.no_grad():
        for start in range(0, n, 4):
            batch = data.val.get_batch(range(start, min(n, start + 4)))
            labels = batch["labels"]
            logits, _ = model(batch["input_ids"])  # every position's logits, (B, T, v)
            masked = labels != -100
            correct += int((logits.argmax(-1)[masked] == labels[masked]).sum())
            total += int(masked.sum())
    assert vals[-1]["val_accuracy"] == pytest.approx(correct / total, abs=1e-12)
    tokens = data.val.tokens
    most = max(range(400), key=lambda t: int((data.train.tokens == t).sum()))
    assert data.unigram_accuracy() == pytest.approx(float((tokens == most).mean()))


def test_a_phases_noise_scale_fields_are_its_own(reference, tiny_data_cache):
    """The noise-scale estimator was built from the run's [schedule] in every phase, so a phase's
    own ``noise_scale_ema`` (and what an adaptive Seesaw cap reads from the estimate) was ignored:
    set in both phases it logged the run without it. It must log as the same field set for the run."""
    tmp, config, ref = reference
    runs = {}
    for name, args in (("phases", [f"--phases.{k}.schedule.noise_scale_ema=0.0" for k in (0, 1)]),
                       ("run", ["--schedule.noise_scale_ema=0.0"])):
        runs[name] = tmp / f"ema-{name}"
        assert main([str(config), f"--run.out_dir={runs[name]}", *args]) == 0
    noise = {name: [r["noise_scale"] for r in train_records(run)] for name, run in runs.items()}
    assert noise["phases"] == noise["run"]
    assert noise["run"] != [r["noise_scale"] for r in train_records(ref)]  # (the default EMA differs)


def test_a_run_stopped_in_a_phase_with_its_own_noise_scale_ema_continues(reference, tiny_data_cache):
    """With the estimator built from the phase's fields, a run stopped in a phase whose own
    ``noise_scale_ema`` differs from the first phase's was refused on resume (the checkpoint's
    ema_decay against the first phase's); it continues, as the same run left uninterrupted."""
    tmp, config, _ = reference
    ema = ["--phases.1.schedule.noise_scale_ema=0.5"]
    straight, stopped = tmp / "ema-straight", tmp / "ema-stopped"
    assert main([str(config), f"--run.out_dir={straight}", *ema]) == 0
    assert main([str(config), f"--run.out_dir={stopped}", *ema, "--run.max_steps=6"]) == 0
    assert main([str(config), f"--run.out_dir={stopped}", *ema]) == 0  # the same command continues
    fields = ("step", "loss", "noise_scale", "batch_size")
    assert [[r[k] for k in fields] for r in train_records(stopped)] == \
        [[r[k] for k in fields] for r in train_records(straight)]


def test_a_target_reached_at_a_phase_switch_ends_the_run_in_that_phase(reference, tmp_path):
    """run.stop_at_target with the target set to phase 0's last evaluation (at the switch): the run
    ends there, in phase 0 -- its final checkpoint, loss and phases as they were at that evaluation, no
    step or evaluation of phase 1."""
    tmp, config, ref = reference
    vals = [r for r in read_metrics(ref) if r["kind"] == "val"]
    switch = next(r for r in vals if r["tokens"] == 2048 and r["seq_len"] == 32)
    assert all(r["val_loss"] > switch["val_loss"] for r in vals if r["tokens"] < 2048)  # (the first at or below)
    run = tmp_path / "ended"
    assert main([str(config), f"--run.out_dir={run}", f"--run.target_val_loss={switch['val_loss']}",
                 "--run.stop_at_target=true"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_at_target"] and summary["final_val_loss"] == switch["val_loss"]
    assert summary["target"]["step"] == switch["step"] and "phase_val_losses" in summary
    assert {r["phase"] for r in read_metrics(run)} == {0}
