"""Learning-rate schedules as pure, picklable functions of tokens consumed (docs/papers.md: schedules).

Every schedule is a small frozen dataclass with ``__call__(tokens) -> lr``. Time is tokens, never
steps: when the batch size changes mid-run (a ramp, Seesaw) a token-keyed schedule still ends where
it should, while a step-keyed one would not. With ``t`` = tokens, ``T`` = total tokens, ``W`` =
warmup tokens, ``peak`` = ``peak_lr``, ``final`` = ``final_lr * peak_lr`` the end points, and ``s``
the progress through the decay:

* ``Constant``      lr = peak (after an optional linear warmup)
* ``Cosine``        lr = final + (peak - final) * (1 + cos(pi * s)) / 2,  s = (t - W) / (T - W)
                    (linear warmup from 0, then the cosine of Loshchilov & Hutter 2017; the base
                    schedule of Seesaw, Meterez et al. 2025)
* ``LinearDecay``   lr = peak + (final - peak) * s
* ``WSD``           warmup, stable at peak, then a cooldown over the last ``cooldown_fraction`` of
                    tokens (MiniCPM, Hu et al. 2024): with s the progress through the cooldown,
                    linear  peak + (final - peak) * s;   cosine  as above;
                    1-sqrt  final + (peak - final) * (1 - sqrt(s))   (Hägele et al. 2024);
                    exponential  peak * (final / peak) ** s
* ``WarmupHoldPolynomial``  LANS (Zheng et al. 2020), with u = t / T, w = W / T, c = hold / T:
                    u < w: peak * u / w;  w <= u < w + c: peak;
                    else peak * ((1 - u) / (1 - w - c)) ** power
* ``InverseSqrt``   lr = peak * sqrt(W / min(t, T)) after warmup (Vaswani et al. 2017; without a
                    ``total_tokens``, sqrt(W / t) for ever)

``final_lr`` is a fraction of ``peak_lr`` everywhere in largebatch (these classes, ``[schedule]``
configs, the CLI): ``Cosine(3e-4, T, W, final_lr=0.1)`` ends at 3e-5. A shape relative to the peak
survives an LR sweep or an ``lr_coupling`` rescale unchanged, and Seesaw's milestones depend only on
it; ``end_lr`` is the absolute value.

Warmup is linear from 0 at ``t = 0`` to ``peak`` at ``t = W``. Past ``total_tokens`` a schedule
holds its final value (the last optimizer step may overshoot the budget by part of a batch).

``scale_lr_for_batch`` is the explicit LR-batch coupling policy (none, linear -- Goyal et al. 2017,
square root -- Krizhevsky 2014 / the Adam SDE rule) for users who change the base batch size.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import ClassVar, Literal, get_args

Coupling = Literal["none", "linear", "sqrt"]
WSDShape = Literal["linear", "cosine", "1-sqrt", "exponential"]
COUPLING_POLICIES = get_args(Coupling)
WSD_SHAPES = get_args(WSDShape)


def _not_a_number(value, name: str) -> TypeError:
    """The TypeError for a non-number argument, naming it (a numeric string gets its number back)."""
    example = f"{name}=0.5"
    if isinstance(value, str):
        try:
            number = float(value)
            example = f"{name}={int(number) if number.is_integer() else number!r}"
        except (ValueError, OverflowError):
            pass
    return TypeError(f"{name}={value!r} is a {type(value).__name__}, not a number; pass a number, "
                     f"e.g. {example}")


def check_number(value, name: str) -> float:
    """Return ``value`` if it is a real number (int, float, numpy scalar; not bool or str), else
    raise a TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _not_a_number(value, name)
    return value


def check_tokens(tokens: float, name: str = "tokens") -> float:
    """Reject negative or non-finite token counts with an error naming the argument."""
    if isinstance(tokens, (str, bytes)):
        raise _not_a_number(tokens, name)
    try:  # not a numbers.Real check: a 0-d tensor of tokens is fine here
        finite = math.isfinite(tokens)
    except TypeError:
        raise _not_a_number(tokens, name) from None
    if not finite or tokens < 0:
        raise ValueError(f"{name}={tokens!r}: token counts must be finite and >= 0")
    return tokens


def check_whole_tokens(tokens, name: str, why: str = "") -> int:
    """``check_tokens``, and a whole number: a float such as 1e9 becomes the int it writes; a fractional
    count (1000.5) is refused naming ``name`` (``why``: what the count is for, in the message)."""
    if isinstance(tokens, bool):
        raise TypeError(f"{name}={tokens!r} is a bool, not a number of tokens")
    check_tokens(tokens, name)
    value = float(tokens)
    if not value.is_integer():
        raise ValueError(f"{name}={tokens!r} must be a whole number of tokens{why}, e.g. {name}={round(value)}")
    return int(tokens) if isinstance(tokens, numbers.Integral) else int(value)  # (np.int64 too: a plain int)


def as_real(value, name: str) -> float:
    """``float(value)`` for a real number or a 0-d tensor of one; a TypeError naming ``name`` for a
    string, a bool or anything else (``float("5")`` would quietly parse a string)."""
    if isinstance(value, (str, bytes, bool)):
        raise _not_a_number(value, name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _not_a_number(value, name) from None


@dataclass(frozen=True)
class LRSchedule:
    """Shared fields and validation; subclasses implement ``_decay(tokens)`` after warmup.

    peak_lr: the LR after warmup. total_tokens: the token budget T. warmup_tokens: W.
    final_lr: the end of the decay as a fraction of peak_lr (0.1 = a tenth of the peak), in [0, 1].
    """

    peak_lr: float
    total_tokens: int | None = None
    warmup_tokens: int = 0
    final_lr: float = 0.0
    needs_total: ClassVar[bool] = True  # the shape is defined relative to the token budget

    def __post_init__(self) -> None:
        check_number(self.peak_lr, "peak_lr")
        check_number(self.final_lr, "final_lr")
        if not math.isfinite(self.peak_lr) or self.peak_lr <= 0:
            raise ValueError(f"peak_lr={self.peak_lr!r} must be a positive finite number")
        if not 0 <= self.final_lr <= 1:
            raise ValueError(
                f"final_lr={self.final_lr!r} must lie in [0, 1]: it is a fraction of peak_lr; "
                "for an absolute end LR e pass final_lr = e / peak_lr")
        for name in ("warmup_tokens", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is None and name == "warmup_tokens"):
                raise TypeError(f"{name}={value!r} is not a number of tokens (0: no warmup)"
                                if value is None else f"{name}={value!r} is a bool, not a number of tokens")
            if value is not None:  # 1e9 as Python writes it is a whole count; 1000.5 is refused
                why = " (the budget's optimizer steps are counted from it)" if name == "total_tokens" else ""
                object.__setattr__(self, name, check_whole_tokens(value, name, why))
        if self.needs_total and self.total_tokens is None:
            raise ValueError(f"{type(self).__name__} needs total_tokens (the token budget)")
        if self.total_tokens is not None:
            if self.warmup_tokens >= self.total_tokens:
                raise ValueError(
                    f"warmup_tokens={self.warmup_tokens} must be shorter than total_tokens="
                    f"{self.total_tokens}; use a smaller warmup or a larger token budget")

    @property
    def end_lr(self) -> float:
        """The absolute LR at the end of the decay: ``final_lr * peak_lr``."""
        return self.final_lr * self.peak_lr

    def __call__(self, tokens: float) -> float:
        check_tokens(tokens)
        if tokens < self.warmup_tokens:
            return self.peak_lr * tokens / self.warmup_tokens
        return self._decay(tokens)

    def _decay(self, tokens: float) -> float:
        raise NotImplementedError

    def _progress(self, tokens: float, start: float) -> float:
        """Fraction of the way from ``start`` to ``total_tokens``, clamped to [0, 1] (a span of no
        token: 0 before ``start``, 1 from it on)."""
        span = self.total_tokens - start
        if span <= 0:
            return 0.0 if tokens < start else 1.0
        return min(1.0, max(0.0, (tokens - start) / span))

    def breakpoints(self) -> list[int]:
        """Token counts where the formula changes (phase-table boundaries), excluding 0 and T."""
        return [self.warmup_tokens] if self.warmup_tokens > 0 else []

    def state_dict(self) -> dict:
        # "final_lr_of" marks the fraction meaning; states written before it hold an absolute LR
        return {"kind": type(self).__name__, **asdict(self), "final_lr_of": "peak_lr"}


@dataclass(frozen=True)
class Constant(LRSchedule):
    """Constant LR after an optional linear warmup."""

    needs_total: ClassVar[bool] = False

    def _decay(self, tokens: float) -> float:
        return self.peak_lr


@dataclass(frozen=True)
class Cosine(LRSchedule):
    """Linear warmup from 0, then cosine from peak_lr to final_lr * peak_lr at total_tokens."""

    def _decay(self, tokens: float) -> float:
        s = self._progress(tokens, self.warmup_tokens)
        final = self.end_lr
        return final + (self.peak_lr - final) * 0.5 * (1 + math.cos(math.pi * s))


@dataclass(frozen=True)
class LinearDecay(LRSchedule):
    """Linear warmup from 0, then a straight line from peak_lr to final_lr * peak_lr."""

    def _decay(self, tokens: float) -> float:
        s = self._progress(tokens, self.warmup_tokens)
        return self.peak_lr + (self.end_lr - self.peak_lr) * s


@dataclass(frozen=True)
class WSD(LRSchedule):
    """Warmup-stable-decay (MiniCPM, Hu et al. 2024): hold peak_lr, then cool down over the last
    ``cooldown_fraction`` of the token budget with the given ``shape``."""

    cooldown_fraction: float = 0.1
    shape: str = "linear"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.cooldown_fraction, "cooldown_fraction")
        if self.shape not in WSD_SHAPES:
            raise ValueError(f"shape={self.shape!r} is not one of {WSD_SHAPES}")
        if self.shape == "exponential" and self.final_lr <= 0:
            raise ValueError("shape='exponential' needs final_lr > 0 (it decays geometrically)")
        if not 0 < self.cooldown_fraction <= 1:
            raise ValueError(f"cooldown_fraction={self.cooldown_fraction!r} must lie in (0, 1]")
        if self.cooldown_start >= self.total_tokens:
            raise ValueError(
                f"cooldown_fraction={self.cooldown_fraction!r} is {self.cooldown_fraction * self.total_tokens:.3g} "
                f"tokens of the {self.total_tokens:,}-token budget, which rounds to no token: there would be "
                f"no cooldown; raise it to at least 1 / total_tokens = {1 / self.total_tokens:.3g}")
        if self.cooldown_start < self.warmup_tokens:
            raise ValueError(
                f"cooldown_fraction={self.cooldown_fraction} starts the cooldown at token "
                f"{self.cooldown_start}, inside the warmup ({self.warmup_tokens} tokens); "
                f"shorten the warmup or the cooldown (cooldown_fraction <= 1 - warmup_tokens / total_tokens "
                f"= {1 - self.warmup_tokens / self.total_tokens:.6g})")

    @property
    def cooldown_start(self) -> int:
        """The first token of the cooldown, ``round(total_tokens * (1 - cooldown_fraction))``; one that
        rounding alone puts inside the warmup (less than a token before its end: a cooldown_fraction of
        1 - warmup share, as a config's fractions give) starts at the warmup's end instead."""
        exact = self.total_tokens * (1 - self.cooldown_fraction)
        start = round(exact)
        return self.warmup_tokens if start < self.warmup_tokens and self.warmup_tokens - exact < 1 else start

    def _decay(self, tokens: float) -> float:
        s = self._progress(tokens, self.cooldown_start)
        peak, final = self.peak_lr, self.end_lr
        if self.shape == "linear":
            return peak + (final - peak) * s
        if self.shape == "cosine":
            return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * s))
        if self.shape == "1-sqrt":
            return final + (peak - final) * (1 - math.sqrt(s))
        return peak * (final / peak) ** s  # exponential

    def breakpoints(self) -> list[int]:
        return sorted(set(super().breakpoints() + [self.cooldown_start]))


@dataclass(frozen=True)
class WarmupHoldPolynomial(LRSchedule):
    """LANS's schedule (Zheng et al. 2020): linear warmup, hold at peak for ``hold_tokens``, then
    polynomial decay ``peak * ((T - t) / (T - W - hold)) ** power`` to 0. final_lr must be 0."""

    hold_tokens: int = 0
    power: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "hold_tokens", check_whole_tokens(self.hold_tokens, "hold_tokens"))
        check_number(self.power, "power")
        if self.final_lr != 0:
            raise ValueError(f"final_lr={self.final_lr!r}: LANS's polynomial decay ends at 0")
        if self.warmup_tokens + self.hold_tokens >= self.total_tokens:
            raise ValueError(
                f"warmup_tokens + hold_tokens = {self.warmup_tokens + self.hold_tokens} must be "
                f"shorter than total_tokens={self.total_tokens}")
        if not (self.power > 0 and math.isfinite(self.power)):
            raise ValueError(f"power={self.power!r} must be > 0 and finite")

    def _decay(self, tokens: float) -> float:
        decay_start = self.warmup_tokens + self.hold_tokens
        if tokens < decay_start:
            return self.peak_lr
        return self.peak_lr * (1 - self._progress(tokens, decay_start)) ** self.power

    def breakpoints(self) -> list[int]:
        return sorted(set(super().breakpoints() + [self.warmup_tokens + self.hold_tokens]))


@dataclass(frozen=True)
class InverseSqrt(LRSchedule):
    """Linear warmup, then ``peak * sqrt(warmup_tokens / tokens)`` (Vaswani et al. 2017). With a
    ``total_tokens`` it holds ``peak * sqrt(warmup_tokens / total_tokens)`` past the budget, as every
    schedule does; without one it decays on."""

    needs_total: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_tokens <= 0:
            raise ValueError("InverseSqrt needs warmup_tokens > 0 (the decay is relative to it)")

    def _decay(self, tokens: float) -> float:
        if self.total_tokens is not None:
            tokens = min(tokens, self.total_tokens)  # past the budget: hold the last value
        return self.peak_lr * math.sqrt(self.warmup_tokens / tokens)

    @property
    def end_lr(self) -> float:
        """The LR at the end of the budget, ``peak * sqrt(warmup_tokens / total_tokens)`` (final_lr
        plays no part in this schedule); 0 without a budget (it decays on)."""
        if self.total_tokens is None:
            return 0.0
        return self._decay(self.total_tokens)


LR_SCHEDULES: dict[str, type[LRSchedule]] = {
    cls.__name__: cls
    for cls in (Constant, Cosine, LinearDecay, WSD, WarmupHoldPolynomial, InverseSqrt)
}


def lr_schedule_from_state(state: dict) -> LRSchedule:
    """Rebuild an LR schedule from its ``state_dict()``."""
    fields = dict(state)
    kind = fields.pop("kind", None)
    if fields.pop("final_lr_of", None) is None and fields.get("final_lr") and fields.get("peak_lr"):
        fields["final_lr"] = fields["final_lr"] / fields["peak_lr"]  # old state: absolute
    if kind not in LR_SCHEDULES:
        raise ValueError(f"state kind={kind!r} is not one of {sorted(LR_SCHEDULES)}")
    return LR_SCHEDULES[kind](**fields)


def upgrade_lr_state(saved: dict, current: LRSchedule) -> dict:
    """``saved`` (an LR schedule's state) in today's meaning of final_lr, read against ``current``.

    A state written before final_lr became a fraction of peak_lr has no "final_lr_of" key and holds
    the absolute end LR; when it equals ``current.end_lr`` it is the same schedule."""
    if "final_lr_of" in saved:
        return saved
    upgraded = {**saved, "final_lr_of": "peak_lr"}
    if saved.get("final_lr") == current.end_lr:
        upgraded["final_lr"] = current.final_lr
    return upgraded


def scale_lr_for_batch(lr: float, batch_size: int, reference_batch_size: int,
                       policy: str) -> float:
    """The LR to use at ``batch_size`` given one tuned at ``reference_batch_size``.

    ``none`` keeps it; ``linear`` multiplies by batch/reference (Goyal et al. 2017, SGD);
    ``sqrt`` by sqrt(batch/reference) (Krizhevsky 2014; the Adam rule behind Seesaw's sqrt(r)).
    """
    if policy not in COUPLING_POLICIES:
        raise ValueError(f"lr coupling policy={policy!r} is not one of {COUPLING_POLICIES}")
    check_number(lr, "lr")
    check_number(batch_size, "batch_size")
    check_number(reference_batch_size, "reference_batch_size")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr={lr!r} must be a finite number >= 0")
    bad = [f"{name}={value!r}" for name, value in (("batch_size", batch_size),
                                                   ("reference_batch_size", reference_batch_size))
           if not (value > 0 and math.isfinite(value))]
    if bad:
        raise ValueError(f"{' and '.join(bad)} must be positive and finite (sequences per optimizer step)")
    exponent = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}[policy]
    return lr * (batch_size / reference_batch_size) ** exponent
