"""The torch.optim contract of LAMB, LANS and LARS on every execution path.

Modelled on torch's OptimizerInfo harness (torch/testing/_internal/common_optimizers.py): a table of
optimizers (``INFOS``: constructor, hyperparameters, float64 reference, valid and invalid values) and
generic tests, each parametrized over optimizer x path (foreach, per-tensor, fused). Every expected
value comes from an independent source: torch's own behaviour, the float64 references of
tests/optim_references.py, or the same optimizer on an equivalent problem (a contiguous clone, the
real view of a complex tensor, a Python float instead of a numpy scalar, an uncopied optimizer).

The fused cases all use small float32 tensors with more than one element (plus float64 where the
contract is about float64), so the compiled kernels specialise as little as possible.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from torch.optim.optimizer import required

from largebatch.optim import LAMB, LANS, LARS
from optim_references import lamb_reference, lans_reference, lars_reference


# ----------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    cls: type
    kwargs: dict  # hyperparameters of every test, also valid for ``reference``
    reference: Callable  # float64 reference of tests/optim_references.py
    scalars: dict  # field -> a value exact in float32 (input-type tests); "betas[0]" is an entry of betas
    bad: dict  # field -> an invalid value of it (the ValueError must name the field)


ADAM_SCALARS = {"lr": 0.015625, "betas[0]": 0.875, "betas[1]": 0.9921875, "eps": 2.0**-20, "weight_decay": 0.0625}
ADAM_BAD = {"lr": -1.0, "betas": (0.9, 1.5), "eps": -1.0, "weight_decay": -0.1}

INFOS = [
    OptimizerInfo("lamb", LAMB, {"lr": 0.02}, lamb_reference, ADAM_SCALARS, ADAM_BAD),
    OptimizerInfo("lans", LANS, {"lr": 0.02}, lans_reference, ADAM_SCALARS, ADAM_BAD),
    OptimizerInfo("lars", LARS, {"lr": 0.5, "weight_decay": 0.01}, lars_reference,
                  {"lr": 0.25, "momentum": 0.875, "weight_decay": 0.0625, "trust_coefficient": 2.0**-9,
                   "eps": 2.0**-26},
                  {"lr": -1.0, "momentum": 1.5, "eps": -1.0, "weight_decay": -0.1, "trust_coefficient": -1.0}),
]
PATHS = {"foreach": {}, "per_tensor": {"foreach": False}, "fused": {"fused": True}}
CASES = [pytest.param(info, path, id=f"{info.name}-{path}") for info in INFOS for path in PATHS]
over_cases = pytest.mark.parametrize("info,path", CASES)

BAD_CASES = [pytest.param(info, path, field, id=f"{info.name}-{path}-{field}")
             for info in INFOS for path in PATHS for field in info.bad]


def factory(info: OptimizerInfo, path: str, **overrides) -> Callable:
    """params -> a new optimizer of ``info`` on ``path`` with the table's hyperparameters and ``overrides``."""
    kwargs = {**info.kwargs, **PATHS[path], **overrides}
    return lambda params: info.cls(params, **kwargs)


# -------------------------------------------------------------------------------------- the helpers
def make_problem(seed=0, shapes=((3, 4), (5,)), n_steps=4, dtype=torch.float32):
    """Initial tensors and ``n_steps`` lists of gradients (one per tensor); no tensor has one element
    (a compiled kernel would specialise on it)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes] for _ in range(n_steps)]
    return params, grads


def leaves(tensors):
    return [torch.nn.Parameter(t.detach().clone()) for t in tensors]


def run(opt_or_factory, params, grads):
    """Build the optimizer (when given a factory) over ``params`` and take one step per entry of
    ``grads`` (a list of gradients, one per parameter; None = no gradient). Returns the optimizer."""
    opt = opt_or_factory if isinstance(opt_or_factory, torch.optim.Optimizer) else opt_or_factory(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    return opt


def all_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(opt):
    """Every parameter and every state entry of ``opt``, cloned, in parameter order."""
    params = all_params(opt)
    state = [{k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in opt.state.get(p, {}).items()}
             for p in params]
    return [p.detach().clone() for p in params], state


def assert_identical(a, b):
    """Two snapshots (or two optimizers) hold bit-identical parameters and state."""
    (params_a, state_a), (params_b, state_b) = (snapshot(x) if isinstance(x, torch.optim.Optimizer) else x
                                                for x in (a, b))
    for pa, pb in zip(params_a, params_b, strict=True):
        assert pa.dtype == pb.dtype and torch.equal(pa, pb)
    for sa, sb in zip(state_a, state_b, strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            if torch.is_tensor(sa[key]):
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            else:
                assert sa[key] == sb[key], key


def assert_close(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected| (a relative error on the tensor's scale)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    error, scale = float((actual - expected).abs().max()), float(expected.abs().max())
    assert error <= rel * scale, f"max error {error:.3g} > {rel:g} * {scale:.3g}"


def tensor_states(opt):
    """(key, tensor) of every moment/buffer in ``opt.state`` (the step count excluded)."""
    return [(k, v) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]


def step_counts(opt):
    return [int(opt.state[p]["step"]) for p in all_params(opt) if opt.state.get(p)]


def with_value(mapping: dict, field: str, value, default_betas=(0.9, 0.999)) -> dict:
    """A copy of a kwargs or group dict with ``field`` set; "betas[i]" replaces one entry of betas."""
    result = dict(mapping)
    match = re.fullmatch(r"betas\[(\d)\]", field)
    if match:
        betas = list(result.get("betas", default_betas))
        betas[int(match.group(1))] = value
        result["betas"] = tuple(betas)
    else:
        result[field] = value
    return result


FOUR_SHAPES = ((3, 4), (5,), (2, 3), (7,))  # two groups of two tensors


# ------------------------------------------------------------------------------- 1. copy and pickle
COPIERS = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


def public_config(opt) -> dict:
    """What an optimizer is configured with: its public non-tensor attributes and its groups'
    hyperparameters. (torch's __setstate__ adds defaults["differentiable"]; not part of the comparison.)"""
    config = {k: v for k, v in vars(opt).items()
              if not k.startswith("_") and k not in ("state", "param_groups") and not torch.is_tensor(v)}
    config["defaults"] = {k: v for k, v in opt.defaults.items() if k != "differentiable"}
    config["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return config


@pytest.mark.parametrize("copier", list(COPIERS))
@over_cases
def test_copy_and_pickle_continue_bit_identically_with_their_switches(info, path, copier):
    params, grads = make_problem(n_steps=4)  # global gradient norm ~4: max_grad_norm=1.0 clips
    live = leaves(params)
    opt = run(factory(info, path, max_grad_norm=1.0, track_trust_ratios=True), live, grads[:2])
    live_copy, opt_copy = COPIERS[copier]((live, opt))
    assert all(a is not b for a, b in zip(live, live_copy))
    assert all(a is b for a, b in zip(all_params(opt_copy), live_copy, strict=True))
    assert public_config(opt_copy) == public_config(opt)
    run(opt, live, grads[2:])
    run(opt_copy, live_copy, grads[2:])
    assert_identical(opt_copy, opt)
    summary = opt_copy.trust_ratio_summary()
    assert summary is not None and summary == opt.trust_ratio_summary()


# -------------------------------------------------------------------------------- 2. load_state_dict
def trained_state_dict(info, path, dtype=torch.float32, n_steps=2):
    params, grads = make_problem(dtype=dtype)
    opt = run(factory(info, path), leaves(params), grads[:n_steps])
    return opt.state_dict(), params, grads


def cast_state_dict(state_dict, dtype):
    """torch's rule written out: floating state tensors (not the step) take ``dtype``."""
    result = copy.deepcopy(state_dict)
    for state in result["state"].values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                state[key] = value.to(dtype)
    return result


@over_cases
def test_float32_state_loaded_into_float64_parameters_continues_in_float64(info, path):
    saved, params, grads = trained_state_dict(info, path)
    live = leaves([p.double() for p in params])
    opt = factory(info, path)(live)
    opt.load_state_dict(saved)
    assert tensor_states(opt) and all(v.dtype == torch.float64 for _, v in tensor_states(opt))
    assert step_counts(opt) == [2, 2]
    expected = factory(info, path)(leaves(live))
    expected.load_state_dict(cast_state_dict(saved, torch.float64))  # a float64 run from the same state
    next_grads = [[g.double() for g in grads[2]]]
    run(opt, all_params(opt), next_grads)
    run(expected, all_params(expected), next_grads)
    assert_identical(opt, expected)


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.float64], ids=["from_fp32", "from_fp64"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@over_cases
def test_state_loaded_into_low_precision_parameters_is_float32(info, path, param_dtype, saved_dtype):
    saved, params, _ = trained_state_dict(info, path)
    opt = factory(info, path)(leaves([p.to(param_dtype) for p in params]))
    opt.load_state_dict(cast_state_dict(saved, saved_dtype))
    assert tensor_states(opt) and all(v.dtype == torch.float32 for _, v in tensor_states(opt))
    assert step_counts(opt) == [2, 2]


@over_cases
def test_loaded_state_is_on_the_parameters_device(info, path):
    saved, params, _ = trained_state_dict(info, path)
    opt = factory(info, path)([torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params])
    opt.load_state_dict(saved)
    assert tensor_states(opt) and all(v.device.type == "meta" for _, v in tensor_states(opt))
    assert step_counts(opt) == [2, 2]


@over_cases
def test_load_state_dict_pre_hook_can_replace_the_state_dict(info, path):
    params, grads = make_problem()
    original = run(factory(info, path), leaves(params), grads[:2])
    other = run(factory(info, path), leaves(params), grads[1:4])  # another trajectory: other state
    replacement = other.state_dict()
    replacement["param_groups"][0]["lr"] = 0.125
    opt = factory(info, path)(leaves(params))
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(sd) or replacement)
    opt.load_state_dict(original.state_dict())
    assert len(seen) == 1 and opt.param_groups[0]["lr"] == 0.125
    assert step_counts(opt) == [3, 3]
    for (key, loaded), (_, expected) in zip(tensor_states(opt), tensor_states(other), strict=True):
        assert torch.equal(loaded, expected), key


@over_cases
def test_load_state_dict_post_hook_edits_survive(info, path):
    saved, params, _ = trained_state_dict(info, path)
    opt = factory(info, path)(leaves(params))

    def post_hook(optimizer):
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if torch.is_tensor(value) and key != "step":
                    state[key] = torch.full_like(value, 0.25)
            state["step"] = 7

    opt.register_load_state_dict_post_hook(post_hook)
    opt.load_state_dict(saved)
    assert tensor_states(opt) and all(bool((v == 0.25).all()) for _, v in tensor_states(opt))
    assert step_counts(opt) == [7, 7]


@over_cases
def test_state_dict_and_step_hooks_are_called(info, path):
    params, grads = make_problem()
    live = leaves(params)
    opt = factory(info, path)(live)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("step_pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("step_post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("state_dict_pre"))

    def post_hook(optimizer, state_dict):
        calls.append("state_dict_post")
        state_dict["note"] = "added by a hook"
        return state_dict

    opt.register_state_dict_post_hook(post_hook)
    run(opt, live, grads[:1])
    saved = opt.state_dict()
    assert calls == ["step_pre", "step_post", "state_dict_pre", "state_dict_post"]
    assert saved["note"] == "added by a hook"


# ------------------------------------------------------------------------------- 3. non-contiguous
@over_cases
def test_non_contiguous_parameters_and_gradients_match_the_contiguous_problem(info, path):
    gen = torch.Generator().manual_seed(3)
    base_t, base_s = torch.randn(5, 3, generator=gen), torch.randn(4, 6, generator=gen)
    untouched = base_s[:, 1::2].clone()
    strided = [torch.nn.Parameter(base_t.t()), torch.nn.Parameter(base_s[:, ::2])]  # (3, 5) and (4, 3) views
    assert not any(p.is_contiguous() for p in strided)
    # gradients: a transposed (5, 3) tensor and a strided slice, both non-contiguous
    grads = [[torch.randn(5, 3, generator=gen).t(), torch.randn(4, 6, generator=gen)[:, ::2]] for _ in range(3)]
    contiguous = [torch.nn.Parameter(p.detach().contiguous()) for p in strided]
    initial = [p.detach().clone() for p in strided]
    run(factory(info, path), strided, grads)
    run(factory(info, path), contiguous, [[g.contiguous() for g in step] for step in grads])
    for p, q, initial in zip(strided, contiguous, initial):
        assert_close(p, q, 1e-6)
        assert not torch.equal(q, initial)
    assert torch.equal(base_t.t(), strided[0]) and torch.equal(base_s[:, ::2], strided[1])  # updated in place
    assert torch.equal(base_s[:, 1::2], untouched)


# ---------------------------------------------------------------------------------------- 4. complex
@over_cases
def test_complex_parameters_behave_as_their_real_view(info, path):
    gen = torch.Generator().manual_seed(4)
    z0 = torch.randn(3, 4, dtype=torch.complex64, generator=gen)
    r0 = torch.randn(6, generator=gen)
    grads = [[torch.randn(3, 4, dtype=torch.complex64, generator=gen), torch.randn(6, generator=gen)]
             for _ in range(3)]
    complex_params = leaves([z0, r0])
    real_params = leaves([torch.view_as_real(z0), r0])
    run(factory(info, path), complex_params, grads)
    run(factory(info, path), real_params, [[torch.view_as_real(g), h] for g, h in grads])
    assert complex_params[0].dtype == torch.complex64
    assert_close(torch.view_as_real(complex_params[0]), real_params[0], 1e-6)
    assert_close(complex_params[1], real_params[1], 1e-6)


# ------------------------------------------------------------------------------ 5. atomic validation
@pytest.mark.parametrize("info,path,field", BAD_CASES)
def test_invalid_group_edit_fails_atomically(info, path, field):
    params, grads = make_problem(shapes=FOUR_SHAPES)
    live = leaves(params)
    opt = factory(info, path)([{"params": live[:2]}, {"params": live[2:]}])
    run(opt, live, grads[:1])
    for p, g in zip(live, grads[1]):
        p.grad = g.clone()
    before = snapshot(opt)
    opt.param_groups[1][field] = info.bad[field]
    with pytest.raises(ValueError) as raised:
        opt.step()
    assert "param_groups[1]" in str(raised.value) and field in str(raised.value)
    assert_identical(snapshot(opt), before)


@pytest.mark.parametrize("info,path,field", BAD_CASES)
def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was(info, path, field):
    """A group refused by add_param_group used to stay in param_groups: every later step raised,
    and adding its parameters again with good values said they were already in a group."""
    params, grads = make_problem(shapes=FOUR_SHAPES)
    live = leaves(params)
    opt = run(factory(info, path), live[:2], [g[:2] for g in grads[:2]])
    before = snapshot(opt)
    with pytest.raises(ValueError) as raised:
        opt.add_param_group({"params": live[2:], field: info.bad[field]})
    assert "param_groups[1]" in str(raised.value) and field in str(raised.value)
    assert len(opt.param_groups) == 1
    assert_identical(snapshot(opt), before)
    opt.add_param_group({"params": live[2:], "lr": 0.01})  # the same parameters, good values: taken
    run(opt, live, grads[2:])
    assert len(opt.param_groups) == 2


# ------------------------------------------------------------------------------------ 6. input types
@over_cases
def test_a_set_of_parameters_is_a_type_error(info, path):
    with pytest.raises(TypeError):  # torch's rule, checked on torch itself
        torch.optim.AdamW([{"params": {torch.nn.Parameter(torch.ones(2))}}])
    with pytest.raises(TypeError):
        factory(info, path)([{"params": set(leaves(make_problem()[0]))}])
    with pytest.raises(TypeError):
        factory(info, path)(set(leaves(make_problem()[0])))


@over_cases
def test_a_generator_and_a_list_of_parameters_give_the_same_result(info, path):
    params, grads = make_problem()
    from_list, from_generator = leaves(params), leaves(params)
    run(factory(info, path), from_list, grads)
    run(lambda ps: factory(info, path)(p for p in ps), from_generator, grads)
    assert all(torch.equal(a, b) for a, b in zip(from_list, from_generator))


NUMERIC_KINDS = {"np.float32": np.float32, "np.float64": np.float64,
                 "tensor0d": lambda v: torch.tensor(v, dtype=torch.float32)}


@pytest.mark.parametrize("kind", list(NUMERIC_KINDS))
@over_cases
def test_numpy_scalars_and_0d_tensors_act_as_python_floats(info, path, kind):
    """In the constructor and written into param_groups between steps (as an LR scheduler does)."""
    params, grads = make_problem(n_steps=3)
    convert = NUMERIC_KINDS[kind]
    for field, value in info.scalars.items():
        expected = leaves(params)
        run(lambda ps: info.cls(ps, **with_value({**info.kwargs, **PATHS[path]}, field, value)), expected, grads)
        given = leaves(params)
        run(lambda ps: info.cls(ps, **with_value({**info.kwargs, **PATHS[path]}, field, convert(value))), given, grads)
        for a, b in zip(given, expected):
            assert_close(a, b, 1e-6)

        edited, edited_expected = leaves(params), leaves(params)
        for live, v in ((edited, convert(value)), (edited_expected, value)):
            opt = run(factory(info, path), live, grads[:1])
            opt.param_groups[0].update(with_value(opt.param_groups[0], field, v))
            run(opt, live, grads[1:])
        for a, b in zip(edited, edited_expected):
            assert_close(a, b, 1e-6)


@pytest.mark.parametrize("path", list(PATHS))
def test_lars_takes_its_learning_rates_from_the_groups(path):
    params, grads = make_problem(shapes=FOUR_SHAPES)
    without, with_default = leaves(params), leaves(params)
    kwargs = {"weight_decay": 0.01, **PATHS[path]}
    run(lambda ps: LARS([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:], "lr": 0.25}], **kwargs), without, grads)
    run(lambda ps: LARS([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:], "lr": 0.25}], lr=3.0, **kwargs),
        with_default, grads)
    assert all(torch.equal(a, b) for a, b in zip(without, with_default))
    live = leaves(params)
    with pytest.raises(ValueError, match="lr"):
        LARS([{"params": live[:2], "lr": 0.5}, {"params": live[2:]}], **kwargs)
    with pytest.raises(ValueError, match="lr"):
        LARS(live, **kwargs)


def test_lars_without_a_constructor_lr_reports_the_first_groups_lr_to_schedulers():
    """transformers' polynomial schedule reads ``defaults["lr"]``; torch's placeholder there raised a
    TypeError. A group added later must still set its own lr, and a copy keeps that rule."""
    pytest.importorskip("transformers")
    from transformers import get_scheduler

    live = leaves(make_problem(shapes=FOUR_SHAPES)[0])
    opt = LARS([{"params": live[:2], "lr": 0.5}, {"params": live[2:], "lr": 0.25}])
    assert opt.defaults["lr"] == 0.5
    schedule = get_scheduler("polynomial", opt, num_warmup_steps=0, num_training_steps=4)
    opt.step()  # no gradients: changes nothing
    schedule.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5 * 0.75, 0.25 * 0.75])  # power 1, end 1e-7
    for copied in (opt, copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        extra = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match=r"param_groups\[2\]: no 'lr'"):
            copied.add_param_group({"params": [extra]})
        copied.add_param_group({"params": [extra], "lr": 0.125})
    with_lr = LARS(leaves(live[:2]), lr=2.0)
    with_lr.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # the constructor's lr applies
    assert with_lr.param_groups[1]["lr"] == 2.0


# ------------------------------------------------------------------------------------ 7. mixed dtypes
@over_cases
def test_a_float64_tensor_in_a_float32_group_gets_float64_accuracy(info, path):
    (p32, p64), grads = make_problem(seed=7, shapes=((4, 5), (6,)), n_steps=3)
    p64 = p64.double()
    grads = [[g32, g64.double()] for g32, g64 in grads]
    live = leaves([p32, p64])  # the group's first tensor is float32
    run(factory(info, path), live, grads)
    assert live[0].dtype == torch.float32 and live[1].dtype == torch.float64
    assert_close(live[1], info.reference([p64], [[g[1]] for g in grads], **info.kwargs)[0], 1e-12)
    assert_close(live[0], info.reference([p32], [[g[0]] for g in grads], **info.kwargs)[0], 2e-6)


@over_cases
def test_the_global_clip_keeps_a_float64_tensor_float64_accurate_beside_float32_ones(info, path):
    """With ``max_grad_norm`` the clip factor scales every tensor's update; it was summed from float32
    squares for the float32 gradients, and a float64 tensor beside them came out ~1e-10 off."""
    (p32, p64), grads = make_problem(seed=8, shapes=((4, 5), (6,)), n_steps=3)
    grads = [[10 * g32, 10 * g64.double()] for g32, g64 in grads]  # a global norm of ~40: clipped to 1
    live = leaves([p32, p64.double()])
    run(factory(info, path, max_grad_norm=1.0, eps=1.0), live, grads)
    reference = info.reference([p32.double(), p64.double()], [[g.double() for g in step] for step in grads],
                               **{**info.kwargs, "max_grad_norm": 1.0, "eps": 1.0})
    assert_close(live[1], reference[1], 1e-12)
    assert_close(live[0], reference[0].float(), 2e-6)


# ----------------------------------------------------------------------------- 8. the torch contract
@over_cases
def test_step_returns_the_closure_loss(info, path):
    params, _ = make_problem()
    live = leaves(params)
    opt = factory(info, path)(live)
    losses = []

    def closure():
        opt.zero_grad()
        loss = sum((p * p).sum() for p in live)
        loss.backward()
        losses.append(loss)
        return loss

    assert opt.step(closure) is losses[0] and len(losses) == 1
    expected = leaves(params)
    run(factory(info, path), expected, [[2 * p for p in params]])  # d(sum p^2)/dp = 2p
    assert all(torch.equal(a, b) for a, b in zip(live, expected))


@over_cases
def test_parameters_without_a_gradient_are_skipped(info, path):
    params, grads = make_problem(shapes=((3, 4), (5,), (2, 3)))
    live = leaves(params)
    opt = run(factory(info, path), live, [[g[0], g[1], None] for g in grads])
    assert not opt.state.get(live[2])
    assert torch.equal(live[2], params[2]) and not torch.equal(live[0], params[0])


@over_cases
def test_zero_grad(info, path):
    params, grads = make_problem()
    live = leaves(params)
    opt = run(factory(info, path), live, grads[:1])
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in live)
    opt.zero_grad()
    assert all(p.grad is None for p in live)


@over_cases
def test_add_param_group_after_steps(info, path):
    params, grads = make_problem(shapes=FOUR_SHAPES)
    live = leaves(params)
    opt = run(factory(info, path), live[:2], [g[:2] for g in grads[:2]])
    opt.add_param_group({"params": live[2:], "lr": 0.01})
    run(opt, live, grads[2:])
    for i in range(2):  # float32 against the float64 references
        assert_close(live[i], info.reference(params[i:i + 1], [g[i:i + 1] for g in grads], **info.kwargs)[0], 2e-6)
        later = info.reference(params[2 + i:3 + i], [g[2 + i:3 + i] for g in grads[2:]], **{**info.kwargs, "lr": 0.01})
        assert_close(live[2 + i], later[0], 2e-6)


@over_cases
def test_state_dict_of_a_fresh_optimizer_loads(info, path):
    params, grads = make_problem()
    a, b = leaves(params), leaves(params)
    opt_a, opt_b = factory(info, path)(a), factory(info, path)(b)
    opt_b.load_state_dict(opt_a.state_dict())
    run(opt_a, a, grads)
    run(opt_b, b, grads)
    assert_identical(opt_a, opt_b)


def _through_torch_save(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@over_cases
@pytest.mark.parametrize("transport", [copy.deepcopy, _through_torch_save], ids=["deepcopy", "torch_save_weights_only"])
def test_state_dict_round_trip_continues_bit_identically(info, path, transport):
    params, grads = make_problem()
    live = leaves(params)
    opt = run(factory(info, path), live, grads[:2])
    twin = leaves(live)
    opt_twin = factory(info, path)(twin)
    opt_twin.load_state_dict(transport(opt.state_dict()))
    run(opt, live, grads[2:])
    run(opt_twin, twin, grads[2:])
    assert_identical(opt, opt_twin)


@over_cases
def test_a_tensor_without_elements_steps_as_in_torch(info, path):
    """A parameter with no elements -- FSDP2's shard of a tensor with fewer rows than ranks, such as
    a (1,) bias on rank 1 -- first in its group crashed the default and fused paths (IndexError in the
    bucket layout), and under FSDP2 the other ranks then waited in the norm all-reduce for good. It
    steps as in AdamW: nothing of it changes, and the other tensors exactly as without it."""
    params, grads = make_problem()
    empty = torch.empty(0)
    with_empty, without = leaves([empty, *params]), leaves(params)
    run(factory(info, path), with_empty, [[empty.clone(), *step] for step in grads])
    run(factory(info, path), without, grads)
    assert with_empty[0].shape == (0,)
    for a, b in zip(with_empty[1:], without, strict=True):
        assert torch.equal(a, b)


@over_cases
def test_an_empty_parameter_list_is_a_value_error_as_in_torch(info, path):
    with pytest.raises(ValueError) as torch_error:
        torch.optim.AdamW([])
    with pytest.raises(ValueError, match=re.escape(str(torch_error.value))):
        factory(info, path)([])


@pytest.mark.parametrize("info,path,field", BAD_CASES)
def test_a_bad_hyperparameter_at_construction_names_the_argument(info, path, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        factory(info, path, **{field: info.bad[field]})(leaves(make_problem()[0]))


def test_importing_the_optimizers_leaves_dtensor_unimported():
    """`import largebatch.optim` costs what `import torch` does: torch.distributed.tensor (about a
    second more) is left to code that makes DTensors (torch's own Optimizer.__init__ imports it, via
    torch._dynamo, when an optimizer is built), and DTensor parameters still work
    (tests/test_optim_distributed.py)."""
    code = "import sys, largebatch.optim; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# ------------------------------------------------------------------- maximize, differentiable, old state
@over_cases
def test_maximize_takes_the_step_of_the_negated_gradient_and_leaves_grad_alone(info, path):
    """torch's ``maximize``: the update of -g (every state included), p.grad untouched; per group."""
    params, grads = make_problem(shapes=FOUR_SHAPES)
    ascending, reference = leaves(params), leaves(params)
    opt = factory(info, path)([{"params": ascending[:2], "maximize": True}, {"params": ascending[2:]}])
    for step_grads in grads:
        for p, g in zip(ascending, step_grads):
            p.grad = g.clone()
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ascending, step_grads))
    negated = [[-g for g in step_grads[:2]] + step_grads[2:] for step_grads in grads]
    expected = run(factory(info, path)([{"params": reference[:2]}, {"params": reference[2:]}]), reference, negated)
    assert_identical(opt, expected)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: maximize=1"):
        opt.param_groups[0]["maximize"] = 1
        opt.step()


@pytest.mark.parametrize("path", ["foreach", "single"])
@pytest.mark.parametrize("info", INFOS, ids=[info.name for info in INFOS])
def test_the_functional_form_takes_maximize(info, path):
    """``lamb(...)``/``lans(...)``/``lars(...)`` with maximize=True: the float64 reference's steps on
    the negated gradients, and the caller's gradients left as they were."""
    from largebatch.optim import lamb, lans, lars
    function = {"lamb": lamb, "lans": lans, "lars": lars}[info.name]
    params, grads = make_problem(shapes=FOUR_SHAPES, dtype=torch.float64)
    x = [p.clone() for p in params]
    kwargs = {**info.kwargs, "weight_decay": 0.0625}
    states = [[torch.zeros_like(p) for p in x] for _ in range(1 if info.name == "lars" else 2)]
    for t, step_grads in enumerate(grads, start=1):
        given = [g.clone() for g in step_grads]
        steps = [] if info.name == "lars" else [[t] * len(x)]
        function(x, given, *states, *steps, **kwargs, foreach=path == "foreach", maximize=True)
        assert all(torch.equal(a, b) for a, b in zip(given, step_grads))
    expected = info.reference(params, [[-g for g in step_grads] for step_grads in grads], **kwargs)
    for actual, wanted in zip(x, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("info", INFOS, ids=[info.name for info in INFOS])
def test_the_functional_form_has_the_class_defaults(info):
    """``lamb(...)``/``lans(...)`` defaulted to weight_decay=0.0 where LAMB/LANS default to 0.01: the
    same call through the function silently dropped the decay."""
    import inspect

    from largebatch.optim import LAMB, LANS, LARS, lamb, lans, lars
    cls, function = {"lamb": (LAMB, lamb), "lans": (LANS, lans), "lars": (LARS, lars)}[info.name]
    ours, theirs = inspect.signature(cls).parameters, inspect.signature(function).parameters
    shared = [name for name in ours if name in theirs and ours[name].default is not inspect.Parameter.empty
              and name not in ("foreach", "fused", "lr")]
    assert "weight_decay" in shared
    for name in shared:
        assert theirs[name].default == ours[name].default, name


@pytest.mark.parametrize("info", INFOS, ids=[info.name for info in INFOS])
def test_differentiable_false_is_accepted_and_true_is_refused(info):
    live = leaves(make_problem()[0])
    info.cls(live, **info.kwargs, differentiable=False)
    with pytest.raises(ValueError, match="differentiable=True"):
        info.cls(live, **info.kwargs, differentiable=True)


@over_cases
def test_a_state_dict_saved_without_a_group_key_takes_the_constructor_value(info, path):
    """An older checkpoint (a hyperparameter added since) loads and continues as if it had held the
    constructor's value, as torch's optimizers do for keys added in later versions."""
    params, grads = make_problem()
    live = leaves(params)
    opt = run(factory(info, path, weight_decay=0.0625), live, grads[:2])
    for key in [k for k in opt.param_groups[0] if k not in ("params", "lr")]:
        saved = copy.deepcopy(opt.state_dict())
        del saved["param_groups"][0][key]
        twin = leaves(live)
        opt_twin = factory(info, path, weight_decay=0.0625)(twin)
        opt_twin.load_state_dict(saved)
        assert opt_twin.param_groups[0][key] == opt.param_groups[0][key], key
        run(opt_twin, twin, grads[2:])
        expected = factory(info, path, weight_decay=0.0625)(leaves(live))
        expected.load_state_dict(opt.state_dict())
        assert_identical(run(expected, all_params(expected), grads[2:]), opt_twin)


@pytest.mark.parametrize("info", INFOS[:2], ids=[info.name for info in INFOS[:2]])
def test_adamw_state_dict_loads_into_lamb_and_lans_and_steps(info):
    """AdamW's groups lack the trust-ratio switches and carry keys of their own: the moments (same
    names) carry over, the missing switches take the constructor's values, and the step runs."""
    params, grads = make_problem()
    live = leaves(params)
    adamw = torch.optim.AdamW(live, lr=0.02)
    run(adamw, live, grads[:2])
    opt = info.cls(live, lr=0.02)
    opt.load_state_dict(adamw.state_dict())
    run(opt, live, grads[2:])
    assert step_counts(opt) == [4, 4] and all(torch.isfinite(p).all() for p in live)
    assert opt.param_groups[0]["adapt"] is True


def test_a_group_key_without_a_default_is_named_at_the_step():
    live = leaves(make_problem()[0])
    opt = LARS([{"params": live, "lr": 0.5}])
    saved = opt.state_dict()
    del saved["param_groups"][0]["lr"]
    opt.load_state_dict(saved)  # defaults["lr"] is 0.5 here: filled
    assert opt.param_groups[0]["lr"] == 0.5
    opt = LARS([{"params": live, "lr": 0.5}])
    opt.defaults["lr"] = required
    opt.load_state_dict(saved)
    for p in live:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: no 'lr'"):
        opt.step()


def test_the_functional_form_refuses_a_step_count_below_one():
    """``steps`` is t after this update (1 on the first): a 0 divided by 1 - beta^0 = 0."""
    from largebatch.optim import lamb, lans
    params, grads = make_problem(dtype=torch.float64)
    for function in (lamb, lans):
        states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        with pytest.raises(ValueError, match=r"steps: t = 0 for a tensor.*1 on the first step"):
            function([p.clone() for p in params], grads[0], *states, [0, 0], lr=0.01)


def _functional_call(info: OptimizerInfo):
    """(function, params, positional state lists) for one step of ``info``'s functional form."""
    from largebatch.optim import lamb, lans, lars
    params, grads = make_problem(dtype=torch.float64)
    states = [[torch.zeros_like(p) for p in params] for _ in range(1 if info.name == "lars" else 2)]
    steps = [] if info.name == "lars" else [[1] * len(params)]
    return {"lamb": lamb, "lans": lans, "lars": lars}[info.name], params, [grads[0], *states, *steps]


@pytest.mark.parametrize("info", INFOS, ids=[info.name for info in INFOS])
def test_the_functional_form_checks_its_arguments_as_the_class_does(info):
    """``lamb(..., lr=-1)`` stepped uphill, ``eps=0`` on a zero gradient made NaN parameters, ``betas``
    of 1 divided by zero, and a short state list raised IndexError: each is now the class's ValueError
    naming the argument, before any tensor changes."""
    function, params, lists = _functional_call(info)
    before = [p.clone() for p in params]
    for field, value in info.bad.items():
        with pytest.raises(ValueError, match=rf"^{info.name}: {field}(\[\d\])?="):
            function(params, *lists, **{**info.kwargs, field: value})
    with pytest.raises(ValueError, match=rf"^{info.name}: lr=nan"):
        function(params, *lists, **{**info.kwargs, "lr": float("nan")})
    with pytest.raises(ValueError, match=rf"^{info.name}: lr='x'"):
        function(params, *lists, **{**info.kwargs, "lr": "x"})
    short = [lists[0], lists[1][:1], *lists[2:]]
    with pytest.raises(ValueError, match=r"has 1 entries for 2 params"):
        function(params, *short, **info.kwargs)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    if info.name != "lars":
        with pytest.raises(ValueError, match=r"steps=1: expected a list"):
            function(params, *lists[:-1], 1, **info.kwargs)
    function(params, *lists, **{**info.kwargs, "lr": torch.tensor(info.kwargs["lr"], dtype=torch.float64)})


@pytest.mark.parametrize("info", INFOS, ids=[info.name for info in INFOS])
def test_the_functional_form_calls_reduce_norms_as_the_class_does(info):
    """docs/optim.md's ``reduce_norms(squared_norms, params)`` works with the class and the function
    alike (the function called it with the squared norms alone, a TypeError for the documented one):
    doubling every squared norm gives the same step through both."""
    function, params, lists = _functional_call(info)
    seen = []

    def reduce_norms(squared_norms, given):
        seen.append(given)
        return squared_norms * 2

    function(params, *lists, **info.kwargs, reduce_norms=reduce_norms)
    assert seen and all(given is params for given in seen)
    live = leaves(make_problem(dtype=torch.float64)[0])
    opt = info.cls(live, **info.kwargs, reduce_norms=reduce_norms)
    for p, g in zip(live, lists[0]):
        p.grad = g.clone()
    opt.step()
    for actual, expected in zip(live, params):
        torch.testing.assert_close(actual, expected, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=rf"{info.name}: reduce_norms=3: expected None or a callable"):
        function(params, *lists, **info.kwargs, reduce_norms=3)


@pytest.mark.parametrize("cls, kwargs", [(LAMB, {}), (LANS, {}), (LARS, {"lr": 1.0})])
def test_parameters_on_the_meta_device_step_as_torchs_adamw_does(cls, kwargs):
    """A model built on 'meta' (shapes only, as large models are before their weights load): the
    default path's bucketing sized a segment index from device data (repeat_interleave without
    output_size), which meta tensors have not ("cannot repeat_interleave a meta tensor")."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, device="meta"), torch.nn.LayerNorm(3, device="meta"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = cls(model.parameters(), **kwargs)
    opt.step()
    assert all(v.device.type == "meta" for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    reference = torch.optim.AdamW(model.parameters())  # what torch's own does there
    reference.step()


def test_lars_warns_of_a_group_left_out_of_adaptation_at_a_lars_learning_rate():
    """param_groups()' default adapts weights and embeddings only (the LAMB recipe); handed to LARS at
    lr 10, biases and norm weights took plain momentum SGD at that LR (a 2-layer net: loss 7e29)."""
    import warnings

    from largebatch.optim import CATEGORIES, param_groups

    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    with pytest.warns(UserWarning, match=r"LARS: 4 tensor\(s\) \(0.bias, 1.weight, 1.bias, \.\.\.\) are in a group "
                                         r"with adapt=False at lr >= 1.*param_groups\(model, adapt="):
        LARS(param_groups(model, 0.0), lr=10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LARS(param_groups(model, 0.0, adapt=CATEGORIES), lr=10.0)  # every tensor adapted
        LARS(param_groups(model, 0.0), lr=0.0)  # the trainer's start: the schedule sets the LR per step
        LARS(model.parameters(), lr=10.0)


@pytest.mark.parametrize("info,path", [case for case in CASES if case.values[1] != "fused"])
def test_a_meta_default_device_leaves_the_step_on_the_parameters_device(info, path):
    """Under ``torch.set_default_device("meta")`` (as a model built on meta leaves it) the step's
    host numbers were made on the default device and could not be copied: NotImplementedError, where
    torch.optim.AdamW steps. The result is the step taken without it."""
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(3, 4, generator=gen), torch.randn(6, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(2)]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    run(factory(info, path), plain, grads)
    on_meta = [torch.nn.Parameter(v.clone()) for v in values]
    with torch.device("meta"):
        run(factory(info, path), on_meta, grads)
    for p, q in zip(on_meta, plain):
        assert p.device.type == "cpu" and torch.equal(p, q)
