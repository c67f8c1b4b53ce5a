"""Seesaw and its relatives: trade LR decay for batch growth at the base schedule's milestones.

Meterez et al. 2025, "Seesaw: Accelerating Training by Balancing Learning Rate and Batch Size
Scheduling" (docs/papers.md: schedules). Take a base schedule with warmup and decay from ``peak`` to ``final``
and a ratio r in (0, 1). Milestone k (k = 1 .. k_max, k_max = floor(log(final / peak) / log r)) is
the first token count after warmup at which the base LR reaches ``peak * r**k``; a ratio giving no
milestone (r <= final / peak) or more than ``MAX_MILESTONES`` (r near 1) is refused. Seesaw replaces
the base decay by steps: at each milestone the LR is multiplied by sqrt(r) and the batch by 1/r;
both are constant between milestones and warmup is unchanged. For Adam-type optimizers the pair
(LR * sqrt(r), batch / r) is equivalent to the base's (LR * r, batch), so the loss follows the
base schedule's while the larger batches need fewer optimizer steps (61.55% of cosine's for 10%
warmup, final = 0.1 * peak, r = 1/1.1).

The general family: at each milestone batch * beta and LR / alpha with alpha * sqrt(beta) = 1/r
and alpha >= sqrt(beta) (Seesaw is the boundary alpha = sqrt(beta); beta = 1 is the base
schedule's step version). Smith et al. 2017, "Don't Decay the Learning Rate, Increase the Batch
Size": batch / r and LR unchanged, the SGD rule (LR / batch constant). It is not in the family
(alpha = 1, beta = 1/r gives alpha * sqrt(beta) = r**-0.5, not 1/r): for Adam-type optimizers the
effective LR falls by sqrt(r) per milestone where the base's falls by r.

All of them are realised here by one rule. With B_k the batch actually used after milestone k
(the ideal ``B_0 * beta**k``, held at ``max_batch_size``, at ``noise_scale_multiple * B_simple``
when an adaptive cap is set, rounded down to a multiple of ``micro_batch * dp_size`` and never
shrinking), the LR is

    lr_k = peak * r**k * (B_k / B_0) ** p          p = 1/2 (Seesaw, family), p = 1 (Smith)

which is exactly the paper's LR when B_k is the ideal batch, and hands the LR whatever share of
the factor r the batch could not take when the batch is held -- at the cap, the LR falls by the
whole r (docs/papers.md: schedules: "beyond a cap the batch must stop growing and the LR take the whole factor
r"). Granularity: with r = 1/1.1, a batch of 16 in micro-batches of 16 cannot grow before the 8th
milestone: the LR decays like the base's steps meanwhile, and rises (by sqrt(2) * r) when the batch
jumps 16 -> 32; the effective LR, lr * sqrt(B_0 / B), still falls by exactly r per milestone.
``phases()`` reports the realised schedule; keep the micro-batch small next to the batch.

Adaptive Seesaw: ``observe_noise_scale(tokens, b_simple)`` records ``noise_scale_multiple *
b_simple`` (McCandlish et al. 2018, see ``noise_scale.py``) as the cap for every milestone after
``tokens``; earlier milestones keep the cap they were realised with, so the schedule stays a
pure function of (tokens, recorded observations) and resumes exactly from ``state_dict()``.
"""

from __future__ import annotations

import bisect
import math

from largebatch.schedules.batch import JointSchedule, check_batch_size, round_down_to_multiple
from largebatch.schedules.lr import Constant, LRSchedule, WarmupHoldPolynomial, as_real, check_number, check_tokens


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """Return ``ratio`` if it lies in (0, 1), else raise naming it."""
    check_number(ratio, name)
    if not 0 < ratio < 1:
        raise ValueError(f"{name}={ratio!r} must lie in (0, 1): it is the factor by which the base "
                         "LR falls between milestones (the paper uses 1/2 and 1/1.1)")
    return ratio


MAX_MILESTONES = 1000
"""The most milestones a schedule may have: k_max = floor(log(final_lr) / log(ratio)) grows without
bound as the ratio nears 1 (r = 0.999 at final_lr 0.1: 2,301; r = 1/1.0001: 23,027), each one a row of
the phase table and a batch change a few steps apart."""


def largest_ratio(final_lr: float) -> float:
    """The largest ratio that keeps k_max within ``MAX_MILESTONES`` at this ``final_lr`` (a fraction
    of peak_lr), rounded down to 6 decimals so that the number printed is itself allowed."""
    return math.floor(final_lr ** (1 / MAX_MILESTONES) * 1e6) / 1e6


def check_base(base: LRSchedule) -> None:
    """Refuse a base schedule on which no milestone can be placed, naming the cause and a fix that works
    for it: milestones are where its LR has fallen by the ratio again, down to its LR at the end of its
    budget, so it needs a budget and an end LR strictly between 0 and its peak."""
    kind = type(base).__name__
    decaying = "Cosine, LinearDecay or WSD with final_lr in (0, 1), e.g. 0.1, or InverseSqrt with total_tokens"
    if isinstance(base, Constant):
        raise ValueError(f"base {kind}: its LR never falls, so there is no milestone to place (whatever its "
                         f"final_lr); use a base that decays: {decaying}")
    if base.total_tokens is None:
        raise ValueError(f"base {kind} has total_tokens=None: milestones are placed down to its LR at the end "
                         "of a token budget, and it has none; give it total_tokens (the run's budget)")
    if isinstance(base, WarmupHoldPolynomial):
        raise ValueError(f"base {kind} (LANS) decays to 0 and takes no other final_lr: milestones are placed "
                         f"down to the base's end LR, so they would never end; use a base that ends above 0: "
                         f"{decaying}")
    if base.end_lr <= 0:
        raise ValueError(
            f"base {kind} has final_lr={base.final_lr}: it ends at LR 0, and k_max = floor(log(final_lr) / "
            "log(ratio)) milestones would never end (final_lr is a fraction of peak_lr); set final_lr > 0, "
            "e.g. 0.1")
    if base.end_lr >= base.peak_lr:
        raise ValueError(
            f"base {kind} has final_lr={base.final_lr}: it ends at its peak LR and never falls, so there is "
            "no milestone to place; set final_lr below 1, e.g. 0.1")


def find_milestones(base: LRSchedule, ratio: float, name: str = "ratio") -> list[int]:
    """Token counts at which ``base`` first reaches ``peak * ratio**k`` after warmup (k >= 1).

    Refuses (naming the ratio as ``name``) a ratio that gives more than ``MAX_MILESTONES``
    milestones -- counted from k_max before any is searched for -- and one that gives none (below
    final_lr, or a base LR that never falls that far before the end of its budget): such a
    schedule would be the base schedule under another name."""
    check_ratio(ratio, name)
    check_base(base)
    final = base.end_lr / base.peak_lr
    allowed = f"use {name} in ({final:g}, {largest_ratio(final):g}] for final_lr={final:g}"
    k_max = math.floor(math.log(final) / math.log(ratio) + 1e-9)
    if k_max >= 1 and ratio**k_max <= final * (1 + 1e-9):
        # peak * ratio**k_max is the base's end LR itself: it is reached at the budget's last token,
        # a milestone of no length, at any budget (found only where the base's end is steep enough:
        # a cosine over 1e10 tokens reached it 1,909 tokens early, and that milestone was kept)
        k_max -= 1
    if k_max > MAX_MILESTONES:
        raise ValueError(
            f"{name}={ratio!r} gives {k_max:,} milestones (floor(log(final_lr={final:g}) / "
            f"log({name}))), more than the {MAX_MILESTONES:,} allowed: the batch would change every "
            f"few steps; {allowed} (the paper uses 1/2 and 1/1.1)")
    if k_max < 1:
        raise ValueError(
            f"{name}={ratio!r} is at or below final_lr={final:g}: the base LR falls to peak_lr * "
            f"{name} at the end of its budget or never, so there would be no milestone and the schedule "
            f"would be the base's; {allowed} "
            "(the paper uses 1/2 and 1/1.1)")
    milestones, lo = [], base.warmup_tokens
    for k in range(1, k_max + 1):
        target = base.peak_lr * ratio**k * (1 + 1e-12)
        hi = base.total_tokens
        if base(hi) > target:
            break
        while hi - lo > 1:  # bisection for the first token with base(t) <= target
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if base(mid) <= target else (mid, hi)
        if hi >= base.total_tokens:
            break  # reached only at the end of the budget: a phase of zero length
        milestones.append(hi)
    if not milestones:
        raise ValueError(
            f"{name}={ratio!r}: the base LR ({type(base).__name__}, final_lr={final:g}) does not fall "
            f"to peak_lr * {name} before the end of its budget, so there would be no milestone and "
            f"the schedule would be the base's; {allowed}, on a base that decays")
    return milestones


class MilestoneSchedule(JointSchedule):
    """The shared machinery of Seesaw, its (alpha, beta) family and Smith's ramp (see module doc):
    after milestone k the batch is B_k and the LR is ``peak * ratio**k * (B_k / B_0) ** p``."""

    def __init__(self, base: LRSchedule, batch_size: int, ratio: float, batch_growth: float,
                 lr_batch_exponent: float, max_batch_size: int | None = None,
                 micro_batch: int = 1, dp_size: int = 1,
                 noise_scale_multiple: float | None = None, ratio_name: str = "ratio"):
        if not isinstance(base, LRSchedule):
            raise TypeError(f"base={base!r} must be an LR schedule (Cosine(...), WSD(...)): the milestones "
                            "are where its LR falls by the ratio")
        self.lr_schedule, self.micro_batch, self.dp_size = base, micro_batch, dp_size
        self.milestones = find_milestones(base, ratio, ratio_name)
        self.total_tokens = int(base.total_tokens)
        self.start_batch = check_batch_size(batch_size, micro_batch, dp_size)
        if max_batch_size is not None:
            check_batch_size(max_batch_size, micro_batch, dp_size, name="max_batch_size")
            if max_batch_size < batch_size:
                raise ValueError(f"max_batch_size={max_batch_size} is below batch_size="
                                 f"{batch_size}; raise it or leave it unset")
        if noise_scale_multiple is not None:
            check_number(noise_scale_multiple, "noise_scale_multiple")
        if noise_scale_multiple is not None and not (noise_scale_multiple > 0 and math.isfinite(noise_scale_multiple)):
            raise ValueError(f"noise_scale_multiple={noise_scale_multiple!r} must be > 0 and finite "
                             "(the batch is capped at this multiple of B_simple) or None")
        self.ratio, self.batch_growth = ratio, batch_growth
        self.lr_batch_exponent = lr_batch_exponent
        self.max_batch_size, self.noise_scale_multiple = max_batch_size, noise_scale_multiple
        self.noise_cap_log: list[tuple[int, float]] = []  # (from tokens, cap in sequences)
        self._realise()

    # -- the realised schedule -------------------------------------------------------------
    def _cap_at(self, tokens: int) -> float | None:
        """The cap of the newest observation made before ``tokens`` (one made at a milestone's own
        token came from the step that already ran with that milestone's batch)."""
        i = bisect.bisect_left([t for t, _ in self.noise_cap_log], tokens)
        return self.noise_cap_log[i - 1][1] if i else None

    def ideal_batch(self, k: int) -> float:
        """The batch after milestone k before caps and rounding: ``B_0 * batch_growth**k``."""
        return self.start_batch * self.batch_growth**k

    def _realise(self) -> None:
        granularity = self.micro_batch * self.dp_size
        self.batches, self.lrs = [self.start_batch], [self.lr_schedule.peak_lr]
        for k, tokens in enumerate(self.milestones, start=1):
            limit = self.ideal_batch(k)
            for cap in (self.max_batch_size, self._cap_at(tokens)):
                limit = limit if cap is None else min(limit, cap)
            batch = max(self.batches[-1], round_down_to_multiple(limit, granularity))
            self.batches.append(batch)
            coupling = (batch / self.start_batch) ** self.lr_batch_exponent
            self.lrs.append(self.lr_schedule.peak_lr * self.ratio**k * coupling)

    def _milestones_passed(self, tokens: float) -> int:
        return bisect.bisect_right(self.milestones, check_tokens(tokens))

    def lr(self, tokens: float) -> float:
        if check_tokens(tokens) < self.lr_schedule.warmup_tokens:
            return self.lr_schedule(tokens)  # warmup unchanged
        return self.lrs[self._milestones_passed(tokens)]

    def batch_size(self, tokens: float) -> int:
        return self.batches[self._milestones_passed(tokens)]

    def breakpoints(self) -> list[int]:
        return sorted(set(self.lr_schedule.breakpoints() + self.milestones))

    def _phase_label(self, start_tokens: int) -> str:
        if start_tokens < self.lr_schedule.warmup_tokens:
            return "warmup"
        k = self._milestones_passed(start_tokens)
        if k == 0:
            return "peak"
        held = " (batch held)" if self.batches[k] == self.batches[k - 1] else ""
        return f"milestone {k}{held}"

    # -- adaptive cap from the gradient noise scale ------------------------------------------
    @property
    def uses_noise_scale(self) -> bool:
        return self.noise_scale_multiple is not None

    def observe_noise_scale(self, tokens: int, b_simple: float | None) -> None:
        """Cap the batch at ``noise_scale_multiple * b_simple`` (sequences) for every milestone
        after ``tokens``: a step that started at ``tokens`` ran with the batch there, milestone
        included, and a batch never changes under a step that used it. ``b_simple=None`` (no
        estimate yet) is ignored."""
        if self.noise_scale_multiple is None:
            raise ValueError("observe_noise_scale needs a schedule built with "
                             "noise_scale_multiple (e.g. 1.0 caps the batch at B_simple)")
        check_tokens(tokens)
        if b_simple is None:
            return
        if not (math.isfinite(as_real(b_simple, "b_simple")) and b_simple > 0):
            raise ValueError(f"b_simple={b_simple!r} must be a positive finite number of sequences")
        log, cap = self.noise_cap_log, self.noise_scale_multiple * float(b_simple)
        if log and tokens < log[-1][0]:
            raise ValueError(f"tokens={tokens} is before the last observation at {log[-1][0]}; "
                             "observations must follow the token clock")
        # an entry that no milestone has read yet is superseded: the log stays <= k_max + 1 long
        if log and not any(log[-1][0] < m <= tokens for m in self.milestones):
            log[-1] = (int(tokens), cap)
        else:
            log.append((int(tokens), cap))
        self._realise()

    # -- checkpointing -----------------------------------------------------------------------
    def _config(self) -> dict:
        return {"lr_schedule": self.lr_schedule.state_dict(), "batch_size": self.start_batch,
                "ratio": self.ratio, "batch_growth": self.batch_growth,
                "lr_batch_exponent": self.lr_batch_exponent,
                "max_batch_size": self.max_batch_size, "micro_batch": self.micro_batch,
                "dp_size": self.dp_size, "noise_scale_multiple": self.noise_scale_multiple}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["state"] = {"noise_cap_log": [list(entry) for entry in self.noise_cap_log]}
        return state

    def _load_state(self, state: dict) -> None:
        self.noise_cap_log = [(int(t), float(cap)) for t, cap in state.get("noise_cap_log", [])]
        self._realise()


class Seesaw(MilestoneSchedule):
    """At each milestone of ``base``: LR * sqrt(ratio), batch / ratio (Meterez et al. 2025)."""

    def __init__(self, base: LRSchedule, batch_size: int, ratio: float = 0.5,
                 max_batch_size: int | None = None, micro_batch: int = 1, dp_size: int = 1,
                 noise_scale_multiple: float | None = None):
        super().__init__(base, batch_size, ratio, 1 / check_ratio(ratio), 0.5, max_batch_size,
                         micro_batch, dp_size, noise_scale_multiple)


class SeesawFamily(MilestoneSchedule):
    """At each milestone: batch * beta, LR / alpha, with ratio = 1 / (alpha * sqrt(beta)) and
    alpha >= sqrt(beta) (Meterez et al. 2025; alpha = sqrt(beta) is Seesaw)."""

    def __init__(self, base: LRSchedule, batch_size: int, alpha: float, beta: float,
                 max_batch_size: int | None = None, micro_batch: int = 1, dp_size: int = 1,
                 noise_scale_multiple: float | None = None):
        check_number(alpha, "alpha"), check_number(beta, "beta")
        if not (math.isfinite(alpha) and math.isfinite(beta) and beta >= 1 and alpha * beta > 0):
            raise ValueError(f"alpha={alpha!r}, beta={beta!r}: need beta >= 1 (batch growth per "
                             "milestone) and alpha > 0 (LR divisor)")
        if alpha < math.sqrt(beta) * (1 - 1e-12):
            raise ValueError(
                f"alpha={alpha} < sqrt(beta)={math.sqrt(beta):.6g}: the batch would grow by "
                f"beta={beta} while the LR falls by less than sqrt(beta), outside the family that "
                "Meterez et al. 2025 show equivalent to the base schedule (alpha >= sqrt(beta); "
                f"Seesaw is alpha = sqrt(beta)). Use alpha >= {math.sqrt(beta):.6g} or beta <= "
                f"alpha**2 = {alpha**2:.6g}")
        if alpha * math.sqrt(beta) <= 1:
            raise ValueError(f"alpha * sqrt(beta) = {alpha * math.sqrt(beta):.6g} must exceed 1: "
                             "it is 1/ratio, the base LR's fall per milestone")
        self.alpha, self.beta = alpha, beta
        super().__init__(base, batch_size, 1 / (alpha * math.sqrt(beta)), beta, 0.5,
                         max_batch_size, micro_batch, dp_size, noise_scale_multiple,
                         ratio_name="1/(alpha*sqrt(beta))")


class SmithRamp(MilestoneSchedule):
    """Smith et al. 2017: at each milestone batch / ratio and the LR held (the SGD rule; outside the
    Seesaw family, see the module docstring).
    When the batch is held at a cap the LR falls by ratio instead (the SGD rule LR / batch)."""

    def __init__(self, base: LRSchedule, batch_size: int, ratio: float = 0.5,
                 max_batch_size: int | None = None, micro_batch: int = 1, dp_size: int = 1,
                 noise_scale_multiple: float | None = None):
        super().__init__(base, batch_size, ratio, 1 / check_ratio(ratio), 1.0, max_batch_size,
                         micro_batch, dp_size, noise_scale_multiple)
