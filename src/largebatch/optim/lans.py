"""LANS -- Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT Pretraining in 54 minutes",
Algorithm 2 (LANS); the formula as written in PAPERS.md §1 (LANS):

    g~ = g/(||g|| + eps)                     (left as g when ||g|| = 0: per-block gradient normalisation)
    m = b1*m + (1-b1)*g~ ;  v = b2*v + (1-b2)*g~^2 ;  m^, v^ bias-corrected as in LAMB
    d = sqrt(v^) + eps
    r = m^/d + wd*x          c = g~/d + wd*x
    x = x - lr * ( b1 * (||x||/||r||) * r  +  (1-b1) * (||x||/||c||) * c )   (each ratio 1 on a zero norm)

Both ratios use the same pre-update x. The same off-by-default switches as LAMB apply where they
mean something (``bias_correction``, ``max_grad_norm``, ``skip_adapt_if_no_decay``, ``trust_clip``,
``weight_norm_clip``); see largebatch.optim.lamb. The paper's LR schedule (warmup, hold, polynomial
decay) lives in largebatch.schedules, not here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .core import (HP_EPS, HP_INV_BC1, HP_INV_BC2, HP_WD, GroupTensors, LayerwiseOptimizer, adam_hyperparameters,
                   adam_moments, adam_moments_scaled_, bias_corrections, direction_plus_decay,
                   foreach_adam_moments_,
                   foreach_folded_denominator, per_tensor, scaled_copy, tile_scalars)


def lans_inverse_denominator(v: Tensor, hp: Tensor) -> Tensor:
    """1/d with d = sqrt(v^) + eps, for one tensor (1-D): one division serves both directions."""
    return 1.0 / ((v * hp[HP_INV_BC2]).sqrt() + hp[HP_EPS])


def lans_moments_kernel(x: Tensor, g: Tensor, m: Tensor, v: Tensor, hp: Tensor, grad_coef: Tensor,
                        out: Tensor | None = None) -> Tensor:
    """Pass 1 for one tensor: g~ = grad_coef*g; update m, v in place; return [||x||^2, ||r||^2, ||c||^2]
    with r = m^/d + wd*x and c = g~/d + wd*x. With ``out``, 1/d is also written there, for pass 2 to
    read instead of recomputing (see LayerwiseOptimizer._stored_directions)."""
    g_normalized = g * grad_coef
    m_new, v_new = adam_moments(m, v, g_normalized, hp)
    inverse_d = lans_inverse_denominator(v_new, hp)
    decay = hp[HP_WD] * x
    r = m_new * hp[HP_INV_BC1] * inverse_d + decay
    c = g_normalized * inverse_d + decay
    m.copy_(m_new)
    v.copy_(v_new)
    if out is not None:
        out.copy_(inverse_d)
    return torch.stack([x.square().sum(), r.square().sum(), c.square().sum()])


def lans_apply_kernel(x: Tensor, g: Tensor, m: Tensor, v: Tensor, hp: Tensor, grad_coef: Tensor,
                      scale_r: Tensor, scale_c: Tensor, inverse_d: Tensor | None = None) -> None:
    """Pass 2 for one tensor: x += scale_r*r + scale_c*c (scale_r = -lr*b1*ratio_r, scale_c = -lr*(1-b1)*ratio_c),
    regrouped as x*(1 + (scale_r + scale_c)*wd) + (scale_r*m^ + scale_c*g~)/d; 1/d from pass 1, or
    recomputed from v when None."""
    if inverse_d is None:
        inverse_d = lans_inverse_denominator(v, hp)
    numerator = m * (scale_r * hp[HP_INV_BC1]) + g * (scale_c * grad_coef)
    x.copy_(x * (1.0 + (scale_r + scale_c) * hp[HP_WD]) + numerator * inverse_d)


class LANS(LayerwiseOptimizer):
    """LANS (Zheng et al. 2020, Alg. 2); same keywords and paths as LAMB (no l2_decay: the paper's decay is
    decoupled). With track_trust_ratios the summary covers both ratios of every adapted tensor (2n)."""

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, adapt: bool = True, bias_correction: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, weight_norm_clip: float | None = None,
                 foreach: bool | None = None, fused: bool = False, track_trust_ratios: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt,
                        bias_correction=bias_correction, skip_adapt_if_no_decay=skip_adapt_if_no_decay,
                        trust_clip=trust_clip, weight_norm_clip=weight_norm_clip)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios)

    def _grad_coefficients(self, group: dict, b: GroupTensors, grad_scale: Tensor | None) -> Tensor:
        """a (n,) with g~ = a*g: s/(s*||g|| + eps), or s when ||g|| = 0 (s = global clip scale, else 1)."""
        (g_norm,) = self._reduced_norms([b.grads], b.params)  # (n,)
        scale = 1.0 if grad_scale is None else grad_scale
        scaled_norm = g_norm * scale
        coef = scale / (scaled_norm + group["eps"])
        return torch.where(g_norm > 0, coef, torch.ones_like(g_norm) * scale)

    def _update_group(self, group: dict, batch: GroupTensors, grad_scale: Tensor | None):
        grad_coef = self._grad_coefficients(group, batch, grad_scale)  # (n,)
        update = self._foreach_update if self.foreach else self._per_tensor_update
        return update(group, batch, grad_coef, self._adapts(group))

    def _ratios_and_scales(self, group, x_norm, r_norm, c_norm, adapt):
        """Per-tensor step sizes (n,) of r and c, and the diagnostics (ratios (2n,), pinned (2n,))."""
        lr, beta1 = group["lr"], group["betas"][0]
        if not adapt:
            ones = torch.ones_like(x_norm)
            return ones * (-lr * beta1), ones * (-lr * (1 - beta1)), None
        ratio_r, pinned_r = self._group_trust_ratio(group, x_norm, r_norm)
        ratio_c, pinned_c = self._group_trust_ratio(group, x_norm, c_norm)
        diagnostics = torch.cat([ratio_r, ratio_c]), torch.cat([pinned_r, pinned_c])
        return ratio_r * (-lr * beta1), ratio_c * (-lr * (1 - beta1)), diagnostics

    def _foreach_update(self, group, b: GroupTensors, grad_coef: Tensor, adapt: bool):
        eps, wd = group["eps"], group["weight_decay"]
        exp_avg, exp_avg_sq = b.state_list("exp_avg"), b.state_list("exp_avg_sq")
        scratch_c, scratch_r = self._scratch(b, 0), self._scratch(b, 1)  # CPU: kept work buffers; else None
        # Bias corrections folded as in LAMB: with denom = sqrt(v) + eps*sqrt(bc2) = sqrt(bc2)*d,
        # r = k*m/denom + wd*x, k = sqrt(bc2)/bc1 ; c = q*g~/denom + wd*x, q = sqrt(bc2); each
        # computed as scale*u by direction_plus_decay (one pass where wd > 0).
        bc1, bc2 = bias_corrections(b.steps, group["betas"], group["bias_correction"])
        k = [math.sqrt(c2) / c1 for c1, c2 in zip(bc1, bc2)]
        q = [math.sqrt(c2) for c2 in bc2]
        # CPU: g~ = coef*g is folded into the moment update and the direction (host floats: no device
        # to synchronise with); elsewhere g~ is written out and coef stays on the device.
        host_coef = grad_coef.tolist() if scratch_c is not None else None
        coef = grad_coef.to(b.grads[0].dtype)
        r_scale, c_scale = list(k), list(q)  # per tensor: r = r_scale*u_r, c = c_scale*u_c
        tiles = self._tiles(b)  # CPU: cache-sized tiles; else one tile of the whole group
        directions, squared = [], []
        for tile in tiles:  # pass 1: moments, u_r, u_c and the partial squared norms, tile by tile
            x, g = tile.views(b.x), tile.views(b.grads)
            s_c, s_r = (None, None) if scratch_c is None else (tile.views(scratch_c), tile.views(scratch_r))
            m, v = tile.views(exp_avg), tile.views(exp_avg_sq)
            if host_coef is not None:
                c_coef = tile.pick(host_coef)
                adam_moments_scaled_(m, v, g, c_coef, group["betas"])
            else:
                g = scaled_copy(g, tile_scalars(coef, tile), None)  # g~
                c_coef = [1.0] * len(g)
                foreach_adam_moments_(m, v, g, group["betas"])
            denom = foreach_folded_denominator(v, eps, tile.pick(bc2), s_r)
            u_c, c_scales = direction_plus_decay(x, g, denom, [qi * ci for qi, ci in zip(tile.pick(q), c_coef)],
                                                 wd, s_c)
            u_r, r_scales = direction_plus_decay(x, m, denom, tile.pick(k), wd, s_r)  # over denom: last
            for i, cs, rs in zip(tile.index, c_scales, r_scales):
                c_scale[i], r_scale[i] = cs, rs
            if adapt:
                squared.append(self._tile_squared_norms([x, u_r, u_c], self.foreach))  # (3, pieces)
            directions.append((u_r, u_c))
        r_per_tensor, c_per_tensor = per_tensor(r_scale, grad_coef), per_tensor(c_scale, grad_coef)
        if adapt:
            x_norm, u_r_norm, u_c_norm = self._reduced_tiled_norms(tiles, squared, b.params)  # 3 x (n,)
            r_norm, c_norm = u_r_norm * r_per_tensor, u_c_norm * c_per_tensor
        else:
            x_norm = r_norm = c_norm = torch.ones_like(grad_coef)
        scale_r, scale_c, diagnostics = self._ratios_and_scales(group, x_norm, r_norm, c_norm, adapt)
        dtype = b.x[0].dtype
        scale_r, scale_c = (scale_r * r_per_tensor).to(dtype), (scale_c * c_per_tensor).to(dtype)
        for tile, (u_r, u_c) in zip(tiles, directions):  # pass 2, tile by tile: x stays in cache
            x = tile.views(b.x)
            torch._foreach_addcmul_(x, u_r, tile_scalars(scale_r, tile))
            torch._foreach_addcmul_(x, u_c, tile_scalars(scale_c, tile))
        return diagnostics

    def _per_tensor_update(self, group, b: GroupTensors, grad_coef: Tensor, adapt: bool):
        hp = adam_hyperparameters(group, b.steps, b.x[0])  # (n, 9)
        coef = grad_coef.to(hp.dtype)  # (n,)
        x, g = self._flat(b.x), self._flat(b.grads)
        m, v = self._flat(b.state_list("exp_avg")), self._flat(b.state_list("exp_avg_sq"))
        moments, apply = self._kernel(lans_moments_kernel), self._kernel(lans_apply_kernel)
        inverse_d = self._stored_directions(b, 0)  # CPU: 1/d kept from pass 1; else None: recomputed
        squared = torch.stack([moments(x[i], g[i], m[i], v[i], hp[i], coef[i], None if inverse_d is None else inverse_d[i])
                               for i in range(len(x))])  # (n, 3)
        if adapt:
            x_norm, r_norm, c_norm = self._reduced_kernel_norms(squared, b.params)  # 3 x (n,)
        else:
            x_norm = r_norm = c_norm = torch.ones_like(coef)
        scale_r, scale_c, diagnostics = self._ratios_and_scales(group, x_norm, r_norm, c_norm, adapt)
        for i in range(len(x)):
            apply(x[i], g[i], m[i], v[i], hp[i], coef[i], scale_r[i], scale_c[i],
                  None if inverse_d is None else inverse_d[i])
        return diagnostics
