"""An optimizer declared in one place: registered here (in this file only), it is accepted by the
config, listed by --help-config, checked by the memory preflight and trained with by the real
trainer -- each step's update checked against signSGD's definition in float64."""

from __future__ import annotations

import json
import re

import pytest
import torch

from largebatch.memory.cli import main as memory_main
from largebatch.memory.estimate import OPTIMIZER_STATE_BYTES
from largebatch.train.cli import main
from largebatch.train.config import load_config
from largebatch.train.optimizer import OPTIMIZERS, register_optimizer
from largebatch.typed_config import ConfigError
from test_train import tiny_overrides

NAME = "sign-sgd"


class SignSGD(torch.optim.Optimizer):
    """x <- x - lr * sign(g) (Bernstein et al. 2018, signSGD). Keeps, for the test, what each step
    saw: the group's LR, and every parameter before and its gradient."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.0))
        self.seen: list[list[tuple[float, torch.Tensor, torch.Tensor]]] = []

    @torch.no_grad()
    def step(self, closure=None):
        seen = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen.append((group["lr"], p.detach().clone(), p.grad.detach().clone()))
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        self.seen.append(seen)


BUILT: list[SignSGD] = []


def _build(groups, cfg):
    BUILT.append(SignSGD(groups))
    return BUILT[-1]


@pytest.fixture
def sign_sgd():
    register_optimizer(NAME, _build, summary="signSGD (Bernstein et al. 2018), a test's own", fields=(),
                       adapt_default=None, state_bytes=0)
    yield
    OPTIMIZERS.pop(NAME)
    OPTIMIZER_STATE_BYTES.pop(NAME)
    BUILT.clear()


def test_a_registered_optimizer_is_a_choice_of_the_config_and_of_the_help(sign_sgd, capsys):
    assert load_config(None, {"optim.name": NAME}).optim.name == NAME
    with pytest.raises(ConfigError, match=f"did you mean '{NAME}'"):
        load_config(None, {"optim.name": "sign-sdg"})
    # its policy: no trust ratio, so optim.adapt is refused naming the optimizers that have one
    with pytest.raises(ConfigError, match=f"{NAME} has no trust ratio; remove optim.adapt or choose lamb, lans, lars"):
        load_config(None, {"optim.name": NAME, "optim.adapt": ["weight"]})
    assert main(["--help-config"]) == 0
    help_text = capsys.readouterr().out
    assert f"'adamw' | '{NAME}'" in help_text
    assert f"{NAME}: signSGD (Bernstein et al. 2018), a test's own" in help_text


def test_unregistered_it_is_refused(capsys):
    assert NAME not in OPTIMIZERS
    with pytest.raises(ConfigError, match=f"optim.name = '{NAME}': must be one of 'lamb', 'lans', 'lars', 'adamw'"):
        load_config(None, {"optim.name": NAME})


def test_the_trainer_trains_with_it(sign_sgd, reference_run, tmp_path, capsys):
    """`largebatch train --optim.name=sign-sgd`: three steps at a constant LR of 1e-3, groups without
    weight decay at half of it (optim.no_decay_lr_mult), each update x - lr * sign(g) exactly."""
    out = tmp_path / "run"
    # the reference run's data cache: the same data config, so no second tokenizer lands in a shared cache
    o = tiny_overrides(reference_run[0], out, **{
        "optim.name": NAME, "optim.no_decay_lr_mult": 0.5, "schedule.lr_schedule": "constant",
        "schedule.warmup": 0.0, "schedule.peak_lr": 1e-3, "schedule.batch_policy": "constant",
        "run.total_tokens": 32 * 8 * 3, "run.eval_every_tokens": 32 * 8 * 3, "model.dropout": 0.0})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0, capsys.readouterr().err
    assert f"optimizer    {NAME}" in capsys.readouterr().out
    # the first two: train.preflight's probe on a small model (one steps, a copy loads its state)
    assert len(BUILT) == 3
    optimizer = BUILT[-1]
    assert len(optimizer.seen) == 3
    lrs = sorted({lr for step in optimizer.seen for lr, _, _ in step})
    assert lrs == pytest.approx([0.5e-3, 1e-3])  # the scheduled LR x each group's lr_mult
    for step, following in zip(optimizer.seen, optimizer.seen[1:]):
        for (lr, before, grad), (_, after, _) in zip(step, following):
            expected = before.double() - lr * torch.sign(grad.double())
            torch.testing.assert_close(after.double(), expected, rtol=0, atol=1e-7)
    assert any(not torch.equal(b, a) for (_, b, _), (_, a, _) in zip(optimizer.seen[0], optimizer.seen[-1]))


def test_the_memory_command_sizes_it(capsys):
    """`largebatch memory --optim.name` takes a registered optimizer and sizes its state as declared:
    12 fp32 bytes per parameter are 3x the fp32 parameters (--dtype-bytes 4: no master copy)."""
    name = "three-moments"
    argv = ["--model", "gpt2-medium", "--dtype-bytes", "4", "--optim.name", name]
    assert pytest.raises(SystemExit, memory_main, argv).value.code == 2  # not registered: not a choice
    assert f"invalid choice: '{name}'" in capsys.readouterr().err
    register_optimizer(name, _build, summary="a test's own", fields=(), adapt_default=None, state_bytes=12)
    try:
        assert memory_main(argv) == 0
    finally:
        OPTIMIZERS.pop(name), OPTIMIZER_STATE_BYTES.pop(name)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Per device, no recompute"))
    parts = dict(re.findall(r"(parameters|gradients|optimizer) (\d+\.\d+)", line))
    assert float(parts["optimizer"]) == pytest.approx(3 * float(parts["parameters"]), abs=0.02), line
