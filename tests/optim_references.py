"""Independent float64 references for tests/test_optim*.py, written from the formulas of
docs/papers.md: optimizers (one tensor at a time, plain loops, no code shared with largebatch.optim).

Each reference takes the initial tensors and a list of steps; a step is a list of gradients, one per
tensor, where None means "no gradient this step" (the tensor is skipped and its step count t does
not advance). Returns the float64 tensors after the last step.
"""

from __future__ import annotations

import math

import torch


def _global_clip_factor(grads, max_grad_norm):
    """Divide every gradient by max(||g||_global / max_grad_norm, 1)."""
    if max_grad_norm is None:
        return 1.0
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return max(total / max_grad_norm, 1.0)


def _ratio(numerator: float, denominator: float, numerator_clip=None, ratio_clip=None) -> float:
    if numerator == 0.0 or denominator == 0.0:
        return 1.0
    if numerator_clip is not None:
        numerator = min(numerator, numerator_clip)
    ratio = numerator / denominator
    return ratio if ratio_clip is None else min(ratio, ratio_clip)


def lamb_reference(params, steps, *, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adapt=True,
                   bias_correction=True, max_grad_norm=None, skip_adapt_if_no_decay=False, trust_clip=None,
                   weight_norm_clip=None, l2_decay=False):
    """LAMB, You et al. 2019 Alg. 2 (docs/papers.md: optimizers) plus each documented switch. ``lr`` may be a list
    (one learning rate per step)."""
    b1, b2 = betas
    x = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    t = [0] * len(x)
    adapted = adapt and not (skip_adapt_if_no_decay and weight_decay == 0)
    for k, grads in enumerate(steps):
        lr_k = lr[k] if isinstance(lr, list) else lr
        clip = _global_clip_factor(grads, max_grad_norm)
        for i, g in enumerate(grads):
            if g is None:
                continue
            t[i] += 1
            g = g.double() / clip
            if l2_decay:
                g = g + weight_decay * x[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t[i]) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2 ** t[i]) if bias_correction else v[i]
            r = m_hat / (v_hat.sqrt() + eps)
            if not l2_decay:
                r = r + weight_decay * x[i]
            ratio = _ratio(float(x[i].norm()), float(r.norm()), weight_norm_clip, trust_clip) if adapted else 1.0
            x[i] = x[i] - lr_k * ratio * r
    return x


def lans_reference(params, steps, *, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adapt=True,
                   bias_correction=True, max_grad_norm=None):
    """LANS, Zheng et al. 2020 Alg. 2 (docs/papers.md: optimizers); ``max_grad_norm``: the gradients
    first divided by the global clip factor, as LAMB's."""
    b1, b2 = betas
    x = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    t = [0] * len(x)
    for grads in steps:
        clip = _global_clip_factor(grads, max_grad_norm)
        for i, g in enumerate(grads):
            if g is None:
                continue
            t[i] += 1
            g = g.double() / clip
            g_norm = float(g.norm())
            g_tilde = g / (g_norm + eps) if g_norm > 0 else g
            m[i] = b1 * m[i] + (1 - b1) * g_tilde
            v[i] = b2 * v[i] + (1 - b2) * g_tilde * g_tilde
            c1 = 1 - b1 ** t[i] if bias_correction else 1.0
            c2 = 1 - b2 ** t[i] if bias_correction else 1.0
            d = (v[i] / c2).sqrt() + eps
            r = (m[i] / c1) / d + weight_decay * x[i]
            c = g_tilde / d + weight_decay * x[i]
            x_norm = float(x[i].norm())
            ratio_r = _ratio(x_norm, float(r.norm())) if adapt else 1.0
            ratio_c = _ratio(x_norm, float(c.norm())) if adapt else 1.0
            x[i] = x[i] - lr * (b1 * ratio_r * r + (1 - b1) * ratio_c * c)
    return x


def lars_reference(params, steps, *, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8,
                   adapt=True, max_grad_norm=None):
    """LARS, You, Gitman, Ginsburg 2017 Alg. 1 (docs/papers.md: optimizers). ``lr``: one value, or
    one per step (a list); ``max_grad_norm``: the gradients first divided by the global clip factor."""
    x = [p.detach().double().clone() for p in params]
    buf = [torch.zeros_like(t) for t in x]
    for k, grads in enumerate(steps):
        lr_k = lr[k] if isinstance(lr, list) else lr
        clip = _global_clip_factor(grads, max_grad_norm)
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.double() / clip
            x_norm, g_norm = float(x[i].norm()), float(g.norm())
            if not adapt or x_norm == 0.0 or g_norm == 0.0:
                local = 1.0
            else:
                local = trust_coefficient * x_norm / (g_norm + weight_decay * x_norm + eps)
            buf[i] = momentum * buf[i] + lr_k * local * (g + weight_decay * x[i])
            x[i] = x[i] - buf[i]
    return x


def random_problem(seed: int = 0, n_steps: int = 4):
    """Tensors of several ranks (one all-zero), gradients per step including an all-zero gradient
    and a step where one tensor has no gradient at all."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (7,), (3, 2, 4), (1,), (4, 4)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    params[1].zero_()  # ||x|| = 0: ratio pinned to 1
    steps = []
    for k in range(n_steps):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if k == 1:
            grads[2] = torch.zeros(shapes[2])  # zero-gradient step for one tensor
        if k == 2:
            grads[4] = None  # no gradient: the tensor's step count must not advance
        steps.append(grads)
    return params, steps


def run_optimizer(make_optimizer, params, steps, dtype=torch.float32):
    """Apply ``make_optimizer(list_of_parameters)`` to the problem; return the final tensors."""
    live = [torch.nn.Parameter(p.clone().to(dtype)) for p in params]
    optimizer = make_optimizer(live)
    for grads in steps:
        for p, g in zip(live, grads):
            p.grad = None if g is None else g.clone().to(dtype)
        optimizer.step()
    return [p.detach() for p in live], optimizer
