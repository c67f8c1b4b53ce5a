"""``ScheduleConfig``: the ``[schedule]`` section of a training config, and its builder.

Token quantities are fractions of the token budget, so one config serves any budget; batch sizes
are in sequences. ``build()`` turns it into a joint schedule (``batch.py``, ``seesaw.py``) and
``describe()`` into the start-up text: the LR-batch coupling that was applied and the realised
phase table next to the base schedule's optimizer steps (docs/papers.md: schedules).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable

from largebatch.schedules import lr as lr_module
from largebatch.schedules.batch import (
    ConstantBatch,
    JointSchedule,
    LinearRamp,
    PiecewiseBatch,
    count_optimizer_steps,
    format_phase_table,
)
from largebatch.schedules.lr import Coupling, WSDShape
from largebatch.schedules.noise_scale import NoiseScale
from largebatch.schedules.seesaw import Seesaw, SeesawFamily, SmithRamp
from largebatch.typed_config import check_fields, check_off, check_registration, from_dict

# lr_schedule name -> LRScheduleEntry: the one place an LR shape is declared (register_lr_schedule,
# below the class); the choices, --help and build_lr read it
LR_BUILDERS: dict[str, LRScheduleEntry] = {}
# batch_policy name -> BatchPolicy (register_batch_policy, below the class): the same shape
BATCH_POLICIES: dict[str, BatchPolicy] = {}
REGISTRIES = {"lr_schedule": LR_BUILDERS, "batch_policy": BATCH_POLICIES}  # open sets, by name
OFF_FIELDS = ("ramp_start", "ramp_increment", "alpha", "beta", "max_batch_size", "noise_scale_multiple",
              "reference_batch_size")  # positive, or None (off / not given)


def fraction(text: str) -> float:
    """'1/1.1' -> 0.909..., '0.5' -> 0.5: Seesaw's ratio as the paper writes it, on a command line
    (``--schedule.ratio 1/1.1``) or as a TOML string (``ratio = "1/1.1"``)."""
    try:
        numerator, _, denominator = text.partition("/")
        value = float(numerator) / float(denominator) if denominator else float(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{text!r} is not a number or a fraction like 1/1.1") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r}: give a finite number")
    return value


def batch_table(text: str) -> list:
    """'0:64,0.5:128' -> [[0.0, 64], [0.5, 128]] (token fraction: batch size), the command line's
    short form of ``batch_table = [[0, 64], [0.5, 128]]``."""
    try:
        return [[float(f), int(b)] for f, b in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise ValueError(f"{text!r}: expected FRACTION:BATCH,... e.g. 0:64,0.5:128, or "
                         "[[0, 64], [0.5, 128]]") from None


@dataclass(frozen=True)
class LRScheduleEntry:
    """An LR shape against tokens, declared by name (:func:`register_lr_schedule`)."""

    build: Callable[[ScheduleConfig, float, int, int], lr_module.LRSchedule]
    """(config, peak LR, token budget, warmup tokens) -> the schedule."""
    help: str
    """One line for --help-config."""


@dataclass(frozen=True)
class BatchPolicy:
    """A batch size against tokens, declared by name (:func:`register_batch_policy`)."""

    build: Callable[[ScheduleConfig, lr_module.LRSchedule, int, dict], JointSchedule]
    """(config, the LR schedule, token budget, sizes) -> the joint schedule; ``sizes`` holds
    micro_batch and dp_size, and for a milestone policy max_batch_size and noise_scale_multiple."""
    help: str
    """One line for --help-config, with its paper."""
    milestones: bool = False
    """Seesaw-type: batch steps at the LR's milestones, placed down to final_lr (which must be > 0);
    max_batch_size and noise_scale_multiple apply."""
    validate: Callable[[ScheduleConfig], None] | None = None
    """Its own field checks (ValueError via ``config._fail``), run before it is built."""


# the fields of [schedule] each shipped batch policy reads beyond batch_size and the LR schedule's
POLICY_FIELDS = {"constant": (), "ramp": ("ramp_start", "ramp_increment", "ramp_tokens"), "table": ("batch_table",),
                 "seesaw": ("ratio",), "smith": ("ratio",), "seesaw-family": ("alpha", "beta")}


@dataclass
class ScheduleConfig:
    lr_schedule: str = field(default="cosine", metadata={"choices": LR_BUILDERS})
    """LR shape against tokens (add one with largebatch.schedules.config.register_lr_schedule)."""
    peak_lr: float = 3e-4
    """Peak LR after warmup, as tuned at reference_batch_size (see lr_coupling)."""
    warmup: float = 0.1
    """Linear warmup from LR 0, as a fraction of the token budget (must be < 1)."""
    final_lr: float = 0.1
    """End of the decay as a fraction of peak_lr, in [0, 1] (cosine, linear, wsd; 0.1 = a tenth of
    the peak), as in the Python schedule classes. Seesaw needs > 0."""
    wsd_cooldown: float = 0.1
    """wsd: the cooldown's share of the token budget (MiniCPM: ~0.1)."""
    wsd_shape: WSDShape = "linear"
    """wsd: cooldown shape."""
    lans_hold: float = 0.0
    """lans: tokens held at peak after warmup, as a fraction of the budget."""
    lans_power: float = 1.0
    """lans: exponent of the polynomial decay to 0 (1 = linear)."""
    batch_policy: str = field(default="constant", metadata={"choices": BATCH_POLICIES})
    """Batch size against tokens (add one with largebatch.schedules.config.register_batch_policy)."""
    batch_size: int = 64
    """Sequences per optimizer step: the constant batch; the final batch of a ramp; the starting
    batch of seesaw / seesaw-family / smith. A multiple of micro_batch x data-parallel ranks. Not
    read by table, whose first row is the batch lr_coupling and the base compare with."""
    ramp_start: int | None = None
    """ramp (required there): first batch size in sequences (Megatron --rampup-batch-size START)."""
    ramp_increment: int | None = None
    """ramp (required there): sequences added at each increment (Megatron INCREMENT)."""
    ramp_tokens: float = 0.1
    """ramp: share of the token budget over which the batch ramps up to batch_size."""
    batch_table: list = field(default_factory=list, metadata={"parse": batch_table})
    """table: [[token fraction, batch size], ...] starting at fraction 0, every fraction in [0, 1)
    (on a command line also 0:64,0.5:128)."""
    ratio: float = field(default=0.5, metadata={"parse": fraction})
    """seesaw / smith: the base LR's fall between milestones (paper: 1/2, 1/1.1; a fraction may be
    written so), in (final_lr, final_lr ** (1/1000)]: at least one milestone and at most 1000
    (0.9977 at final_lr 0.1)."""
    alpha: float | None = None
    """seesaw-family (required there): LR divisor per milestone, alpha >= sqrt(beta);
    ratio = 1/(alpha sqrt(beta))."""
    beta: float | None = None
    """seesaw-family (required there): batch multiplier per milestone (>= 1)."""
    max_batch_size: int | None = None
    """seesaw / seesaw-family / smith: batch cap in sequences, e.g. the critical batch (None: no cap)."""
    noise_scale_multiple: float | None = None
    """Adaptive Seesaw: cap the batch at this multiple of the measured B_simple (None: off)."""
    noise_scale_ema: float = 0.95
    """EMA decay for the B_simple numerator and denominator (McCandlish et al. 2018)."""
    lr_coupling: Coupling = "none"
    """How peak_lr follows batch_size vs reference_batch_size."""
    reference_batch_size: int | None = None
    """Batch size at which peak_lr was tuned (None: batch_size, i.e. no rescaling)."""

    @classmethod
    def from_dict(cls, values: dict) -> ScheduleConfig:
        """Build from a TOML ``[schedule]`` table; an unknown key is an error with a suggestion."""
        return from_dict(cls, values, prefix="schedule")

    def _fail(self, name: str, why: str) -> None:
        raise ValueError(f"schedule.{name} = {getattr(self, name)!r}: {why}")

    def _validate(self) -> None:
        check_fields(self, "schedule")
        for name, choices in REGISTRIES.items():
            if getattr(self, name) not in choices:
                self._fail(name, f"must be one of {', '.join(map(repr, choices))}")
        if not (isinstance(self.peak_lr, (int, float)) and math.isfinite(self.peak_lr) and self.peak_lr > 0):
            self._fail("peak_lr", "must be a finite number > 0: the LR at the end of the warmup, e.g. 1e-3")
        if self.batch_policy == "ramp":  # required there: 0 is no value to turn off
            for name in ("ramp_start", "ramp_increment"):
                value = getattr(self, name)
                if value is not None and (not isinstance(value, int) or value <= 0):
                    self._fail(name, f"must be a positive number of sequences (batch_policy 'ramp' needs "
                               f"it), e.g. {8 if name == 'ramp_increment' else 16}")
        for name in OFF_FIELDS:
            check_off(f"schedule.{name}", getattr(self, name))
        if self.batch_size <= 0:
            self._fail("batch_size", "must be a positive number of sequences per optimizer step "
                       "(a multiple of micro_batch x data-parallel ranks), e.g. 64")
        if not 0 <= self.warmup < 1:
            self._fail("warmup", "must lie in [0, 1): it is a fraction of the token budget")
        if not 0 <= self.final_lr <= 1:
            self._fail("final_lr", "must lie in [0, 1]: it is a fraction of peak_lr")
        if self.lr_schedule == "inverse-sqrt" and self.warmup <= 0:
            self._fail("warmup", "inverse-sqrt decays relative to the warmup; set warmup > 0")
        policy = BATCH_POLICIES[self.batch_policy]
        if policy.milestones and self.lr_schedule in ("constant", "lans"):
            fall = "never falls" if self.lr_schedule == "constant" else "falls to 0 whatever final_lr says"
            self._fail("lr_schedule", f"{self.lr_schedule!r} with batch_policy {self.batch_policy!r}: "
                       f"Seesaw-type schedules place a milestone wherever the base LR has fallen by ratio "
                       f"again, down to final_lr, and {self.lr_schedule!r} {fall}; use cosine, linear, "
                       "wsd or inverse-sqrt")
        if policy.milestones and self.final_lr <= 0:
            self._fail("final_lr", "Seesaw-type schedules place milestones down to final_lr; "
                       "set it > 0, e.g. 0.1")
        if self.lr_schedule == "wsd" and not 0 < self.wsd_cooldown <= 1 - self.warmup:
            self._fail("wsd_cooldown", f"must lie in (0, 1 - warmup = {1 - self.warmup:g}]")
        if self.lr_schedule == "lans" and not 0 <= self.lans_hold < 1 - self.warmup:
            self._fail("lans_hold", f"must lie in [0, 1 - warmup = {1 - self.warmup:g})")
        # the ranges of the fields other schedules and policies read, whichever is chosen: a value no
        # schedule could take is a mistake wherever it stands (a policy's own checks add the rest)
        ranges = [("wsd_cooldown", 0 < self.wsd_cooldown <= 1, "(0, 1]", "the wsd cooldown's share of the budget"),
                  ("lans_hold", 0 <= self.lans_hold < 1, "[0, 1)", "the lans hold's share of the budget"),
                  ("ramp_tokens", 0 < self.ramp_tokens <= 1, "(0, 1]", "the ramp's share of the budget")]
        if "ratio" not in POLICY_FIELDS.get(self.batch_policy, ("ratio",)):  # (seesaw and smith say more of it)
            ranges.append(("ratio", 0 < self.ratio < 1, "(0, 1)", "the base LR's fall between milestones, e.g. 0.5"))
        for name, inside, bounds, what in ranges:
            if not inside:
                self._fail(name, f"must lie in {bounds}: {what}")
        for name in ("alpha", "beta", "ramp_start", "ramp_increment"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                self._fail(name, "must be > 0, or none when the batch policy does not read it")
        if not self.lans_power > 0:
            self._fail("lans_power", "must be > 0: the exponent of the decay to 0 (1 = linear)")
        if not 0 <= self.noise_scale_ema < 1:
            self._fail("noise_scale_ema", "must lie in [0, 1): the EMA decay of the noise-scale "
                       "estimate (0 = no smoothing; default 0.95)")
        if policy.validate is not None:
            policy.validate(self)
        milestone_policies = " | ".join(n for n, p in BATCH_POLICIES.items() if p.milestones)
        for name in ("max_batch_size", "noise_scale_multiple"):
            if getattr(self, name) is not None and not policy.milestones:
                self._fail(name, f"only applies to batch_policy {milestone_policies}, "
                           f"not {self.batch_policy!r}; omit it")

    def unread_fields_problem(self, only=None, table: str = "schedule", owner: str = "run") -> str | None:
        """A message naming a field set for another batch policy than this one (alpha and beta under
        seesaw, where seesaw-family was meant; ramp_start under constant): it would be silently
        ignored. Fields whose unset value is none or empty only (a default value cannot be told from
        one that was set), and for the shipped policies only (a registered one may read any).
        ``only``: the fields to look at (a phase's own table; None: all); ``table`` and ``owner``
        name them in the message ("phases[1].schedule", "phase 1")."""
        reads = POLICY_FIELDS.get(self.batch_policy)
        if reads is None:
            return None
        for name in ("alpha", "beta", "ramp_start", "ramp_increment", "batch_table"):
            if only is not None and name not in only:
                continue
            if getattr(self, name) not in (None, [], ()) and name not in reads:
                users = " | ".join(p for p, fields in POLICY_FIELDS.items() if name in fields)
                return (f"{table}.{name} = {getattr(self, name)!r}: only batch_policy {users} reads it, and this "
                        f"{owner}'s is {self.batch_policy!r}; omit it, or choose that policy")
        return None

    def _validate_family(self) -> None:
        if self.alpha is None or self.beta is None:
            self._fail("alpha" if self.alpha is None else "beta",
                       f"seesaw-family needs alpha and beta (alpha={self.alpha!r}, beta={self.beta!r}); "
                       "give both, e.g. alpha = 1.6, beta = 1.5")

    def _validate_ramp(self) -> None:
        if self.ramp_start is None or self.ramp_start > self.batch_size:
            self._fail("ramp_start", f"must lie in (0, batch_size={self.batch_size}]")
        if self.ramp_increment is None or (self.batch_size - self.ramp_start) % self.ramp_increment:
            self._fail("ramp_increment", f"must be > 0 and divide batch_size - ramp_start = "
                       f"{self.batch_size - self.ramp_start}")
        if not 0 < self.ramp_tokens <= 1:
            self._fail("ramp_tokens", "must lie in (0, 1]: it is a fraction of the token budget")

    def _validate_table(self) -> None:
        example = "e.g. [[0, 64], [0.5, 128]]"
        if not self.batch_table:
            self._fail("batch_table", f"batch_policy 'table' needs [[token fraction, batch size], ...] "
                       f"starting at fraction 0, {example}")
        for row in self.batch_table:
            if (not isinstance(row, (list, tuple)) or len(row) != 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)):
                self._fail("batch_table", f"row {row!r} is not [token fraction, batch size], {example}")
            if not 0 <= row[0] < 1:
                self._fail("batch_table", f"the fraction {row[0]!r} must lie in [0, 1): it is the share "
                           "of the token budget where that batch starts, and a row at 1 or later would "
                           f"never be used; drop it or give a fraction below 1, {example}")
            if not isinstance(row[1], int) or row[1] <= 0:
                self._fail("batch_table", f"the batch size {row[1]!r} (row {row!r}) must be a positive "
                           f"whole number of sequences, {example}")
        fractions = [row[0] for row in self.batch_table]
        if fractions[0] != 0:
            self._fail("batch_table", f"the first row starts at fraction {fractions[0]!r}: the table must "
                       f"start at 0 (the batch of the first step), {example}")
        if any(b <= a for a, b in zip(fractions, fractions[1:])):
            self._fail("batch_table", f"the fractions {fractions} must increase from row to row, {example}")

    @property
    def run_batch_size(self) -> int:
        """The batch peak_lr is coupled at and the base schedule runs: batch_size, except under the
        table policy, which never reads batch_size: its first row's batch (the run's starting one; the
        coupling and the "% of base" used the unread batch_size, so a table of batches 8 and 16 trained
        at the LR for 64)."""
        if self.batch_policy == "table" and self.batch_table:
            return int(self.batch_table[0][1])
        return self.batch_size

    def coupled_peak_lr(self) -> float:
        """peak_lr after the lr_coupling policy moves it from reference_batch_size to the run's batch
        (``run_batch_size``)."""
        reference = self.reference_batch_size or self.run_batch_size
        return lr_module.scale_lr_for_batch(self.peak_lr, self.run_batch_size, reference,
                                            self.lr_coupling)

    def build_lr(self, total_tokens: int) -> lr_module.LRSchedule:
        """The plain LR schedule (also Seesaw's base)."""
        self._validate()
        peak, warmup = self.coupled_peak_lr(), round(self.warmup * total_tokens)
        if self.warmup and warmup < 1:
            self._fail("warmup", f"is {self.warmup * total_tokens:.3g} tokens of the {total_tokens:,}-token "
                       "budget, less than one: no warmup would run; raise it, or give 0 for none")
        if self.warmup and warmup >= total_tokens:
            self._fail("warmup", f"is {warmup:,} of the {total_tokens:,}-token budget, which leaves no "
                       "token after the warmup; lower it")
        schedule = LR_BUILDERS[self.lr_schedule].build(self, peak, total_tokens, warmup)
        if not isinstance(schedule, lr_module.LRSchedule):
            self._fail("lr_schedule", f"its builder (register_lr_schedule) returned {type(schedule).__name__!r}, "
                       "not a largebatch.schedules.LRSchedule; return an instance of a subclass")
        points = sorted({0, warmup, total_tokens // 2, total_tokens - 1,
                         *(t for t in schedule.breakpoints() if 0 <= t < total_tokens)})
        for tokens in points:  # a registered schedule's values, where they change: once, before any step
            value = schedule(tokens)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                self._fail("lr_schedule", f"its schedule gives lr({tokens:,} tokens) = {value!r}; an LR must be "
                           "a finite number >= 0 (check the builder given to register_lr_schedule)")
        return schedule

    def build(self, total_tokens: int, seq_len: int, micro_batch: int = 1,
              dp_size: int = 1) -> JointSchedule:
        """The joint (LR, batch) schedule for a token budget; errors name the field and the fix."""
        try:
            return self._build(total_tokens, seq_len, micro_batch, dp_size)
        except ValueError as exc:
            raise ValueError(_named_once(str(exc))) from exc

    def _build(self, total_tokens, seq_len, micro_batch, dp_size) -> JointSchedule:
        lr_sched = self.build_lr(total_tokens)
        policy = BATCH_POLICIES[self.batch_policy]
        sizes = {"micro_batch": micro_batch, "dp_size": dp_size}
        if policy.milestones:
            sizes.update(max_batch_size=self.max_batch_size, noise_scale_multiple=self.noise_scale_multiple)
        schedule = policy.build(self, lr_sched, total_tokens, sizes)
        if not isinstance(schedule, JointSchedule):
            self._fail("batch_policy", f"its builder (register_batch_policy) returned {type(schedule).__name__!r}, "
                       "not a largebatch.schedules.JointSchedule; return an instance of a subclass")
        try:  # once, before any step: a checkpoint rebuilds the schedule from these
            schedule._config()
        except NotImplementedError:
            self._fail("batch_policy", f"its schedule {type(schedule).__name__} does not implement _config() (the "
                       "constructor arguments a checkpoint records to rebuild it): add it")
        for tokens in sorted({0, *(t for t in schedule.breakpoints() if 0 <= t < total_tokens)}):
            try:
                schedule.check_batch(tokens)
            except ValueError as exc:
                self._fail("batch_policy", str(exc))
        return schedule

    def build_base(self, total_tokens: int, micro_batch: int = 1,
                   dp_size: int = 1) -> ConstantBatch:
        """The base schedule for comparison: the same LR schedule at a constant batch_size."""
        return ConstantBatch(self.build_lr(total_tokens), self.run_batch_size, micro_batch, dp_size)

    def build_noise_scale(self) -> NoiseScale:
        return NoiseScale(self.noise_scale_ema)

    def describe(self, total_tokens: int, seq_len: int, micro_batch: int = 1,
                 dp_size: int = 1) -> str:
        """Start-up text: LR schedule, coupling applied, phase table, steps vs the base."""
        schedule = self.build(total_tokens, seq_len, micro_batch, dp_size)
        base_steps = count_optimizer_steps(self.build_base(total_tokens, micro_batch, dp_size),
                                           seq_len)
        steps = count_optimizer_steps(schedule, seq_len)
        reference = self.reference_batch_size or self.run_batch_size
        coupling = (f"lr coupling: {self.lr_coupling} (peak_lr {self.peak_lr:.4g} tuned at batch "
                    f"{reference} -> {self.coupled_peak_lr():.4g} at batch {self.run_batch_size})")
        lines = [
            f"schedule: lr {self.lr_schedule}, batch {self.batch_policy} "
            f"({type(schedule).__name__}), {total_tokens:,} tokens, seq_len {seq_len}, "
            f"micro_batch {micro_batch} x dp {dp_size}",
            coupling,
            format_phase_table(schedule.phases(seq_len)),
            f"base ({self.lr_schedule}, constant batch {self.run_batch_size}): {base_steps:,} "
            f"optimizer steps; this schedule: {steps:,} ({100 * steps / base_steps:.2f}% of base)",
        ]
        if self.noise_scale_multiple is not None and BATCH_POLICIES[self.batch_policy].milestones:
            lines.append(f"adaptive: each milestone's batch is capped at {self.noise_scale_multiple:g} x the "
                         "noise scale measured by then, so the table above is the uncapped plan: its batches "
                         "an upper bound, its steps and % of base a lower bound; a held batch keeps the full "
                         "LR fall at its milestone. The run's own are in metrics.jsonl and schedule.png")
        return "\n".join(lines)


# a schedule class's argument -> the config field it comes from, where the names differ
CLASS_ARGUMENTS = {"start_batch": "ramp_start", "cooldown_fraction": "wsd_cooldown"}


def _named_once(message: str) -> str:
    """A schedule class's message with its field named as the config writes it, once:
    'alpha=1 < sqrt(beta)=2' -> 'schedule.alpha=1 < sqrt(beta)=2'; an already named one stays; an
    argument the config calls otherwise is renamed throughout ('start_batch' -> 'schedule.ramp_start')."""
    if message.startswith("schedule.") or ".schedule." in message.split(" ")[0]:
        return message
    first = message.split("=")[0].split(" ")[0]
    if first in CLASS_ARGUMENTS:
        return re.sub(rf"\b{first}\b", f"schedule.{CLASS_ARGUMENTS[first]}", message)
    return f"schedule.{message}" if first in ScheduleConfig.__dataclass_fields__ else f"schedule: {message}"


def register_batch_policy(name: str, build: Callable[[ScheduleConfig, lr_module.LRSchedule, int, dict],
                                                     JointSchedule], *, help: str, milestones: bool = False,
                          validate: Callable[[ScheduleConfig], None] | None = None) -> BatchPolicy:
    """Declare ``schedule.batch_policy = name`` (replacing one of that name): ``build(config, lr_schedule,
    total_tokens, sizes)`` returns the joint schedule (``sizes``: see :class:`BatchPolicy`)."""
    check_registration("register_batch_policy", name, BATCH_POLICIES, {"build": build, "validate?": validate},
                       {"help": help})
    BATCH_POLICIES[name] = BatchPolicy(build, help, milestones, validate)
    return BATCH_POLICIES[name]


register_batch_policy("constant", lambda c, lr, total, sizes: ConstantBatch(lr, c.batch_size, **sizes),
                      help="batch_size throughout")
def _ramp(c: ScheduleConfig, lr: lr_module.LRSchedule, total: int, sizes: dict) -> LinearRamp:
    tokens = round(c.ramp_tokens * total)
    if tokens < 1:
        c._fail("ramp_tokens", f"is {c.ramp_tokens * total:.3g} tokens of the {total:,}-token budget, "
                "less than one; raise it")
    return LinearRamp(lr, c.ramp_start, c.ramp_increment, tokens, c.batch_size, **sizes)


register_batch_policy("ramp", _ramp,
    help="Megatron's linear ramp from ramp_start to batch_size (--rampup-batch-size)",
    validate=ScheduleConfig._validate_ramp)
def _table(c: ScheduleConfig, lr: lr_module.LRSchedule, total: int, sizes: dict) -> PiecewiseBatch:
    rows = [(round(share * total), b) for share, b in c.batch_table]
    for (before, _), (start, _), row in zip(rows, rows[1:], c.batch_table[1:]):
        if start <= before:
            c._fail("batch_table", f"the row {row!r} starts at token {start:,} of the {total:,}-token "
                    "budget, where the row before starts too; drop it or move it later")
    return PiecewiseBatch(lr, rows, **sizes)


register_batch_policy("table", _table,
    help="piecewise constant from batch_table", validate=ScheduleConfig._validate_table)
register_batch_policy("seesaw", lambda c, lr, total, sizes: Seesaw(lr, c.batch_size, c.ratio, **sizes),
                      help="Seesaw (Meterez et al. 2025): at each milestone of the LR schedule, LR x sqrt(ratio) "
                           "and batch / ratio", milestones=True)
register_batch_policy("seesaw-family", lambda c, lr, total, sizes: SeesawFamily(
    lr, c.batch_size, c.alpha, c.beta, **sizes),
    help="Seesaw's (alpha, beta) family: LR / alpha and batch x beta per milestone", milestones=True,
    validate=ScheduleConfig._validate_family)
register_batch_policy("smith", lambda c, lr, total, sizes: SmithRamp(lr, c.batch_size, c.ratio, **sizes),
                      help="Smith et al. 2017: at each milestone batch / ratio, the LR held",
                      milestones=True)


def register_lr_schedule(name: str, build: Callable[[ScheduleConfig, float, int, int], lr_module.LRSchedule], *,
                         help: str) -> LRScheduleEntry:
    """Declare ``schedule.lr_schedule = name`` (replacing one of that name): ``build(config, peak_lr,
    total_tokens, warmup_tokens)`` returns the schedule (``config.final_lr`` is a fraction of the
    peak, as the classes take it); ``help`` is its line in --help-config."""
    check_registration("register_lr_schedule", name, LR_BUILDERS, {"build": build}, {"help": help})
    LR_BUILDERS[name] = LRScheduleEntry(build, help)
    return LR_BUILDERS[name]


register_lr_schedule("constant", lambda c, peak, total, warmup: lr_module.Constant(peak, total, warmup),
                     help="peak_lr after the warmup, to the end")
register_lr_schedule("cosine", lambda c, peak, total, warmup: lr_module.Cosine(peak, total, warmup, c.final_lr),
                     help="cosine from peak_lr to final_lr x peak_lr after the warmup")
register_lr_schedule("linear", lambda c, peak, total, warmup: lr_module.LinearDecay(peak, total, warmup,
                                                                                    c.final_lr),
                     help="a straight line from peak_lr to final_lr x peak_lr after the warmup")
def _wsd(c: ScheduleConfig, peak: float, total: int, warmup: int) -> lr_module.LRSchedule:
    if round(c.wsd_cooldown * total) < 1:
        c._fail("wsd_cooldown", f"is {c.wsd_cooldown * total:.3g} tokens of the {total:,}-token budget, "
                "less than one: no cooldown; raise it")
    return lr_module.WSD(peak, total, warmup, c.final_lr, c.wsd_cooldown, c.wsd_shape)


register_lr_schedule("wsd", _wsd,
                     help="warmup-stable-decay: hold peak_lr, cool down over the last wsd_cooldown of the "
                          "budget with wsd_shape (Hu et al. 2024)")
register_lr_schedule("lans", lambda c, peak, total, warmup: lr_module.WarmupHoldPolynomial(
    peak, total, warmup, 0.0, round(c.lans_hold * total), c.lans_power),
                     help="warmup, hold peak_lr for lans_hold of the budget, polynomial decay of power "
                          "lans_power to 0 (Zheng et al. 2020)")
register_lr_schedule("inverse-sqrt", lambda c, peak, total, warmup: lr_module.InverseSqrt(peak, total, warmup),
                     help="peak_lr x sqrt(warmup tokens / tokens) after the warmup (Vaswani et al. 2017)")
