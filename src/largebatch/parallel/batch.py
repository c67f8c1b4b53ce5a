"""Variable batch under data parallel: splitting a step's batch, and the noise scale across ranks.

The joint schedule (Seesaw, ramps; docs/papers.md: schedules) gives a global batch in sequences. Under data
parallel each of the dp ranks takes an equal contiguous slice of the step's sample ids and
accumulates it as whole micro-batches, so a step is the same computation whatever dp is; a batch
that does not split evenly is an error, not a silent rounding (docs/papers.md: schedules "Granularity").

Gradient noise scale (McCandlish et al. 2018, App. A; docs/papers.md: schedules "Critical batch size") from
two batch sizes that data parallel gives for free: B_small = one rank's batch (its local gradient,
before the all-reduce) and B_big = the global batch (the all-reduced gradient). The local squared
norms of the dp ranks are averaged (dp unbiased estimates of |G_small|^2 instead of one). Under
DDP, ``LocalGradNorm`` records the local squared norm inside DDP's communication hook, from the
very buckets it all-reduces: no extra pass over the gradients and no extra collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from largebatch.parallel.mesh import ParallelState


def micro_batches_per_rank(global_batch: int, micro_batch: int, dp_size: int) -> int:
    """How many micro-batches each data-parallel rank accumulates for a step of ``global_batch``."""
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("dp_size", dp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be a positive integer")
    per_step = micro_batch * dp_size
    if global_batch % per_step:
        lower, upper = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
        raise ValueError(f"batch of {global_batch} sequences does not split into micro-batches of "
                         f"{micro_batch} "
                         f"on {dp_size} data-parallel ranks (multiples of {per_step}): use a batch of "
                         f"{lower or per_step} or {upper}, or set run.micro_batch so that micro_batch x dp "
                         f"divides every batch size of the schedule")
    return global_batch // per_step


def rank_samples(sample_ids: Sequence[int], state: ParallelState) -> Sequence[int]:
    """This rank's contiguous slice of a step's sample ids (same on all tp ranks of a dp rank)."""
    if len(sample_ids) % state.dp_size:
        raise ValueError(f"{len(sample_ids)} samples do not split across dp = {state.dp_size} ranks")
    per_rank = len(sample_ids) // state.dp_size
    return sample_ids[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]


class LocalGradNorm:
    """Squared L2 norm of this rank's accumulated gradient before DDP's all-reduce.

    ``LocalGradNorm.install(ddp_model, state)`` registers the comm hook; read ``take()`` after the
    step's last (synchronising) backward: it returns the squared norm and resets.

    Each parameter's part is summed on its own and the parts in the model's parameter order, so the
    value does not depend on how DDP laid the gradients out in its buckets: a process that resumed a
    run has its first backward's layout for one step where the run had the rebuilt one, and a sum
    over the bucket in layout order came out 1 ulp apart (the noise scale then too).
    """

    def __init__(self, state: ParallelState, parameters: Sequence[torch.nn.Parameter] = ()):
        self.state = state
        self.order = {id(p): i for i, p in enumerate(parameters)}
        self.parts: dict[int, torch.Tensor] = {}

    @classmethod
    def install(cls, ddp_model: torch.nn.Module, state: ParallelState) -> "LocalGradNorm":
        recorder = cls(state, list(ddp_model.parameters()))
        ddp_model.register_comm_hook(recorder, _record_then_allreduce)
        return recorder

    def record(self, parameters: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor]) -> None:
        for p, g in zip(parameters, gradients):
            part = g.double().square().sum()
            self.parts[id(p)] = self.parts[id(p)] + part if id(p) in self.parts else part

    def take(self) -> torch.Tensor:
        keys = sorted(self.parts, key=lambda k: self.order.get(k, len(self.order)))
        value = (torch.stack([self.parts[k] for k in keys]).sum() if keys
                 else torch.zeros((), dtype=torch.float64, device=self.state.device))
        self.parts = {}
        return value


def _record_then_allreduce(recorder, bucket):  # no annotations: DDP checks them literally
    recorder.record(bucket.parameters(), bucket.gradients())  # local gradient, not yet averaged
    return default_hooks.allreduce_hook(recorder.state.dp_group, bucket)


def noise_scale_inputs(local_squared: torch.Tensor, global_squared: torch.Tensor, local_batch: int,
                       state: ParallelState, local_targets: int | None = None,
                       step_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(|G_small|^2, B_small, |G_big|^2, B_big) for largebatch.schedules.NoiseScale.update.

    local_squared: this rank's squared gradient norm over its ``local_batch`` sequences (before
    the all-reduce; of its stage's parameters under pipeline parallel); global_squared: the squared
    norm of the all-reduced gradient (same on every rank). One all-reduce averages the local norms
    over the dp group -- over the whole job under pp, which also sums the stages' parts (replicas
    hold whole tensors: no tensor parallel). The norms stay device tensors (no host read): the
    trainer feeds them to the estimator when it logs.

    local_targets, step_targets: this rank's target count and the step's over all ranks, when the
    rank's loss was scaled by dp / step_targets (the trainer's convention): its gradient is then its
    own mean gradient times dp x local_targets / step_targets, which is 1 only when every rank has
    the same count (a causal LM; not masked-LM batches), so its squared norm is scaled back by the
    square of the inverse first. A rank without targets has no mean gradient and adds 0.
    """
    if state.dp_size < 2:
        raise ValueError("noise_scale_inputs needs dp >= 2 (two batch sizes); at dp = 1 estimate from "
                         "one micro-batch vs the accumulated step instead")
    mean_local = local_squared.detach().double().clone()
    if local_targets is not None and step_targets is not None:
        mean_local *= (step_targets.double() / (state.dp_size * local_targets)).square() if local_targets else 0.0
    dist.all_reduce(mean_local, group=state.dp_group if state.pp_size == 1 else None)
    mean_local /= state.dp_size
    return mean_local, local_batch, global_squared.detach(), local_batch * state.dp_size


def global_sum(local: int | float | torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum of a per-rank count over the dp ranks (e.g. the step's target tokens, for the loss scale
    ``dp_size / n_targets``: DDP and FSDP average gradients over dp ranks, so each rank's summed
    loss is divided by n_targets / dp_size to give the gradient of the global mean loss). A 0-d
    float64 tensor on the device: summed there, never read back to the host."""
    if isinstance(local, torch.Tensor):
        total = local.detach().to(device=state.device, dtype=torch.float64, copy=True)
    else:  # a fill on the device: a blocking host-to-device copy would wait for the queue
        total = torch.full((), local, dtype=torch.float64, device=state.device)
    if state.dp_size > 1:
        dist.all_reduce(total, group=state.dp_group)
    return total
