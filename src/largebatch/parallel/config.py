"""ParallelConfig: the ``[parallel]`` table of a run -- how many ranks, and how they share the work.

The world (``torchrun --nproc-per-node N``) is laid out as a 2-D device mesh ``dp x tp``
(data parallel x tensor parallel, docs/papers.md: sharding and §2, Korthikanti et al. 2022 §4.2.2
for sequence parallelism). ``dp`` may be left at 0 to take whatever ``world / tp`` is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DP_MODES = ("ddp", "fsdp")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    dp: int = 0
    """Data-parallel degree: ranks that each see a different slice of every batch. 0 (default):
    the world size divided by ``tp`` (so a plain ``torchrun --nproc-per-node N`` is N-way data
    parallel). dp x tp must equal the number of processes torchrun started."""
    tp: int = 1
    """Tensor-parallel degree t: ranks that split every linear layer (q/k/v and fc1 by output
    columns, attn.proj and fc2 by input rows) and the vocabulary. Must divide n_head, the MLP
    width and the vocabulary size. Keep it within one node (it communicates every layer)."""
    sequence_parallel: bool = False
    """With tp > 1: also split the LayerNorm, dropout and residual regions along the sequence across
    the t ranks (Korthikanti et al. 2022 §4.2.2), cutting their activation memory by t at the same
    communication volume. The sequence length must be divisible by tp."""
    loss_parallel: bool = False
    """With tp > 1: keep the logits split over the vocabulary and compute the cross-entropy on the
    shards (Megatron's vocabulary-parallel loss), so the (batch x seq x vocab) fp32 logits are never
    gathered: that output-layer activation memory is divided by tp. The trainer then runs forward and
    backward inside ``ParallelState.loss_context()``."""
    dp_mode: Literal["ddp", "fsdp"] = "ddp"
    """How data-parallel ranks hold the model: 'ddp' (DistributedDataParallel: full replicas,
    gradients all-reduced) or 'fsdp' (FSDP2 ``fully_shard``: parameters, gradients and optimizer
    state sharded across the dp ranks, gathered layer by layer). With tp > 1 use 'fsdp'."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: 'auto' (NCCL when CUDA is available, else gloo), 'nccl' (GPUs) or 'gloo'
    (CPU)."""
    timeout_s: float = 600.0
    """Seconds a collective may wait before it fails the job (no rank hangs forever when another
    one died). Checkpoint saves of large models may need more."""

    def __post_init__(self):
        for name in ("dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "dp" else 1):
                bound = ">= 0 (0: world size / tp)" if name == "dp" else ">= 1"
                raise ValueError(f"parallel.{name} = {value!r}: must be an integer {bound}")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"parallel.dp_mode = {self.dp_mode!r}: must be one of {', '.join(DP_MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel.backend = {self.backend!r}: must be one of {', '.join(BACKENDS)}")
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s = {self.timeout_s!r}: must be > 0 seconds")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel = true needs parallel.tp > 1 (it splits the "
                             "sequence across the tensor-parallel ranks); set tp, or turn it off")
        if self.loss_parallel and self.tp == 1:
            raise ValueError("parallel.loss_parallel = true needs parallel.tp > 1 (it splits the vocabulary "
                             "across the tensor-parallel ranks); set tp, or turn it off")
        if self.tp > 1 and self.dp_mode == "ddp" and self.dp not in (0, 1):
            raise ValueError(f"parallel.dp_mode = 'ddp' with tp = {self.tp} and dp = {self.dp}: DDP "
                             "cannot replicate tensor-parallel (DTensor) parameters; use "
                             "parallel.dp_mode = 'fsdp' for data x tensor parallel")
