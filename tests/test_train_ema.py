"""run.ema_decay (largebatch.train.ema): the bias-corrected moving average of the weights against a
float64 reference written from its sum form, a training left bit-identical by it, its validation loss
against a float64 cross-entropy of the saved average, exact resume, a resume that turns it on, the
skip of a non-finite step, and the average exported and fine-tuned (--ema)."""

from __future__ import annotations

import json

import pytest
import torch

from largebatch.checkpoint import list_checkpoints, load_checkpoint
from largebatch.train.cli import main
from largebatch.train.deferred import HostReads
from largebatch.train.metrics import read_metrics
from test_train import _run, _train_losses, tiny_overrides
from test_train_step import _trainer

DECAY = 0.8  # ~5 steps: the tiny run's ~24 steps move the average well away from any one weight


def _reference_average(snapshots: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """a_n = sum_k d^(n-k) (1 - d) w_k / (1 - d^n) over the weights after each applied step, float64."""
    n = len(snapshots)
    scale = (1 - decay) / (1 - decay ** n)
    return {name: sum(decay ** (n - k) * scale * w[name] for k, w in enumerate(snapshots, start=1))
            for name in snapshots[0]}


def _named(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().double().clone() for group in trainer.optimizer.param_groups
            for name, p in zip(group["names"], group["params"])}


def test_the_average_is_the_bias_corrected_weighted_mean_of_the_applied_steps(tmp_path, reference_run):
    """Seven steps under run.on_nonfinite = "skip", the 3rd and 5th made non-finite by a forward hook:
    after each step the average equals the float64 sum form over the weights after the applied steps
    only (its count skips the taken-back ones), and after the first it is those weights exactly; no
step reads a value from the device."""
    trainer = _trainer(reference_run[0], tmp_path / "run", **{"run.ema_decay": DECAY, "run.on_nonfinite": "skip"})
    snapshots = []
    try:
        for step in range(1, 8):
            hook = (trainer.raw_model.blocks[0].mlp.register_forward_hook(lambda m, a, out: out * float("inf"))
                    if step in (3, 5) else None)
            try:
                with HostReads() as reads:  # the average's update included: no step reads the device
                    trainer.train_step()
                assert reads.scalar == 0 and reads.calls == [], (step, reads.scalar, reads.calls)
            finally:
                if hook is not None:
                    hook.remove()
            if step not in (3, 5):
                snapshots.append(_named(trainer))
            assert trainer.ema.step_count() == len(snapshots)
            average = trainer.ema.state_dict()
            if step == 1:
                assert all(torch.equal(average[k].double(), v) for k, v in snapshots[0].items())
            expected = _reference_average(snapshots, DECAY)
            for name, value in expected.items():
                torch.testing.assert_close(average[name].double(), value, rtol=2e-6, atol=2e-7, msg=name)
        assert any(not torch.allclose(average[k].double(), v) for k, v in snapshots[-1].items())  # it lags
    finally:
        trainer._close()


def test_training_is_bit_identical_and_the_average_is_evaluated_on_the_same_tokens(tmp_path, reference_run):
    """The reference run again with run.ema_decay: every training loss and every validation loss of the
    weights are bit-identical to the run without it (the evaluation's swap copies the weights back);
    each evaluation also logs val_loss_ema, and the final one equals the float64 cross-entropy of the
    checkpoint's saved average over the evaluated sequences; the summary and log line carry it."""
    from largebatch.data import DataConfig, build_data
    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    cache, ref_dir, _ = reference_run
    out = tmp_path / "ema"
    lines: list[str] = []
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer

    cfg = load_config(resolve_config(None), tiny_overrides(cache, out, **{"run.ema_decay": DECAY}))
    summary = Trainer(cfg, out, log=lines.append).fit()
    assert _train_losses(out) == _train_losses(ref_dir)
    vals = [r for r in read_metrics(out) if r["kind"] == "val"]
    assert [r["val_loss"] for r in vals] == [r["val_loss"] for r in read_metrics(ref_dir) if r["kind"] == "val"]
    assert len(vals) >= 4 and all("val_loss_ema" in r for r in vals)
    assert vals[-1]["val_loss_ema"] != vals[-1]["val_loss"]
    assert any("weight average decay 0.8 (~5 steps)" in line for line in lines)
    assert any(line.strip().startswith("eval") and line.endswith(f"ema {vals[-1]['val_loss_ema']:.4f}")
               for line in lines), lines[-5:]

    extra = load_checkpoint(list_checkpoints(out)[-1])
    assert extra["ema"] == {"decay": DECAY, "steps": summary["steps"]}
    model = build_model(from_dict(ModelConfig, extra["config"]["model"]))
    model.load_state_dict(extra["model"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(extra["ema_tensors"][name])
    model = model.double().eval()
    data = build_data(from_dict(DataConfig, extra["config"]["data"]), seq_len=32)
    batch = data.val.get_batch(range(32 * 16 // 32))
    with torch.no_grad():
        logits, _ = model(batch["input_ids"])
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  batch["targets"].reshape(-1), ignore_index=-100)
    assert summary["final_val_loss_ema"] == pytest.approx(float(reference), rel=1e-5)
    assert summary["final_val_loss_ema"] == vals[-1]["val_loss_ema"]
    assert summary["final_val_accuracy_ema"] == vals[-1]["val_accuracy_ema"]


def test_resume_is_exact_and_a_resume_may_turn_the_average_on_or_off(tmp_path, reference_run, capsys):
    """Stopped at step 7 and continued: the final average, its count and every val_loss_ema equal the
    uninterrupted run's, bit for bit. A run stopped without an average and continued with one starts
    it from the resumed weights (a note says so; its count is the steps after the resume); a
    continuation with the average off drops it (a note). A bad decay is one line naming the field."""
    cache = reference_run[0]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _run(tiny_overrides(cache, whole, **{"run.ema_decay": DECAY}))
    assert _run(tiny_overrides(cache, parts, **{"run.ema_decay": DECAY, "run.max_steps": 7}))["stopped_early"]
    _run(tiny_overrides(cache, parts, **{"run.ema_decay": DECAY}), resume=True)
    a, b = (load_checkpoint(list_checkpoints(d)[-1]) for d in (whole, parts))
    assert a["ema"] == b["ema"]
    assert all(torch.equal(a["ema_tensors"][k], b["ema_tensors"][k]) for k in a["ema_tensors"])

    def ema_vals(run):
        return [(r["step"], r["val_loss_ema"]) for r in read_metrics(run) if r["kind"] == "val"]
    assert ema_vals(parts) == ema_vals(whole)

    late = tmp_path / "late"
    o = tiny_overrides(cache, late, **{"run.max_steps": 7})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    capsys.readouterr()
    o.update({"run.max_steps": 5, "run.ema_decay": DECAY})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    out = capsys.readouterr().out
    assert "holds no weight average: run.ema_decay = 0.8 averages from its weights (step 7) on" in out, out
    stopped = load_checkpoint(list_checkpoints(late)[-1])
    assert stopped["progress"]["step"] == 12 and stopped["ema"]["steps"] == 5

    o.update({"run.ema_decay": None, "run.max_steps": None})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0
    assert "this launch has run.ema_decay off: the average is not kept from here on" in capsys.readouterr().out
    assert "ema_tensors" not in load_checkpoint(list_checkpoints(late)[-1])

    for bad in ("1.0", "0", "-0.5"):
        assert main([f"--run.ema_decay={bad}", "--check"]) == 2
        err = capsys.readouterr().err
        assert f"run.ema_decay = {float(bad)}: must lie strictly between 0 and 1" in err, err


def test_export_and_finetune_take_the_average_with_ema(tmp_path, reference_run):
    """`largebatch export --ema` writes the average (the transformers model's weights equal the
    checkpoint's average, and its logits are verified against largebatch's); without an average in
    the checkpoint --ema is one line; load_run(ema=True), what fine-tuning judges, holds the average."""
    from safetensors.torch import load_file

    from largebatch.export import ExportError, load_run
    from largebatch.export import main as export_main

    cache, ref_dir, _ = reference_run
    run = tmp_path / "ema"
    _run(tiny_overrides(cache, run, **{"run.ema_decay": DECAY}))
    saved = load_checkpoint(list_checkpoints(run)[-1])["ema_tensors"]
    assert export_main([str(run), str(tmp_path / "hf"), "--format", "hf", "--ema"]) == 0
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(written["transformer.wte.weight"], saved["tok_emb.weight"])
    assert torch.equal(written["transformer.h.1.mlp.c_fc.weight"], saved["blocks.1.mlp.fc1.weight"].t())

    loaded = load_run(run, ema=True)
    assert loaded.ema and all(torch.equal(p, saved[name]) for name, p in loaded.model.named_parameters())
    plain = load_run(run)
    assert not torch.equal(plain.model.tok_emb.weight, saved["tok_emb.weight"])
    with pytest.raises(ExportError, match="--ema: checkpoint .* holds no weight average .* leave --ema out"):
        load_run(ref_dir, ema=True)


@pytest.fixture
def frozen_positions_and_flat_sgd():
    """A registered model kind whose position embedding has requires_grad=False, and a registered
    optimizer whose builder takes one flat list of tensors (its groups carry no names)."""
    from largebatch.memory.estimate import OPTIMIZER_STATE_BYTES
    from largebatch.models import GPT, MODELS, register_model
    from largebatch.train.optimizer import OPTIMIZERS, register_optimizer

    class Frozen(GPT):
        def __init__(self, config):
            super().__init__(config)
            self.pos_emb.weight.requires_grad_(False)

    gpt = MODELS["gpt"]
    register_model("frozen-pos-gpt", build=Frozen, objective="causal", help="a test's own",
                   head_flops=gpt.head_flops, output_activations=gpt.output_activations,
                   stage_parameters=gpt.stage_parameters, pipeline_first=gpt.pipeline_first,
                   pipeline_last=gpt.pipeline_last, tp_plan=gpt.tp_plan)
    register_optimizer("flat-sgd", lambda groups, cfg: torch.optim.SGD([p for g in groups for p in g["params"]],
                                                                       lr=0.0, momentum=0.9),
                       summary="a test's own", fields=(), adapt_default=None, state_bytes=4)
    yield
    MODELS.pop("frozen-pos-gpt")
    OPTIMIZERS.pop("flat-sgd"), OPTIMIZER_STATE_BYTES.pop("flat-sgd")


def test_groups_without_names_and_frozen_parameters(tmp_path, reference_run, frozen_positions_and_flat_sgd):
    """An optimizer whose groups carry no names gets its tensors named from the model (the run started
    where it failed after the data build); a frozen parameter has no average, keeps its weights in
    load_run(ema=True), and is not taken for a damaged checkpoint."""
    from largebatch.export import load_run

    run = tmp_path / "frozen"
    _run(tiny_overrides(reference_run[0], run, **{"run.ema_decay": DECAY, "optim.name": "flat-sgd",
                                                   "model.kind": "frozen-pos-gpt"}))
    extra = load_checkpoint(list_checkpoints(run)[-1])
    assert set(extra["ema_tensors"]) == {k for k in extra["model"] if k not in ("pos_emb.weight", "lm_head.weight")}
    loaded = load_run(run, ema=True, log=lambda *_: None)
    assert torch.equal(loaded.model.pos_emb.weight, extra["model"]["pos_emb.weight"])
    assert torch.equal(loaded.model.tok_emb.weight, extra["ema_tensors"]["tok_emb.weight"])


def test_the_memory_estimates_count_the_average(tmp_path, capsys):
    """`largebatch memory --config` counts the weight average's fp32 copy with the optimizer state
    (4 bytes a parameter: as much again as fp32 parameters), as `largebatch train --check` does."""
    import re

    from largebatch.memory.cli import main as memory_main

    config = tmp_path / "ema.toml"
    config.write_text('[model]\nn_layer = 4\nn_embd = 256\n[run]\ndtype = "fp32"\nema_decay = 0.999\n')
    parts = []
    for extra in ([], ["--run.ema_decay", "none"]):
        assert memory_main(["--config", str(config), *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Per device, no recompute"))
        parts.append({k: float(v) for k, v in re.findall(r"(parameters|gradients|optimizer) (\d+\.\d+)", line)})
    assert parts[0]["optimizer"] - parts[1]["optimizer"] == pytest.approx(parts[0]["parameters"], abs=0.011)


def test_the_loss_plot_draws_the_average_beside_the_validation_loss(tmp_path, monkeypatch):
    """loss.png's validation curve has the weight average's beside it, at the evaluations' tokens and
    steps with their val_loss_ema; a run without an average draws none."""
    from matplotlib.figure import Figure

    from largebatch.train import plots

    train = [{"kind": "train", "step": s, "tokens": 256 * s, "loss": 6.0 - s / 100, "lr": 1e-3, "batch_size": 8}
             for s in range(1, 21)]
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: figures.append(fig) or save(fig, *a, **kw))
    for with_average in (True, False):
        val = [{"kind": "val", "step": s, "tokens": 256 * s, "val_loss": 6.1 - s / 100,
                **({"val_loss_ema": 6.2 - s / 200} if with_average else {})} for s in (5, 10, 20)]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + val))
        figures.clear()
        plots.plot_run(tmp_path)
        for ax, key in zip(figures[0].axes, ("tokens", "step")):
            lines = {line.get_label(): line for line in ax.get_lines()}
            assert ("validation, weight average" in lines) == with_average
            if with_average:
                average = lines["validation, weight average"]
                assert list(average.get_xdata()) == [r[key] for r in val]
                assert list(average.get_ydata()) == pytest.approx([r["val_loss_ema"] for r in val])
