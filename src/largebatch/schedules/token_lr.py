"""``TokenLR``: a token-keyed schedule as a ``torch.optim.lr_scheduler.LRScheduler``.

    schedule = Cosine(3e-4, total_tokens, warmup_tokens, final_lr=0.1)
    optimizer = LAMB(param_groups(model, weight_decay=0.01), lr=3e-4)
    scheduler = TokenLR(optimizer, schedule, tokens_per_step=batch_size * seq_len)
    for batch in loader:
        loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()                 # or scheduler.step(tokens=n) when steps differ in size

It keeps the token clock ``tokens_seen`` (tokens consumed before the coming optimizer step) and sets
each parameter group's LR to

    lr_g = initial_lr_g * schedule(tokens_seen) / peak_lr * others_g

so a group built with lr = 0.1 * peak stays at a tenth of the schedule; a group at ``peak_lr`` gets
``schedule(tokens_seen)`` exactly. ``schedule`` is an LR schedule (``Cosine``, ``WSD`` ...) or a
joint schedule (``Seesaw`` ...; its ``lr``). ``others_g`` is the factor by which anything else
changed the group's LR since TokenLR last set it (another scheduler in a ``ChainedScheduler``, a
manual edit): TokenLR is chainable the way torch's multiplicative schedulers are. A factor applied
while the LR is 0 (the first step of a warmup from 0) cannot be seen, as for any chainable
scheduler: put TokenLR first in a ``ChainedScheduler``; nor is a factor ever read off an LR of 0
(a group set to 0 by hand returns to the schedule at the next step). In a ``SequentialLR`` a
TokenLR's clock starts when it takes over.

When the batch grows (Seesaw, a ramp), pass each step's tokens: ``scheduler.step(tokens=
plan.tokens)`` with ``plan`` from ``schedule.steps(seq_len)`` (see ``batch.py``).
``state_dict()`` holds the clock and the schedule's own state (a copy: it does not change as
training goes on); ``load_state_dict`` refuses a state from a different schedule, so a resumed run
continues exactly. The LR of the first step after a load comes from the clock and the saved
factors, whether or not the optimizer's own state was loaded too: a load writes it into each
group whose LR is still the one this scheduler set before the load. ``tokens_per_step`` is not
restored: it is the resumed run's own step size (a run resumed with twice the batch counts twice
the tokens per step). ``last_epoch=k`` (torch's way to resume without a state dict: k + 1 steps
taken) starts the clock at ``(k + 1) * tokens_per_step`` unless ``tokens_seen`` is given.
"""

from __future__ import annotations

import copy
import numbers

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from largebatch.schedules.batch import JointSchedule
from largebatch.schedules.lr import LRSchedule, check_tokens, upgrade_lr_state


def _check_tokens_per_step(value, name: str):
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)
                              or value <= 0):
        raise ValueError(f"{name}={value!r} must be a positive integer number of tokens "
                         "(batch size x sequence length), or None to pass step(tokens=...)")
    return value


class TokenLR(LRScheduler):
    """Drive ``optimizer``'s LR from a token-keyed ``schedule`` (see the module docstring).

    tokens_per_step: tokens one optimizer step consumes (batch x seq_len x data-parallel ranks);
        None when every ``step(tokens=...)`` says it (a growing batch).
    tokens_seen: where the clock starts (0 for a fresh run).
    last_epoch: torch's resume argument (the groups need ``initial_lr``): k steps taken before this
        one, so the clock starts at ``(k + 1) * tokens_per_step`` when ``tokens_seen`` is 0.
    """

    def __init__(self, optimizer: Optimizer, schedule: LRSchedule | JointSchedule,
                 tokens_per_step: int | None = None, tokens_seen: int = 0, last_epoch: int = -1):
        if isinstance(schedule, JointSchedule):
            self.peak_lr = schedule.lr_schedule.peak_lr
        elif isinstance(schedule, LRSchedule):
            self.peak_lr = schedule.peak_lr
        else:
            raise TypeError(f"schedule={schedule!r} must be an LR schedule (Cosine(...), WSD(...)) "
                            "or a joint schedule (Seesaw(...), ConstantBatch(...))")
        if not isinstance(optimizer, Optimizer):  # (as torch's schedulers refuse it, before reading it)
            raise TypeError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer: TokenLR(optimizer, "
                            "schedule) writes the schedule's LR into the optimizer's param_groups")
        self.schedule = schedule
        self.tokens_per_step = _check_tokens_per_step(tokens_per_step, "tokens_per_step")
        self.tokens_seen: float = check_tokens(tokens_seen, "tokens_seen")
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Integral) or last_epoch < -1:
            raise ValueError(f"last_epoch={last_epoch!r} must be an integer >= -1 (-1: a fresh run; k: "
                             "k + 1 steps were taken, as torch's schedulers count)")
        if last_epoch >= 0 and not self.tokens_seen:  # torch's resume idiom: the steps say where the clock is
            if self.tokens_per_step is None:
                raise ValueError(f"last_epoch={last_epoch} with tokens_per_step=None: the steps taken do "
                                 "not say how many tokens they consumed; pass tokens_seen= instead")
            self.tokens_seen = (int(last_epoch) + 1) * self.tokens_per_step
        n = len(optimizer.param_groups)
        self._others = [1.0] * n      # what other schedulers multiplied the LR by (chaining)
        self._written: list[float | None] = [None] * n  # the LR TokenLR last left in each group
        self._started = False  # the constructor's own first step does not advance the clock
        self._unloaded: list[float | None] | None = None  # the LRs a load found (see get_lr)
        super().__init__(optimizer, last_epoch)

    def schedule_lr(self, tokens: float) -> float:
        """The schedule's absolute LR at ``tokens`` (a group at lr = peak_lr gets this)."""
        if isinstance(self.schedule, JointSchedule):
            return self.schedule.lr(tokens)
        return self.schedule(tokens)

    def step(self, tokens: int | None = None) -> None:  # type: ignore[override]
        """Advance the clock by the tokens the optimizer step just taken consumed (default
        ``tokens_per_step``) and set the LR for the next step."""
        initial = getattr(self, "_is_initial", False) or not self._started  # torch's first step
        self._started = True
        if not initial:
            if tokens is None and self.tokens_per_step is None:
                raise ValueError("TokenLR was built with tokens_per_step=None: call "
                                 "step(tokens=...) with the tokens this optimizer step consumed")
            tokens = self.tokens_per_step if tokens is None else tokens
            if isinstance(tokens, Tensor) and tokens.dim() == 0 and not tokens.is_floating_point():
                tokens = int(tokens)  # a count a loop kept as a tensor (a read of it, as int() of any)
            if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
                raise ValueError(f"step(tokens={tokens!r}): tokens must be an integer >= 0")
            self.tokens_seen += int(tokens)
        super().step()
        self._written = [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float | Tensor]:  # (torch's LRScheduler.get_lr type; floats here)
        unloaded, self._unloaded = self._unloaded, None
        for i, group in enumerate(self.optimizer.param_groups):
            current, written = float(group["lr"]), self._written[i]
            if unloaded is not None and current == unloaded[i]:
                continue  # the optimizer's state was not loaded: its LR is the fresh one, no factor
            # Another scheduler or the user scaled it. A factor is never read off an LR of 0: it
            # could not be undone, and would hold the LR at 0 for good.
            if written and current and current != written:
                self._others[i] *= current / written
        return self._lrs()

    def _get_closed_form_lr(self) -> list[float]:
        """What torch uses when SequentialLR hands over to this scheduler: the schedule at the
        clock, with nothing carried over from the previous scheduler."""
        self._others = [1.0] * len(self.optimizer.param_groups)
        return self._lrs()

    def _lrs(self) -> list[float]:
        scale = self.schedule_lr(self.tokens_seen)
        lrs = [scale * (float(base) / self.peak_lr) * other
               for base, other in zip(self.base_lrs, self._others)]
        self._written = list(lrs)
        return lrs

    def state_dict(self) -> dict:
        # A deep copy: the lists (_others, _written, base_lrs ...) change in place as training
        # goes on, and a snapshot must not change with them.
        state = copy.deepcopy({k: v for k, v in self.__dict__.items()
                               if k not in ("optimizer", "schedule", "_unloaded")})
        state["schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        # tokens_per_step stays this scheduler's: the resumed run's step size, which may differ
        state = copy.deepcopy({k: v for k, v in state_dict.items() if k not in ("_unloaded", "tokens_per_step")})
        saved = state.pop("schedule")
        if isinstance(self.schedule, JointSchedule):
            self.schedule.load_state_dict(saved)  # checks the config, restores observations
        elif upgrade_lr_state(saved, self.schedule) != self.schedule.state_dict():
            raise ValueError(f"checkpoint TokenLR schedule {saved} does not match this one "
                             f"{self.schedule.state_dict()}; resume with the same schedule")
        fresh = list(self._written)  # what this scheduler wrote before the load
        self.__dict__.update(state)
        # The first step after the load runs at the clock's LR: written into each group whose LR is
        # still the one set before the load (the optimizer's state was not loaded, or not yet: a
        # later load of it brings the same LR, or that LR times a factor get_lr then takes up).
        for group, before, lr in zip(self.optimizer.param_groups, fresh, self._lrs()):
            if before is not None and float(group["lr"]) == before:
                if isinstance(group["lr"], Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
        self._unloaded = fresh
