"""State, precision and safety of largebatch.optim: bit-identical resume, GradScaler, bf16 parameters,
trust-ratio diagnostics, the sharding hook, and bad input."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from largebatch.optim import LAMB, LANS, LARS
from optim_references import random_problem, run_optimizer

OPTIMIZERS = {
    "lamb": lambda ps, **kw: LAMB(ps, lr=0.02, **kw),
    "lans": lambda ps, **kw: LANS(ps, lr=0.02, **kw),
    "lars": lambda ps, **kw: LARS(ps, lr=0.5, weight_decay=0.01, **kw),
}


def _step(optimizer, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype)
    optimizer.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bit_identical(name, dtype):
    params, steps = random_problem(seed=6, n_steps=6)
    live = [torch.nn.Parameter(p.clone().to(dtype)) for p in params]
    optimizer = OPTIMIZERS[name](live, max_grad_norm=1.0)
    for grads in steps[:3]:
        _step(optimizer, live, grads)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in live], "optimizer": optimizer.state_dict()}, buffer)
    for grads in steps[3:]:
        _step(optimizer, live, grads)

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = [torch.nn.Parameter(p) for p in checkpoint["params"]]
    optimizer2 = OPTIMIZERS[name](resumed, max_grad_norm=1.0)
    optimizer2.load_state_dict(checkpoint["optimizer"])
    for grads in steps[3:]:
        _step(optimizer2, resumed, grads)
    for a, b in zip(live, resumed):
        assert torch.equal(a, b)
    for state_a, state_b in zip(optimizer.state.values(), optimizer2.state.values()):
        for key, value in state_a.items():
            assert torch.equal(value, state_b[key]) if torch.is_tensor(value) else value == state_b[key]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_parameters_use_fp32_math_and_fp32_state(name):
    """A bf16 step equals the fp32 step on the same values, rounded to bf16 once."""
    params, steps = random_problem(seed=7, n_steps=1)
    bf16 = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in params]
    fp32 = [torch.nn.Parameter(p.to(torch.bfloat16).float()) for p in params]
    opt16, opt32 = OPTIMIZERS[name](bf16), OPTIMIZERS[name](fp32)
    grads = [g.to(torch.bfloat16) for g in steps[0]]
    _step(opt16, bf16, grads)
    _step(opt32, fp32, [g.float() for g in grads])
    for a, b in zip(bf16, fp32):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
    state = next(iter(opt16.state.values()))
    assert all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_norms_are_taken_after_unscaling(name):
    """Loss scaled by 2^12 under torch.amp.GradScaler gives the unscaled run's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference_model = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    optimizer = OPTIMIZERS[name](model.parameters(), max_grad_norm=1.0)
    reference = OPTIMIZERS[name](reference_model.parameters(), max_grad_norm=1.0)
    data = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(data[0]), data[1])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference_model(data[0]), data[1]).backward()
        reference.step()
        reference.zero_grad()
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_trust_ratio_summary_reports_the_last_step():
    params, steps = random_problem(seed=8, n_steps=1)
    steps[0][0] = torch.zeros_like(params[0])  # tensor 0: zero gradient -> r = wd*x only (not pinned)
    _, optimizer = run_optimizer(lambda ps: LAMB(ps, lr=0.02, weight_decay=0.0, track_trust_ratios=True),
                                 params, steps, torch.float64)
    summary = optimizer.trust_ratio_summary()
    # step 1, weight decay 0: r = m^/(sqrt(v^)+eps) = g/(|g|+eps) elementwise
    ratios = []
    for x, g in zip(params, steps[0]):
        r = g.double() / (g.double().abs() + 1e-6)
        ratios.append(1.0 if float(x.norm()) == 0 or float(r.norm()) == 0 else float(x.norm() / r.norm()))
    assert summary["count"] == len(params)
    assert summary["pinned"] == 2  # tensor 0 (r = 0) and tensor 1 (x = 0)
    assert summary["min"] == pytest.approx(min(ratios)) and summary["max"] == pytest.approx(max(ratios))
    assert summary["median"] == pytest.approx(sorted(ratios)[(len(ratios) - 1) // 2])
    assert all(isinstance(summary[k], float) for k in ("min", "median", "max"))
    assert LAMB(params[:1]).trust_ratio_summary() is None


class Recording:
    """A ``reduce_norms``: records what it receives, and doubles every squared norm."""

    def __init__(self):
        self.calls = []

    def __call__(self, squared_norms, params):
        self.calls.append((squared_norms.shape, len(params)))
        return squared_norms * 2.0  # as if two identical shards were summed


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_sharding_hook_sees_all_norms_before_any_ratio(foreach):
    params, steps = random_problem(seed=9, n_steps=1)
    live = [torch.nn.Parameter(p.clone().double()) for p in params]
    recording = Recording()
    optimizer = LAMB(live, lr=0.02, max_grad_norm=1.0, foreach=foreach, reduce_norms=recording)
    _step(optimizer, live, steps[0])
    n = len(params)
    assert recording.calls == [(torch.Size([n]), n), (torch.Size([2 * n]), n)]  # global clip, then [x; r]
    # doubling every squared norm doubles the global norm: the step must change (ratios stay the same)
    plain, _ = run_optimizer(lambda ps: LAMB(ps, lr=0.02, max_grad_norm=1.0, foreach=foreach),
                             params, steps[:1], torch.float64)
    assert max(float((a.detach() - b).abs().max()) for a, b in zip(live, plain)) > 1e-8


BAD_ARGUMENTS = [
    (LAMB, {"lr": -1.0}, "lr=-1.0"),
    (LAMB, {"betas": (0.9, 1.0)}, "betas[1]=1.0"),
    (LANS, {"betas": (-0.1, 0.999)}, "betas[0]=-0.1"),
    (LAMB, {"eps": 0.0}, "eps=0.0"),
    (LANS, {"weight_decay": -0.1}, "weight_decay=-0.1"),
    (LARS, {"lr": 0.1, "momentum": 1.5}, "momentum=1.5"),
    (LARS, {"lr": 0.1, "trust_coefficient": 0.0}, "trust_coefficient=0.0"),
    (LAMB, {"max_grad_norm": -1.0}, "max_grad_norm=-1.0"),
    (LAMB, {"trust_clip": 0.0}, "trust_clip=0.0"),
    (LAMB, {"fused": True, "foreach": True}, "fused=True, foreach=True"),
]


@pytest.mark.parametrize("optimizer_class,kwargs,message", BAD_ARGUMENTS, ids=[m for _, _, m in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument_and_value(optimizer_class, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        optimizer_class([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_bad_group_edit_is_caught_at_the_next_step():
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = LAMB([p])
    optimizer.param_groups[0]["lr"] = -0.5
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr=-0.5"):
        optimizer.step()


def test_parameter_in_two_groups_and_sparse_gradients_are_rejected():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"params: parameter 0 of group 1 \(shape \(3,\)\) is already in group 0"):
        LAMB([{"params": [p, q]}, {"params": [p]}])
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 \(shape \(3,\)\) appears twice in that group"):
        LAMB([p, p])  # (it said "is already in group 0", the group it was being added to)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    optimizer = LANS(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"sparse gradient for a parameter of shape \(10, 4\)"):
        optimizer.step()
    with pytest.raises(ValueError, match="preset='nvidia'"):
        LAMB.from_preset("nvidia", [q])


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_non_contiguous_parameters_are_updated_in_place(foreach):
    from optim_references import lamb_reference

    params, steps = random_problem(seed=10, n_steps=3)
    transposed = torch.nn.Parameter(params[0].t().contiguous().t().double())  # (6, 5), non-contiguous storage
    assert not transposed.is_contiguous()
    optimizer = LAMB([transposed], lr=0.02, foreach=foreach)
    for grads in steps:
        transposed.grad = grads[0].double()
        optimizer.step()
    expected = lamb_reference(params[:1], [g[:1] for g in steps], lr=0.02)[0]
    assert float((transposed.detach() - expected).abs().max()) < 1e-12


def test_the_trust_ratio_median_of_an_even_count_is_the_mean_of_the_middle_two():
    """torch.median gives the lower middle value (a LAMB run logged 0.035648 where numpy's median is
    0.036404); the summary's median is numpy's."""
    import numpy as np

    from largebatch.optim import LAMB

    params = [torch.nn.Parameter(torch.full((3,), float(k + 1))) for k in range(4)]
    optimizer = LAMB(params, lr=1e-3, track_trust_ratios=True)
    for k, p in enumerate(params):
        p.grad = torch.full((3,), float(3 * k + 1))
    optimizer.step()
    ratios = torch.cat([r for r, _ in optimizer._last_ratios]).double().numpy()
    assert len(ratios) == 4 and len(set(ratios.tolist())) == 4
    assert optimizer.trust_ratio_summary()["median"] == pytest.approx(float(np.median(ratios)), rel=1e-6)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_of_tensors_left_out_of_a_step_keeps_no_flat_buffer_alive(name):
    """Small tensors keep their state as views of their flat bucket's buffer. When only some of them
    have a gradient (routed experts, frozen layers), the next bucket is gathered from those alone; the
    views of the others must not keep the old buffer alive: held (and saved) state stayed at 2.6-5x its
    size. Every step is also checked against the per-tensor path, which keeps no buffers."""
    import random

    rng = random.Random(0)
    torch.manual_seed(0)
    shapes = [(16, 16)] * 24  # 256 elements each: one flat bucket of all 24 on the default path
    grads = [[torch.randn(s) for s in shapes]]
    for _ in range(12):
        grads.append([torch.randn(s) if rng.random() < 0.3 else None for s in shapes])
    start = [torch.randn(s) for s in shapes]
    runs = {}
    for foreach in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = OPTIMIZERS[name](params, foreach=foreach)
        for step_grads in grads:
            _step(optimizer, params, step_grads)
        runs[foreach] = params, optimizer
    (params, optimizer), (reference, _) = runs[True], runs[False]
    for p, q in zip(params, reference):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    tensors = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim()]
    nominal = sum(t.numel() * t.element_size() for t in tensors)
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    assert held == nominal
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    assert saved.tell() < nominal + 64 * 1024  # the tensors' bytes and the pickle around them


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_of_another_shape_is_refused_at_load(name):
    """AdamW fails at the next step when a loaded moment's shape differs from its parameter's; here
    the kernels see flat tensors, so state of the same size and another shape (a transposed layout,
    another parameter order) was used, pairing each moment with another element, on every later
    step. It is refused at the load, naming the parameter, and nothing is loaded."""
    a = torch.nn.Parameter(torch.randn(4, 5))
    source = OPTIMIZERS[name]([a])
    a.grad = torch.randn(4, 5)
    source.step()
    b = torch.nn.Parameter(torch.randn(5, 4))
    target = OPTIMIZERS[name]([b])
    with pytest.raises(ValueError, match=r"state '\w+' of parameter 0 has shape \(4, 5\), the parameter \(5, 4\)"):
        target.load_state_dict(source.state_dict())
    assert not target.state  # nothing loaded
    b.grad = torch.randn(5, 4)
    target.step()  # a fresh start


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_follows_a_change_of_the_parameters_dtype(name):
    """`model.double()` after some steps: the state takes the parameters' dtype, as a load would put it
    (small tensors kept float32 moments for float64 parameters; large ones failed or went on in float32,
    depending on the optimizer). The next steps equal those of an optimizer whose state was loaded into
    the float64 model."""
    torch.manual_seed(0)
    shapes = [(8,), (300, 200)]  # a flat-bucket tensor and a multi-tensor one
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    optimizer = OPTIMIZERS[name](params)
    for _ in range(2):
        _step(optimizer, params, [torch.randn(s) for s in shapes])
    twin_params = [torch.nn.Parameter(p.detach().double().clone()) for p in params]
    twin = OPTIMIZERS[name](twin_params)
    twin.load_state_dict(optimizer.state_dict())
    for p in params:
        p.data = p.data.double()
    grads = [[torch.randn(s, dtype=torch.float64) for s in shapes] for _ in range(2)]
    for step_grads in grads:
        _step(optimizer, params, step_grads)
        _step(twin, twin_params, step_grads)
    for p, q in zip(params, twin_params):
        assert p.dtype == torch.float64 and torch.equal(p, q)
    assert all(v.dtype == torch.float64 for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim())


def test_work_buffers_of_a_dropped_or_frozen_parameter_are_freed():
    """The kept CPU work buffers (one per large parameter for LAMB, two for LANS) stayed after the
    parameter was frozen, and held a parameter removed from the optimizer alive (AdamW lets it go)."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optimizer = LANS(list(model.parameters()), lr=1e-3)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    assert len(optimizer._workspace) == 2  # the two 256 x 256 weights (2^16 elements: multi-tensor)
    model[0].weight.requires_grad_(False)
    model[0].weight.grad = None
    optimizer.step()
    assert len(optimizer._workspace) == 1
    dropped = model[1].weight
    optimizer.param_groups[0]["params"] = [p for p in optimizer.param_groups[0]["params"] if p is not dropped]
    optimizer.state.pop(dropped)
    alive = weakref.ref(dropped)
    del dropped, model
    gc.collect()
    assert alive() is None and len(optimizer._workspace) == 0
