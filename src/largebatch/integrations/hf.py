"""largebatch's token-keyed LR schedules inside ``transformers.Trainer``.

    schedule = Cosine(peak_lr=6e-4, total_tokens=tokens, warmup_tokens=tokens // 10, final_lr=0.1)
    trainer = Trainer(model, TrainingArguments(..., learning_rate=6e-4), train_dataset=data,
                      callbacks=[TokenScheduleCallback(schedule, seq_len=128)])

At the start of every optimizer step the callback sets each optimizer group's LR to

    lr_g = initial_lr_g * schedule(tokens_seen) / peak_lr

(a group Trainer built at ``learning_rate`` = peak_lr gets ``schedule(tokens_seen)``), and makes
Trainer log that LR. The token clock is ``tokens_seen = global_step * tokens_per_step`` with
``tokens_per_step = per_device_train_batch_size * max(1, n_gpu) * gradient_accumulation_steps *
world_size * seq_len``; with ``seq_len=None`` it is ``state.num_input_tokens_seen`` as the previous
step ended instead (needs ``TrainingArguments(include_num_input_tokens_seen=True)``; it counts the
tokens really fed, padding included unless set to "non_padding"; read at the step's end because
transformers 4.x has already counted the next step's first micro-batch when that step begins).
Both survive ``resume_from_checkpoint``: they live in Trainer's own state. Trainer's
``lr_scheduler_type`` and ``warmup_*`` are overridden.

What Trainer cannot do: change the batch size during a run. Its batch is fixed by
``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x ranks, so Seesaw's batch side
(and a ramp or a batch table) has no effect there. Given a joint schedule whose batch grows, the
callback warns once and applies its *base* LR schedule (``schedule.lr_schedule``) at Trainer's fixed
batch: for Seesaw that is the constant-batch schedule Seesaw is equivalent to (Meterez et al. 2025),
not Seesaw's own stepped LR, which assumes the batch grows (without the growth it would decay the
LR by only sqrt(r) per milestone). To grow the batch, use a plain loop with ``schedule.steps()`` and
``largebatch.schedules.TokenLR`` (examples/schedule_plain_loop.py) or ``largebatch train``.
"""

from __future__ import annotations

import warnings

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - transformers is a test dependency
    raise ImportError("largebatch.integrations.hf needs transformers: pip install transformers"
                      ) from err

from largebatch.schedules.batch import ConstantBatch, JointSchedule
from largebatch.schedules.lr import LRSchedule, check_tokens

BATCH_GROWTH_WARNING = (
    "transformers.Trainer cannot change the batch size during a run: {name}'s batch schedule is "
    "ignored and its base LR schedule ({base}) is applied at Trainer's fixed batch. To grow the "
    "batch use a plain loop with schedule.steps() and TokenLR, or `largebatch train`.")


class TokenScheduleCallback(TrainerCallback):
    """Apply a largebatch LR schedule to Trainer's optimizer at every step (module docstring).

    schedule: an LR schedule (``Cosine``, ``WSD`` ...) or a joint schedule (its base LR is used;
        a warning says so when its batch would change).
    seq_len: tokens per sequence, for the clock ``global_step * tokens_per_step``; None reads
        ``state.num_input_tokens_seen``.
    """

    def __init__(self, schedule: LRSchedule | JointSchedule, seq_len: int | None = None):
        if isinstance(schedule, JointSchedule):
            if not isinstance(schedule, ConstantBatch):
                warnings.warn(BATCH_GROWTH_WARNING.format(
                    name=type(schedule).__name__, base=type(schedule.lr_schedule).__name__),
                    stacklevel=2)
            schedule = schedule.lr_schedule
        if not isinstance(schedule, LRSchedule):
            raise TypeError(f"schedule={schedule!r} must be an LR schedule (Cosine(...), WSD(...)) "
                            "or a joint schedule (Seesaw(...), ConstantBatch(...))")
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                    or seq_len <= 0):
            raise ValueError(f"seq_len={seq_len!r} must be a positive integer (tokens per "
                             "sequence), or None to read state.num_input_tokens_seen")
        self.schedule, self.seq_len = schedule, seq_len
        self.tokens_seen = 0
        self._counted = 0  # state.num_input_tokens_seen when the last step ended (or training began)

    def tokens_per_step(self, args) -> int:
        """Tokens in one of Trainer's optimizer steps, over all ranks."""
        return (args.train_batch_size * args.gradient_accumulation_steps * args.world_size
                * self.seq_len)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.seq_len is None and args.include_num_input_tokens_seen in (False, "no"):
            raise ValueError("TokenScheduleCallback(seq_len=None) reads "
                             "state.num_input_tokens_seen: set TrainingArguments("
                             "include_num_input_tokens_seen=True) or pass seq_len=")
        self._counted = int(getattr(state, "num_input_tokens_seen", 0) or 0)  # a resumed run's count

    def on_step_end(self, args, state, control, **kwargs):
        # the tokens of every step so far: read here, not at the next step's begin, where some
        # transformers versions (4.x) have already counted that step's first micro-batch
        self._counted = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.seq_len is None:
            tokens = self._counted
        else:
            tokens = state.global_step * self.tokens_per_step(args)
        self.tokens_seen = check_tokens(tokens, "tokens_seen")
        scale = self.schedule(tokens) / self.schedule.peak_lr
        for group in optimizer.param_groups:
            group["lr"] = float(group.setdefault("initial_lr", group["lr"])) * scale
        if lr_scheduler is not None and hasattr(lr_scheduler, "_last_lr"):
            # Trainer logs lr_scheduler.get_last_lr(): make it the LR this step really uses
            lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
