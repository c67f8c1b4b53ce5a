"""LARS -- You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks", Algorithm 1
(SGD with momentum and a layer-wise local LR); the formula as written in PAPERS.md §1 (LARS):

    local = tc*||x|| / (||g|| + wd*||x|| + eps)      (1 when ||x|| = 0 or ||g|| = 0)
    buf = m*buf + lr*local*(g + wd*x) ;  x = x - buf

Paper trust coefficient tc = 0.001. Off-by-default switches shared with LAMB: ``max_grad_norm``
(global pre-clipping), ``skip_adapt_if_no_decay`` (local = 1 for weight_decay = 0 groups, the usual
"exclude biases and norms"), ``trust_clip`` (clamp local from above, as NVIDIA's LARC clip mode at 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core import GroupTensors, LayerwiseOptimizer, device_tensor, scaled_copy

_MOMENTUM, _WD = range(2)  # columns of the (n, 2) hyperparameter tensor of the per-tensor kernels


def lars_norms_kernel(x: Tensor, g: Tensor) -> Tensor:
    """Pass 1 for one tensor: [||x||^2, ||g||^2] (2,) in one read of each."""
    return torch.stack([x.square().sum(), g.square().sum()])


def lars_apply_kernel(x: Tensor, g: Tensor, buf: Tensor, hp: Tensor, grad_scale: Tensor | None,
                      step_scale: Tensor) -> None:
    """Pass 2 for one tensor: buf = m*buf + step_scale*(g + wd*x) ; x -= buf (step_scale = lr*local)."""
    if grad_scale is not None:
        g = g * grad_scale
    buf.mul_(hp[_MOMENTUM]).add_((g + hp[_WD] * x) * step_scale)
    x.sub_(buf)


class LARS(LayerwiseOptimizer):
    """LARS (You et al. 2017, Alg. 1). ``lr`` has no default: LARS learning rates are model-specific.

    Per group: ``lr``, ``momentum``, ``weight_decay``, ``trust_coefficient``, ``eps``, ``adapt`` and the
    switches; paths as in LAMB (foreach default, per-tensor, fused=True)."""

    _state_keys = ("momentum_buffer",)

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, *, adapt: bool = True,
                 max_grad_norm: float | None = None, skip_adapt_if_no_decay: bool = False,
                 trust_clip: float | None = None, foreach: bool | None = None, fused: bool = False,
                 track_trust_ratios: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, adapt=adapt, skip_adapt_if_no_decay=skip_adapt_if_no_decay, trust_clip=trust_clip)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, foreach=foreach, fused=fused,
                         track_trust_ratios=track_trust_ratios)

    def _check_group(self, group: dict, where: str) -> None:
        super()._check_group(group, where)
        tc = group["trust_coefficient"]
        if not isinstance(tc, (int, float)) or not tc > 0:
            raise ValueError(f"{where}trust_coefficient={tc!r}: must be > 0 (the paper uses 0.001)")

    def _local_lr(self, group: dict, x_norm: Tensor, g_norm: Tensor) -> tuple[Tensor, Tensor]:
        """local (n,) and pinned (n,): tc*||x|| / (||g|| + wd*||x|| + eps), 1 on a zero norm."""
        denominator = torch.where(g_norm > 0, g_norm + group["weight_decay"] * x_norm + group["eps"],
                                  torch.zeros_like(g_norm))
        return self._group_trust_ratio(group, group["trust_coefficient"] * x_norm, denominator)

    def _update_group(self, group: dict, b: GroupTensors, grad_scale: Tensor | None):
        lr, adapt = group["lr"], self._adapts(group)
        diagnostics = None
        if adapt:
            if self.foreach:
                x_norm, g_norm = self._reduced_norms([b.x, b.grads], b.params)  # (n,), (n,)
            else:
                kernel = self._kernel(lars_norms_kernel)
                squared = torch.stack([kernel(x, g) for x, g in zip(self._flat(b.x), self._flat(b.grads))])  # (n, 2)
                x_norm, g_norm = self._reduced_kernel_norms(squared, b.params)
            if grad_scale is not None:
                g_norm = g_norm * grad_scale
            local, pinned = self._local_lr(group, x_norm, g_norm)
            diagnostics = local, pinned
            step_scale = local * lr  # (n,)
        else:
            step_scale = torch.full((len(b.x),), float(lr), dtype=b.x[0].dtype, device=b.x[0].device)
        if self.foreach:
            self._foreach_apply(group, b, grad_scale, step_scale)
        else:
            hp = device_tensor([[group["momentum"], group["weight_decay"]]] * len(b.x), b.x[0])  # (n, 2)
            apply = self._kernel(lars_apply_kernel)
            x, g, buf = self._flat(b.x), self._flat(b.grads), self._flat(b.state_list("momentum_buffer"))
            step_scale = step_scale.to(hp.dtype)
            for i in range(len(x)):
                apply(x[i], g[i], buf[i], hp[i], grad_scale, step_scale[i])
        return diagnostics

    def _foreach_apply(self, group: dict, b: GroupTensors, grad_scale: Tensor | None, step_scale: Tensor) -> None:
        wd, direction = group["weight_decay"], b.grads  # direction = g (+ wd*x); p.grad is never modified
        if grad_scale is not None or wd != 0:
            direction = scaled_copy(b.grads, 1.0 if grad_scale is None else grad_scale, self._scratch(b, 0))
            if wd != 0:
                torch._foreach_add_(direction, b.x, alpha=wd)
        buffers = b.state_list("momentum_buffer")
        torch._foreach_mul_(buffers, group["momentum"])
        torch._foreach_addcmul_(buffers, direction, list(step_scale.to(b.x[0].dtype).unbind()))
        torch._foreach_sub_(b.x, buffers)
