"""Shard-correct norms: LAMB / LANS / LARS trust ratios and the global gradient norm under sharding.

docs/papers.md: sharding: a trust ratio is defined on the WHOLE tensor. Under tensor parallel or
FSDP2 a parameter is a DTensor and each rank holds a shard, so every per-tensor squared norm must
be summed over the shards (one SUM all-reduce of all the stacked partial norms) before any square
root or ratio -- otherwise the optimizer silently computes a different algorithm.

How a rank contributes: the squared norm of its local shard, for every mesh dimension along which
the tensor is sharded; along a dimension where the tensor is replicated (a DTensor with
``Replicate()``, a plain tensor under DDP or tensor parallel) only the rank at coordinate 0
contributes, so the single all-reduce counts every element exactly once. Pipeline stages hold
disjoint tensors: a per-tensor norm reduces over the ranks of one stage (``ParallelState.stage_group``,
dp x tp), the global gradient norm over the whole job.

``sharded_norms(state)`` is this reduction as the optimizers' public ``reduce_norms`` argument
(``shard_optimizer(optimizer, state)`` sets it on an existing optimizer). The optimizers run their
element-wise math on the local shards of DTensor parameters: the optimizer state stays DTensors
shaped like the parameters (so distributed checkpoints reshard it), the arithmetic is the unchanged
single-process algorithm. ``global_grad_norm`` and
``clip_grad_norm_`` are the same reduction for the trainer (logging, clipping, noise scale).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over TP: not a Shard subclass

from largebatch.optim.core import LayerwiseOptimizer, local_grad
from largebatch.optim.kernels import host_constant
from largebatch.parallel.mesh import ParallelState


def contributes(param: Tensor, state: ParallelState) -> bool:
    """Whether this rank's local squared norm of ``param`` enters the job-wide sum (see module doc)."""
    if state.mesh is None:
        return True
    coords = {dim: rank for dim, rank in state.coords().items() if dim != "pp"}  # stages are disjoint
    sharded_dims: set[str] = set()
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, param.placements):
            if placement.is_shard() or isinstance(placement, _StridedShard):
                sharded_dims.add(name)
            elif not placement.is_replicate():
                raise ValueError(f"parameter with placement {placement} on mesh dim {name!r}: expected "
                                 "Shard or Replicate (a Partial parameter has no defined norm)")
    return all(coords[name] == 0 for name in coords if name not in sharded_dims)


class ShardedSquaredNorms:
    """A ``reduce_norms(squared_norms, params)`` for largebatch.optim optimizers on a sharded model.

    ``squared_norms`` is (k * n,): k quantities (||x||^2, ||r||^2, ...) for the n ``params`` (the
    parameters as given to the optimizer, DTensors or plain), each entry the sum of squares over the
    local shard. Returns the job-wide sums with one all-reduce.
    """

    def __init__(self, state: ParallelState):
        self.state = state
        self.flags: dict[int, bool] = {}  # id(param) -> contributes

    def __deepcopy__(self, memo):  # a copied optimizer reduces over the same process group
        return self

    def __call__(self, squared_norms: Tensor, params: list[Tensor]) -> Tensor:
        if self.state.mesh is None or not any(isinstance(p, DTensor) for p in params):
            return squared_norms  # plain replicas (DDP) already hold identical whole tensors
        n = len(params)
        keep = host_constant(tuple(self._contributes(p) for p in params), squared_norms.device)  # (n,)
        keep = keep.repeat(squared_norms.numel() // n)  # (k * n,)
        summed = torch.where(keep, squared_norms, torch.zeros_like(squared_norms))  # no 0 * inf = nan
        dist.all_reduce(summed, group=self.state.stage_group)  # ONE collective for the bucket: sum over shards
        return summed

    def _contributes(self, p: Tensor) -> bool:
        if id(p) not in self.flags:
            self.flags[id(p)] = contributes(p, self.state)
        return self.flags[id(p)]


def sharded_norms(state: ParallelState) -> ShardedSquaredNorms | None:
    """The ``reduce_norms`` argument of LAMB/LANS/LARS for ``state``'s mesh (None on one process)."""
    return None if state.mesh is None else ShardedSquaredNorms(state)


def shard_optimizer(optimizer: torch.optim.Optimizer, state: ParallelState) -> torch.optim.Optimizer:
    """Make a largebatch.optim optimizer (LAMB, LANS, LARS) shard-correct for ``state``'s mesh: sets its
    public ``reduce_norms`` (the optimizers already compute on the local shards of DTensor parameters,
    gradients and state). A no-op at world size 1, and for element-wise optimizers
    (torch.optim.AdamW, SGD, ...): they run on DTensor parameters as they are.
    """
    if state.mesh is None or not isinstance(optimizer, LayerwiseOptimizer):
        return optimizer
    optimizer.reduce_norms = sharded_norms(state)
    return optimizer


def global_grad_norm(params: list[Tensor], state: ParallelState, local_value: Tensor | None = None) -> Tensor:
    """L2 norm of all gradients of the (possibly sharded) model, identical on every rank: (,) fp64.

    One all-reduce. Parameters without a gradient are skipped. Under DDP, call it after the
    gradients were all-reduced (it then needs no communication, except to sum pipeline stages).
    Where it all-reduces (sharded parameters, pipeline stages), it is non-finite on every rank when
    any rank holds a non-finite gradient -- a replica the sum leaves to another rank included -- or a
    non-finite ``local_value`` (the step's own loss), so that every rank decides a non-finite step
    alike (a fault on one tensor-parallel rank made them disagree). Under DDP the gradients are
    already alike and the caller sums the loss over the ranks.
    """
    with_grad = [p for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    if with_grad:
        grads = [local_grad(p) for p in with_grad]
        squared = torch.stack(torch._foreach_norm(grads)).double().square()  # (n,)
        total = squared.sum()
    sharded = any(isinstance(p, DTensor) for p in with_grad)
    if state.mesh is not None and (sharded or state.pp_size > 1):  # (else every gradient is in the sum
        # already, and the caller sums the loss over the ranks)
        # x * 0 is 0 for a finite x and NaN for inf or NaN: this rank's own values, in the one all-reduce
        own = total * 0 if local_value is None else total * 0 + local_value.detach().to(total) * 0
        if with_grad:  # every element once: replicas along dp/tp leave it to coordinate 0
            keep = host_constant(tuple(contributes(p, state) for p in with_grad), squared.device)
            total = torch.where(keep, squared, torch.zeros_like(squared)).sum()
        total = total + own
        dist.all_reduce(total)  # over the job: shards and pipeline stages
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: list[Tensor], max_norm: float, state: ParallelState,
                    local_value: Tensor | None = None, unscale: Tensor | None = None) -> Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``; return the norm before.

    ``max_norm = math.inf`` only measures. Same rule as torch.nn.utils.clip_grad_norm_, with the
    norm summed over shards (and non-finite on every rank as global_grad_norm says). ``unscale``
    (a 0-d tensor, 1 / an fp16 run's loss scale): the gradients hold the loss scale times the
    gradient; they are divided by it first -- in the same pass as the clipping -- and the norm
    returned and clipped is the unscaled one.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm = {max_norm!r}: must be > 0 (math.inf to only measure)")
    norm = global_grad_norm(params, state, local_value)
    if unscale is not None:
        norm = norm * unscale.to(norm.dtype)
    if math.isfinite(max_norm) or unscale is not None:
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if math.isfinite(max_norm) else None
        if unscale is not None:
            factor = unscale if factor is None else factor * unscale.to(factor.dtype)
        grads = [local_grad(p) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return norm
