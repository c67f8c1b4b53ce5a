"""The trainer end to end on real text: exact resume (also after a SIGKILL and across a Seesaw
batch-size change), GPT and BERT losses falling, clean errors for bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.checkpoint import list_checkpoints, load_checkpoint
from largebatch.train.cli import format_summary, main, resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics


def tiny_overrides(cache_dir: Path, out_dir: Path, **extra) -> dict:
    """A 2-layer GPT on Shakespeare that runs ~12 steps in a few seconds, with a Seesaw batch
    doubling twice (8 -> 16 -> 32 sequences) so resume is tested across batch-size changes."""
    o = {
        "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
        "model.dropout": 0.1, "data.vocab_size": 512, "data.cache_dir": str(cache_dir),
        "schedule.lr_schedule": "cosine", "schedule.peak_lr": 3e-2, "schedule.warmup": 0.1,
        "schedule.final_lr": 0.2, "schedule.batch_policy": "seesaw", "schedule.ratio": 0.5,
        "schedule.batch_size": 8, "run.micro_batch": 4, "run.total_tokens": 32 * 8 * 24,
        "run.eval_tokens": 32 * 16, "run.eval_every_tokens": 32 * 8 * 6, "run.tensorboard": False,
        "run.progress": "off", "run.sample_tokens": 0, "run.out_dir": str(out_dir),
        "run.peak_flops": 1e11, "run.plots": False,  # matplotlib would double a tiny run's time
    }
    o.update(extra)
    return o


def _train_losses(run_dir: Path) -> list[tuple[int, int, float]]:
    return [(r["step"], r["batch_size"], r["loss"]) for r in read_metrics(run_dir)
            if r["kind"] == "train"]


def _run(overrides: dict, resume: bool = False) -> dict:
    cfg = load_config(resolve_config(None), overrides)  # the same base as the CLI
    return Trainer(cfg, overrides["run.out_dir"], resume=resume, log=lambda *_: None).fit()


def test_reference_run_learns_and_grows_batch(reference_run):
    cache, out, summary = reference_run
    losses = _train_losses(out)
    batches = sorted({b for _, b, _ in losses})
    assert batches[0] == 8 and len(batches) >= 3, batches  # Seesaw grew the batch at milestones
    first_val = [r["val_loss"] for r in read_metrics(out) if r["kind"] == "val"][0]
    assert first_val > 6.0  # ~ln(512) at initialisation
    assert summary["final_val_loss"] < first_val - 0.3  # ~20 steps of a 2-layer model: it learns
    assert 0 < summary["unigram_val_loss"] < math.log(512)
    for name in ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "schedule.png"):
        assert (out / name).is_file(), name
    assert summary["mfu"] > 0 and summary["tokens_per_s"] > 0


def test_eval_micro_batch_changes_no_step_and_evaluates_the_same_tokens(reference_run, tmp_path, capsys):
    """run.eval_micro_batch = 5 where the reference evaluates its 16 validation sequences 4 at a time
    (5 leaves a tail of 1): every training step is bit-identical, every evaluation the same mean,
    and the last one equals the float64 cross-entropy of the final weights over those 16 sequences."""
    from largebatch.data import DataConfig, build_data
    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    cache, ref_dir, _ = reference_run
    out = tmp_path / "eval-mb"
    summary = _run(tiny_overrides(cache, out, **{"run.eval_micro_batch": 5}))
    assert _train_losses(out) == _train_losses(ref_dir)

    def vals(run):
        return [r["val_loss"] for r in read_metrics(run) if r["kind"] == "val"]

    assert len(vals(out)) >= 4 and vals(out) == pytest.approx(vals(ref_dir), rel=2e-6, abs=0)
    extra = load_checkpoint(list_checkpoints(out)[-1])
    model = build_model(from_dict(ModelConfig, extra["config"]["model"]))
    model.load_state_dict(extra["model"])
    model = model.double().eval()
    data = build_data(from_dict(DataConfig, extra["config"]["data"]), seq_len=32)
    batch = data.val.get_batch(range(32 * 16 // 32))
    with torch.no_grad():
        logits, _ = model(batch["input_ids"])
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
                                                  ignore_index=-100)
    assert summary["final_val_loss"] == pytest.approx(float(reference), rel=1e-5)
    assert main(["--run.eval_micro_batch=0"]) == 2
    assert "run.eval_micro_batch = 0: must be > 0, or unset (the training micro-batch)" in capsys.readouterr().err


def test_resume_is_bit_identical_across_batch_changes(reference_run, tmp_path):
    cache, ref_dir, ref_summary = reference_run
    ref = _train_losses(ref_dir)
    change_steps = [s for (s, b, _), (_, b_prev, _) in zip(ref[1:], ref) if b != b_prev]
    stop_at = change_steps[0] - 2  # stop before the first batch change, resume across it
    out = tmp_path / "resumed"
    o = tiny_overrides(cache, out, **{"run.max_steps": stop_at})
    first = _run(o)
    assert first["stopped_early"] and first["step"] == stop_at
    state = torch.load(list_checkpoints(out)[-1], weights_only=True)  # torch.load's default since torch 2.6
    assert state["progress"]["step"] == stop_at and "tok_emb.weight" in state["model"]
    assert state["numerics"] == {"threads": torch.get_num_threads(), "torch": torch.__version__}
    other = tmp_path / "other-threads"  # a copy, resumed under another thread count: the note says so
    shutil.copytree(out, other)
    threads, lines = torch.get_num_threads(), []
    torch.set_num_threads(threads + 1)
    try:
        cfg = load_config(resolve_config(None), {**o, "run.out_dir": str(other), "run.max_steps": stop_at + 1})
        Trainer(cfg, other, resume=True, log=lines.append).fit()
    finally:
        torch.set_num_threads(threads)
    note = [line for line in lines if "sums round in another order" in line]
    assert len(note) == 1 and f"with {threads} torch thread" in note[0] and f"has {threads + 1} torch threads" \
        in note[0], lines
    o["run.max_steps"] = None
    lines = []
    cfg = load_config(resolve_config(None), o)
    summary = Trainer(cfg, out, resume=True, log=lines.append).fit()
    assert _train_losses(out) == ref  # every step's loss equal to the last bit
    assert summary["final_val_loss"] == ref_summary["final_val_loss"]
    assert not [line for line in lines if "round in another order" in line]  # the same threads: no note


def test_sigkill_then_resume_continues_exactly(reference_run, tmp_path):
    cache, ref_dir, ref_summary = reference_run
    out = tmp_path / "killed"
    o = tiny_overrides(cache, out, **{"run.checkpoint_every_tokens": 32 * 8 * 3})
    args = [sys.executable, "-m", "largebatch", "train"] + [f"--{k}={json.dumps(v)}"
                                                           for k, v in o.items()]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        ckpts = list_checkpoints(out)
        if ckpts and int(ckpts[-1].stem.split("_")[1]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list_checkpoints(out), proc.stderr.read().decode()
    assert main([f"--resume={out}", "--run.progress=off"]) == 0
    assert _train_losses(out) == _train_losses(ref_dir)


def test_bert_masked_lm_learns(tmp_path, reference_run):
    cache = reference_run[0]
    o = tiny_overrides(cache, tmp_path / "bert", **{
        "model.kind": "bert", "schedule.batch_policy": "constant", "run.total_tokens": 32 * 8 * 16})
    summary = _run(o)
    vals = [r["val_loss"] for r in read_metrics(tmp_path / "bert") if r["kind"] == "val"]
    assert summary["final_val_loss"] < vals[0] - 0.3
    assert not list((tmp_path / "bert").glob("*.png"))  # run.plots = false: no matplotlib at the end


def test_nonfinite_loss_stops_naming_step_and_checkpoint(tmp_path, reference_run, capsys):
    cache = reference_run[0]
    o = tiny_overrides(cache, tmp_path / "nan", **{"schedule.peak_lr": 1e30,
                                                   "schedule.batch_policy": "constant",
                                                   "optim.name": "adamw"})
    args = [f"--{k}={json.dumps(v)}" for k, v in o.items()]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "loss is nan" in err.lower() or "loss is inf" in err.lower(), err
    assert "at step" in err and "Last good checkpoint" in err and "Traceback" not in err


def test_bf16_skip_nonfinite_and_tensorboard(tmp_path, reference_run):
    """bf16 autocast trains; a non-finite step is skipped (not applied) when configured; TensorBoard
    event files and the per-step metrics are written."""
    cache = reference_run[0]
    out = tmp_path / "bf16"
    o = tiny_overrides(cache, out, **{"run.dtype": "bf16", "run.tensorboard": True,
                                       "schedule.batch_policy": "constant",
                                       "run.total_tokens": 32 * 8 * 4})
    summary = _run(o)
    assert math.isfinite(summary["final_val_loss"])
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    skip = tiny_overrides(cache, tmp_path / "skip", **{
        "schedule.peak_lr": 1e30, "schedule.batch_policy": "constant", "optim.name": "adamw",
        "run.on_nonfinite": "skip", "run.total_tokens": 32 * 8 * 6})
    summary = _run(skip)
    records = [r for r in read_metrics(tmp_path / "skip") if r["kind"] == "train"]
    assert summary["skipped_steps"] >= 1 and any(r.get("skipped") for r in records)
    assert len(records) == 6  # the run went on to the end of its budget


def test_skip_gives_up_after_consecutive_nonfinite_steps(tmp_path, reference_run, capsys):
    """run.on_nonfinite='skip' does not run a NaN model to the end: after run.max_skipped_steps
    consecutive skips it exits 1 naming the step, the count and the last good checkpoint."""
    o = tiny_overrides(reference_run[0], tmp_path / "nan", **{
        "schedule.peak_lr": 1e30, "schedule.batch_policy": "constant", "optim.name": "adamw",
        "run.on_nonfinite": "skip", "run.max_skipped_steps": 3})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 1
    err = capsys.readouterr().err
    assert "3 consecutive non-finite steps" in err and "Last good checkpoint" in err, err
    assert "Traceback" not in err
    records = [r for r in read_metrics(tmp_path / "nan") if r["kind"] == "train"]
    assert len(records) < 24 and records[-1].get("skipped")  # stopped well before the budget


def test_finished_run_relaunched_is_already_complete(tmp_path, reference_run, capsys):
    """The same command (or --resume) on a finished run says so and changes no file."""
    cache, ref, summary = reference_run
    out = tmp_path / "done"
    shutil.copytree(ref, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    o = tiny_overrides(cache, out)
    for args in ([f"--{k}={json.dumps(v)}" for k, v in o.items()], ["--resume", str(out)]):
        assert main(args) == 0
        stdout = capsys.readouterr().out
        assert "already complete" in stdout and f"{summary['tokens']} tokens" in stdout, stdout
    # --resume with a change its checkpoints allow (dropout) trained no step, then wrote the change
    # into config.toml, so the run's record named a dropout it never ran with and the original
    # command was refused as another config
    assert main(["--resume", str(out), "--model.dropout=0.5"]) == 0
    stdout = capsys.readouterr().out
    assert "already complete" in stdout and "model.dropout: 0.1 -> 0.5 would apply to no step" in stdout, stdout
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # its checkpoints deleted to save space: still finished (it trained again from scratch over its
    # metrics, leaving the old summary.json, which the next launch then took as the end)
    shutil.rmtree(out / "checkpoints")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for args in ([f"--{k}={json.dumps(v)}" for k, v in o.items()], ["--resume", str(out)]):
        assert main(args) == 0
        assert "already complete" in capsys.readouterr().out
    # another config or a larger budget into it: nothing to continue from, refused in one line
    for change in ({"optim.name": "lamb"}, {"run.total_tokens": 2 * summary["tokens"]}):
        assert main([f"--{k}={json.dumps(v)}" for k, v in {**o, **change}.items()]) == 2
        err = capsys.readouterr().err
        assert "holds a finished run (summary.json)" in err and "no checkpoint to continue it from" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_checkpoint_cadence_set_on_resume_applies_at_once(tmp_path, reference_run):
    """run.checkpoint_every_tokens added when a stopped run continues (a requeue after lost work)
    checkpoints at its own points from then on; the saved next point was the old cadence's (here
    the end of the run), and no checkpoint came before it."""
    cache = reference_run[0]
    step_tokens = 32 * 8
    o = tiny_overrides(cache, tmp_path / "cadence", **{"schedule.batch_policy": "constant",
                                                      "run.keep_checkpoints": 10})
    assert _run({**o, "run.max_steps": 3})["stopped_early"]
    assert [int(c.stem.split("_")[1]) for c in list_checkpoints(tmp_path / "cadence")] == [3]
    assert _run({**o, "run.max_steps": 6, "run.checkpoint_every_tokens": 2 * step_tokens}, resume=True)
    # the new points: every 2 steps (4, 6, 8), then the stop at step 9 (6 steps from step 3)
    assert [int(c.stem.split("_")[1]) for c in list_checkpoints(tmp_path / "cadence")] == [3, 4, 6, 8, 9]


def test_checkpoints_written_in_the_background_resume_to_the_bit(tmp_path, reference_run, monkeypatch):
    """run.async_checkpoint: every save is started and the training goes on while its file is
    written (here each write is held until the next step has run, so every checkpoint but the last is
    written beside a step); the stop waits for its own. The checkpoints are those a synchronous run
    keeps, and the run continued from them equals the uninterrupted reference run to the bit."""
    import largebatch.checkpoint.local as local

    cache, ref_dir, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "async", **{"run.async_checkpoint": True, "run.keep_checkpoints": 10,
                                                    "run.checkpoint_every_tokens": 2 * 32 * 8})
    overlapped = []
    real_save = local.save_checkpoint
    steps_seen = []

    def save_after_a_step(run_dir, step, state, keep_last=2):
        begun = len(steps_seen)
        deadline = time.time() + 5
        while len(steps_seen) == begun and time.time() < deadline:  # held until the training moves on
            time.sleep(0.005)
        overlapped.append(len(steps_seen) > begun)
        return real_save(run_dir, step, state, keep_last)

    monkeypatch.setattr(local, "save_checkpoint", save_after_a_step)
    real_step = Trainer.train_step

    def counted_step(self):
        record = real_step(self)
        steps_seen.append(self.pos.step)
        return record

    monkeypatch.setattr(Trainer, "train_step", counted_step)
    assert _run({**o, "run.max_steps": 7})["stopped_early"]
    steps = [int(c.stem.split("_")[1]) for c in list_checkpoints(tmp_path / "async")]
    assert steps == [2, 4, 6, 7] and overlapped == [True, True, True, False], (steps, overlapped)
    monkeypatch.setattr(local, "save_checkpoint", real_save)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    _run(o, resume=True)
    assert _train_losses(tmp_path / "async") == _train_losses(ref_dir)


def test_a_run_failing_beside_a_background_write_names_that_checkpoint(tmp_path, reference_run, monkeypatch):
    """A non-finite loss while a checkpoint was still being written in the background said "Last good
    checkpoint: none", and the checkpoint landed a moment later; the failing run now waits for it and
    names it."""
    import threading

    from largebatch.train.loop import NonFiniteLoss

    real_fsync = os.fsync

    def slow_fsync(fd):  # a slow disk, for the background thread's writes
        if threading.current_thread() is not threading.main_thread():
            time.sleep(1.0)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    cache = reference_run[0]
    o = tiny_overrides(cache, tmp_path / "nan", **{"run.async_checkpoint": True, "schedule.peak_lr": 1e4,
                                                  "schedule.warmup": 0.0, "schedule.batch_policy": "constant",
                                                  "run.checkpoint_every_tokens": 2 * 32 * 8})
    with pytest.raises(NonFiniteLoss) as info:
        _run(o)
    kept = list_checkpoints(tmp_path / "nan")
    assert kept and f"Last good checkpoint: {kept[-1]}." in str(info.value), (kept, str(info.value))


def test_a_measured_peak_leaves_the_dropout_stream_alone(tmp_path, reference_run):
    """run.peak_flops left undeclared: the trainer measures a matmul after a resume has restored the
    RNG state. Its random matrices came from the global generator, so a resumed run's dropout masks
    (0.1 here) shifted and its losses left the uninterrupted run's from the first step after the
    resume. Stopped at step 5 and continued, the run now equals the reference run to the bit (which
    declared its peak: measuring draws nothing from the run's stream)."""
    cache, ref_dir, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "measured", **{"run.peak_flops": None})
    assert _run({**o, "run.max_steps": 5})["stopped_early"]
    summary = _run(o, resume=True)
    assert summary["peak_flops_source"].startswith("measured")
    assert _train_losses(tmp_path / "measured") == _train_losses(ref_dir)


def _tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps of ``tag``'s scalars as TensorBoard shows them (purged events dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_relaunches_log_every_record_once(tmp_path, reference_run):
    """A run killed before its first checkpoint starts again from scratch: its earlier TensorBoard
    events are gone (TensorBoard showed the first steps twice). A run killed after its final
    checkpoint, during the final evaluation's aftermath (sampling, summary): the relaunch evaluates
    again at the last step, and that validation record is not kept twice (metrics.jsonl, TensorBoard)."""
    cache = reference_run[0]
    out = tmp_path / "relaunched"
    o = tiny_overrides(cache, out, **{"run.tensorboard": True, "schedule.batch_policy": "constant",
                                      "run.total_tokens": 32 * 8 * 6, "run.eval_every_tokens": 32 * 8 * 3,
                                      "run.checkpoint_every_tokens": 32 * 8 * 3})
    _run(o)
    expected = {"train": [r["step"] for r in read_metrics(out) if r["kind"] == "train"],
                "val": [r["step"] for r in read_metrics(out) if r["kind"] == "val"]}
    assert expected == {"train": [1, 2, 3, 4, 5, 6], "val": [0, 3, 6]}
    # an evaluation's record wrote tokens, phase and seq_len again at its step: twice at steps 3 and 6
    assert _tensorboard_steps(out, "tokens") == _tensorboard_steps(out, "seq_len") == expected["train"]
    # a kill after the final checkpoint, relaunched without TensorBoard: the final evaluation's
    # points, at the checkpoint's step, stay (they were purged with nothing written again)
    (out / "summary.json").unlink()
    assert not _run({**o, "run.tensorboard": False}, resume=True).get("stopped_early")
    assert _tensorboard_steps(out, "val_loss") == expected["val"]
    # the state a kill after the final checkpoint leaves: every record, no summary
    (out / "summary.json").unlink()
    assert not _run(o, resume=True).get("stopped_early")
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "val"] == expected["val"]
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == expected["train"]
    assert _tensorboard_steps(out, "val_loss") == expected["val"]
    assert _tensorboard_steps(out, "loss") == expected["train"]
    # the state a kill before the first checkpoint leaves: records and events, no checkpoint
    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()
    _run(o)
    assert _tensorboard_steps(out, "val_loss") == expected["val"]
    assert _tensorboard_steps(out, "loss") == expected["train"]
    # relaunched with run.tensorboard = false: a resume drops what was written past its checkpoint
    # (they stayed, as the run's), and a fresh start the earlier attempt's events and their folder
    newest = list_checkpoints(out)[-1]
    assert load_checkpoint(newest)["progress"]["step"] == 6
    newest.unlink()  # the state of a kill after step 6 was logged, before its checkpoint was written
    (out / "summary.json").unlink()
    assert not _run({**o, "run.tensorboard": False}, resume=True).get("stopped_early")
    assert _tensorboard_steps(out, "loss") == [step for step in expected["train"] if step <= 3]
    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()
    _run({**o, "run.tensorboard": False})
    assert not (out / "tensorboard").exists()
    # a new run directory's tensorboard/ holding a user's own event file: not an earlier attempt's
    mine = tmp_path / "mine" / "tensorboard" / "events.out.tfevents.1.host.1.0.mine"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"")
    _run({**o, "run.out_dir": str(tmp_path / "mine")})
    assert mine.exists()


def test_model_vocab_size_pads_the_embedding_or_is_refused(reference_run, tmp_path, capsys):
    """model.vocab_size left at its default takes the tokenizer's size (512); a larger value pads
    the embedding (kept in the run, the checkpoint and the Hugging Face export, whose tokenizer
    still has 512 ids); a smaller one is one line before training."""
    from transformers import AutoConfig, AutoTokenizer

    from largebatch.cli import main as cli_main

    cache, ref_dir, _ = reference_run
    assert load_config(ref_dir / "config.toml", resolve_init=False).model.vocab_size == 512
    o = tiny_overrides(cache, tmp_path / "padded", **{"model.vocab_size": 576, "run.total_tokens": 32 * 8 * 2,
                                                       "schedule.batch_policy": "constant"})
    summary = _run(o)
    assert summary["steps"] == 2 and math.isfinite(summary["final_val_loss"])
    assert load_config(tmp_path / "padded" / "config.toml", resolve_init=False).model.vocab_size == 576
    state = load_checkpoint(list_checkpoints(tmp_path / "padded")[-1])["model"]
    assert state["tok_emb.weight"].shape == (576, 32)
    assert cli_main(["export", str(tmp_path / "padded"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "hf").vocab_size == 576
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == 512
    capsys.readouterr()
    smaller = tiny_overrides(cache, tmp_path / "smaller", **{"model.vocab_size": 500})
    assert main(["--check", *[f"--{k}={json.dumps(v)}" for k, v in smaller.items()]]) == 2
    assert ("model.vocab_size=500 is smaller than data.vocab_size=512, the size the run's tokenizer is "
            "trained to: lower data.vocab_size to 500") in capsys.readouterr().err


def test_a_tokenizer_that_stops_short_of_data_vocab_size_resumes(tmp_path, capsys):
    """On a corpus too small to fill data.vocab_size the trained tokenizer has fewer ids, and the
    run's config.toml keeps that size as model.vocab_size: ``--resume`` took data.vocab_size for the
    tokenizer's size and refused the run's own vocabulary; so did launching the run's own config.toml
    (which continues it)."""
    from largebatch.data.corpus import shakespeare_documents

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k, document in enumerate(shakespeare_documents()[:3]):  # three openings, 1,200 characters
        (corpus / f"play{k}.txt").write_text(document.text[:400])
    o = tiny_overrides(tmp_path / "cache", tmp_path / "run", **{
        "data.corpus": str(corpus), "data.vocab_size": 2048, "model.seq_len": 16, "run.total_tokens": 16 * 8 * 3,
        "run.eval_tokens": 64, "run.eval_every_tokens": 16 * 8 * 3, "schedule.batch_policy": "constant",
        "run.max_steps": 1})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    kept = load_config(tmp_path / "run" / "config.toml", resolve_init=False).model.vocab_size
    assert kept < 2048  # the tokenizer stopped short
    capsys.readouterr()
    assert main([str(tmp_path / "run" / "config.toml"), "--run.max_steps=1"]) == 0, capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [1, 2, 3]


def test_the_unigram_baseline_is_also_given_on_the_evaluated_tokens(reference_run):
    """The validation loss is measured on run.eval_tokens tokens, the unigram baseline was on the
    whole validation split: with a small slice a model no better than the unigram looked better
    than it. The summary also gives the baseline on the evaluated targets (float64 here, from the
    train split's add-one-smoothed counts)."""
    from largebatch.data import build_data

    cache, out, summary = reference_run
    cfg = load_config(out / "config.toml")
    data = build_data(cfg.data, cfg.model.seq_len, "causal")
    n = cfg.run.eval_tokens // cfg.model.seq_len
    targets = data.val.get_batch(range(n))["targets"].numpy().ravel()
    counts = np.bincount(data.train.tokens, minlength=data.vocab_size).astype(np.float64)
    log_p = np.log((counts + 1) / (counts.sum() + data.vocab_size))
    assert summary["unigram_eval_loss"] == pytest.approx(-log_p[targets].mean(), rel=1e-12)
    assert summary["unigram_eval_accuracy"] == pytest.approx((targets == counts.argmax()).mean(), rel=1e-12)
    assert summary["unigram_eval_loss"] != pytest.approx(summary["unigram_val_loss"], abs=1e-4)


def test_run_dtype_alone_sets_the_precision_and_the_callers_state_is_left_alone(reference_run, tmp_path):
    """From Python: a caller's ``torch.set_default_dtype(torch.float64)`` made an fp32 run train in
    float64, and a caller's bf16 ``torch.autocast`` moved its loss by 0.24, both unsaid; a run's plots
    switched the caller's matplotlib backend to Agg; the progress bar wrote to the stderr of import
    time, past ``contextlib.redirect_stderr``."""
    import contextlib
    import io

    import matplotlib

    cache, _, _ = reference_run
    plain = _run(tiny_overrides(cache, tmp_path / "plain"))
    backend, err = matplotlib.get_backend(), io.StringIO()
    matplotlib.use("svg")
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), contextlib.redirect_stderr(err):
            odd = _run(tiny_overrides(cache, tmp_path / "odd", **{"run.plots": True, "run.progress": "on"}))
            assert torch.is_autocast_enabled("cpu") and torch.get_default_dtype() == torch.float64
        assert matplotlib.get_backend() == "svg"
    finally:
        torch.set_default_dtype(torch.float32)
        matplotlib.use(backend)
    assert odd["final_val_loss"] == plain["final_val_loss"]
    state = load_checkpoint(list_checkpoints(tmp_path / "odd")[-1])["model"]
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}
    assert "% " in err.getvalue() and " tok  ETA " in err.getvalue()  # the bar, where the caller sent stderr
    assert (tmp_path / "odd" / "loss.png").stat().st_size > 0


def test_warning_filters_a_run_adds_are_removed_when_its_methods_return():
    """FSDP2 with tensor parallel silences FSDP2's view warning for the trainer's blocks; the filter
    stayed in the process after ``fit`` and silenced it for the caller's own models."""
    import warnings

    from largebatch.parallel.parallelize import FSDP_VIEW_WARNING
    from largebatch.train.loop import _run_state

    class Run:
        quiet_view_warning = True

        @_run_state
        def fit(self):
            return [f[1].pattern for f in warnings.filters if f[1] is not None]

    before = list(warnings.filters)
    assert FSDP_VIEW_WARNING in Run().fit()
    assert warnings.filters == before


def test_the_summary_mfu_counts_each_launch_at_its_own_peak(reference_run, tmp_path):
    """The run's MFU divided all its steps' seconds by the last launch's peak FLOP/s x processes: after
    a resume on more processes (or with the peak measured again) the earlier launches were counted at
    the new rate, and the run's MFU fell outside the range of its launches' own (0.12 for launches of
    0.16 and 0.15, 1 -> 2 processes). Here the second launch declares 4x the first one's peak."""
    cache, out, straight = reference_run
    assert straight["peak_varied"] is False  # one launch: its own peak, named
    assert f"% of {straight['peak_flops'] / 1e12:.3f} TFLOP/s (" in format_summary(straight, out)
    o = tiny_overrides(cache, tmp_path / "run", **{"run.peak_flops": 1e9, "run.max_steps": 4})
    _run(o)
    first = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])["progress"]
    assert first["step"] == 4
    summary = _run({**o, "run.peak_flops": 4e9, "run.max_steps": None}, resume=True)
    last = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])["progress"]
    assert last["step"] == summary["steps"] > 4 and last["train_seconds"] == summary["train_seconds"]
    seconds = (first["train_seconds"], last["train_seconds"] - first["train_seconds"])
    assert summary["mfu"] == pytest.approx(last["model_flops"] / (seconds[0] * 1e9 + seconds[1] * 4e9), rel=1e-9)
    # and the summary does not call it a fraction of this launch's peak alone
    assert summary["peak_varied"] is True
    assert "of each launch's own peak and processes (this launch: 1 x 0.004 TFLOP/s" in format_summary(
        summary, tmp_path / "run")


def test_a_pt_that_is_not_a_trainers_checkpoint_is_named_so(reference_run, tmp_path):
    """A model's state dict saved by hand (or torch's dcp_to_torch_save output) under a checkpoint's
    name ended the resume with the bare text of a KeyError: "'optimizer'"."""
    cache, _, _ = reference_run
    o = tiny_overrides(cache, tmp_path / "run", **{"run.max_steps": 2})
    _run(o)
    newest = list_checkpoints(tmp_path / "run")[-1]
    torch.save({"model": load_checkpoint(newest)["model"]}, newest)
    with pytest.raises(ValueError, match=r"cannot resume from .*step_00000002.pt \(intact, so no older checkpoint is "
                                         r"used instead\): it has no '\w+' entry, so it is not a checkpoint of this "
                                         r"trainer"):
        _run({**o, "run.max_steps": None}, resume=True)
