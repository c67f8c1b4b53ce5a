"""LAMB, LANS and LARS against independent float64 references (docs/papers.md; tests/optim_references.py):
several steps, a zero tensor, a zero-gradient step, a step without a gradient; every switch; every
execution path (flat buckets of small tensors, several buckets, multi-tensor, multi-tensor in tiny CPU
tiles that split tensors and mix them, per-tensor, and the GPU forms of each) and their agreement;
param_groups edits between steps."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from largebatch.optim import LAMB, LANS, LARS, kernels, tiling
from optim_references import lamb_reference, lans_reference, lars_reference, random_problem, run_optimizer

CASES = {
    "lamb": (LAMB, lamb_reference, {"lr": 0.02}),
    "lans": (LANS, lans_reference, {"lr": 0.02}),
    "lars": (LARS, lars_reference, {"lr": 0.5, "weight_decay": 0.01}),
    "lamb_no_decay": (LAMB, lamb_reference, {"lr": 0.02, "weight_decay": 0.0}),
    "lans_plain": (LANS, lans_reference, {"lr": 0.02, "adapt": False, "bias_correction": False}),
    "lans_no_decay": (LANS, lans_reference, {"lr": 0.02, "weight_decay": 0.0}),
    # c/wd > 1e8: "divide, then add wd*x" instead of one addcdiv, whose x + (c/wd)*m/d would have a
    # squared norm near float32's limit (core.direction_plus_decay)
    "lamb_tiny_decay": (LAMB, lamb_reference, {"lr": 0.02, "weight_decay": 1e-12}),
    "lans_tiny_decay": (LANS, lans_reference, {"lr": 0.02, "weight_decay": 1e-12}),
    "lars_plain": (LARS, lars_reference, {"lr": 0.05, "adapt": False, "momentum": 0.5}),
}

LAMB_SWITCHES = [
    {"bias_correction": False},
    {"max_grad_norm": 1.0},
    {"max_grad_norm": 100.0},  # above the global norm: no clipping
    {"skip_adapt_if_no_decay": True, "weight_decay": 0.0},
    {"skip_adapt_if_no_decay": True},  # decayed group: still adapted
    {"trust_clip": 1.0},
    {"weight_norm_clip": 2.0},
    {"l2_decay": True, "weight_decay": 0.1},
    {"adapt": False},
    {"betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.3},
]


PATHS = ["foreach", "flat_chunks", "multi_tensor", "tiled", "per_tensor", "multi_tensor_gpu_like",
         "per_tensor_gpu_like"]


@contextlib.contextmanager
def _path_settings(path):
    """The layout knobs for ``path`` on this problem, whose tensors are all small. "foreach": the default
    (small tensors in one flat bucket); "flat_chunks": buckets of <= 16 elements; "multi_tensor": no
    flat bucket (every tensor on the foreach path, one tile); "tiled": that path in 7-element CPU
    tiles, so the 30-element tensor is split over tiles and small tensors share one; "*_gpu_like": the
    code a GPU runs, here on CPU: no kept work buffers, one tile of whole tensors, directions
    recomputed in pass 2 instead of stored."""
    patches = {"flat_chunks": [(kernels, "CPU_FLAT_BUCKET_ELEMENTS", 16)],
               "multi_tensor": [(kernels, "FLAT_MAX_ELEMENTS", 0)],
               "tiled": [(kernels, "FLAT_MAX_ELEMENTS", 0), (tiling, "CPU_TILE_ELEMENTS", 7)],
               "multi_tensor_gpu_like": [(kernels, "FLAT_MAX_ELEMENTS", 0), (tiling, "CPU_TILE_ELEMENTS", None)]
               }.get(path, [])
    if path.endswith("gpu_like"):
        patches.append((tiling.Workspace, "buffers", lambda self, keys, like, slot: None))
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


def _run(optimizer_class, path, params, steps, dtype=torch.float32, **kwargs):
    with _path_settings(path):
        return run_optimizer(_make(optimizer_class, path, **kwargs), params, steps, dtype)


def _make(optimizer_class, path, **kwargs):
    """A factory for run_optimizer (the layout knobs: _path_settings)."""
    return lambda params: optimizer_class(params, foreach=not path.startswith("per_tensor"), **kwargs)


def _max_error(actual, expected):
    return max(float((a.double() - e).abs().max()) for a, e in zip(actual, expected))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, path):
    optimizer_class, reference, kwargs = CASES[case]
    params, steps = random_problem()
    expected = reference(params, steps, **kwargs)
    actual64, _ = _run(optimizer_class, path, params, steps, torch.float64, **kwargs)
    assert _max_error(actual64, expected) < 1e-12
    actual32, _ = _run(optimizer_class, path, params, steps, **kwargs)
    assert _max_error(actual32, expected) < 2e-6
    assert _max_error(actual64, [p.double() for p in params]) > 1e-3  # the problem really moved


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("switches", LAMB_SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_lamb_switches_match_reference(switches, path):
    params, steps = random_problem(seed=1)
    kwargs = {"lr": 0.02, **switches}
    expected = lamb_reference(params, steps, **kwargs)
    actual, _ = _run(LAMB, path, params, steps, torch.float64, **kwargs)
    assert _max_error(actual, expected) < 1e-12


def test_switches_change_the_update():
    """Each switch must matter on this problem (else the tests above would prove nothing about it)."""
    params, steps = random_problem(seed=1)
    base = lamb_reference(params, steps, lr=0.02)
    for switches in LAMB_SWITCHES:
        if switches == {"max_grad_norm": 100.0} or switches == {"skip_adapt_if_no_decay": True}:
            continue
        assert _max_error(lamb_reference(params, steps, lr=0.02, **switches), base) > 1e-6, switches


@pytest.mark.parametrize("optimizer_class,kwargs", [
    (LAMB, {"max_grad_norm": 1.0, "trust_clip": 1.5, "weight_norm_clip": 3.0}),
    (LANS, {"max_grad_norm": 1.0, "bias_correction": False}),
    (LARS, {"lr": 0.3, "weight_decay": 0.01, "max_grad_norm": 1.0, "trust_clip": 0.002}),
], ids=["lamb", "lans", "lars"])
def test_foreach_and_per_tensor_paths_agree_in_float32(optimizer_class, kwargs):
    params, steps = random_problem(seed=2, n_steps=6)
    single, _ = _run(optimizer_class, "per_tensor", params, steps, **kwargs)
    for path in PATHS:
        multi, _ = _run(optimizer_class, path, params, steps, **kwargs)
        assert _max_error(multi, [s.double() for s in single]) < 1e-6, path


def test_param_group_edits_apply_at_the_next_step():
    params, steps = random_problem(seed=3, n_steps=5)
    lrs = [0.02, 0.02, 0.005, 0.005, 0.05]
    live = [torch.nn.Parameter(p.clone().double()) for p in params]
    optimizer = LAMB(live, lr=lrs[0])
    for k, grads in enumerate(steps):
        optimizer.param_groups[0]["lr"] = lrs[k]  # as an LR scheduler would
        for p, g in zip(live, grads):
            p.grad = None if g is None else g.double()
        optimizer.step()
    assert _max_error([p.detach() for p in live], lamb_reference(params, steps, lr=lrs)) < 1e-12


def test_lars_coasts_on_its_momentum_at_lr_zero():
    """LARS's LR sits inside its momentum buffer (Alg. 1: buf = m buf + lr local (g + wd x); x -= buf),
    so a step at lr = 0 -- a schedule's end, or the extra step transformers' Trainer takes when it
    resumes from its final checkpoint -- still moves each tensor by m buf, where torch's SGD (LR
    outside the buffer) stands still (docs/optim.md)."""
    params, steps = random_problem(seed=3, n_steps=5)
    lrs = [0.5, 0.5, 0.5, 0.0, 0.0]
    live = [torch.nn.Parameter(p.clone().double()) for p in params]
    sgd_live = [torch.nn.Parameter(p.clone().double()) for p in params]
    optimizer, sgd = LARS(live, lr=lrs[0], weight_decay=0.01), torch.optim.SGD(sgd_live, lr=0.5, momentum=0.9)
    for k, grads in enumerate(steps):
        if k == 3:
            frozen = [p.detach().clone() for p in sgd_live]
        for opt, ps in ((optimizer, live), (sgd, sgd_live)):
            opt.param_groups[0]["lr"] = lrs[k]
            for p, g in zip(ps, grads):
                p.grad = None if g is None else g.double()
            opt.step()
    assert _max_error([p.detach() for p in live], lars_reference(params, steps, lr=lrs, weight_decay=0.01)) < 1e-12
    moved = [float((a.detach() - b).abs().max()) for a, b in zip(live, lars_reference(params, steps[:3], lr=0.5,
                                                                              weight_decay=0.01))]
    assert max(moved) > 1e-3  # two steps at lr 0 moved it
    assert all(torch.equal(a, b) for a, b in zip(sgd_live, frozen))  # SGD at lr 0 did not move


@pytest.mark.parametrize("path", PATHS)
def test_per_group_adapt_and_weight_decay(path):
    params, steps = random_problem(seed=4)
    live = [torch.nn.Parameter(p.clone().double()) for p in params]
    optimizer = _make(LAMB, path, lr=0.02)([{"params": live[:3]},
                                             {"params": live[3:], "adapt": False, "weight_decay": 0.0}])
    with _path_settings(path):
        for grads in steps:
            for p, g in zip(live, grads):
                p.grad = None if g is None else g.double()
            optimizer.step()
    first = lamb_reference(params[:3], [g[:3] for g in steps], lr=0.02)
    second = lamb_reference(params[3:], [g[3:] for g in steps], lr=0.02, adapt=False, weight_decay=0.0)
    assert _max_error([p.detach() for p in live], first + second) < 1e-12


@pytest.mark.parametrize("path", PATHS)
def test_lans_tensors_with_tiny_gradients_share_tiles_with_others(path):
    """LANS's direction scale c = sqrt(bc2)/||g|| is huge for a tensor with a tiny gradient, so at a
    small decay that tensor takes the two-pass direction while the others take the one-pass one. In
    7-element tiles it shares a tile with a piece of a split tensor: each tensor's form must follow
    from its own c, not from its tile-mates'."""
    params, steps = random_problem()
    steps = [[None if g is None else (g * 1e-6 if i == 2 else g) for i, g in enumerate(grads)]
             for grads in steps]
    kwargs = {"lr": 0.02, "weight_decay": 1e-6}
    expected = lans_reference(params, steps, **kwargs)
    actual, _ = _run(LANS, path, params, steps, torch.float64, **kwargs)
    assert _max_error(actual, expected) < 1e-12


@pytest.mark.parametrize("optimizer_class,kwargs", [(LAMB, {}), (LANS, {}), (LARS, {"lr": 1.0})])
@pytest.mark.parametrize("foreach", [True, False])
def test_a_nan_gradient_is_not_pinned_to_a_trust_ratio_of_one(optimizer_class, kwargs, foreach):
    # a NaN norm is neither zero nor a ratio: the tensor's step is NaN (as its norm), never a finite
    # step taken with the ratio pinned to 1 (LARS once took ~100x its step on the finite elements)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(100))
    opt = optimizer_class([p], foreach=foreach, track_trust_ratios=True, **kwargs)
    p.grad = torch.randn(100) * 0.01
    p.grad[0] = float("nan")
    opt.step()
    assert torch.isnan(p.detach()).all()
    assert opt.trust_ratio_summary()["pinned"] == 0
