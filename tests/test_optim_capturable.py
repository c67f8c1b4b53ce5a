"""``capturable=True`` (torch.optim's meaning) for LAMB, LANS and LARS: step counts are device tensors,
bias corrections are computed on the device, and ``step()`` reads nothing on the host. On every
path the update equals the host-count one: bit for bit where the same operations run (the
per-tensor path, flat buckets of small tensors, fused; LARS everywhere), else within float rounding
of the float64 references (LAMB/LANS on the multi-tensor path, where device scalars take the
two-pass form of the decoupled decay). State dicts and DCP checkpoints load across modes."""

from __future__ import annotations

import copy
import pickle
from unittest import mock

import pytest
import torch

from largebatch.checkpoint.distributed import load_distributed, save_distributed
from largebatch.optim import LAMB, LANS, LARS, kernels
from largebatch.parallel.mesh import ParallelState
from largebatch.train.deferred import HostReads
from optim_references import lamb_reference, lans_reference, lars_reference, random_problem, run_optimizer
from test_optim_formulas import CASES as REFERENCE_CASES
from test_optim_formulas import LAMB_SWITCHES, PATHS, _max_error, _path_settings

CASES = {
    "lamb": (LAMB, lamb_reference, {"lr": 0.02}),
    "lans": (LANS, lans_reference, {"lr": 0.02}),
    "lars": (LARS, lars_reference, {"lr": 0.5, "weight_decay": 0.01}),
}
# test_optim_formulas' layouts of the default and per-tensor paths (flat buckets, multi-tensor, CPU
# tiles, what a GPU runs), and the fused path
MULTI_TENSOR = ("multi_tensor", "tiled", "multi_tensor_gpu_like")


def _options(path: str) -> dict:
    return {"fused": True} if path == "fused" else {"foreach": not path.startswith("per_tensor")}


def _state(optimizer) -> list[dict]:
    return [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("path", [*PATHS, "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_capturable_equals_host_counts_and_reads_nothing(name, path):
    """Five steps (one tensor without a gradient at step 3: its count stays behind) with host and with
    device step counts: the same parameters and state, bit for bit, except for LAMB/LANS on the
    multi-tensor path (within float32 rounding of the float64 reference, and within 1e-12 in
    float64); the counts are float32 tensors on the parameters' device equal to the host ints; a
    step reads nothing on the host."""
    optimizer_class, reference, kwargs = CASES[name]
    params, steps = random_problem(n_steps=5)
    options = {**kwargs, **_options(path)}
    with _path_settings(path):
        host, host_optimizer = run_optimizer(lambda p: optimizer_class(p, **options), params, steps)
        device, optimizer = run_optimizer(lambda p: optimizer_class(p, **options, capturable=True), params, steps)
        if path in MULTI_TENSOR and name != "lars":  # (LARS has no bias correction: the same operations)
            assert _max_error(device, reference(params, steps, **kwargs)) < 2e-6
            device64, _ = run_optimizer(lambda p: optimizer_class(p, **options, capturable=True), params, steps,
                                        torch.float64)
            assert _max_error(device64, reference(params, steps, **kwargs)) < 1e-12
        else:
            assert all(torch.equal(a, b) for a, b in zip(host, device))
            for a, b in zip(_state(host_optimizer), _state(optimizer)):
                assert all(torch.equal(a[key], b[key]) for key in optimizer_class._state_keys)
        for a, b in zip(_state(host_optimizer), _state(optimizer)):
            count = b["step"]
            assert isinstance(count, torch.Tensor) and count.dtype == torch.float32 and count.dim() == 0
            assert isinstance(a["step"], int) and float(count) == a["step"]
        assert [float(s["step"]) for s in _state(optimizer)] == [5, 5, 5, 5, 4]
        assert kernels.packed([s["step"] for s in _state(optimizer)]) is not None  # one buffer: one add a step

        for p, g in zip((p for group in optimizer.param_groups for p in group["params"]), steps[0]):
            p.grad = g.clone()
        # the fused kernels run eagerly here: a dispatch mode cannot run compiled frames, and
        # fullgraph=True already refuses a host read inside them
        eager = mock.patch.object(kernels, "compiled", lambda kernel: kernel)
        with eager, HostReads() as reads:
            optimizer.step()
        assert reads.total == 0 and reads.calls == [], (reads.scalar, reads.calls)


@pytest.mark.parametrize("path", [*PATHS, "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_lr_is_used_on_its_device_and_never_read(name, path):
    """A 0-d tensor LR (what drives a capturable step from a scheduler: set in place, the step never
    rebuilt) was read with .item() at every step -- a device sync, and no CUDA graph could hold the
    step. With capturable=True it stays a tensor: the same update as the Python float it holds (bit for
    bit in float32), an in-place change of it is the next step's LR, and a step reads nothing on the host
    (LANS: within float32 rounding, its scales' products are taken in the tensor's float32)."""
    optimizer_class, _, kwargs = CASES[name]
    params, steps = random_problem(n_steps=4)
    options = {**kwargs, **_options(path), "capturable": True}
    lr = torch.tensor(kwargs["lr"], dtype=torch.float32)
    halved = torch.tensor(kwargs["lr"] / 2, dtype=torch.float32).item()  # the float32 values the tensor holds
    with _path_settings(path):
        floats = [p.detach().clone().requires_grad_(True) for p in params]
        tensors = [p.detach().clone().requires_grad_(True) for p in params]
        by_float = optimizer_class(floats, **{**options, "lr": lr.item()})
        by_tensor = optimizer_class(tensors, **{**options, "lr": lr})
        with mock.patch.object(kernels, "compiled", lambda kernel: kernel):  # (see above: eager fused kernels)
            for k, grads in enumerate(steps):
                if k == 2:  # a scheduler's in-place change: the next step's LR
                    by_float.param_groups[0]["lr"] = halved
                    lr.fill_(halved)
                for ours, theirs, g in zip(floats, tensors, grads):
                    ours.grad, theirs.grad = (None, None) if g is None else (g.clone(), g.clone())
                by_float.step()
                if k == 0:
                    by_tensor.step()  # (the first step creates the state)
                    continue
                with HostReads() as reads:
                    by_tensor.step()
                assert reads.total == 0 and reads.calls == [], (k, reads.scalar, reads.calls)
        assert by_tensor.param_groups[0]["lr"] is lr
        for ours, theirs in zip(floats, tensors):
            if name == "lans":  # -lr*beta1 and -lr*(1-beta1): in float32 on the tensor, in float64 on the host
                torch.testing.assert_close(theirs, ours, rtol=2e-6, atol=1e-7)
            else:
                assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr=tensor\(-1.\): the learning rate must be"):
        optimizer_class([torch.nn.Parameter(torch.ones(2))], **{**kwargs, "lr": torch.tensor(-1.0)}, capturable=True)


@pytest.mark.parametrize("path", PATHS)
def test_capturable_meets_the_references_with_every_switch(path):
    """Every case of tests/test_optim_formulas.py (tiny and no decay, no bias correction, LARS
    without ratios) and every LAMB switch, with device counts: 1e-12 in float64, 2e-6 in float32."""
    params, steps = random_problem()
    cases = [(c, ref, kw) for c, ref, kw in REFERENCE_CASES.values()]
    cases += [(LAMB, lamb_reference, {"lr": 0.02, **switches}) for switches in LAMB_SWITCHES]
    for optimizer_class, reference, kwargs in cases:
        expected = reference(params, steps, **kwargs)
        with _path_settings(path):
            for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
                actual, _ = run_optimizer(lambda p: optimizer_class(p, **kwargs, **_options(path), capturable=True),
                                          params, steps, dtype)
                assert _max_error(actual, expected) < tolerance, (optimizer_class.__name__, kwargs, dtype)


def test_device_bias_corrections_equal_the_host_ones_in_float32():
    """1/(1 - beta^t) computed on the device in float64 and cast to float32 equals the host rows for
    every t up to 20000 (several betas); in float64 the two differ by at most 1 ulp."""
    t = list(range(1, 20001))
    like = torch.empty(0)
    for betas in ((0.9, 0.999), (0.95, 0.98), (0.8, 0.99)):
        host = kernels.adam_hyperparameters(0.1, betas, 1e-6, 0.01, True, t, like).device
        device = kernels.adam_hyperparameters(0.1, betas, 1e-6, 0.01, True,
                                              list(torch.tensor(t, dtype=torch.float32).unbind()), like)
        assert device.host is None and torch.equal(host, device.device)
        host64 = kernels.adam_hyperparameters(0.1, betas, 1e-6, 0.01, True, t, like.double()).device
        device64 = kernels.device_adam_rows(0.1, betas, 1e-6, 0.01, True,
                                            list(torch.tensor(t, dtype=torch.float64).unbind()), like.double())
        ulp = torch.finfo(torch.float64).eps * host64.abs()
        assert bool(((host64 - device64).abs() <= ulp).all())


def test_copies_keep_capturable():
    """deepcopy and pickle keep the option and the device counts, and continue bit for bit."""
    params, steps = random_problem(n_steps=4)
    for copier in (copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))):
        _, optimizer = run_optimizer(lambda p: LANS(p, lr=0.02, capturable=True), params, steps[:2])
        live = optimizer.param_groups[0]["params"]
        live_copy, optimizer_copy = copier((live, optimizer))
        assert optimizer_copy.capturable and all(isinstance(s["step"], torch.Tensor) for s in _state(optimizer_copy))
        for grads in steps[2:]:
            for p, q, g in zip(live, live_copy, grads):
                p.grad = q.grad = None if g is None else g.clone()
            optimizer.step()
            optimizer_copy.step()
        assert all(torch.equal(a, b) for a, b in zip(live, live_copy))


@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_state_dicts_load_across_modes(name):
    """Two steps in one mode, its state_dict loaded into an optimizer of the other mode, two more: the
    same as four steps in one mode, bit for bit, both ways; the count is an int or a device tensor as
    the loading optimizer keeps it."""
    optimizer_class, _, kwargs = CASES[name]
    params, steps = random_problem(n_steps=4)
    straight, _ = run_optimizer(lambda p: optimizer_class(p, **kwargs), params, steps)
    for first, second in ((True, False), (False, True)):
        live, optimizer = run_optimizer(lambda p: optimizer_class(p, **kwargs, capturable=first), params, steps[:2])
        saved = optimizer.state_dict()
        assert isinstance(saved["state"][0]["step"], torch.Tensor if first else int)
        resumed = optimizer_class(live, **kwargs, capturable=second)
        resumed.load_state_dict(saved)
        counts = [s["step"] for s in _state(resumed)]
        assert all(isinstance(c, torch.Tensor) if second else type(c) is int for c in counts)
        assert not second or kernels.packed(counts) is not None  # loaded counts share one buffer again
        assert [float(c) for c in counts] == [2, 2, 2, 2, 2]
        for grads in steps[2:]:
            for p, g in zip(live, grads):
                p.grad = None if g is None else g.clone()
            resumed.step()
        assert all(torch.equal(a, b) for a, b in zip(straight, live)), (first, second)


def test_dcp_checkpoints_load_across_modes(tmp_path):
    """A one-process DCP checkpoint written with host counts loads into a capturable LANS and the
    other way round; the counts and moments arrive unchanged."""
    params, steps = random_problem(n_steps=2)
    for first, second in ((False, True), (True, False)):
        model = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params])
        optimizer = LANS(list(model), lr=0.02, capturable=first)
        for grads in steps:
            for p, g in zip(model, grads):
                p.grad = None if g is None else g.clone()
            optimizer.step()
        path = save_distributed(tmp_path / f"{first}", 2, model, optimizer, {"step": 2}, ParallelState())
        resumed_model = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params])
        resumed = LANS(list(resumed_model), lr=0.02, capturable=second)
        load_distributed(path, resumed_model, resumed, ParallelState())
        for a, b in zip(_state(optimizer), _state(resumed)):
            assert isinstance(b["step"], torch.Tensor if second else int), (first, second, b["step"])
            assert float(a["step"]) == float(b["step"])
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
