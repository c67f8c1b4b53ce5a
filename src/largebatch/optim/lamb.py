"""LAMB -- You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
Algorithm 2 (LAMB) with phi = identity; docs/papers.md, LAMB:

    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    m^ = m/(1-b1^t) ;  v^ = v/(1-b2^t)
    r = m^/(sqrt(v^) + eps) + wd*x
    x = x - lr * ||x||/||r|| * r          (ratio 1 when ||x|| = 0 or ||r|| = 0)

With default arguments ``LAMB`` computes exactly this, for every tensor, with no clipping. What other
libraries do silently is a keyword here, off by default:

====================================  ==========================================================
``bias_correction=False``             no m^/v^ correction (LAMB paper v3, torch-optimizer)
``max_grad_norm=1.0``                 divide all gradients by max(||g||_global/1.0, 1) first (apex, timm)
``skip_adapt_if_no_decay=True``       ratio 1 for groups with weight_decay = 0 (apex, timm)
``trust_clip=1.0``                    clamp the trust ratio at 1.0 (timm's LAMBC)
``weight_norm_clip=10.0``             clamp ||x|| at 10 in the ratio (torch-optimizer)
``l2_decay=True``                     g += wd*x before the moments instead of decoupled decay in r
====================================  ==========================================================

``LAMB.from_preset(name, params, **kwargs)`` sets those switches to reproduce a library (PRESETS).
``lamb(...)`` is the functional form (as torch's ``adamw``), usable without the class.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import checks
from .core import LayerwiseOptimizer, NormReduction, hooked_norms, trust_ratio
from .kernels import (
    HP_EPS,
    HP_INV_BC1,
    HP_INV_BC2,
    HP_WD,
    KernelRun,
    Layout,
    Rebind,
    Steps,
    adam_hyperparameters,
    adam_moments,
    at,
    fresh_buffers,
    row,
    sums,
)
from .multi_tensor import (
    column,
    direction_plus_decay,
    divide_into,
    folded_bias_corrections,
    foreach_adam_moments_,
    foreach_folded_denominator,
    scaled_copy,
    sum_tile_pieces,
    tile_squared_norms,
)
from .tiling import cpu_tiles, tile_scalars

# Library behaviour as switches. Each preset's equality with its library is a test (tests/test_optim_presets.py).
PRESETS: dict[str, dict] = {
    # apex.optimizers.FusedLAMB defaults (adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
    # use_nvlamb=False): NVIDIA's LAMB ("NVLAMB") with global gradient pre-normalisation.
    "apex": {"max_grad_norm": 1.0, "skip_adapt_if_no_decay": True},
    # timm.optim.Lamb defaults -- written to behave as apex FusedLAMB, so the same switches.
    "timm": {"max_grad_norm": 1.0, "skip_adapt_if_no_decay": True},
    # torch_optimizer.Lamb defaults (debias=False, clamp_value=10, adam=False).
    "torch_optimizer": {"bias_correction": False, "weight_norm_clip": 10.0},
}


# ------------------------------------------------------------------------------ the math, per tensor
def lamb_direction(x: Tensor, m: Tensor, v: Tensor, h: Tensor, l2_decay: bool) -> Tensor:
    """r = m^/(sqrt(v^) + eps) (+ wd*x when decay is decoupled); h: hyperparameters at every element."""
    r = (m * h[..., HP_INV_BC1]) / ((v * h[..., HP_INV_BC2]).sqrt() + h[..., HP_EPS])
    return r if l2_decay else r + h[..., HP_WD] * x


def lamb_moments_kernel(x, g, m, v, r, hp, grad_scale, l2_decay, seg, n):
    """Pass 1: update m, v in place; return [||x||^2, ||r||^2]. With a buffer ``r``, r is also stored
    there for pass 2 to read instead of recomputing it (CPU; see kernels.py)."""
    h = row(hp, seg)
    if grad_scale is not None:
        g = g * grad_scale
    if l2_decay:
        g = g + h[..., HP_WD] * x
    m_new, v_new = adam_moments(m, v, g, h)
    direction = lamb_direction(x, m_new, v_new, h, l2_decay)
    m.copy_(m_new)
    v.copy_(v_new)
    if r is not None:
        r.copy_(direction)
    return torch.stack([sums(x * x, seg, n), sums(direction * direction, seg, n)])


def lamb_apply_kernel(x, m, v, r, hp, step_scale, l2_decay, seg, n):
    """Pass 2: x += step_scale * r with step_scale = -lr * trust_ratio; r stored by pass 1 or recomputed."""
    if r is None:
        r = lamb_direction(x, m, v, row(hp, seg), l2_decay)
    x.addcmul_(r, at(step_scale, seg))


# ------------------------------------------------------------------------------ the functional form
FUNCTIONAL_SPEC: dict[str, checks.Check] = dict(
    lr=checks.learning_rate, betas=checks.betas, eps=checks.positive, weight_decay=checks.non_negative,
    trust_clip=checks.optional_positive, weight_norm_clip=checks.optional_positive,
    reduce_norms=checks.optional_callable)
"""The checks of the functional forms' hyperparameters (``lamb`` and ``lans``; the classes' ``_spec`` adds
their switches)."""


def lamb(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
         steps: Steps, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         weight_decay: float = 0.01, adapt: bool = True, bias_correction: bool = True,
         trust_clip: float | None = None, weight_norm_clip: float | None = None, l2_decay: bool = False,
         grad_scale: Tensor | None = None, reduce_norms: NormReduction | None = None,
         foreach: bool = True, fused: bool = False,
         work_buffers: Callable[[int, list[int]], list[Tensor] | None] | None = None,
         rebind_state: Rebind | None = None, maximize: bool = False) -> tuple[Tensor, Tensor] | None:
    """One LAMB step on same-device, same-dtype, contiguous real tensors (updated in place); ``steps``:
    t per tensor after this update, host ints or 0-d device tensors (then the bias corrections are
    computed on the device and the step reads nothing on the host: torch's ``capturable``).
    Returns (trust ratios (n,), pinned (n,)), or None when not ``adapt``.
    ``reduce_norms(squared_norms, params)``: the (k*n,) squared norms -> their sum over shards, as the
    classes' (see core.py), handed ``params``. ``work_buffers``:
    (slot, indices) -> kept CPU buffers for those tensors (None: fresh ones). ``rebind_state``: see
    kernels.KernelRun.finish (None: flat buckets are copied back into the state tensors each step).
    ``maximize``: the step of -grads (torch's maximize; ``grads`` are left as they are).
    Hyperparameters are checked as the class checks them (ValueError naming the argument); a tensor
    one is used unread."""
    checks.per_tensor("lamb: ", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    hyper = checks.arguments("lamb: ", FUNCTIONAL_SPEC, dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_clip=trust_clip,
        weight_norm_clip=weight_norm_clip, reduce_norms=reduce_norms))
    lr, betas, eps, weight_decay = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    if not params:
        return None
    if maximize:  # ascend: the update of -g, the caller's gradients untouched (torch's maximize)
        grads = torch._foreach_neg(grads)
    layout = Layout(params, "fused" if fused else "foreach" if foreach else "single")
    work = work_buffers or fresh_buffers(params)
    hp = adam_hyperparameters(lr, betas, eps, weight_decay, bias_correction, steps, params[0])  # (n, 9)
    squared = params[0].new_zeros(2, len(params))  # [||x||^2, ||r||^2] per tensor
    run = KernelRun(layout, {"x": params, "g": grads, "m": exp_avgs, "v": exp_avg_sqs}, write=("x", "m", "v"))
    run.add("r", work(0, layout.kernel))
    run(lamb_moments_kernel, ("x", "g", "m", "v", "r"), (hp,), (grad_scale, l2_decay), out=squared)
    multi = _MultiTensorLAMB(layout.foreach, params, grads, exp_avgs, exp_avg_sqs, steps, betas, eps,
                             weight_decay, bias_correction, l2_decay, grad_scale, work)
    multi.pass1(squared)
    if adapt:  # (an unadapted step needs no norms: no reduction, no collective)
        x_norm, r_norm = hooked_norms(squared, reduce_norms, params)
        ratio, pinned = trust_ratio(x_norm, r_norm, numerator_clip=weight_norm_clip, ratio_clip=trust_clip)
    else:
        ratio, pinned = squared.new_ones(len(params)), None
    step_scale = ratio * (-lr)  # (n,)
    run(lamb_apply_kernel, ("x", "m", "v", "r"), (hp, step_scale), (l2_decay,))
    multi.pass2(step_scale)
    run.finish(rebind_state)
    return None if pinned is None else (ratio, pinned)


class _MultiTensorLAMB:
    """The multi-tensor path of the large tensors ``index``: foreach operations, on CPU tile by tile.

    Bias corrections are folded into per-tensor scalars (saves two passes): with denom = sqrt(v) +
    eps*sqrt(bc2), r = k*m/denom + wd*x, k = sqrt(bc2)/bc1, computed as r = scale*u by
    direction_plus_decay (u = x + (k/wd)*m/denom, scale = wd: one pass). With device step counts the
    scalars are 0-d device tensors and u = m/denom + (wd/k)*x, scale = k (two passes)."""

    def __init__(self, index, params, grads, exp_avgs, exp_avg_sqs, steps, betas, eps, weight_decay,
                 bias_correction, l2_decay, grad_scale, work):
        def pick(ts):
            return ([ts[i] for i in index])
        self.index, self.x, self.g, self.m, self.v = index, pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs)
        self.betas, self.eps, self.wd, self.l2_decay, self.grad_scale = betas, eps, weight_decay, l2_decay, grad_scale
        self.offsets, self.k, _ = folded_bias_corrections([steps[i] for i in index], betas, eps, bias_correction,
                                                          params[0])
        self.scratch = work(0, index) if index else None
        self.tiles = cpu_tiles(self.x)
        self.directions: list[list[Tensor]] = []
        self.r_scale: list = list(self.k)

    def pass1(self, squared: Tensor) -> None:
        """Moments, u and the squared norms [||x||^2, ||r||^2] into ``squared``'s columns ``index``."""
        if not self.index:
            return
        partial = []
        for tile in self.tiles:
            x, s = tile.views(self.x), None if self.scratch is None else tile.views(self.scratch)
            grads = tile.views(self.g)
            if self.grad_scale is not None or (self.l2_decay and self.wd != 0):
                grads = scaled_copy(grads, 1.0 if self.grad_scale is None else self.grad_scale, s)
                if self.l2_decay and self.wd != 0:
                    torch._foreach_add_(grads, x, alpha=self.wd)
            m = tile.views(self.m)
            foreach_adam_moments_(m, tile.views(self.v), grads, self.betas)
            denom = foreach_folded_denominator(tile.views(self.v), tile.pick(self.offsets), s)
            if self.l2_decay:  # the decay is already in g: r = k*m/denom
                u = divide_into(m, denom, s)
            else:
                u, scales = direction_plus_decay(x, m, denom, tile.pick(self.k), self.wd, s)
                for i, scale in zip(tile.index, scales):
                    self.r_scale[i] = scale
            partial.append(tile_squared_norms([x, u]))
            self.directions.append(u)
        sq = sum_tile_pieces(self.tiles, partial, len(self.x))  # (2, n_large)
        sq[1] *= column(self.r_scale, sq).square()
        squared[:, self.index] = sq

    def pass2(self, step_scale: Tensor) -> None:
        """x += step_scale * r = (step_scale * r_scale) * u, tile by tile."""
        if not self.index:
            return
        scale = step_scale[self.index] * column(self.r_scale, step_scale)
        for tile, u in zip(self.tiles, self.directions):
            torch._foreach_addcmul_(tile.views(self.x), u, tile_scalars(scale, tile))


# ------------------------------------------------------------------------------------- the class
class LAMB(LayerwiseOptimizer):
    """LAMB (You et al. 2019, Alg. 2). See the module docstring for the switches and PRESETS.

    Per group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adapt`` (trust ratio on/off) and the
    switches; edits to ``param_groups`` apply at the next step. ``foreach`` (default) / per-tensor
    (``foreach=False``) / ``fused=True`` (torch.compile) paths compute the same update.
    ``reduce_norms``: see largebatch.optim.core (sharded models). ``capturable=True``: step counts as
    device tensors, bias corrections on the device, no host read in ``step()`` (docs/optim.md).
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _kernel_names = ("m", "v")
    _spec = {**{key: check for key, check in FUNCTIONAL_SPEC.items() if key != "reduce_norms"},  # (a constructor
             **dict(adapt=checks.flag, bias_correction=checks.flag, skip_adapt_if_no_decay=checks.flag,  # argument)
                    l2_decay=checks.flag, maximize=checks.flag)}

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, adapt: bool = True, bias_correction: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, weight_norm_clip: float | None = None, l2_decay: bool = False,
                 foreach: bool | None = None, fused: bool = False, track_trust_ratios: bool = False,
                 reduce_norms: NormReduction | None = None, capturable: bool = False,
                 maximize: bool = False, differentiable: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay, adapt=adapt, bias_correction=bias_correction,
                        skip_adapt_if_no_decay=skip_adapt_if_no_decay, trust_clip=trust_clip,
                        weight_norm_clip=weight_norm_clip, l2_decay=l2_decay, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios, reduce_norms=reduce_norms, capturable=capturable,
                         differentiable=differentiable)

    @classmethod
    def from_preset(cls, name: str, params, **kwargs) -> "LAMB":
        """``LAMB(params, **PRESETS[name], **kwargs)``; names: apex, timm, torch_optimizer."""
        if name not in PRESETS:
            raise ValueError(f"preset={name!r}: unknown; choose one of {sorted(PRESETS)}")
        return cls(params, **{**PRESETS[name], **kwargs})

    def _update(self, h, b, grad_scale, reduce):
        return lamb(b.x, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], b.steps, lr=h["lr"],
                    betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"], adapt=self._adapts(h),
                    bias_correction=h["bias_correction"], trust_clip=h["trust_clip"],
                    weight_norm_clip=h["weight_norm_clip"], l2_decay=h["l2_decay"], grad_scale=grad_scale,
                    reduce_norms=reduce, work_buffers=self._work_buffers(b),
                    rebind_state=self._rebind(b), **self._paths())
