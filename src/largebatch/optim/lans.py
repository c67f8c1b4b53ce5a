"""LANS -- Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT Pretraining in 54 minutes",
Algorithm 2 (LANS); docs/papers.md, LANS:

    g~ = g/(||g|| + eps)                     (left as g when ||g|| = 0: per-block gradient normalisation)
    m = b1*m + (1-b1)*g~ ;  v = b2*v + (1-b2)*g~^2 ;  m^, v^ bias-corrected as in LAMB
    d = sqrt(v^) + eps
    r = m^/d + wd*x          c = g~/d + wd*x
    x = x - lr * ( b1 * (||x||/||r||) * r  +  (1-b1) * (||x||/||c||) * c )   (each ratio 1 on a zero norm)

Both ratios use the same pre-update x. The same off-by-default switches as LAMB apply where they
mean something (``bias_correction``, ``max_grad_norm``, ``skip_adapt_if_no_decay``, ``trust_clip``,
``weight_norm_clip``); see largebatch.optim.lamb. The paper's LR schedule (warmup, hold, polynomial
decay) lives in largebatch.schedules, not here. ``lans(...)`` is the functional form.
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
    on_device,
    row,
    squared_norms_kernel,
    sums,
)
from .lamb import FUNCTIONAL_SPEC, LAMB
from .multi_tensor import (
    adam_moments_scaled_,
    column,
    direction_plus_decay,
    folded_bias_corrections,
    foreach_adam_moments_,
    foreach_folded_denominator,
    per_tensor,
    scaled_copy,
    stacked_squared_norms,
    sum_tile_pieces,
    tile_squared_norms,
)
from .tiling import cpu_tiles, tile_scalars


# ------------------------------------------------------------------------------ the math, per tensor
def lans_inverse_denominator(v: Tensor, h: Tensor) -> Tensor:
    """1/d with d = sqrt(v^) + eps: one division serves both directions."""
    return 1.0 / ((v * h[..., HP_INV_BC2]).sqrt() + h[..., HP_EPS])


def lans_moments_kernel(x, g, m, v, inverse_d, hp, grad_coef, seg, n):
    """Pass 1: g~ = grad_coef*g; update m, v in place; return [||x||^2, ||r||^2, ||c||^2] with
    r = m^/d + wd*x and c = g~/d + wd*x. With a buffer ``inverse_d``, 1/d is stored for pass 2."""
    h = row(hp, seg)
    g_normalized = g * at(grad_coef, seg)
    m_new, v_new = adam_moments(m, v, g_normalized, h)
    inv_d = lans_inverse_denominator(v_new, h)
    decay = h[..., HP_WD] * x
    r = m_new * h[..., HP_INV_BC1] * inv_d + decay
    c = g_normalized * inv_d + decay
    m.copy_(m_new)
    v.copy_(v_new)
    if inverse_d is not None:
        inverse_d.copy_(inv_d)
    return torch.stack([sums(x * x, seg, n), sums(r * r, seg, n), sums(c * c, seg, n)])


def lans_apply_kernel(x, g, m, v, inverse_d, hp, grad_coef, scale_r, scale_c, seg, n):
    """Pass 2: x += scale_r*r + scale_c*c (scale_r = -lr*b1*ratio_r, scale_c = -lr*(1-b1)*ratio_c),
    regrouped as x*(1 + (scale_r + scale_c)*wd) + (scale_r*m^ + scale_c*g~)/d."""
    h = row(hp, seg)
    if inverse_d is None:
        inverse_d = lans_inverse_denominator(v, h)
    s_r, s_c = at(scale_r, seg), at(scale_c, seg)
    numerator = m * (s_r * h[..., HP_INV_BC1]) + g * (s_c * at(grad_coef, seg))
    x.copy_(x * (1.0 + (s_r + s_c) * h[..., HP_WD]) + numerator * inverse_d)


# ------------------------------------------------------------------------------ the functional form
def lans(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
         steps: Steps, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         weight_decay: float = 0.01, adapt: bool = True, bias_correction: bool = True,
         trust_clip: float | None = None, weight_norm_clip: float | None = None,
         grad_scale: Tensor | None = None, reduce_norms: NormReduction | None = None,
         foreach: bool = True, fused: bool = False,
         work_buffers: Callable[[int, list[int]], list[Tensor] | None] | None = None,
         rebind_state: Rebind | None = None, maximize: bool = False) -> tuple[Tensor, Tensor] | None:
    """One LANS step; arguments, checks and return as ``largebatch.optim.lamb.lamb`` (ratios: (2n,), r's
    then c's)."""
    checks.per_tensor("lans: ", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    hyper = checks.arguments("lans: ", FUNCTIONAL_SPEC, dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_clip=trust_clip,
        weight_norm_clip=weight_norm_clip, reduce_norms=reduce_norms))
    lr, betas, eps, weight_decay = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    if not params:
        return None
    if maximize:  # ascend: the update of -g, the caller's gradients untouched (torch's maximize)
        grads = torch._foreach_neg(grads)
    layout = Layout(params, "fused" if fused else "foreach" if foreach else "single")
    work = work_buffers or fresh_buffers(params)
    n = len(params)
    tensors = {"x": params, "g": grads, "m": exp_avgs, "v": exp_avg_sqs}
    run = KernelRun(layout, tensors, write=("x", "m", "v"))
    # pass 0: ||g|| per tensor -> g~ = coef * g with coef = s/(s*||g|| + eps), s when ||g|| = 0
    # (a lone reduction is the one thing torch's own norms do faster than a compiled kernel: inductor's
    # dynamic-shape sum is cascaded, 2.4x the time of a memory-bound pass on CPU; so the fused path
    # takes torch's norms for its large tensors too)
    squared_g = params[0].new_zeros(1, n)
    native = layout.foreach + (layout.kernel if layout.compiled else [])
    run(squared_norms_kernel, ("g",), (), (), out=squared_g, buckets_only=layout.compiled)
    if native:
        squared_g[:, native] = stacked_squared_norms([grads[i] for i in native], True)
    (g_norm,) = hooked_norms(squared_g, reduce_norms, params)
    scale = 1.0 if grad_scale is None else grad_scale
    grad_coef = torch.where(g_norm > 0, scale / (g_norm * scale + eps), torch.ones_like(g_norm) * scale)  # (n,)

    hp = adam_hyperparameters(lr, betas, eps, weight_decay, bias_correction, steps, params[0])  # (n, 9)
    squared = params[0].new_zeros(3, n)  # [||x||^2, ||r||^2, ||c||^2]
    # 1/d kept for pass 2 on the eager paths; the fused pass 2 recomputes it from v, which saves a
    # parameter-sized write and read (12 passes over parameter-sized memory, AdamW's 7 -> 1.71x)
    run.add("inverse_d", None if layout.compiled else work(0, layout.kernel))
    run(lans_moments_kernel, ("x", "g", "m", "v", "inverse_d"), (hp, grad_coef), (), out=squared)
    multi = _MultiTensorLANS(layout.foreach, tensors, steps, betas, eps, weight_decay, bias_correction,
                             grad_coef, work)
    multi.pass1(squared)
    beta1 = betas[0]
    if adapt:  # (an unadapted step needs no norms: no reduction, no collective)
        x_norm, r_norm, c_norm = hooked_norms(squared, reduce_norms, params)
        ratio_r, pinned_r = trust_ratio(x_norm, r_norm, numerator_clip=weight_norm_clip, ratio_clip=trust_clip)
        ratio_c, pinned_c = trust_ratio(x_norm, c_norm, numerator_clip=weight_norm_clip, ratio_clip=trust_clip)
        diagnostics = torch.cat([ratio_r, ratio_c]), torch.cat([pinned_r, pinned_c])
    else:
        ratio_r = ratio_c = squared.new_ones(n)
        diagnostics = None
    scale_r, scale_c = ratio_r * (-lr * beta1), ratio_c * (-lr * (1 - beta1))  # (n,), (n,)
    run(lans_apply_kernel, ("x", "g", "m", "v", "inverse_d"), (hp, grad_coef, scale_r, scale_c), ())
    multi.pass2(scale_r, scale_c)
    run.finish(rebind_state)
    return diagnostics


class _MultiTensorLANS:
    """The multi-tensor path of the large tensors ``index`` (foreach; on CPU tile by tile).

    Bias corrections folded as in LAMB: with denom = sqrt(v) + eps*sqrt(bc2) = sqrt(bc2)*d,
    r = k*m/denom + wd*x, k = sqrt(bc2)/bc1 ; c = q*g~/denom + wd*x, q = sqrt(bc2); each computed as
    scale*u by direction_plus_decay (one pass where wd > 0). On CPU g~ = coef*g is folded into the
    moment update and the direction (host floats: no device to synchronise with); elsewhere g~ is
    written out and coef stays on the device, as with device step counts (whose folded scalars are
    0-d device tensors; both directions then take direction_plus_decay's two-pass form)."""

    def __init__(self, index, tensors, steps, betas, eps, weight_decay, bias_correction, grad_coef, work):
        self.index = index
        if not index:
            return
        def pick(ts):
            return (None if ts is None else [ts[i] for i in index])
        self.x, self.g, self.m, self.v = (pick(tensors[key]) for key in ("x", "g", "m", "v"))
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        large = [steps[i] for i in index]
        self.offsets, self.k, self.q = folded_bias_corrections(large, betas, eps, bias_correction, self.x[0])
        self.scratch_c, self.scratch_r = work(0, index), work(1, index)
        self.coef = grad_coef[index]
        # CPU: coef as host floats (a read of CPU memory), except with device step counts: nothing read
        self.host_coef = self.coef.tolist() if self.scratch_c is not None and not on_device(large) else None
        self.tiles = cpu_tiles(self.x)
        self.directions: list[tuple[list[Tensor], list[Tensor]]] = []
        self.r_scale, self.c_scale = list(self.k), list(self.q)

    def pass1(self, squared: Tensor) -> None:
        """Moments, u_r, u_c and the squared norms [||x||^2, ||r||^2, ||c||^2] into columns ``index``."""
        if not self.index:
            return
        partial = []
        for tile in self.tiles:
            x, g = tile.views(self.x), tile.views(self.g)
            s_c, s_r = ((None, None) if self.scratch_c is None
                        else (tile.views(self.scratch_c), tile.views(self.scratch_r)))
            m, v = tile.views(self.m), tile.views(self.v)
            if self.host_coef is not None:
                c_coef = tile.pick(self.host_coef)
                adam_moments_scaled_(m, v, g, c_coef, self.betas)
            else:  # g~ (into the c buffer, which u_c then overwrites element by element)
                g = scaled_copy(g, tile_scalars(self.coef.to(g[0].dtype), tile), s_c)
                c_coef = None
                foreach_adam_moments_(m, v, g, self.betas)
            denom = foreach_folded_denominator(v, tile.pick(self.offsets), s_r)
            q = tile.pick(self.q)
            u_c, c_scales = direction_plus_decay(x, g, denom, q if c_coef is None else
                                                 [qi * ci for qi, ci in zip(q, c_coef)], self.wd, s_c)
            u_r, r_scales = direction_plus_decay(x, m, denom, tile.pick(self.k), self.wd, s_r)  # over denom: last
            for i, cs, rs in zip(tile.index, c_scales, r_scales):
                self.c_scale[i], self.r_scale[i] = cs, rs
            partial.append(tile_squared_norms([x, u_r, u_c]))
            self.directions.append((u_r, u_c))
        sq = sum_tile_pieces(self.tiles, partial, len(self.x))  # (3, n_large)
        sq[1] *= self._scales(self.r_scale, sq).square()
        sq[2] *= self._scales(self.c_scale, sq).square()
        squared[:, self.index] = sq

    @staticmethod
    def _scales(values: list, like: Tensor) -> Tensor:
        if values and isinstance(values[0], Tensor):  # device values
            return column(values, like)
        scale = per_tensor(values, like)
        return scale if isinstance(scale, Tensor) else like.new_full((len(values),), scale)

    def pass2(self, scale_r: Tensor, scale_c: Tensor) -> None:
        """x += scale_r*r_scale*u_r + scale_c*c_scale*u_c, tile by tile (x stays in cache)."""
        if not self.index:
            return
        like = scale_r
        s_r = scale_r[self.index] * self._scales(self.r_scale, like)
        s_c = scale_c[self.index] * self._scales(self.c_scale, like)
        for tile, (u_r, u_c) in zip(self.tiles, self.directions):
            x = tile.views(self.x)
            torch._foreach_addcmul_(x, u_r, tile_scalars(s_r, tile))
            torch._foreach_addcmul_(x, u_c, tile_scalars(s_c, tile))


# ------------------------------------------------------------------------------------- the class
class LANS(LayerwiseOptimizer):
    """LANS (Zheng et al. 2020, Alg. 2); same keywords and paths as LAMB (no l2_decay: the paper's decay is
    decoupled). With track_trust_ratios the summary covers both ratios of every adapted tensor (2n)."""

    _state_keys = ("exp_avg", "exp_avg_sq")
    _kernel_names = ("m", "v")
    _spec = {key: check for key, check in LAMB._spec.items() if key != "l2_decay"}  # the decay is decoupled

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, adapt: bool = True, bias_correction: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, weight_norm_clip: float | None = None,
                 foreach: bool | None = None, fused: bool = False, track_trust_ratios: bool = False,
                 reduce_norms: NormReduction | None = None, capturable: bool = False,
                 maximize: bool = False, differentiable: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay, adapt=adapt, bias_correction=bias_correction,
                        skip_adapt_if_no_decay=skip_adapt_if_no_decay, trust_clip=trust_clip,
                        weight_norm_clip=weight_norm_clip, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios, reduce_norms=reduce_norms, capturable=capturable,
                         differentiable=differentiable)

    def _update(self, h, b, grad_scale, reduce):
        return lans(b.x, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], b.steps, lr=h["lr"],
                    betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"], adapt=self._adapts(h),
                    bias_correction=h["bias_correction"], trust_clip=h["trust_clip"],
                    weight_norm_clip=h["weight_norm_clip"], grad_scale=grad_scale, reduce_norms=reduce,
                    work_buffers=self._work_buffers(b), rebind_state=self._rebind(b),
                    **self._paths())
