"""fused=True (the kernels of largebatch.optim.kernels compiled by torch.compile/inductor) against the
default path, as it runs on CPU (directions stored in pass 1) and as on a GPU (recomputed in pass 2);
the number of compiled graphs is bounded whatever the parameter shapes: a new learning rate, 200 new
distinct shapes, or other optimizers compiled in the same process compile nothing new. The one
torch.compile test file of the optim suite (~30-60 s cold)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from largebatch.optim import LAMB, LANS, LARS, tiling
from optim_references import random_problem, run_optimizer

CASES = [(LAMB, {"lr": 0.02, "max_grad_norm": 1.0}), (LANS, {"lr": 0.02}), (LARS, {"lr": 0.5, "weight_decay": 0.01})]


def _shapes_problem(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_fused_equals_default_and_compiles_a_bounded_number_of_graphs():
    params, steps = random_problem(seed=12, n_steps=4)
    big = [(300, 200), (40000,)]  # past kernels.FLAT_MAX_ELEMENTS: one compiled call per tensor
    for optimizer_class, kwargs in CASES:
        default, _ = run_optimizer(lambda ps: optimizer_class(ps, **kwargs), params, steps)
        with mock.patch.object(tiling.Workspace, "buffers", lambda self, keys, like, slot: None):
            gpu_like, _ = run_optimizer(lambda ps: optimizer_class(ps, fused=True, **kwargs), params, steps)
        fused, optimizer = run_optimizer(lambda ps: optimizer_class(ps, fused=True, **kwargs), params, steps)
        for name, result in (("fused", fused), ("fused, recomputed directions", gpu_like)):
            error = max(float((a - b).abs().max()) for a, b in zip(result, default))
            assert error < 1e-6, (optimizer_class.__name__, name, error)
        # large tensors (one call each) beside small ones (one flat bucket): fused equals default
        a = _shapes_problem(big + [(7,), (3, 5)], seed=1)
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        for p, q in zip(a, b):
            q.grad = p.grad.clone()
        optimizer_class(a, **kwargs).step()
        optimizer_class(b, fused=True, **kwargs).step()
        assert max(float((p - q).abs().max()) for p, q in zip(a, b)) < 1e-6, optimizer_class.__name__

    for optimizer_class, kwargs in CASES:  # a new lr and weight decay: no recompilation
        live = _shapes_problem([(6, 5), (8,), (40000,)], seed=2)
        optimizer = optimizer_class(live, fused=True, **kwargs)
        optimizer.step()
        graphs = _graphs()
        for group in optimizer.param_groups:
            group["lr"] *= 0.37
            group["weight_decay"] = 0.2
        optimizer.step()
        assert _graphs() == graphs, f"{optimizer_class.__name__}: a new lr or weight decay recompiled"

    # 200 distinct small shapes and 10 distinct large ones, for every optimizer in one process; then
    # 200 + 10 OTHER shapes compile nothing new (shapes are dynamic, small tensors share flat buckets)
    for offset in (0, 1000):
        shapes = ([(offset + i + 2,) if i % 2 else (offset + i + 2, 3) for i in range(200)]
                  + [(50000 + offset + 17 * i,) for i in range(10)])
        for optimizer_class, kwargs in CASES:
            optimizer_class(_shapes_problem(shapes, seed=3), fused=True, **kwargs).step()
        if offset == 0:
            graphs = _graphs()
    assert _graphs() == graphs, f"{_graphs() - graphs} new graphs for new shapes"
