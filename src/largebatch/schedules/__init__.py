"""Token-keyed LR and batch-size schedules, Seesaw, and the gradient noise scale (docs/papers.md: schedules).

Time is tokens consumed; optimizer steps are derived. Usable in any PyTorch loop:

    sched = Seesaw(Cosine(3e-4, total_tokens, warmup_tokens, final_lr=0.1), batch_size=64,
                   ratio=1 / 1.1, micro_batch=8)
    scheduler = TokenLR(optimizer, sched)     # a torch LRScheduler; optimizer built at lr=3e-4
    for step in sched.steps(seq_len):         # step.batch_size, step.micro_batches, step.lr
        ...                                   # accumulate step.micro_batches micro-batches
        optimizer.step()
        scheduler.step(tokens=step.tokens)

``largebatch.integrations.hf`` applies the same schedules inside ``transformers.Trainer``.
"""

from typing import TYPE_CHECKING

from largebatch.schedules.batch import (
                                        ConstantBatch,
                                        JointSchedule,
                                        LinearRamp,
                                        Phase,
                                        PiecewiseBatch,
                                        StepPlan,
                                        check_batch_size,
                                        count_optimizer_steps,
                                        format_phase_table,
                                        trim_to_budget,
)
from largebatch.schedules.config import ScheduleConfig
from largebatch.schedules.lr import (
                                        WSD,
                                        Constant,
                                        Cosine,
                                        InverseSqrt,
                                        LinearDecay,
                                        LRSchedule,
                                        WarmupHoldPolynomial,
                                        scale_lr_for_batch,
)
from largebatch.schedules.noise_scale import NoiseScale
from largebatch.schedules.seesaw import MilestoneSchedule, Seesaw, SeesawFamily, SmithRamp, find_milestones

__all__ = [
    "LRSchedule", "Constant", "Cosine", "LinearDecay", "WSD", "WarmupHoldPolynomial",
    "InverseSqrt", "scale_lr_for_batch",
    "JointSchedule", "Phase", "StepPlan", "ConstantBatch", "LinearRamp", "PiecewiseBatch",
    "check_batch_size", "trim_to_budget", "count_optimizer_steps", "format_phase_table",
    "MilestoneSchedule", "Seesaw", "SeesawFamily", "SmithRamp", "find_milestones",
    "NoiseScale", "ScheduleConfig", "TokenLR",
]


if TYPE_CHECKING:  # what __getattr__ serves, for type checkers (imported on first use at run time)
    from largebatch.schedules.token_lr import TokenLR


def __getattr__(name: str):
    """TokenLR on first use: it needs torch, which the schedules themselves (and the ``largebatch
    schedule`` command) do not -- importing torch costs ~2 s a start."""
    if name == "TokenLR":
        from largebatch.schedules.token_lr import TokenLR

        return TokenLR
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
