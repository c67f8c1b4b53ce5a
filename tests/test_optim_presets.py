"""Each LAMB preset against the library it names: timm's Lamb and torch_optimizer.Lamb run here; apex
FusedLAMB needs CUDA extensions, so its algorithm (apex/optimizers/fused_lamb.py docstring and the two
stages of csrc/multi_tensor_lamb.cu: global grad-norm clip, moments, r, per-tensor ratio skipped for
wd = 0 unless use_nvlamb) is written out below in float64."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types

import pytest
import torch
import torch_optimizer

from largebatch.optim import LAMB
from optim_references import random_problem, run_optimizer


@pytest.fixture(scope="module")
def timm_lamb():
    """timm's optim/lamb.py without importing timm (which needs torchvision): stub the packages."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        pytest.fail("timm is not installed: make install puts it in .venv (pip install --no-deps timm)")
    root = os.path.dirname(spec.origin)
    saved = {name: sys.modules.get(name) for name in ("timm", "timm.optim")}
    for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
        stub = types.ModuleType(name)
        stub.__path__ = [path]
        sys.modules[name] = stub
    try:
        yield importlib.import_module("timm.optim.lamb").Lamb
    finally:
        for name in [n for n in sys.modules if n.startswith("timm")]:
            del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


def apex_fused_lamb_reference(params, steps, groups, *, lr, betas=(0.9, 0.999), eps=1e-6, max_grad_norm=1.0,
                              adam_w_mode=True, use_nvlamb=False, bias_correction=True):
    """apex FusedLAMB (NVLAMB) in float64. ``groups``: weight decay per tensor."""
    b1, b2 = betas
    x = [p.double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    for step, grads in enumerate(steps, start=1):
        global_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        clipped = global_norm / max_grad_norm if global_norm > max_grad_norm else 1.0
        c1, c2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(grads):
            decay = groups[i]
            scaled = g.double() / clipped
            if not adam_w_mode:
                scaled = scaled + decay * x[i]
            m[i] = m[i] * b1 + (1 - b1) * scaled
            v[i] = v[i] * b2 + (1 - b2) * scaled * scaled
            update = (m[i] / c1) / ((v[i] / c2).sqrt() + eps)
            if adam_w_mode:
                update = update + decay * x[i]
            ratio = lr
            if use_nvlamb or decay != 0.0:
                p_norm, u_norm = float(x[i].norm()), float(update.norm())
                ratio = lr * (p_norm / u_norm) if p_norm != 0.0 and u_norm != 0.0 else lr
            x[i] = x[i] - ratio * update
    return x


def _problem(scale: float):
    """Gradients scaled so the global norm exceeds 1 (clipping active); every tensor has a gradient
    at every step (apex and timm keep one step count per group)."""
    params, steps = random_problem(seed=5)
    steps = [[torch.zeros_like(p) if g is None else g * scale for p, g in zip(params, grads)] for grads in steps]
    return params, steps


def _two_groups(weight_decay):
    """Tensors 0-2 decayed, 3-4 not (exercises the wd = 0 ratio skip)."""
    return lambda ps: [{"params": ps[:3], "weight_decay": weight_decay}, {"params": ps[3:], "weight_decay": 0.0}]


def _max_error(actual, expected):
    return max(float((a.double() - e.double()).abs().max()) for a, e in zip(actual, expected))


@pytest.mark.parametrize("nvlamb,l2", [(False, False), (True, False), (False, True)],
                         ids=["apex_default", "use_nvlamb", "adam_w_mode_false"])
def test_apex_preset_matches_fused_lamb_algorithm(nvlamb, l2):
    params, steps = _problem(scale=3.0)
    wd = [0.01, 0.01, 0.01, 0.0, 0.0]
    expected = apex_fused_lamb_reference(params, steps, wd, lr=0.02, use_nvlamb=nvlamb, adam_w_mode=not l2)
    actual, _ = run_optimizer(
        lambda ps: LAMB.from_preset("apex", _two_groups(0.01)(ps), lr=0.02, skip_adapt_if_no_decay=not nvlamb,
                                    l2_decay=l2), params, steps, torch.float64)
    assert _max_error(actual, expected) < 1e-12
    # the preset differs from the paper's defaults on this problem (clipping + skipped ratios)
    plain, _ = run_optimizer(lambda ps: LAMB(_two_groups(0.01)(ps), lr=0.02), params, steps, torch.float64)
    assert _max_error(plain, expected) > 1e-4


@pytest.mark.parametrize("foreach", [True, False], ids=["timm_foreach", "timm_single"])
def test_timm_preset_matches_timm_lamb(timm_lamb, foreach):
    params, steps = _problem(scale=3.0)
    theirs, _ = run_optimizer(lambda ps: timm_lamb(_two_groups(0.01)(ps), lr=0.02, foreach=foreach), params, steps)
    ours, _ = run_optimizer(lambda ps: LAMB.from_preset("timm", _two_groups(0.01)(ps), lr=0.02), params, steps)
    assert _max_error(ours, theirs) < 1e-6
    plain, _ = run_optimizer(lambda ps: LAMB(_two_groups(0.01)(ps), lr=0.02), params, steps)
    assert _max_error(plain, theirs) > 1e-4


def test_timm_trust_clip_matches_lambc(timm_lamb):
    params, steps = _problem(scale=3.0)
    theirs, _ = run_optimizer(lambda ps: timm_lamb(ps, lr=0.02, trust_clip=True, always_adapt=True), params, steps)
    ours, _ = run_optimizer(lambda ps: LAMB(ps, lr=0.02, max_grad_norm=1.0, trust_clip=1.0), params, steps)
    assert _max_error(ours, theirs) < 1e-6


def test_torch_optimizer_preset_matches_its_lamb():
    params, steps = _problem(scale=1.0)
    params[0] = params[0] * 8.0  # ||x|| > 10: torch-optimizer's clamp of the weight norm is active
    theirs, _ = run_optimizer(lambda ps: torch_optimizer.Lamb(ps, lr=0.02, weight_decay=0.01), params, steps)
    ours, _ = run_optimizer(lambda ps: LAMB.from_preset("torch_optimizer", ps, lr=0.02, weight_decay=0.01),
                            params, steps)
    assert _max_error(ours, theirs) < 1e-6
    plain, _ = run_optimizer(lambda ps: LAMB(ps, lr=0.02, weight_decay=0.01), params, steps)
    assert _max_error(plain, theirs) > 1e-4
