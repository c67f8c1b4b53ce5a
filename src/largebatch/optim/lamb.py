"""LAMB -- You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
Algorithm 2 (LAMB) with phi = identity; the formula as written in PAPERS.md §1 (LAMB):

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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .core import (HP_EPS, HP_INV_BC1, HP_INV_BC2, HP_WD, GroupTensors, LayerwiseOptimizer, adam_hyperparameters,
                   adam_moments, add_scaled_, bias_corrections, direction_plus_decay, divide_into,
                   foreach_adam_moments_,
                   foreach_folded_denominator, per_tensor, scaled_copy, tile_scalars)

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


def lamb_direction(x: Tensor, m: Tensor, v: Tensor, hp: Tensor, l2_decay: bool) -> Tensor:
    """r = m^/(sqrt(v^) + eps) (+ wd*x when decay is decoupled). All 1-D, hp: (9,)."""
    r = (m * hp[HP_INV_BC1]) / ((v * hp[HP_INV_BC2]).sqrt() + hp[HP_EPS])
    return r if l2_decay else r + hp[HP_WD] * x


def lamb_moments_kernel(x: Tensor, g: Tensor, m: Tensor, v: Tensor, hp: Tensor, grad_scale: Tensor | None,
                        l2_decay: bool, out: Tensor | None = None) -> Tensor:
    """Pass 1 for one tensor: update m, v in place; return [||x||^2, ||r||^2] (2,). With ``out``, r is
    also written there, for pass 2 to read instead of recomputing (see LayerwiseOptimizer._stored_directions)."""
    if grad_scale is not None:
        g = g * grad_scale
    if l2_decay:
        g = g + hp[HP_WD] * x
    m_new, v_new = adam_moments(m, v, g, hp)
    r = lamb_direction(x, m_new, v_new, hp, l2_decay)
    m.copy_(m_new)
    v.copy_(v_new)
    if out is not None:
        out.copy_(r)
    return torch.stack([x.square().sum(), r.square().sum()])


def lamb_apply_kernel(x: Tensor, m: Tensor, v: Tensor, hp: Tensor, step_scale: Tensor, l2_decay: bool) -> None:
    """Pass 2 for one tensor: x += step_scale * r, r recomputed from m and v, with step_scale = -lr *
    trust_ratio (0-d). (Where pass 1 stored r, pass 2 is a plain x.addcmul_(r, step_scale).)"""
    x.copy_(x + lamb_direction(x, m, v, hp, l2_decay) * step_scale)


class LAMB(LayerwiseOptimizer):
    """LAMB (You et al. 2019, Alg. 2). See the module docstring for the switches and PRESETS.

    Per group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adapt`` (trust ratio on/off) and the
    switches; edits to ``param_groups`` apply at the next step. ``foreach`` (default) / per-tensor /
    ``fused=True`` (torch.compile) paths compute the same update.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, adapt: bool = True, bias_correction: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, weight_norm_clip: float | None = None, l2_decay: bool = False,
                 foreach: bool | None = None, fused: bool = False, track_trust_ratios: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt,
                        bias_correction=bias_correction, skip_adapt_if_no_decay=skip_adapt_if_no_decay,
                        trust_clip=trust_clip, weight_norm_clip=weight_norm_clip, l2_decay=l2_decay)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios)

    @classmethod
    def from_preset(cls, name: str, params, **kwargs) -> "LAMB":
        """``LAMB(params, **PRESETS[name], **kwargs)``; names: apex, timm, torch_optimizer."""
        if name not in PRESETS:
            raise ValueError(f"preset={name!r}: unknown; choose one of {sorted(PRESETS)}")
        return cls(params, **{**PRESETS[name], **kwargs})

    def _update_group(self, group: dict, batch: GroupTensors, grad_scale: Tensor | None):
        update = self._foreach_update if self.foreach else self._per_tensor_update
        return update(group, batch, grad_scale, self._adapts(group))

    def _foreach_update(self, group, b: GroupTensors, grad_scale, adapt):
        lr, eps, wd, l2_decay = group["lr"], group["eps"], group["weight_decay"], group["l2_decay"]
        exp_avg, exp_avg_sq = b.state_list("exp_avg"), b.state_list("exp_avg_sq")
        scratch = self._scratch(b, 0)  # CPU: one kept work buffer per tensor; else None
        # Bias corrections folded into per-tensor scalars (saves two passes): with
        # denom = sqrt(v) + eps*sqrt(bc2), r = k*m/denom + wd*x, k = sqrt(bc2)/bc1, computed as
        # r = scale*u by direction_plus_decay (u = x + (k/wd)*m/denom, scale = wd: one pass).
        bc1, bc2 = bias_corrections(b.steps, group["betas"], group["bias_correction"])
        k = [math.sqrt(c2) / c1 for c1, c2 in zip(bc1, bc2)]
        r_scale = list(k)  # per tensor: r = r_scale * u
        tiles = self._tiles(b)  # CPU: cache-sized tiles; else one tile of the whole group
        directions, squared = [], []
        for tile in tiles:  # pass 1: moments, u and the partial squared norms, tile by tile
            x, s = tile.views(b.x), None if scratch is None else tile.views(scratch)
            grads = tile.views(b.grads)
            if grad_scale is not None or (l2_decay and wd != 0):
                grads = scaled_copy(grads, 1.0 if grad_scale is None else grad_scale, s)
                if l2_decay and wd != 0:
                    torch._foreach_add_(grads, x, alpha=wd)
            m = tile.views(exp_avg)
            foreach_adam_moments_(m, tile.views(exp_avg_sq), grads, group["betas"])
            denom = foreach_folded_denominator(tile.views(exp_avg_sq), eps, tile.pick(bc2), s)
            if l2_decay:  # the decay is already in g: r = k*m/denom
                u = divide_into(m, denom, s)
            else:
                u, scales = direction_plus_decay(x, m, denom, tile.pick(k), wd, s)
                for i, scale in zip(tile.index, scales):
                    r_scale[i] = scale
            if not adapt:
                add_scaled_(x, u, [-lr * r_scale[i] for i in tile.index])
                continue
            squared.append(self._tile_squared_norms([x, u], self.foreach))  # (2, pieces)
            directions.append(u)
        if not adapt:
            return None
        x_norm, u_norm = self._reduced_tiled_norms(tiles, squared, b.params)  # (n,), (n,)
        scale = per_tensor(r_scale, u_norm)  # float, or (n,) when it differs within the group
        ratio, pinned = self._group_trust_ratio(group, x_norm, u_norm * scale)
        step_scale = (ratio * (-lr) * scale).to(b.x[0].dtype)  # (n,)
        for tile, u in zip(tiles, directions):  # pass 2: x += step_scale * u
            torch._foreach_addcmul_(tile.views(b.x), u, tile_scalars(step_scale, tile))
        return ratio, pinned

    def _per_tensor_update(self, group, b: GroupTensors, grad_scale, adapt):
        lr, l2_decay = group["lr"], group["l2_decay"]
        hp = adam_hyperparameters(group, b.steps, b.x[0])  # (n, 9)
        x, g = self._flat(b.x), self._flat(b.grads)
        m, v = self._flat(b.state_list("exp_avg")), self._flat(b.state_list("exp_avg_sq"))
        moments, apply = self._kernel(lamb_moments_kernel), self._kernel(lamb_apply_kernel)
        r = self._stored_directions(b, 0)  # CPU: r kept from pass 1 (see there); else None: recomputed
        squared = torch.stack([moments(x[i], g[i], m[i], v[i], hp[i], grad_scale, l2_decay,
                                       None if r is None else r[i])
                               for i in range(len(x))])  # (n, 2)
        if adapt:
            x_norm, r_norm = self._reduced_kernel_norms(squared, b.params)  # (n,), (n,)
            ratio, pinned = self._group_trust_ratio(group, x_norm, r_norm)
        else:
            ratio, pinned = torch.ones_like(squared[:, 0]), None
        step_scale = ratio * (-lr)  # (n,)
        for i in range(len(x)):
            if r is None:
                apply(x[i], m[i], v[i], hp[i], step_scale[i], l2_decay)
            else:  # as fast as a compiled kernel: one memory-bound pass
                x[i].addcmul_(r[i], step_scale[i])
        return None if pinned is None else (ratio, pinned)
