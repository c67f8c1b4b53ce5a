"""LARS -- You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks", Algorithm 1
(SGD with momentum and a layer-wise local LR); docs/papers.md, LARS:

    local = tc*||x|| / (||g|| + wd*||x|| + eps)      (1 when ||x|| = 0 or ||g|| = 0)
    buf = m*buf + lr*local*(g + wd*x) ;  x = x - buf

Paper trust coefficient tc = 0.001. Off-by-default switches shared with LAMB: ``max_grad_norm``
(global pre-clipping), ``skip_adapt_if_no_decay`` (local = 1 for weight_decay = 0 groups, the usual
"exclude biases and norms"), ``trust_clip`` (clamp local from above, as NVIDIA's LARC clip mode at 1).
``lars(...)`` is the functional form.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT, required

from . import checks
from .core import LayerwiseOptimizer, NormReduction, hooked_norms, trust_ratio
from .kernels import KernelRun, Layout, Rebind, Rows, at, row, sums
from .multi_tensor import scaled_copy, stacked_squared_norms

_MOMENTUM, _WD = range(2)  # columns of the (n, 2) hyperparameter tensor of the kernels


# ------------------------------------------------------------------------------ the math, per tensor
def lars_norms_kernel(x, g, seg, n):
    """Pass 1: [||x||^2, ||g||^2] in one read of each."""
    return torch.stack([sums(x * x, seg, n), sums(g * g, seg, n)])


def lars_apply_kernel(x, g, buf, hp, step_scale, grad_scale, seg, n):
    """Pass 2: buf = m*buf + step_scale*(g + wd*x) ; x -= buf (step_scale = lr*local)."""
    h = row(hp, seg)
    if grad_scale is not None:
        g = g * grad_scale
    buf.copy_(buf * h[..., _MOMENTUM] + (g + h[..., _WD] * x) * at(step_scale, seg))
    x.sub_(buf)


# ------------------------------------------------------------------------------ the functional form
FUNCTIONAL_SPEC: dict[str, checks.Check] = dict(
    lr=checks.learning_rate, momentum=checks.unit_interval, weight_decay=checks.non_negative,
    trust_coefficient=checks.positive, eps=checks.positive, trust_clip=checks.optional_positive,
    reduce_norms=checks.optional_callable)
"""The checks of ``lars``'s hyperparameters (the class's ``_spec`` adds its switches)."""


def lars(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *, lr: float,
         momentum: float = 0.9, weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 1e-8,
         adapt: bool = True, trust_clip: float | None = None, grad_scale: Tensor | None = None,
         reduce_norms: NormReduction | None = None, foreach: bool = True, fused: bool = False,
         work_buffers: Callable[[int, list[int]], list[Tensor] | None] | None = None,
         rebind_state: Rebind | None = None, maximize: bool = False) -> tuple[Tensor, Tensor] | None:
    """One LARS step on same-device, same-dtype, contiguous real tensors (updated in place). Returns
    (local LRs (n,), pinned (n,)), or None when not ``adapt``; other arguments and checks as ``lamb``."""
    checks.per_tensor("lars: ", params, grads=grads, momentum_buffers=momentum_buffers)
    hyper = checks.arguments("lars: ", FUNCTIONAL_SPEC, dict(
        lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps,
        trust_clip=trust_clip, reduce_norms=reduce_norms))
    lr, momentum, weight_decay = hyper["lr"], hyper["momentum"], hyper["weight_decay"]
    trust_coefficient, eps = hyper["trust_coefficient"], hyper["eps"]
    if not params:
        return None
    if maximize:  # ascend: the update of -g, the caller's gradients untouched (torch's maximize)
        grads = torch._foreach_neg(grads)
    layout = Layout(params, "fused" if fused else "foreach" if foreach else "single")
    n = len(params)
    run = KernelRun(layout, {"x": params, "g": grads, "buf": momentum_buffers}, write=("x", "buf"))
    squared = params[0].new_zeros(2, n)  # [||x||^2, ||g||^2]
    large = layout.foreach
    if adapt:
        run(lars_norms_kernel, ("x", "g"), (), (), out=squared)
    if adapt and large:
        squared[:, large] = torch.stack([stacked_squared_norms([params[i] for i in large], True),
                                         stacked_squared_norms([grads[i] for i in large], True)])
    diagnostics = None
    if adapt:  # local = tc*||x|| / (||g|| + wd*||x|| + eps), pinned to 1 on a zero norm
        x_norm, g_norm = hooked_norms(squared, reduce_norms, params)
        if grad_scale is not None:
            g_norm = g_norm * grad_scale
        # a zero gradient norm pins the ratio to 1; a NaN one must stay NaN (``> 0`` would pin it too)
        denominator = torch.where(g_norm == 0, torch.zeros_like(g_norm), g_norm + weight_decay * x_norm + eps)
        local, pinned = trust_ratio(trust_coefficient * x_norm, denominator, ratio_clip=trust_clip)
        diagnostics = local, pinned
        step_scale = local * lr  # (n,)
    else:
        step_scale = params[0].new_ones(n) * lr  # (a tensor LR stays on its device)
    hp = Rows([[momentum, weight_decay]] * n, params[0])  # (n, 2)
    run(lars_apply_kernel, ("x", "g", "buf"), (hp, step_scale), (grad_scale,))
    if large:
        scratch = work_buffers(0, large) if work_buffers is not None else None
        _multi_tensor_apply([params[i] for i in large], [grads[i] for i in large],
                            [momentum_buffers[i] for i in large], momentum, weight_decay, grad_scale,
                            step_scale[large], scratch)
    run.finish(rebind_state)
    return diagnostics


def _multi_tensor_apply(x, grads, buffers, momentum, weight_decay, grad_scale, step_scale, scratch) -> None:
    """buf = m*buf + step_scale*(g + wd*x) ; x -= buf, with foreach operations (p.grad never modified)."""
    direction = grads
    if grad_scale is not None or weight_decay != 0:
        direction = scaled_copy(grads, 1.0 if grad_scale is None else grad_scale, scratch)
        if weight_decay != 0:
            torch._foreach_add_(direction, x, alpha=weight_decay)
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_addcmul_(buffers, direction, list(step_scale.unbind()))
    torch._foreach_sub_(x, buffers)


# ------------------------------------------------------------------------------------- the class
class LARS(LayerwiseOptimizer):
    """LARS (You et al. 2017, Alg. 1). ``lr`` has no default (LARS learning rates are model-specific):
    give it here or in every parameter group (then ``defaults["lr"]``, which some schedulers read, is
    the first group's, and a group added later must set its own).

    Per group: ``lr``, ``momentum``, ``weight_decay``, ``trust_coefficient``, ``eps``, ``adapt`` and the
    switches; paths as in LAMB (foreach default, per-tensor, fused=True), and ``capturable`` (its
    step counts as device tensors; LARS has no bias correction to compute)."""

    _state_keys = ("momentum_buffer",)
    _kernel_names = ("buf",)
    _spec = {**{key: check for key, check in FUNCTIONAL_SPEC.items() if key != "reduce_norms"},  # (a constructor
             **dict(adapt=checks.flag, skip_adapt_if_no_decay=checks.flag, maximize=checks.flag)}  # argument)

    def __init__(self, params: ParamsT, lr: float | None = None, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, *, adapt: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, foreach: bool | None = None, fused: bool = False,
                 track_trust_ratios: bool = False, reduce_norms: NormReduction | None = None,
                 capturable: bool = False, maximize: bool = False, differentiable: bool = False) -> None:
        defaults = dict(lr=required if lr is None else lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, adapt=adapt,
                        skip_adapt_if_no_decay=skip_adapt_if_no_decay, trust_clip=trust_clip, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios, reduce_norms=reduce_norms, capturable=capturable,
                         differentiable=differentiable)
        self._lr_per_group = lr is None
        if self._lr_per_group:  # every group has one (checked): defaults["lr"] is what schedulers read
            self.defaults["lr"] = self.param_groups[0]["lr"]
        plain = [g for g in self.param_groups if not g["adapt"] and float(g["lr"]) >= 1.0]
        if plain:  # param_groups()'s default (the LAMB recipe's) left biases and norms out
            names = [n for g in plain for n in g.get("names", [])][:3]
            warnings.warn(f"LARS: {sum(len(g['params']) for g in plain)} tensor(s) "
                          f"{'(' + ', '.join(names) + ', ...) ' if names else ''}are in a group with adapt=False at "
                          f"lr >= 1: without the trust ratio they take plain momentum SGD at the LARS learning "
                          "rate and can diverge (a 2-layer net reached loss 7e29 at lr 10); LARS adapts every "
                          "tensor: param_groups(model, adapt=largebatch.optim.CATEGORIES)", stacklevel=2)

    _options = LayerwiseOptimizer._options + ("_lr_per_group",)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_lr_per_group", False) and "lr" not in param_group:
            index = len(self.param_groups)
            raise ValueError(f"param_groups[{index}]: no 'lr'; this LARS was built without lr=..., so every "
                             "parameter group sets its own: add 'lr' to the group")
        super().add_param_group(param_group)

    def _update(self, h, b, grad_scale, reduce):
        return lars(b.x, b.grads, b.states["momentum_buffer"], lr=h["lr"], momentum=h["momentum"],
                    weight_decay=h["weight_decay"], trust_coefficient=h["trust_coefficient"], eps=h["eps"],
                    adapt=self._adapts(h), trust_clip=h["trust_clip"], grad_scale=grad_scale,
                    reduce_norms=reduce, work_buffers=self._work_buffers(b),
                    rebind_state=self._rebind(b), **self._paths())
