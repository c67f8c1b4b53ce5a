"""``parallelize``: apply the techniques to a model in one fixed, documented order (torchtitan's).

    1. tensor parallel (+ sequence parallel)   largebatch.parallel.tensor_parallel
    2. activation recomputation                largebatch.memory.apply_recompute (policy by name)
    3. torch.compile (opt-in)                  each block compiled in place
    4. data parallel: DDP or FSDP2             over the mesh's "dp" dimension

Why this order: recomputation wraps the already-sharded block (so it recomputes local shards and
re-issues the block's collectives), compile sees the final per-block graph, and FSDP shards last so
that its all-gathers wrap everything (docs/papers.md: sharding, §2; Korthikanti et al. 2022 §4.2.2).

Gradient accumulation: ``gradient_sync(model, enabled)`` turns the data-parallel reduction off for
all but the last micro-batch of a step (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from largebatch.memory import apply_recompute
from largebatch.parallel.mesh import ParallelState
from largebatch.parallel.tensor_parallel import apply_tensor_parallel


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: each block is one all-gather/reduce-scatter unit, the rest (embeddings, head) the root.
    ``param_dtype`` (e.g. bf16): FSDP2's MixedPrecisionPolicy -- the sharded parameters, their
    gradients and the optimizer stay fp32; the unsharded parameters of the forward and backward are
    cast to ``param_dtype`` (half the all-gather bytes) and gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


def apply_ddp(model: nn.Module, state: ParallelState) -> nn.Module:
    """DDP over the "dp" group. Buffers are broadcast from rank 0 at the start (as the parameters are),
    and again before every forward, as torch's DDP does, unless every buffer is a constant of the
    config: non-persistent and owned by a module that rebuilds it with ``init_buffers(device)`` (the
    built-in kinds' explicit-attention causal mask, s^2 bytes a layer, and rotary cos/sin tables,
    8 s d bytes a layer in fp32, the same on every rank). A model of the user's with any other
    buffer (a BatchNorm's running statistics, a non-persistent running scale) keeps torch's sync."""
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    saved = set(model.state_dict())
    constant = all(hasattr(module, "init_buffers") and f"{prefix}.{name}".lstrip(".") not in saved
                   for prefix, module in model.named_modules() for name, _ in module.named_buffers(recurse=False))
    return DistributedDataParallel(model, device_ids=device_ids, process_group=state.dp_group,
                                   forward_sync_buffers=not constant)


def parallelize(model: nn.Module, state: ParallelState, *, recompute: str | list[str] = "none",
                compile: bool = False, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` for ``state``'s mesh; returns the module to call (a DDP wrapper under DDP).

    ``model`` must already be on ``state.device`` and initialised identically on every rank (same
    seed): tensor parallel distributes rank 0's values, FSDP shards each rank's own copy.
    Checkpoints and the optimizer use ``unwrap(result)`` (the model itself). ``param_dtype``: the
    compute dtype of FSDP's unsharded parameters (see apply_fsdp); ignored by the other modes.
    """
    if state.tp_size > 1:
        apply_tensor_parallel(model, state.tp_mesh, state.sequence_parallel, state.loss_parallel)
    if recompute != "none":
        apply_recompute(model, recompute)
    if compile:
        for block in model.blocks:
            block.compile()
    if state.dp_size > 1:
        if state.dp_mode == "fsdp":
            return apply_fsdp(model, state.dp_mesh, param_dtype)
        return apply_ddp(model, state)
    return model


FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(\w+\) returned a view tensor"
"""torch's warning for a block whose output is a view (tensor parallel's sequence-sharded output
under FSDP2): an in-place op on it would skip FSDP's pre-backward hook."""


def quiet_fsdp_view_warning() -> None:
    """Silence FSDP_VIEW_WARNING for the trainer's models, whose block outputs are only ever used out
    of place (``x = block(x)`` in ``run_blocks``, never ``x += ...``): under FSDP2 with tensor parallel
    it was printed on every rank of every run, naming wrong gradients that cannot occur here. Not
    called by ``parallelize``: a model of one's own may do what the warning is about."""
    import warnings

    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING, category=UserWarning)


def settle_ddp_buckets(model: nn.Module, backward: Callable[[], None]) -> bool:
    """Give a DDP model, in a process that continues a run, the gradient buckets the run had.

    DDP all-reduces its first backward's gradients in one bucket in reverse parameter order, and the
    next forward rebuilds the buckets in the order the gradients arrived (torch's reducer, once per
    process). A run's steps after its first use the rebuilt layout; a process that resumed it used
    the first-step layout for its first step. An all-reduce sums each element in an order set by its
    offset in the bucket: with 3 or more replicas that order, and so the rounding, moved, and the
    resumed run left the uninterrupted one by ~1e-7 from its first step on (2 replicas add two
    numbers, in either order the same). ``backward()``: the caller's forward and backward of any
    batch, with the random state kept; its gradients are dropped here, and the next forward
    rebuilds the buckets as the run's own second step did. Collective: every rank calls it. True if
    it ran (a DDP model), False otherwise."""
    if not isinstance(model, DistributedDataParallel):
        return False
    backward()
    for parameter in model.parameters():
        parameter.grad = None
    return True


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 and tensor parallel modify the model in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Within this context, backward does (enabled=True) or skips the data-parallel gradient
    reduction; skip it on every micro-batch of a step but the last."""
    if isinstance(model, DistributedDataParallel):
        with (nullcontext() if enabled else model.no_sync()):
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield
