"""run.dtype = "fp16": autocast with dynamic loss scaling (largebatch.train.loss_scale). The scale
follows the rule as written out here; an fp16 step hands clipping, the noise scale and the optimizer
the unscaled gradient (its norm and the noise-scale inputs equal an fp32 step's, where a forgotten
division would leave them 2**16 too large); an overflow is skipped on the device, parameters and
optimizer state unchanged to the bit, and is not a non-finite step -- except at scale 1; and a run
stopped and continued carries its scale on, equal to the uninterrupted run record for record."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from largebatch.train.cli import main, resolve_config
from largebatch.train.config import load_config
from largebatch.train.deferred import HostReads
from largebatch.train.loop import NonFiniteLoss
from largebatch.train.loss_scale import LossScale
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError
from test_train import tiny_overrides
from test_train_step import _trainer


def _rule(scale: float, growth_steps: int, steps: list[str]) -> list[tuple[float, int, int, bool]]:
    """The dynamic loss-scale rule, from its statement, for steps that are "good", "overflow" (the
    gradients overflowed, the loss finite) or "nan" (the loss not finite): on overflow halve (never
    below 1) and start counting again, an overflow at 1 being a non-finite step and not counted as an
    overflow; a NaN loss changes nothing; a good step counts, and at growth_steps good steps in a row
    the scale doubles (if the double is finite) and the count starts again."""
    good = total = 0
    out = []
    for step in steps:
        at_floor = step == "overflow" and scale <= 1.0
        if at_floor:
            good = 0
        elif step == "overflow":
            scale, good, total = max(scale / 2, 1.0), 0, total + 1
        elif step == "nan":
            pass
        else:
            good += 1
            if good == growth_steps:
                good = 0
                if scale * 2 < float(torch.finfo(torch.float32).max):
                    scale *= 2
        out.append((scale, good, total, at_floor))
    return out


@pytest.mark.parametrize("start, growth_steps", [(8.0, 3), (2.0**16, 1), (2.0**126, 2), (1.0, 4)])
def test_the_loss_scale_follows_the_rule(start, growth_steps):
    """Random sequences of good, overflowed and NaN-loss steps (runs of overflows reach the floor at 1;
    growth past fp32's largest power of two stops) give the scale, the good-step count, the overflow
    count and the at-floor flag of the rule written out above, step by step."""
    rng = random.Random(int(start) % 1000 + growth_steps)
    steps = (rng.choices(["good", "overflow", "nan"], weights=[60, 35, 5], k=200) + ["overflow"] * 12
             + ["good", "nan"] * 5 + ["good"] * 30)
    scaler = LossScale(torch.device("cpu"), start, growth_steps)
    got = []
    for step in steps:
        at_floor = scaler.update(torch.tensor(step == "overflow"), hold=torch.tensor(step == "nan"))
        got.append((*scaler.read(), bool(at_floor)))
    assert got == _rule(start, growth_steps, steps)


def test_fp16_settings_are_checked(tiny_data_cache, tmp_path):
    """An fp16-only field on another precision, a scale below 1 and torch's dtype spellings are
    refused in one line naming the field, the value and the fix."""
    base = tiny_overrides(tiny_data_cache, tmp_path / "run")
    for extra, words in [({"run.loss_scale": 1024.0}, "run.loss_scale = 1024.0: read by fp16 runs only"),
                         ({"run.loss_scale_growth_steps": 50, "run.loss_scale": 8.0},
                          "run.loss_scale = 8.0 and run.loss_scale_growth_steps = 50: read by fp16 runs only, and "
                          "run.dtype = 'fp32': set run.dtype = 'fp16', or set them back"),
                         ({"run.dtype": "fp16", "run.loss_scale": 0.5}, "must be a number from 1 to 2**127"),
                         ({"run.dtype": "fp16", "run.loss_scale": 1e39}, "run.loss_scale = 1e+39: must be a number"),
                         ({"run.dtype": "fp16", "run.loss_scale_growth_steps": 0}, "must be >= 1"),
                         ({"run.dtype": "half"}, "write 'fp16'"), ({"run.dtype": "float16"}, "write 'fp16'")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(resolve_config(None), {**base, **extra})
    cfg = load_config(resolve_config(None), {**base, "run.dtype": "fp16", "run.loss_scale": 256})
    assert cfg.run.loss_scale == 256.0 and cfg.run.loss_scale_growth_steps == 2000


def test_an_fp16_step_gives_clipping_and_the_noise_scale_the_unscaled_gradient(tiny_data_cache, tmp_path):
    """The same first step (two micro-batches, no dropout) in fp32 and in fp16 at the default scale
    2**16: the clipped norm and the noise scale's inputs (the first micro-batch's squared norm, the
    step's) agree within fp16's rounding, the scale is unchanged and nothing overflowed; and the update
    steps with the fp32 step's clipped gradient within that rounding."""
    runs = {}
    for dtype in ("fp32", "fp16"):
        trainer = _trainer(tiny_data_cache, tmp_path / dtype, **{"run.dtype": dtype, "model.dropout": 0.0,
                                                                 "schedule.warmup": 0.0,
                                                                 "optim.grad_clip": 0.5})
        try:
            seen = []  # the gradients the optimizer steps with (after unscaling and clipping)
            step = trainer.optimizer.step
            trainer.optimizer.step = lambda: (seen.append(torch.cat([p.grad.flatten() for p in
                                                                     trainer.raw_model.parameters()])), step())[1]
            record = trainer.train_step()
            norms, small_batch, big_batch = trainer.deferred.noise_inputs[0]  # (small_sq, big_sq, kept)
            inputs = [*norms.tolist(), small_batch, big_batch]
            runs[dtype] = (trainer.log_record(record), inputs, seen[0])
        finally:
            trainer._close()
    (r32, in32, d32), (r16, in16, d16) = runs["fp32"], runs["fp16"]
    assert r32["grad_norm"] > 0.5  # clipping binds: the clipped update depends on the norm's scale
    assert r16["grad_norm"] == pytest.approx(r32["grad_norm"], rel=5e-3)
    assert r16["loss"] == pytest.approx(r32["loss"], rel=1e-3)
    assert in16 == pytest.approx(in32, rel=1e-2)  # (small_sq, step's squared norm, kept, micro-batch, batch)
    assert r16["loss_scale"] == 2.0**16 and r16["overflow_steps"] == 0 and "overflow" not in r16
    assert "loss_scale" not in r32
    assert d32.norm() == pytest.approx(0.5, rel=1e-4)  # clipped to optim.grad_clip
    assert (d16 - d32).norm() < 1e-2 * d32.norm()


def test_an_fp16_step_that_does_not_log_reads_nothing_from_the_device(tiny_data_cache, tmp_path):
    """The scale, the overflow decision and the take-back stay on the device: neither a step that
    applies its update nor one that overflows reads a value to the host (counted at the dispatcher)."""
    trainer = _trainer(tiny_data_cache, tmp_path / "run", **{"run.dtype": "fp16", "run.loss_scale": 2.0**40,
                                                             "optim.name": "lans", "optim.grad_clip": 0.5})
    try:
        trainer.train_step()  # creates the optimizer state
        with HostReads() as reads:
            overflowed = trainer.train_step()
        assert reads.scalar == 0 and reads.calls == [], (reads.scalar, reads.calls)
        assert trainer.log_record(overflowed)["overflow"] is True
        trainer.loss_scale.scale.fill_(2.0**10)  # (a scale that fits)
        with HostReads() as reads:
            applied = trainer.train_step()
        assert reads.scalar == 0 and reads.calls == [], (reads.scalar, reads.calls)
        record = trainer.log_record(applied)
        assert "overflow" not in record and record["loss_scale"] == 2.0**10
    finally:
        trainer._close()


def test_an_overflow_is_skipped_on_the_device_and_is_not_a_non_finite_step(tiny_data_cache, tmp_path):
    """Started at 2**40, the first steps' gradients overflow fp16: each is taken back (parameters and
    LAMB's state, its device step count included, unchanged to the bit), halves the scale and is
    logged as an overflow, while run.on_nonfinite = 'stop' does not stop the run and no step counts as
    skipped for non-finiteness. Once the scale fits, the first update is LAMB's step 1."""
    trainer = _trainer(tiny_data_cache, tmp_path / "run", **{"run.dtype": "fp16", "run.loss_scale": 2.0**40,
                                                             "optim.name": "lamb", "run.total_tokens": 32 * 8 * 100,
                                                             "schedule.batch_policy": "constant",
                                                             "run.ema_decay": 0.9})
    try:
        params = [p.detach().clone() for p in trainer.raw_model.parameters()]
        average = {k: v.clone() for k, v in trainer.ema.state_dict().items()}
        record = trainer.log_record(trainer.train_step())
        assert record["overflow"] is True and record["loss_scale"] == 2.0**39 and record["overflow_steps"] == 1
        assert not any(key.startswith("trust_") for key in record)  # (the undone update's ratios are not logged)
        assert all(torch.equal(a, p) for a, p in zip(params, trainer.raw_model.parameters()))
        assert all(float(s["step"]) == 0 for s in trainer.optimizer.state.values())
        # the weight average neither moved nor counted the step
        assert trainer.ema.step_count() == 0
        assert all(torch.equal(v, average[k]) for k, v in trainer.ema.state_dict().items())
        overflowed = 1
        while True:
            before = [p.detach().clone() for p in trainer.raw_model.parameters()]
            record = trainer.log_record(trainer.train_step())
            moved = not all(torch.equal(a, p) for a, p in zip(before, trainer.raw_model.parameters()))
            if not record.get("overflow"):
                break
            overflowed += 1
            assert not moved and record["loss_scale"] == 2.0 ** (40 - overflowed)
            assert overflowed < 40
        assert moved and overflowed >= 5  # (a scale fp16 can hold is far below 2**35 here)
        assert record["loss_scale"] == 2.0 ** (40 - overflowed) and record["overflow_steps"] == overflowed
        assert all(float(s["step"]) == 1 for s in trainer.optimizer.state.values())
        assert trainer.pos.skipped_steps == 0 and trainer.pos.step == overflowed + 1
        assert trainer.ema.step_count() == 1 and "trust_median" in record
    finally:
        trainer._close()


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_an_overflow_at_scale_one_is_a_non_finite_step(tiny_data_cache, tmp_path, policy):
    """One parameter's gradient made infinite (a tensor hook; the loss stays finite): at scale 4 the
    step overflows (4 -> 2), again (2 -> 1), and at 1 nothing is left to lower: that step is
    non-finite. 'stop' stops the run at the next read naming it; 'skip' counts it toward
    run.max_skipped_steps, and gives up at the second, naming both kinds of fp16 non-finite step."""
    trainer = _trainer(tiny_data_cache, tmp_path / "run", **{
        "run.dtype": "fp16", "run.loss_scale": 4.0, "run.on_nonfinite": policy, "run.max_skipped_steps": 2})
    trainer.raw_model.blocks[0].mlp.fc1.weight.register_hook(lambda g: g * float("inf"))
    try:
        for scale in (2.0, 1.0):
            record = trainer.log_record(trainer.train_step())
            assert record["overflow"] is True and record["loss_scale"] == scale and "skipped" not in record
        record = trainer.train_step()
        if policy == "stop":
            words = (r"loss is [0-9.]+ \(gradient norm (inf|nan)\) at step 3, \d+ tokens \(run.dtype = 'fp16': the "
                     r"gradients overflowed at a loss scale of 1, the least it goes\)\..*"
                     r"or train in run.dtype = 'bf16'")
            with pytest.raises(NonFiniteLoss, match=words):
                trainer.log_record(record)
        else:  # a non-finite step, not an overflow
            record = trainer.log_record(record)
            assert record["skipped"] is True and "overflow" not in record
            assert record["loss_scale"] == 1.0 and record["overflow_steps"] == 2
            assert (trainer.pos.skipped_steps, trainer.pos.skipped_in_a_row) == (1, 1)
            with pytest.raises(NonFiniteLoss, match=r"2 consecutive non-finite steps skipped, the last at step 4 "
                                                    r"\(2 skipped in all\) \(run.dtype = 'fp16': .*or gradients "
                                                    r"that overflowed at a loss scale of 1"):
                trainer.log_record(trainer.train_step())
    finally:
        trainer._close()


def test_an_fp16_run_stopped_and_continued_equals_the_uninterrupted_one(tiny_data_cache, tmp_path):
    """A tiny fp16 run started at 2**24 with growth every 3 good steps (so its scale falls and rises
    on both sides of the stop), stopped at step 7 (run.max_steps) and continued by the same command:
    every record -- loss, gradient norm, loss scale, overflow count -- and the summary equal the
    uninterrupted run's."""
    fp16 = {"run.dtype": "fp16", "run.loss_scale": 2.0**24, "run.loss_scale_growth_steps": 3,
            "run.log_every_steps": 1}
    full, stopped = tmp_path / "full", tmp_path / "stopped"

    def train(out, **extra):
        o = tiny_overrides(tiny_data_cache, out, **fp16, **extra)
        assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0

    train(full)
    train(stopped, **{"run.max_steps": 7})
    train(stopped)

    def records(run):
        return [(r["step"], r["loss"], str(r["grad_norm"]), r["loss_scale"], r["overflow_steps"], r.get("overflow"))
                for r in read_metrics(run) if r["kind"] == "train"]  # (an overflow's norm: inf or nan)

    ours = records(full)
    scales = [r[3] for r in ours]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert records(stopped) == ours
    summaries = [json.loads((run / "summary.json").read_text()) for run in (full, stopped)]
    for key in ("final_val_loss", "loss_scale", "overflow_steps", "steps"):
        assert summaries[0][key] == summaries[1][key], key
    assert summaries[0]["overflow_steps"] == ours[-1][4] > 0


def test_a_phase_that_resets_the_optimizer_keeps_its_step_counts_on_the_device(tiny_data_cache, tmp_path):
    """[[phases]] with optimizer_state = 'reset' builds a new optimizer at the switch: in an fp16 run
    (an overflow is taken back on the device) LANS must keep its step counts there too, as the first
    phase's does, so that an overflow right after the switch leaves the count as it was."""
    from largebatch.train.loop import Trainer
    from test_train_phases import write_config

    config = write_config(tmp_path, tiny_data_cache, run_extra='dtype = "fp16"\nloss_scale = 1099511627776.0',
                          phase_extra='optimizer_state = "reset"')
    out = tmp_path / "run"
    trainer = Trainer(load_config(resolve_config(str(config)), {"run.out_dir": str(out)}), out, log=lambda *_: None)
    try:
        assert trainer.optimizer.capturable
        trainer._begin_next_phase()
        assert trainer.optimizer.capturable
        record = trainer.log_record(trainer.train_step())  # 2**40: overflows
        assert record["overflow"] is True
        assert all(float(s["step"]) == 0 for s in trainer.optimizer.state.values())
    finally:
        trainer._close()


def test_check_counts_the_copy_a_step_that_may_be_taken_back_keeps(tiny_data_cache, tmp_path):
    """`train --check`'s state estimate: an fp16 (or skip-enabled) step copies the parameters and the
    optimizer state while the optimizer steps; the estimate's copy equals the bytes of those tensors in
    a real trainer after its first step (LANS: two moments and a step count per tensor), and an fp32
    run without skip has none."""
    from largebatch.train.preflight import estimate_state

    for extra, copies in [({"run.dtype": "fp16"}, True), ({"run.on_nonfinite": "skip"}, True), ({}, False)]:
        o = tiny_overrides(tiny_data_cache, tmp_path / f"run{len(extra)}{copies}", **{"optim.name": "lans", **extra})
        cfg = load_config(resolve_config(None), o)
        trainer = _trainer(tiny_data_cache, tmp_path / f"t{len(extra)}{copies}", **{"optim.name": "lans", **extra})
        try:
            trainer.train_step()
            params = [p for p in trainer.raw_model.parameters() if p.requires_grad]
            held = sum(p.numel() * p.element_size() for p in params) + sum(
                v.numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)  # (0-d step counts: a few bytes, not counted)
        finally:
            trainer._close()
        est = estimate_state(cfg, trainer.data.vocab_size)
        assert est.step_copy == (pytest.approx(held, rel=1e-6) if copies else 0.0)


def test_a_loss_scale_given_on_resume_starts_the_scale_again_there(tiny_data_cache, tmp_path, capsys):
    """`--resume RUN --run.loss_scale=1024`: the checkpoint's scale gives way to the one given (said
    in a note), as config.toml then records; the same command without a change continues the
    checkpoint's scale."""
    out = tmp_path / "run"
    o = tiny_overrides(tiny_data_cache, out, **{"run.dtype": "fp16", "run.log_every_steps": 1, "run.max_steps": 3})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    assert main(["--resume", str(out), "--run.max_steps=2"]) == 0  # unchanged: continues at 65536
    assert main(["--resume", str(out), "--run.loss_scale=1024", "--run.max_steps=2"]) == 0
    logged = capsys.readouterr().out
    assert "note: run.loss_scale = 1024 (the run started at 65536): the loss scale starts again there, from 65536" \
        in logged, logged[-2000:]
    scales = [(r["step"], r["loss_scale"]) for r in read_metrics(out) if r["kind"] == "train"]
    assert scales == [(1, 65536.0), (2, 65536.0), (3, 65536.0), (4, 65536.0), (5, 65536.0), (6, 1024.0),
                      (7, 1024.0)], scales
    assert "loss_scale = 1024.0" in (out / "config.toml").read_text()


def test_a_non_finite_loss_leaves_the_scale_and_its_count_alone(tiny_data_cache, tmp_path):
    """Steps whose loss is NaN (an MLP output made infinite: the forward pass, which a scale cannot
    mend) under run.on_nonfinite = 'skip' with growth every 2 steps: they are skipped as non-finite,
    and neither grow the scale (they are no good steps) nor halve it (no overflow)."""
    trainer = _trainer(tiny_data_cache, tmp_path / "run", **{
        "run.dtype": "fp16", "run.loss_scale": 4.0, "run.loss_scale_growth_steps": 2, "run.on_nonfinite": "skip"})
    hook = trainer.raw_model.blocks[0].mlp.register_forward_hook(lambda m, args, out: out * float("inf"))
    try:
        for _ in range(3):
            record = trainer.log_record(trainer.train_step())
            assert record["skipped"] is True and "overflow" not in record and record["loss_scale"] == 4.0
        assert (trainer.pos.loss_scale_good_steps, trainer.pos.overflow_steps, trainer.pos.skipped_steps) == (0, 0, 3)
        hook.remove()
        for scale in (4.0, 8.0):  # good steps again: the second doubles it
            assert trainer.log_record(trainer.train_step())["loss_scale"] == scale
    finally:
        hook.remove()
        trainer._close()



def test_an_fp16_run_continues_in_bf16_and_back(tiny_data_cache, tmp_path, capsys):
    """`--resume RUN --run.dtype=bf16` of an fp16 run started at its own loss scale (a move to a GPU
    with bf16): its loss-scale settings go with fp16 (set back to their defaults, with a note, as
    config.toml records) and it continues in bf16 with no scale; back in fp16 the scale starts again at
    the default. A loss scale given with bf16 on the same command is still refused, naming it."""
    out = tmp_path / "run"
    o = tiny_overrides(tiny_data_cache, out, **{"run.dtype": "fp16", "run.loss_scale": 1024.0,
                                                "run.loss_scale_growth_steps": 7, "run.log_every_steps": 1,
                                                "run.max_steps": 2})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    capsys.readouterr()
    assert main(["--resume", str(out), "--run.dtype=bf16", "--run.loss_scale=512", "--run.max_steps=2"]) == 2
    assert "run.loss_scale = 512.0: read by fp16 runs only" in capsys.readouterr().err
    assert main(["--resume", str(out), "--run.dtype=bf16", "--run.max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert ("note: run.dtype = 'bf16' (the run trained in fp16): its run.loss_scale = 1024 and "
            "run.loss_scale_growth_steps = 7 go with fp16 and are set back to their defaults") in err, err
    saved = load_config(out / "config.toml")
    assert (saved.run.dtype, saved.run.loss_scale, saved.run.loss_scale_growth_steps) == ("bf16", 65536.0, 2000)
    assert main(["--resume", str(out), "--run.dtype=fp16", "--run.max_steps=1"]) == 0
    scales = [(r["step"], r.get("loss_scale")) for r in read_metrics(out) if r["kind"] == "train"]
    assert scales == [(1, 1024.0), (2, 1024.0), (3, None), (4, None), (5, 65536.0)], scales
