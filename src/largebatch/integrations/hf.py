"""largebatch's token-keyed LR schedules inside ``transformers.Trainer``.

    schedule = Cosine(peak_lr=6e-4, total_tokens=tokens, warmup_tokens=tokens // 10, final_lr=0.1)
    trainer = Trainer(model, TrainingArguments(..., learning_rate=6e-4), train_dataset=data,
                      callbacks=[TokenScheduleCallback(schedule, seq_len=128)])

At the start of every optimizer step the callback sets each optimizer group's LR to

    lr_g = initial_lr_g * schedule(tokens_seen) / peak_lr

(a group Trainer built at ``learning_rate`` = peak_lr gets ``schedule(tokens_seen)``; a warning says
so once when ``learning_rate`` is not ``peak_lr``, e.g. left at Trainer's 5e-5), and makes
Trainer log that LR. The token clock is ``tokens_seen = batches * batch_tokens``: ``batch_tokens =
per_device_train_batch_size * max(1, n_gpu) * world_size * seq_len`` (the tokens of one micro-batch on
every rank; without the ``world_size`` factor under ``accelerator_config={"split_batches": True}``,
where the ranks split one batch), and ``batches = global_step * gradient_accumulation_steps``, except
where an epoch's batches are not a multiple of the accumulation: then, as Trainer does, each epoch's
last step takes the remainder (10 batches at accumulation 4: steps of 4, 4 and 2). The clock counts
every rank as a data-parallel rank: under Trainer's tensor, context or sequence parallelism use
``seq_len=None``. With ``seq_len=None`` it is ``state.num_input_tokens_seen`` as the previous
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

import math
import warnings

try:
    from transformers import TrainerCallback
except ImportError as err:  # the [hf] extra: transformers and the accelerate its Trainer needs
    raise ImportError("largebatch.integrations.hf needs transformers, part of the [hf] extra: "
                      "pip install 'largebatch[hf]'") from err

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
    seq_len: tokens per sequence, for the clock ``batches * batch_tokens`` (module docstring); None
        reads ``state.num_input_tokens_seen``.
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
        self._epoch_batches: int | None = None  # len(train_dataloader) per rank, when it has one
        self._warned = False

    def batch_tokens(self, args) -> int:
        """Tokens in one micro-batch (a batch of Trainer's dataloader), over all ranks."""
        config = getattr(args, "accelerator_config", None)
        split = config.get("split_batches", False) if isinstance(config, dict) else \
            getattr(config, "split_batches", False)
        return args.train_batch_size * (1 if split else args.world_size) * self.seq_len

    def tokens_per_step(self, args) -> int:
        """Tokens in one of Trainer's full optimizer steps (``gradient_accumulation_steps``
        micro-batches), over all ranks."""
        return self.batch_tokens(args) * args.gradient_accumulation_steps

    def batches_done(self, args, steps: int) -> int:
        """Micro-batches per rank in Trainer's first ``steps`` optimizer steps: each epoch of
        ``len(train_dataloader)`` batches ends with a shorter step when the accumulation does not
        divide it (transformers' Trainer; a dataloader without a length is taken as endless)."""
        accumulation, epoch = args.gradient_accumulation_steps, self._epoch_batches
        if not epoch or epoch % accumulation == 0:
            return steps * accumulation
        per_epoch = -(-epoch // accumulation)  # optimizer steps per epoch, the last one short
        return (steps // per_epoch) * epoch + min((steps % per_epoch) * accumulation, epoch)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if self.seq_len is None and args.include_num_input_tokens_seen in (False, "no"):
            raise ValueError("TokenScheduleCallback(seq_len=None) reads "
                             "state.num_input_tokens_seen: set TrainingArguments("
                             "include_num_input_tokens_seen=True) or pass seq_len=")
        self._counted = int(getattr(state, "num_input_tokens_seen", 0) or 0)  # a resumed run's count
        peak = self.schedule.peak_lr
        if not self._warned and not math.isclose(args.learning_rate, peak, rel_tol=1e-9):
            self._warned = True  # (once: a resumed or repeated train() says it again only if new)
            warnings.warn(f"TrainingArguments.learning_rate={args.learning_rate:g} is not the schedule's "
                          f"peak_lr={peak:g}: every group's LR is the schedule's x {args.learning_rate / peak:.4g} "
                          f"(learning_rate / peak_lr); set learning_rate={peak:g} for the schedule's own LRs",
                          stacklevel=2)
        try:
            self._epoch_batches = len(train_dataloader) if train_dataloader is not None else None
        except TypeError:  # an iterable dataset: no epochs, every step full
            self._epoch_batches = None

    def on_step_end(self, args, state, control, **kwargs):
        # the tokens of every step so far: read here, not at the next step's begin, where some
        # transformers versions (4.x) have already counted that step's first micro-batch
        self._counted = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.seq_len is None:
            tokens = self._counted
        else:
            tokens = self.batches_done(args, state.global_step) * self.batch_tokens(args)
        self.tokens_seen = check_tokens(tokens, "tokens_seen")
        scale = self.schedule(tokens) / self.schedule.peak_lr
        for group in optimizer.param_groups:
            group["lr"] = float(group.setdefault("initial_lr", group["lr"])) * scale
        if lr_scheduler is not None and hasattr(lr_scheduler, "_last_lr"):
            # Trainer logs lr_scheduler.get_last_lr(): make it the LR this step really uses
            lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
