"""run.on_nonfinite='skip' decided on the device (largebatch.train.skip): a step that does not log
reads nothing from the device (counted at the dispatcher, as tests/test_train_step.py does), a
non-finite step leaves the parameters and the optimizer state bit-identical, and a diverging run
still gives up naming the step where the consecutive skips reached the limit."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from largebatch.train.cli import main
from largebatch.train.deferred import HostReads
from largebatch.train.metrics import read_metrics
from test_train import tiny_overrides
from test_train_step import _trainer

OPTIMIZERS = [
    {"optim.name": "lamb"},  # capturable under skip: device step counts, taken back with the rest
    {"optim.name": "lans", "optim.grad_clip": 0.5},
    {"optim.name": "adamw", "optim.fused": True, "optim.grad_clip": 0.5},  # tensor step counters
    # torch's default path (foreach on a GPU, whose step counters stay on the host: settled at the
    # next read; benchmarks/gpu_check.sh runs this file on the device)
    {"optim.name": "adamw", "optim.grad_clip": 0.5},
]


def _state(optimizer) -> dict:
    """The optimizer state as plain values (tensors cloned), for an exact comparison."""
    return copy.deepcopy({k: v for k, v in optimizer.state_dict()["state"].items()})


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].keys() == b[index].keys()
        for key, value in a[index].items():
            other = b[index][key]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), (index, key)


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_a_skip_enabled_step_reads_nothing_and_a_nonfinite_one_changes_nothing(tmp_path, reference_run, optim):
    """A finite step that does not log: no host read, and the update applied. A step whose MLP output
    is made infinite by a forward hook (so the loss and every gradient are non-finite): still no
    host read, and after the next read the parameters and the whole optimizer state (moments and
    step counts) equal those before it, bit for bit; the log marks it skipped."""
    trainer = _trainer(reference_run[0], tmp_path / "run", **optim, **{"run.on_nonfinite": "skip"})
    # torch's default AdamW reads its own step counters, which it keeps on the host on every device
    # (.item() of CPU tensors: no device wait); the rest of the step is held to no reads by the others
    own_reads = optim["optim.name"] == "adamw" and not optim.get("optim.fused")
    try:
        trainer.train_step()  # creates the optimizer state
        start = [p.detach().clone() for p in trainer.raw_model.parameters()]
        with HostReads() as reads:
            record = trainer.train_step()
        assert own_reads or reads.scalar == 0 and reads.calls == [], (reads.scalar, reads.calls)
        assert all(not torch.equal(a, p) for a, p in zip(start, trainer.raw_model.parameters()))
        assert "skipped" not in trainer.log_record(record)

        params = [p.detach().clone() for p in trainer.raw_model.parameters()]
        state = _state(trainer.optimizer)
        hook = trainer.raw_model.blocks[0].mlp.register_forward_hook(lambda m, args, out: out * float("inf"))
        try:
            with HostReads() as reads:
                record = trainer.train_step()
        finally:
            hook.remove()
        assert own_reads or reads.scalar == 0 and reads.calls == [], (reads.scalar, reads.calls)
        logged = trainer.log_record(record)  # the read: counts settled, host step counters corrected
        assert logged.get("skipped") is True and not torch.isfinite(torch.tensor(logged["loss"]))
        assert all(torch.equal(a, p) for a, p in zip(params, trainer.raw_model.parameters()))
        _assert_same_state(state, _state(trainer.optimizer))
        assert (trainer.pos.skipped_steps, trainer.pos.skipped_in_a_row) == (1, 1)

        trainer.train_step()  # a finite step again: applied, the consecutive count back to 0
        assert "skipped" not in trainer.log_record(record := trainer.train_step())
        assert (trainer.pos.skipped_steps, trainer.pos.skipped_in_a_row) == (1, 0)
        assert all(not torch.equal(a, p) for a, p in zip(params, trainer.raw_model.parameters()))
    finally:
        trainer._close()


def test_give_up_is_detected_at_the_next_read_naming_the_same_step(tmp_path, reference_run, capsys):
    """At LR 1e30 the run diverges within a few steps: with reads every step and every 4th step the run exits 1
    with the same message (the step where 3 consecutive skips were reached, the count, the last good
    checkpoint; the deferred one detects it at its next read, here the checkpoint due after that
    step), and neither writes a checkpoint or a log record past that step."""
    messages, logged, saved = [], [], []
    for every in (1, 4):
        out = tmp_path / f"nan{every}"
        o = tiny_overrides(reference_run[0], out, **{
            "schedule.peak_lr": 1e30, "schedule.batch_policy": "constant", "optim.name": "adamw",
            "run.on_nonfinite": "skip", "run.max_skipped_steps": 3, "run.log_every_steps": every,
            "run.checkpoint_every_tokens": 32 * 8})
        assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Last good checkpoint: " in err, err
        messages.append(err[err.index("3 consecutive non-finite steps skipped"):].split(" Last good")[0])
        logged.append([r for r in read_metrics(out) if r["kind"] == "train"])
        saved.append(sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*")))
    # the give-up step from the every-step run's own log: its first skipped step + 2 (3 in a row)
    first_skipped = min(r["step"] for r in logged[0] if r.get("skipped"))
    assert all(r.get("skipped") for r in logged[0] if r["step"] >= first_skipped)
    give_up = first_skipped + 2
    assert messages[0] == messages[1] == (f"3 consecutive non-finite steps skipped, the last at step "
                                          f"{give_up} (3 skipped in all)."), messages
    assert max(r["step"] for r in logged[1]) < give_up  # the deferred run logged nothing past it
    assert all(step < give_up for steps in saved for step in steps), saved  # nor checkpointed
    # metrics.jsonl is strict JSON (no bare NaN, which jq, JavaScript, polars refuse): a skipped step's
    # non-finite loss is null there, named in the record's "nonfinite"; read_metrics puts it back
    def refuse(constant):
        raise AssertionError(f"{constant} in metrics.jsonl")

    lines = (tmp_path / "nan1" / "metrics.jsonl").read_text().splitlines()
    raw = [json.loads(line, parse_constant=refuse) for line in lines]
    skipped = [(r, back) for r, back in zip(raw, read_metrics(tmp_path / "nan1")) if r.get("skipped")]
    assert skipped and any(r["loss"] is None for r, _ in skipped)
    for r, back in skipped:
        for pointer, spelled in r.get("nonfinite", {}).items():
            key = pointer[1:]  # (top-level keys here, none with "/" or "~")
            assert r[key] is None and spelled in ("NaN", "Infinity", "-Infinity")
            assert math.isnan(back[key]) if spelled == "NaN" else back[key] == float(spelled)
        assert "nonfinite" not in back


def test_a_run_that_ends_with_a_non_finite_loss_writes_a_strict_summary(tmp_path, reference_run):
    """Every step skipped (LR 1e30, no limit on skips): the run ends (exit 0) with a NaN validation
    loss, and summary.json is strict JSON too: the loss null, named in "nonfinite"."""
    out = tmp_path / "nan"
    o = tiny_overrides(reference_run[0], out, **{
        "schedule.peak_lr": 1e30, "schedule.batch_policy": "constant", "optim.name": "adamw",
        "run.on_nonfinite": "skip", "run.max_skipped_steps": None})
    assert main([f"--{k}={json.dumps(v) if v is not None else 'none'}" for k, v in o.items()]) == 0

    def refuse(constant):
        raise AssertionError(f"{constant} in summary.json")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert summary["final_val_loss"] is None and summary["nonfinite"]["/final_val_loss"] == "NaN", summary


def test_a_records_non_finite_numbers_go_out_as_strict_json_and_come_back():
    """strict_record / restored_record at any depth: nested dicts and lists, keys with "/" and "~"
    (JSON Pointer's escapes), numpy's floats; a record's own key named "nonfinite" is refused, and
    another program's "nonfinite" that is not the writer's map is left as it is."""
    import numpy as np

    from largebatch.train.metrics import restored_record, strict_record

    record = {"loss": float("nan"), "val_loss/a~b": np.float64("inf"), "step": 3, "ok": True,
              "trust": {"blocks.0/q": [1.0, float("-inf")], "": float("nan")}, "lr": 1e-3}
    line = json.dumps(strict_record(record), allow_nan=False)
    raw = json.loads(line)
    assert raw["loss"] is None and raw["trust"]["blocks.0/q"] == [1.0, None] and raw["step"] == 3
    assert raw["nonfinite"] == {"/loss": "NaN", "/val_loss~1a~0b": "Infinity", "/trust/blocks.0~1q/1": "-Infinity",
                                "/trust/": "NaN"}
    back = restored_record(raw)
    assert math.isnan(back["loss"]) and back["val_loss/a~b"] == float("inf") and math.isnan(back["trust"][""])
    assert back["trust"]["blocks.0/q"] == [1.0, float("-inf")] and "nonfinite" not in back and back["ok"] is True
    assert strict_record({"loss": 1.0}) == {"loss": 1.0}  # (no map without a non-finite number)
    with pytest.raises(ValueError, match="may not hold a key named 'nonfinite'"):
        strict_record({"nonfinite": 2})
    assert restored_record({"nonfinite": 3, "x": 1.0}) == {"nonfinite": 3, "x": 1.0}


@pytest.mark.parametrize("optim", [{"optim.name": "lans", "optim.grad_clip": 0.5},
                                   # torch's default path: on an accelerator its counts become device tensors
                                   # (capturable), where the take-back reaches them; on CPU they are already
                                   {"optim.name": "adamw", "optim.grad_clip": 0.5}])
def test_skipped_steps_leave_no_trace_in_the_step_counts_or_the_trajectory(tmp_path, reference_run, optim):
    """LANS under skip, six steps of which the 1st (the optimizer state is created by it), 3rd and 4th
    are made non-finite by a forward hook: its step counts (device tensors: capturable) equal the 3
    applied steps, and every step's parameters and the final state equal, bit for bit, those of a
    run whose optimizer keeps host counts and is not stepped at all where a host check finds the
    step non-finite. The same for torch's AdamW, with no host read between the steps: on a GPU its
    default path kept its counts on the host, where a take-back did not reach them before the next
    read (benchmarks/gpu_check.sh runs this file there)."""
    bad = {1, 3, 4}
    runs = []
    for device_skip in (True, False):
        trainer = _trainer(reference_run[0], tmp_path / f"run{device_skip}", **{**optim, "run.on_nonfinite": "skip"})
        layerwise = optim["optim.name"] == "lans"
        assert not layerwise or trainer.optimizer.capturable
        if not device_skip:  # the reference: host counts, and no step at all when not finite
            if layerwise:  # (torch's AdamW keeps its flag: its capturable bias corrections round otherwise)
                trainer.optimizer.capturable = False
            trainer.skip.step = lambda optimizer, finite, step, **_: optimizer.step() if bool(finite) else None
        block = trainer.raw_model.blocks[0].mlp
        trajectory = []
        try:
            for step in range(1, 7):
                hook = block.register_forward_hook(lambda m, args, out: out * float("inf")) if step in bad else None
                try:
                    trainer.train_step()
                finally:
                    if hook is not None:
                        hook.remove()
                trajectory.append([p.detach().clone() for p in trainer.raw_model.parameters()])
            runs.append((trajectory, _state(trainer.optimizer)))
        finally:
            trainer._close()
    (device_run, device_state), (host_run, host_state) = runs
    assert all(torch.equal(a, b) for at, bt in zip(device_run, host_run) for a, b in zip(at, bt))
    assert device_state.keys() == host_state.keys()
    for index, state in device_state.items():
        count = state["step"]
        assert isinstance(count, torch.Tensor) and float(count) == host_state[index]["step"] == 3
        assert all(torch.equal(state[key], host_state[index][key]) for key in ("exp_avg", "exp_avg_sq"))
    assert not torch.equal(device_run[0][0], device_run[-1][0])  # the applied steps did move it


def test_torchs_optimizers_keep_their_step_counts_where_a_take_back_reaches_them():
    """device_step_counts, the logic (a GPU runs the trainer's tests above through
    benchmarks/gpu_check.sh): AdamW's groups whose parameters sit on a device type torch allows
    capturable on get the flag, and a step count a loaded state kept elsewhere moves to the
    parameter's device (the meta device stands in for an accelerator here); a CPU group (torch
    refuses capturable there) and a fused one are left as they are."""
    from largebatch.train.optimizer import device_step_counts

    cpu = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(cpu, lr=0.1)
    cpu[0].grad = torch.ones(3)
    opt.step()
    device_step_counts(opt)  # torch's own list: no CPU in it
    assert opt.param_groups[0]["capturable"] is False and opt.state[cpu[0]]["step"].device.type == "cpu"
    device_step_counts(opt, supported=frozenset({"cpu"}))
    assert opt.param_groups[0]["capturable"] is True
    meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    opt = torch.optim.AdamW(meta, lr=0.1)
    opt.state[meta[0]]["step"] = torch.tensor(4.0)  # as a non-capturable checkpoint loads it: on the host
    device_step_counts(opt, supported=frozenset({"meta"}))
    assert opt.param_groups[0]["capturable"] is True and opt.state[meta[0]]["step"].device.type == "meta"
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, fused=True)
    device_step_counts(fused, supported=frozenset({"cpu"}))
    assert fused.param_groups[0]["capturable"] is False
