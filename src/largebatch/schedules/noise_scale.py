"""The gradient noise scale B_simple from squared gradient norms at two batch sizes.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A.1 (docs/papers.md: schedules
"Critical batch size"). With G the true gradient and Sigma the per-sample gradient covariance,
B_simple = tr(Sigma) / |G|^2 is the batch size beyond which a larger batch stops paying for itself.
A batch mean of B per-sample gradients has E|G_B|^2 = |G|^2 + tr(Sigma) / B, so two batch sizes
B_small < B_big give unbiased estimates

    |G|^2     ~ (B_big * |G_big|^2 - B_small * |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and B_simple ~ EMA(tr Sigma) / EMA(|G|^2), numerator and denominator smoothed separately because
the ratio of two unbiased estimates is not unbiased. In a training loop the two batch sizes come
for free: one micro-batch vs the accumulated step, or one rank's gradient vs the all-reduced one
(average the small norms over micro-batches or ranks first: it lowers the variance, not the mean).
Batch sizes are in sequences, so B_simple is too.
"""

from __future__ import annotations

import math
import numbers

from largebatch.schedules.lr import as_real, check_number


def _as_float(value, name: str) -> float:
    value = as_real(value, name)  # accepts 0-d tensors; a string is a TypeError naming it
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite squared norm >= 0")
    return value


class NoiseScale:
    """Running estimate of B_simple; ``ema_decay`` in [0, 1) smooths each half separately."""

    def __init__(self, ema_decay: float = 0.95):
        check_number(ema_decay, "ema_decay")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay={ema_decay!r} must lie in [0, 1) (0 = no smoothing)")
        self.ema_decay = ema_decay
        self.ema_trace_covariance = 0.0  # EMA of tr(Sigma) estimates
        self.ema_grad_sq_norm = 0.0  # EMA of |G|^2 estimates
        self.updates = 0

    def update(self, small_sq_norm, small_batch: int, big_sq_norm, big_batch: int) -> float | None:
        """Feed |G_small|^2 at ``small_batch`` and |G_big|^2 at ``big_batch``; return b_simple."""
        small_sq = _as_float(small_sq_norm, "small_sq_norm")
        big_sq = _as_float(big_sq_norm, "big_sq_norm")
        for name, value in (("small_batch", small_batch), ("big_batch", big_batch)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}={value!r} must be a whole number of samples (sequences)")
        if not 0 < small_batch < big_batch:
            raise ValueError(f"small_batch={small_batch!r} and big_batch={big_batch!r} need "
                             "0 < small_batch < big_batch (e.g. one micro-batch vs the whole step)")
        grad_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
        trace = (small_sq - big_sq) / (1 / small_batch - 1 / big_batch)
        decay = self.ema_decay
        self.ema_grad_sq_norm = decay * self.ema_grad_sq_norm + (1 - decay) * grad_sq
        self.ema_trace_covariance = decay * self.ema_trace_covariance + (1 - decay) * trace
        self.updates += 1
        return self.b_simple

    def _debiased(self, ema: float) -> float | None:
        # the EMA starts at 0: divide by (1 - decay^n) as Adam does (cancels in b_simple)
        return ema / (1 - self.ema_decay**self.updates) if self.updates else None

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed estimate of |G|^2 (None before the first update)."""
        return self._debiased(self.ema_grad_sq_norm)

    @property
    def trace_covariance(self) -> float | None:
        """Smoothed estimate of tr(Sigma) (None before the first update)."""
        return self._debiased(self.ema_trace_covariance)

    @property
    def b_simple(self) -> float | None:
        """tr(Sigma) / |G|^2, or None until both smoothed halves are positive."""
        if not self.updates or self.ema_grad_sq_norm <= 0 or self.ema_trace_covariance <= 0:
            return None
        return self.ema_trace_covariance / self.ema_grad_sq_norm

    def state_dict(self) -> dict:
        return {"ema_decay": self.ema_decay, "ema_trace_covariance": self.ema_trace_covariance,
                "ema_grad_sq_norm": self.ema_grad_sq_norm, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        keys = ("ema_decay", "ema_trace_covariance", "ema_grad_sq_norm", "updates")
        missing = [key for key in keys if key not in state] if isinstance(state, dict) else list(keys)
        if missing:
            raise ValueError(f"noise-scale state={state!r} lacks {', '.join(missing)}: it is not a "
                             "NoiseScale.state_dict(); load the one saved with the checkpoint")
        if state["ema_decay"] != self.ema_decay:
            raise ValueError(f"checkpoint has ema_decay={state['ema_decay']!r} but this NoiseScale "
                             f"has ema_decay={self.ema_decay!r}; build it with the saved value")
        self.ema_trace_covariance = float(state["ema_trace_covariance"])
        self.ema_grad_sq_norm = float(state["ema_grad_sq_norm"])
        self.updates = int(state["updates"])
