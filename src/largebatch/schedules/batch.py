"""Batch-size schedules and the joint (LR, batch) schedule interface, keyed on tokens.

docs/papers.md: schedules.

A joint schedule answers two questions about the token clock: ``lr(tokens)`` and
``batch_size(tokens)`` (in sequences). Optimizer steps are derived, never the key: step k starts at
``tokens_k`` and consumes ``batch_size(tokens_k) * seq_len`` tokens, so ``tokens_{k+1} = tokens_k +
batch_size(tokens_k) * seq_len``. ``steps(seq_len)`` yields each step's ``StepPlan`` (batch size,
micro-batches per rank, LR, tokens) for a plain training loop; its last step takes only the
sequences the budget still needs (``trim_to_budget``), so the steps consume the budget exactly.
``phases(seq_len)`` is the realised
schedule as a table: token range, LR at both ends, batch size, and the optimizer steps that start
inside the range.

Batch sizes here (following Megatron-LM's ``--rampup-batch-size start increment samples`` and
docs/papers.md: schedules "Batch ramps in practice") change the number of micro-batches accumulated, never the
micro-batch shape: every batch is a whole multiple of ``micro_batch * dp_size`` sequences.

* ``ConstantBatch``  a plain LR schedule with a constant batch.
* ``LinearRamp``     Megatron's ramp: from ``start_batch`` up by ``increment`` in equal token slices
                     until ``ramp_tokens``, then ``batch_size``.
* ``PiecewiseBatch`` an explicit table of (start token, batch size).
"""

from __future__ import annotations

import bisect
import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from largebatch.schedules.lr import Constant, LRSchedule, check_tokens, check_whole_tokens, upgrade_lr_state


def check_batch_size(batch_size: int, micro_batch: int = 1, dp_size: int = 1,
                     name: str = "batch_size") -> int:
    """Return ``batch_size`` if it is a whole number of ``micro_batch * dp_size`` sequences.

    Otherwise raise a ValueError naming the conflicting numbers and the nearest sizes that work.
    """
    for arg, value in ((name, batch_size), ("micro_batch", micro_batch), ("dp_size", dp_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{arg}={value!r} must be a positive integer (sequences / ranks)")
    granularity = micro_batch * dp_size
    if batch_size % granularity:
        below = max(granularity, batch_size // granularity * granularity)
        options = sorted({below, batch_size // granularity * granularity + granularity})
        raise ValueError(
            f"{name}={batch_size} is not a whole number of micro_batch ({micro_batch}) x dp_size "
            f"({dp_size}) = {granularity} sequences; use {name}="
            f"{' or '.join(map(str, options))}, or a micro_batch that divides {name} / dp_size")
    return batch_size


def trim_to_budget(batch_size: int, tokens_left: int, seq_len: int, granularity: int = 1) -> int:
    """The sequences of a step that starts ``tokens_left`` tokens before the end of the budget.

    ``batch_size`` while the budget holds a whole step; the last step takes only the sequences still
    needed, ``ceil(tokens_left / seq_len)``, rounded up to a multiple of ``granularity`` (the
    data-parallel ranks, which must all take the same count), never more than ``batch_size``. So a
    run ends exactly on its budget when the budget is a whole number of ``granularity`` sequences,
    and at most ``granularity * seq_len - 1`` tokens past it otherwise; a schedule with bigger
    batches (Seesaw) no longer overshoots more than one with small ones.
    """
    if tokens_left <= 0:
        raise ValueError(f"tokens_left={tokens_left}: the budget is spent, there is no step to trim")
    needed = -(-int(tokens_left) // seq_len)
    return min(batch_size, -(-needed // granularity) * granularity)


def round_down_to_multiple(batch: float, granularity: int) -> int:
    """The largest multiple of ``granularity`` not above ``batch`` (but at least one multiple)."""
    return max(granularity, int(math.floor(batch / granularity + 1e-9)) * granularity)


@dataclass(frozen=True)
class Phase:
    """One row of the realised schedule: tokens [start_tokens, end_tokens)."""

    start_tokens: int
    end_tokens: int
    lr_start: float
    lr_end: float
    batch_size: int
    steps: int
    label: str = ""


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of a joint schedule: what a plain training loop needs to run it."""

    tokens_seen: int
    """Tokens consumed before this step: the schedule's clock."""
    batch_size: int
    """Sequences in this step, over all data-parallel ranks."""
    micro_batch: int
    """Sequences in one micro-batch (forward/backward)."""
    micro_batches: int
    """Micro-batches each rank accumulates: ceil(batch_size / (micro_batch * dp_size)) (the last,
    trimmed step's last micro-batch may be shorter)."""
    lr: float
    """The schedule's LR for this step."""
    tokens: int
    """Tokens this step consumes: batch_size * seq_len (advance the clock by it)."""


class JointSchedule:
    """LR and batch size as functions of tokens consumed. Subclasses set ``lr_schedule``,
    ``total_tokens``, ``micro_batch``, ``dp_size`` and implement ``lr``, ``batch_size``,
    ``breakpoints`` and ``_config``."""

    lr_schedule: LRSchedule
    total_tokens: int
    micro_batch: int
    dp_size: int

    def lr(self, tokens: float) -> float:
        raise NotImplementedError

    def batch_size(self, tokens: float) -> int:
        raise NotImplementedError

    def breakpoints(self) -> list[int]:
        """Token counts where the LR formula or the batch size changes."""
        raise NotImplementedError

    def _config(self) -> dict:
        """The constructor arguments: a resumed run must be rebuilt with the same ones."""
        raise NotImplementedError

    def _phase_label(self, start_tokens: int) -> str:
        return "warmup" if start_tokens < self.lr_schedule.warmup_tokens else ""

    def micro_batches(self, tokens: float) -> int:
        """Micro-batches each data-parallel rank accumulates for the step starting at ``tokens``."""
        return self.batch_size(tokens) // (self.micro_batch * self.dp_size)

    def check_batch(self, tokens: float) -> int:
        """``batch_size(tokens)``, checked: a whole number of micro_batch x dp_size sequences (a batch
        policy registered from outside may return anything); ValueError naming the value otherwise."""
        batch = self.batch_size(tokens)
        granularity = self.micro_batch * self.dp_size
        if (isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < granularity
                or batch % granularity):
            raise ValueError(f"{type(self).__name__}.batch_size({tokens:,} tokens) = {batch!r}: a batch must be a "
                             f"whole multiple of micro_batch x dp_size = {self.micro_batch} x {self.dp_size} = "
                             f"{granularity} sequences")
        return int(batch)

    def step_batch(self, tokens: float, seq_len: int, granularity: int | None = None) -> int:
        """Sequences of the step starting at ``tokens``: ``batch_size(tokens)``, except the budget's
        last step, which takes only the sequences still needed (``trim_to_budget``; ``granularity``
        defaults to ``dp_size``). The LR of that step is ``lr(tokens)`` as ever."""
        return trim_to_budget(self.check_batch(tokens), self.total_tokens - int(tokens), seq_len,
                              self.dp_size if granularity is None else granularity)

    def plan(self, tokens_seen: float, seq_len: int) -> StepPlan:
        """The optimizer step that starts at ``tokens_seen``: batch size, micro-batches, LR (the last
        step trimmed to the budget, see ``step_batch``)."""
        check_batch_size(seq_len, name="seq_len")
        tokens_seen = check_whole_tokens(tokens_seen, "tokens_seen")
        batch = self.step_batch(tokens_seen, seq_len)
        per_rank = -(-batch // (self.micro_batch * self.dp_size))
        return StepPlan(int(tokens_seen), batch, self.micro_batch, per_rank, self.lr(tokens_seen),
                        batch * seq_len)

    def steps(self, seq_len: int, tokens_seen: int = 0) -> Iterator[StepPlan]:
        """The optimizer steps from ``tokens_seen`` (resume) to the end of the budget, in order.

        Each plan is computed when the loop asks for it, so an ``observe_noise_scale`` made during
        a step shapes the next one. They are the steps ``count_optimizer_steps`` counts."""
        check_batch_size(seq_len, name="seq_len")
        tokens_seen = check_whole_tokens(tokens_seen, "tokens_seen")
        while tokens_seen < self.total_tokens:
            step = self.plan(tokens_seen, seq_len)
            yield step
            tokens_seen += step.tokens

    uses_noise_scale = False
    """True when the trainer should feed ``observe_noise_scale(tokens, b_simple)`` (adaptive)."""

    def phases(self, seq_len: int, end_tokens: int | None = None) -> list[Phase]:
        """The realised schedule over ``[0, end_tokens)`` (default: the whole budget) with the
        optimizer steps that start in each phase."""
        check_batch_size(seq_len, name="seq_len")
        total = self.total_tokens if end_tokens is None else end_tokens
        if check_tokens(total, "end_tokens") <= 0:
            raise ValueError(f"end_tokens={end_tokens} must be positive")
        bounds = sorted({0, total, *(b for b in self.breakpoints() if 0 < b < total)})
        table, next_step_start = [], 0  # a step started in one phase may run into the next
        for start, end in zip(bounds, bounds[1:]):
            batch = self.batch_size(start)
            tokens_per_step = batch * seq_len
            steps = max(0, -(-(end - next_step_start) // tokens_per_step))
            next_step_start += steps * tokens_per_step
            table.append(Phase(start, end, self.lr(start), self.lr(max(start, end - 1)), batch,
                               steps, self._phase_label(start)))
        return table

    def state_dict(self) -> dict:
        return {"kind": type(self).__name__, "config": self._config(), "state": {}}

    def load_state_dict(self, state: dict) -> None:
        """Check that ``state`` came from a schedule built the same way; restore its record."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state={state!r} is a {type(state).__name__}, not the dict a schedule's "
                            "state_dict() returns; pass that dict (as saved with the checkpoint)")
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"checkpoint schedule kind={state.get('kind')!r} does not match this "
                             f"{type(self).__name__}; resume with the same [schedule] config")
        if not isinstance(state.get("config"), Mapping):
            raise ValueError(f"checkpoint schedule state has config={state.get('config')!r} (keys: "
                             f"{sorted(state)}): not a state_dict() of a {type(self).__name__}, which holds "
                             "its constructor arguments there; resume from the state this schedule saved")
        mine, saved_config = self._config(), dict(state["config"])
        if "lr_schedule" in saved_config:
            saved_config["lr_schedule"] = upgrade_lr_state(saved_config["lr_schedule"],
                                                           self.lr_schedule)
        for key, saved in saved_config.items():
            if mine.get(key) != saved:
                raise ValueError(f"checkpoint schedule has {key}={saved!r} but this one has "
                                 f"{key}={mine.get(key)!r}; resume with the same [schedule] config")
        self._load_state(state.get("state", {}))

    def _load_state(self, state: dict) -> None:
        pass

    def describe(self, seq_len: int) -> str:
        """The phase table and total optimizer steps, as printed at start-up."""
        return format_phase_table(self.phases(seq_len))


def count_optimizer_steps(schedule: JointSchedule, seq_len: int,
                          tokens: int | None = None) -> int:
    """Optimizer steps that start before ``tokens`` (default: the whole budget), where step k
    starts at tokens_k and consumes ``batch_size(tokens_k) * seq_len`` tokens."""
    return sum(phase.steps for phase in schedule.phases(seq_len, tokens))


def format_phase_table(phases: Sequence[Phase]) -> str:
    lines = [f"{'tokens from':>14} {'to':>14} {'lr start':>10} {'lr end':>10} "
             f"{'batch':>7} {'steps':>9}  phase"]
    for p in phases:
        lines.append(f"{p.start_tokens:>14,} {p.end_tokens:>14,} {p.lr_start:>10.3e} "
                     f"{p.lr_end:>10.3e} {p.batch_size:>7} {p.steps:>9,}  {p.label}")
    lines.append(f"total optimizer steps: {sum(p.steps for p in phases):,}")
    return "\n".join(lines)


def _resolve_total(lr_schedule: LRSchedule, total_tokens: int | None) -> int:
    """The joint schedule's budget: ``total_tokens``, else the LR schedule's. A budget past the LR
    schedule's is allowed (its final LR is held, as past any budget) but warned about, since its
    decay was then planned for a shorter run -- except for a ``Constant`` LR, which has no decay."""
    if not isinstance(lr_schedule, LRSchedule):
        raise TypeError(f"lr_schedule={lr_schedule!r} must be an LR schedule (Cosine(...), WSD(...), "
                        "Constant(...)), the first argument: the batch schedule sets the batch, the LR schedule "
                        "the learning rate at each token")
    total = lr_schedule.total_tokens if total_tokens is None else total_tokens
    if total is None:
        raise ValueError(f"total_tokens is required: {type(lr_schedule).__name__} has no budget")
    total = check_whole_tokens(total, "total_tokens", " (the budget's optimizer steps are counted from it)")
    if total <= 0:
        raise ValueError(f"total_tokens={total} must be positive")
    lr_total = lr_schedule.total_tokens
    if lr_total is not None and total > lr_total and not isinstance(lr_schedule, Constant):
        warnings.warn(
            f"total_tokens={int(total):,} is past the LR schedule's total_tokens={int(lr_total):,}: "
            f"its last {int(total - lr_total):,} tokens run at the held final LR "
            f"{lr_schedule(lr_total):.4g}; build the {type(lr_schedule).__name__} with total_tokens="
            f"{int(total)} (or pass total_tokens <= {int(lr_total)}) unless that is meant",
            UserWarning, stacklevel=3)
    return int(total)


class _PlainLR(JointSchedule):
    """A joint schedule whose LR is the plain LR schedule (the batch does not change it)."""

    def lr(self, tokens: float) -> float:
        return self.lr_schedule(tokens)

    def _common_config(self) -> dict:
        return {"lr_schedule": self.lr_schedule.state_dict(), "total_tokens": self.total_tokens,
                "micro_batch": self.micro_batch, "dp_size": self.dp_size}


class ConstantBatch(_PlainLR):
    """A plain LR schedule with a constant batch size (sequences)."""

    def __init__(self, lr_schedule: LRSchedule, batch_size: int, micro_batch: int = 1,
                 dp_size: int = 1, total_tokens: int | None = None):
        self.lr_schedule, self.micro_batch, self.dp_size = lr_schedule, micro_batch, dp_size
        self.total_tokens = _resolve_total(lr_schedule, total_tokens)
        self.constant_batch = check_batch_size(batch_size, micro_batch, dp_size)

    def batch_size(self, tokens: float) -> int:
        check_tokens(tokens)
        return self.constant_batch

    def breakpoints(self) -> list[int]:
        return self.lr_schedule.breakpoints()

    def _config(self) -> dict:
        return {**self._common_config(), "batch_size": self.constant_batch}


class LinearRamp(_PlainLR):
    """Megatron-style ramp: ``start_batch + increment * floor(tokens / slice)`` until
    ``ramp_tokens``, where ``slice = ramp_tokens / n`` and ``n = (batch_size - start_batch) /
    increment`` increments; ``batch_size`` afterwards."""

    def __init__(self, lr_schedule: LRSchedule, start_batch: int, increment: int,
                 ramp_tokens: int, batch_size: int, micro_batch: int = 1, dp_size: int = 1,
                 total_tokens: int | None = None):
        self.lr_schedule, self.micro_batch, self.dp_size = lr_schedule, micro_batch, dp_size
        self.total_tokens = _resolve_total(lr_schedule, total_tokens)
        check_batch_size(start_batch, micro_batch, dp_size, name="start_batch")
        check_batch_size(increment, micro_batch, dp_size, name="increment")
        check_batch_size(batch_size, micro_batch, dp_size)
        if batch_size < start_batch or (batch_size - start_batch) % increment:
            raise ValueError(f"batch_size - start_batch = {batch_size - start_batch} must be a "
                             f"non-negative multiple of increment={increment}")
        ramp_tokens = check_whole_tokens(ramp_tokens, "ramp_tokens")
        if not 0 < ramp_tokens <= self.total_tokens:
            raise ValueError(f"ramp_tokens={ramp_tokens} must lie in (0, total_tokens="
                             f"{self.total_tokens}]")
        self.start_batch, self.increment, self.final_batch = start_batch, increment, batch_size
        self.ramp_tokens = ramp_tokens
        self.increments = (batch_size - start_batch) // increment

    def batch_size(self, tokens: float) -> int:
        check_tokens(tokens)
        done = min(self.increments, int(tokens * self.increments // self.ramp_tokens))
        return self.start_batch + done * self.increment

    def breakpoints(self) -> list[int]:
        # the batch becomes start + k * increment at the first token with tokens * n >= k * ramp
        ramp = [-(-k * self.ramp_tokens // self.increments) for k in range(1, self.increments + 1)]
        return sorted(set(self.lr_schedule.breakpoints() + ramp))

    def _phase_label(self, start_tokens: int) -> str:
        ramping = start_tokens < self.ramp_tokens and self.increments > 0
        return " ".join(filter(None, [super()._phase_label(start_tokens), ramping * "ramp"]))

    def _config(self) -> dict:
        return {**self._common_config(), "start_batch": self.start_batch,
                "increment": self.increment, "ramp_tokens": self.ramp_tokens,
                "batch_size": self.final_batch}


class PiecewiseBatch(_PlainLR):
    """An explicit table: ``table = [(start_tokens, batch_size), ...]`` starting at token 0."""

    def __init__(self, lr_schedule: LRSchedule, table: Sequence[tuple[int, int]],
                 micro_batch: int = 1, dp_size: int = 1, total_tokens: int | None = None):
        self.lr_schedule, self.micro_batch, self.dp_size = lr_schedule, micro_batch, dp_size
        self.total_tokens = _resolve_total(lr_schedule, total_tokens)
        example = "e.g. table=[(0, 64), (500_000, 128)]"
        if isinstance(table, (str, bytes, Mapping)) or not isinstance(table, Iterable):
            raise TypeError(f"table={table!r} is a {type(table).__name__}, not a list of (start_tokens, "
                            f"batch_size) rows; {example}")
        rows = []
        for row in table:
            pair = () if isinstance(row, (str, bytes, Mapping)) or not isinstance(row, Iterable) else tuple(row)
            if len(pair) != 2:
                raise ValueError(f"table row {row!r} is not a (start_tokens, batch_size) pair; {example}")
            start, batch = pair
            check_tokens(start, "table start")  # checked before any int(): 12.7 must not become 12
            if isinstance(start, bool) or not float(start).is_integer():
                raise ValueError(f"table start {start!r} must be a whole number of tokens")
            check_batch_size(batch, micro_batch, dp_size, name=f"table batch at token {start}")
            rows.append((int(start), int(batch)))
        if not rows or rows[0][0] != 0:
            raise ValueError(f"table={table!r} must start with an entry at token 0")
        for (prev, _), (start, _) in zip(rows, rows[1:]):
            if start <= prev:
                raise ValueError(f"table start tokens must increase strictly; got {prev} then "
                                 f"{start}")
        if rows[-1][0] >= self.total_tokens:
            raise ValueError(f"table start token {rows[-1][0]} is at or past total_tokens="
                             f"{self.total_tokens}: that batch would never be used; drop the row or "
                             "start it inside the budget")
        for start, batch in rows:
            check_batch_size(batch, micro_batch, dp_size, name=f"table batch at token {start}")
        self.starts = [start for start, _ in rows]
        self.batches = [batch for _, batch in rows]

    def batch_size(self, tokens: float) -> int:
        check_tokens(tokens)
        return self.batches[bisect.bisect_right(self.starts, tokens) - 1]

    def breakpoints(self) -> list[int]:
        return sorted(set(self.lr_schedule.breakpoints() + self.starts[1:]))

    def _config(self) -> dict:
        table = [[s, b] for s, b in zip(self.starts, self.batches)]
        return {**self._common_config(), "table": table}

