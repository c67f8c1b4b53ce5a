"""Training phases: one run, several sequence lengths, each with its own schedule and budget.

BERT pretraining as the LAMB and LANS papers run it (docs/papers.md: LANS) has two phases: most of
the tokens at sequence length 128 with a huge batch, then a short phase at 512 with a smaller one,
each with its own warmup and decay (the LR re-warms in phase 2). A config declares them as an
array of tables::

    [[phases]]
    seq_len = 128
    total_tokens = 3_000_000
    schedule = { batch_size = 64, peak_lr = 1e-2 }     # overrides of [schedule] for this phase

    [[phases]]
    seq_len = 512
    total_tokens = 1_000_000
    micro_batch = 2
    schedule = { batch_size = 16, peak_lr = 5e-3, warmup = 0.1 }
    optimizer_state = "carry"                           # or "reset"

Every phase runs at ``seq_len <= model.seq_len`` (positions beyond a phase's length are simply not
trained in it, as in BERT's phase 1). The run's token clock runs on; a phase's schedule is keyed on
the tokens since the phase began, and its sample order on the sample index within the phase (the
data are re-packed at the phase's length, with the same split and masking rule). A run without
``[[phases]]`` is one phase at ``model.seq_len`` with ``[schedule]`` and ``run.total_tokens``.

:class:`PhaseSwitch` is how the trainer moves from one phase to the next (and onto the phase a
checkpoint was written in): data re-packed, the phase's schedule, a fresh noise-scale estimator,
the optimizer's state carried or reset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from largebatch.arguments import token_count
from largebatch.data import build_data
from largebatch.data.prefetch import Prefetcher
from largebatch.models.registry import model_spec
from largebatch.parallel import shard_optimizer
from largebatch.schedules import ScheduleConfig
from largebatch.train.progress import human_count
from largebatch.typed_config import ConfigError, check_fields, check_off, from_dict, to_dict


@dataclass
class PhaseConfig:
    seq_len: int
    """Tokens per sequence in this phase; at most model.seq_len (the position table's size, or the
    rotary tables')."""
    total_tokens: int = field(metadata={"parse": token_count})
    """This phase's budget in tokens; the run's budget is the sum over phases."""
    micro_batch: int | None = None
    """Sequences per forward/backward in this phase (None: run.micro_batch). Longer sequences need
    smaller micro-batches for the same memory."""
    schedule: dict[str, Any] = field(default_factory=dict)
    """Fields of [schedule] that differ in this phase (e.g. { batch_size = 16, peak_lr = 5e-3 });
    the rest are the run's [schedule]. The schedule restarts at the phase's first token."""
    optimizer_state: Literal["carry", "reset"] = "carry"
    """Keep the optimizer's moments from the previous phase ('carry') or start them afresh
    ('reset'). The LR always follows this phase's schedule (its warmup re-warms it)."""

    def __post_init__(self):
        check_fields(self, "phase")
        for name in ("seq_len", "total_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0")
        check_off("micro_batch", self.micro_batch)


@dataclass(frozen=True)
class Phase:
    """A resolved phase: where it sits in the run and what it runs with."""

    index: int
    seq_len: int
    total_tokens: int
    micro_batch: int
    schedule: ScheduleConfig
    optimizer_state: str


def resolve_phases(phases: list[PhaseConfig], schedule: ScheduleConfig, model_seq_len: int,
                   run_tokens: int, micro_batch: int, init_from: str | None = None,
                   rotary: bool = False) -> list[Phase]:
    """The run's phases, validated; one phase of the whole run when none are declared.
    ``init_from``: the directory that sets model.seq_len, if any (then it cannot be raised, unless
    the model's positions are ``rotary``: no table of that size)."""
    if not phases:
        return [Phase(0, model_seq_len, run_tokens, micro_batch, schedule, "carry")]
    out = []
    base = to_dict(schedule)
    for i, p in enumerate(phases):
        where = f"phases[{i}]"
        if p.seq_len > model_seq_len:
            fix = (f"model.init_from={init_from!r} sets it: shorten the phase to at most {model_seq_len}"
                   if init_from and not rotary else f"raise model.seq_len to {p.seq_len} or shorten the phase")
            raise ConfigError(f"{where}.seq_len = {p.seq_len}: longer than model.seq_len = {model_seq_len} "
                              f"(the position table, or the rotary tables); {fix}")
        merged = {**base, **p.schedule}
        phase_schedule = from_dict(ScheduleConfig, merged, prefix=f"{where}.schedule")
        if i == 0 and p.optimizer_state == "reset":
            raise ConfigError(f"{where}.optimizer_state = 'reset': the first phase has no earlier state; "
                              "remove it (reset applies when a later phase begins)")
        out.append(Phase(i, p.seq_len, p.total_tokens, p.micro_batch or micro_batch, phase_schedule,
                         p.optimizer_state))
    return out


def phases_total(phases: list[PhaseConfig]) -> int:
    return sum(p.total_tokens for p in phases)


def describe(phases: list[Phase]) -> list[str]:
    """One line per phase for the run's header."""
    return [f"phase {p.index}: seq {p.seq_len}, {p.total_tokens:,} tokens, micro-batch {p.micro_batch}, "
            f"{p.schedule.lr_schedule} LR peak {p.schedule.peak_lr:g}, batch {p.schedule.batch_policy} "
            f"{p.schedule.batch_size}" + (", optimizer state reset" if p.optimizer_state == "reset" else "")
            for p in phases]


def with_phase_total(cfg_run, phases: list[PhaseConfig]):
    """``cfg_run`` (a RunConfig) with total_tokens = the phases' sum (unchanged without phases)."""
    if not phases:
        return cfg_run
    return dataclasses.replace(cfg_run, total_tokens=phases_total(phases))


class PhaseSwitch:
    """The Trainer's phase switching (a mixin of ``largebatch.train.loop.Trainer``): it sets the
    trainer's ``phase``, ``data``, ``prefetch``, ``schedule``, ``flops_per_token``, ``noise`` and
    (on a reset) ``optimizer``, and the phase fields of its position ``pos``."""

    def _build_schedule(self):
        p = self.phase
        return p.schedule.build(total_tokens=p.total_tokens, seq_len=p.seq_len, micro_batch=p.micro_batch,
                                dp_size=self.schedule_dp)

    def _set_phase(self, phase: Phase) -> None:
        """Data packed at the phase's length, its schedule and its FLOPs per token."""
        if phase.seq_len != self.phase.seq_len:
            objective = model_spec(self.cfg.model.kind).objective
            self.data = build_data(self.cfg.data, seq_len=phase.seq_len, objective=objective)
            self.prefetch.close()
            self.prefetch = Prefetcher(self.data.train.get_batch, pin_memory=self.device.type == "cuda")
        self.phase = phase
        self.schedule = self._build_schedule()
        self.flops_per_token = self.model_flops_per_token(phase.seq_len)

    def _last_phase(self) -> bool:
        return self.phase.index + 1 == len(self.phases)

    def _next_phase(self) -> bool:
        """At the end of a phase: evaluate at its length (the summary's phase_val_losses), begin the
        next one and evaluate again at the new length. False after the last phase: the run ends."""
        if self._last_phase():
            return False
        self.phase_val_losses.append(self._log_eval())  # at the ending phase's length
        if self._ended_at_target():  # run.stop_at_target reached by that evaluation: the run ends in this phase
            self.phase_val_losses.pop()  # (the summary's final loss is that evaluation's)
            return False
        self._begin_next_phase()
        self.pos.next_eval = self.pos.tokens  # and at the new length
        return True

    def _begin_next_phase(self) -> None:
        from largebatch.train.optimizer import build_optimizer  # it imports train.config, which imports us

        pos = self.pos
        self._set_phase(self.phases[pos.phase + 1])
        pos.phase, pos.phase_start, pos.samples = self.phase.index, pos.tokens, 0
        self.noise = self.phase.schedule.build_noise_scale()  # B_noise is in sequences of the old length
        if self.phase.optimizer_state == "reset":
            self.optimizer = shard_optimizer(build_optimizer(
                self.raw_model, self.cfg.optim, capturable=self.cfg.run.takes_steps_back), self.par)
        self.log(f"phase {self.phase.index} begins at {human_count(pos.tokens)} tokens: "
                 + describe([self.phase])[0].split(": ", 1)[1])
