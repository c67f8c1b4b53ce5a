"""fused=True (the per-tensor kernels compiled by torch.compile/inductor) against the default path, both as
it runs on CPU (directions stored in pass 1) and as on a GPU (recomputed in pass 2); a new learning rate
must not recompile. The one torch.compile test of the optim suite (~20-40 s cold)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from largebatch.optim import LAMB, LANS, LARS
from optim_references import random_problem, run_optimizer


def _gpu_like(optimizer):
    """The fused path as a GPU runs it: pass 2 recomputes the direction (compiled apply kernels)."""
    optimizer._scratch = lambda b, slot: None
    return optimizer


@pytest.mark.slow
def test_fused_equals_default_and_lr_changes_do_not_recompile():
    params, steps = random_problem(seed=12, n_steps=4)
    cases = [(LAMB, {"lr": 0.02, "max_grad_norm": 1.0}), (LANS, {"lr": 0.02}),
             (LARS, {"lr": 0.5, "weight_decay": 0.01})]
    for optimizer_class, kwargs in cases:
        default, _ = run_optimizer(lambda ps: optimizer_class(ps, **kwargs), params, steps)
        gpu_like, _ = run_optimizer(lambda ps: _gpu_like(optimizer_class(ps, fused=True, **kwargs)), params, steps)
        fused, optimizer = run_optimizer(lambda ps: optimizer_class(ps, fused=True, **kwargs), params, steps)
        for name, result in (("fused", fused), ("fused, recomputed directions", gpu_like)):
            error = max(float((a - b).abs().max()) for a, b in zip(result, default))
            assert error < 1e-6, (optimizer_class.__name__, name, error)

        graphs = counters["stats"]["unique_graphs"]
        for group in optimizer.param_groups:
            group["lr"] *= 0.37
            group["weight_decay"] = 0.2
        live = [p for g in optimizer.param_groups for p in g["params"]]
        for p, g in zip(live, steps[0]):
            p.grad = torch.zeros_like(p) if g is None else g.clone()
        optimizer.step()
        assert counters["stats"]["unique_graphs"] == graphs, f"{optimizer_class.__name__} recompiled for a new lr"
