"""ParallelConfig: the ``[parallel]`` table of a run -- how many ranks, and how they share the work.

The world (``torchrun --nproc-per-node N``) is laid out as a device mesh ``pp x dp x tp``
(pipeline x data x tensor parallel; docs/papers.md: sharding and §2, Korthikanti et al. 2022 §4.2.2
for sequence parallelism, Narayanan et al. 2021 for the pipeline schedules), the data-parallel
dimension itself ``dp_replicate x dp_shard`` (torchtitan's layout): FSDP2 shards over dp_shard and
replicates over dp_replicate (HSDP); DDP is dp_shard = 1. ``dp`` may be left at 0 to take whatever
``world / (pp x tp)`` is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from largebatch.typed_config import check_fields

DPMode = Literal["ddp", "fsdp"]
Backend = Literal["auto", "nccl", "gloo"]
PPSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"]
DP_MODES, BACKENDS = get_args(DPMode), get_args(Backend)
# pipeline schedules of torch.distributed.pipelining, by the name the config uses
PP_SCHEDULES = dict(zip(get_args(PPSchedule), ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                                                      "ZBVZeroBubble")))
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zb", "zbv")  # may hold several stages per rank


@dataclass
class ParallelConfig:
    dp: int = 0
    """Data-parallel degree: ranks that each see a different slice of every batch. 0 (default):
    the world size divided by ``pp x tp`` (so a plain ``torchrun --nproc-per-node N`` is N-way data
    parallel). pp x dp x tp must equal the number of processes torchrun started."""
    pp: int = 1
    """Pipeline-parallel degree p: ranks that each hold a contiguous slice of the layers (the first
    also the embedding, the last the final norm, output layer and loss) and pass activations on.
    A step's micro-batches are the pipeline's micro-batches."""
    pp_schedule: PPSchedule = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining): 'gpipe' (all forwards, then all backwards:
    keeps every micro-batch), '1f1b' (one forward one backward: the first stage keeps p
    micro-batches), 'interleaved-1f1b' (pp_virtual_stages stages per rank, smaller bubble) or
    'interleaved-zb' (interleaved zero bubble: backward split into input and weight parts) or 'zbv'
    (zero bubble, V-shaped: 2 stages per rank, rank r holding stages r and 2p - 1 - r). All but
    GPipe need at least p micro-batches per step."""
    pp_virtual_stages: int = 1
    """V: pipeline stages per rank (interleaved schedules; 2 for 'zbv'). The model is cut into
    p x V stages, rank r holding stages r, r + p, ... (Narayanan et al. 2021)."""
    pp_split: list[int] | None = None
    """Optional layer indices where each stage after the first begins (p x V - 1 increasing
    numbers), e.g. [3] for 2 stages of 3 and L - 3 layers; omitted: L / (p x V) layers each."""
    tp: int = 1
    """Tensor-parallel degree t: ranks that split every linear layer (q/k/v and fc1 by output
    columns, attn.proj and fc2 by input rows) and the vocabulary. Must divide n_head, n_kv_head
    (grouped-query attention: k and v are split by whole heads) and the MLP width; a vocabulary it
    does not divide (GPT-2's 50257) is split unevenly. Keep it within one
    node (it communicates every layer)."""
    sequence_parallel: bool = False
    """With tp > 1: also split the LayerNorm, dropout and residual regions along the sequence across
    the t ranks (Korthikanti et al. 2022 §4.2.2), cutting their activation memory by t at the same
    communication volume. The sequence length must be divisible by tp."""
    loss_parallel: bool = False
    """With tp > 1: keep the logits split over the vocabulary and compute the cross-entropy on the
    shards (Megatron's vocabulary-parallel loss), so the (batch x seq x vocab) fp32 logits are never
    gathered: that output-layer activation memory is divided by tp. The trainer then runs forward and
    backward inside ``ParallelState.loss_context()`` (under pp: the pipeline's step, on the last
    stage's loss)."""
    dp_mode: DPMode = "ddp"
    """How data-parallel ranks hold the model: 'ddp' (full replicas, gradients all-reduced:
    DistributedDataParallel, or under pp > 1 bucketed flat all-reduces after the schedule's step) or
    'fsdp' (FSDP2 ``fully_shard``: parameters, gradients and optimizer state sharded across the dp
    ranks, gathered layer by layer; with dp_replicate > 1, HSDP). With tp > 1 use 'fsdp'."""
    dp_replicate: int = 1
    """R, with dp_mode = 'fsdp': HSDP -- the dp ranks form R replica groups of dp / R ranks each;
    FSDP2 shards parameters, gradients and optimizer state within a group (dp / R ways) and
    all-reduces gradients across the groups (the sharding collectives stay inside a group, e.g. a
    node). Must divide dp and leave dp / R > 1. 1 (default): plain FSDP over all dp ranks."""
    backend: Backend = "auto"
    """Collective backend: 'auto' (NCCL when CUDA is available, else gloo), 'nccl' (GPUs) or 'gloo'
    (CPU)."""
    timeout_s: float = 600.0
    """Seconds a collective may wait before it fails the job (no rank hangs forever when another
    one died). Checkpoint saves of large models may need more."""
    step_timeout_s: float | None = None
    """Seconds a collective inside an optimizer step may wait, from each launch's second step on;
    the start-up, the launch's first step (allocations, compilation), evaluations and checkpoint
    saves keep ``timeout_s``. A rank that hangs in a step (a stuck read, a stopped process, a device
    fault) is then found after this many seconds instead of ``timeout_s``. Set it well above the
    slowest step and above rank 0's logging between steps (the other ranks wait for it in the next
    step's first collective). None: ``timeout_s`` throughout."""
    shared_fs_wait_s: float = 15.0
    """Seconds each rank waits at start for the note rank 0 writes into the run directory (and its
    checkpoints/) to appear: a network filesystem's caches can hold a new file back. A rank that has
    not seen it by then is named on every rank and the job stops before any step (the run directory
    must be on a filesystem every node shares). Raise it for a slow filesystem; ranks that share one
    see the note at once and never wait."""

    def __post_init__(self):
        check_fields(self, "parallel")
        for name in ("dp", "tp", "pp", "pp_virtual_stages", "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "dp" else 1):
                bound = ">= 0 (0: world size / (pp x tp))" if name == "dp" else ">= 1"
                raise ValueError(f"parallel.{name} = {value!r}: must be an integer {bound}")
        self._check_pipeline()
        # torch keeps timeouts in whole milliseconds (less is 0 ms: every wait fails at once), and its
        # store refuses ~1e15 s with an OverflowError
        if not 0.001 <= self.timeout_s <= 1e9:
            raise ValueError(f"parallel.timeout_s = {self.timeout_s!r}: must be at least 0.001 seconds (torch "
                             "counts whole milliseconds) and at most 1e9 (~32 years)")
        if self.step_timeout_s is not None and not 0.001 <= self.step_timeout_s <= 1e9:
            raise ValueError(f"parallel.step_timeout_s = {self.step_timeout_s!r}: must be at least 0.001 seconds "
                             "(torch counts whole milliseconds) and at most 1e9, or none (parallel.timeout_s "
                             "throughout)")
        if not 0 <= self.shared_fs_wait_s <= 86400:
            raise ValueError(f"parallel.shared_fs_wait_s = {self.shared_fs_wait_s!r}: must be a number of "
                             "seconds in [0, 86400] (how long each rank waits at start to see rank 0's "
                             "note in the run directory); 15 is the default")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel = true needs parallel.tp > 1 (it splits the "
                             "sequence across the tensor-parallel ranks); set tp, or turn it off")
        if self.loss_parallel and self.tp == 1:
            raise ValueError("parallel.loss_parallel = true needs parallel.tp > 1 (it splits the vocabulary "
                             "across the tensor-parallel ranks); set tp, or turn it off")
        self._check_replicate()
        if self.tp > 1 and self.dp_mode == "ddp" and self.dp not in (0, 1):
            raise ValueError(f"parallel.dp_mode = 'ddp' with tp = {self.tp} and dp = {self.dp}: DDP "
                             "cannot replicate tensor-parallel (DTensor) parameters; use "
                             "parallel.dp_mode = 'fsdp' for data x tensor parallel")

    def _check_replicate(self) -> None:
        r = self.dp_replicate
        if r > 1 and self.dp_mode != "fsdp":
            raise ValueError(f"parallel.dp_replicate = {r} with dp_mode = {self.dp_mode!r}: replica groups are "
                             "HSDP (sharded within a group); DDP already replicates over every dp rank -- set "
                             "dp_mode = 'fsdp' or dp_replicate = 1")
        if r > 1 and self.dp and (self.dp % r or self.dp == r):
            raise ValueError(f"parallel.dp_replicate = {r} with dp = {self.dp}: R must divide dp and leave "
                             f"dp / R > 1 ranks to shard over; choose a proper divisor of {self.dp}")

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: p x V."""
        return self.pp * self.pp_virtual_stages

    def _check_pipeline(self) -> None:
        v = self.pp_virtual_stages
        if v > 1 and self.pp_schedule not in MULTI_STAGE:
            raise ValueError(f"parallel.pp_virtual_stages = {v} with pp_schedule = {self.pp_schedule!r}: "
                             f"several stages per rank need an interleaved schedule "
                             f"({', '.join(MULTI_STAGE)}); set pp_virtual_stages = 1 or change the schedule")
        if self.pp_schedule == "zbv" and v != 2:
            raise ValueError(f"parallel.pp_virtual_stages = {v} with pp_schedule = 'zbv': the V shape holds "
                             "exactly 2 stages per rank; set pp_virtual_stages = 2")
        split = self.pp_split
        if split is None:
            return
        stages = self.pp_stages
        if (not isinstance(split, list) or len(split) != stages - 1
                or any(not isinstance(i, int) or isinstance(i, bool) for i in split)):
            raise ValueError(f"parallel.pp_split = {split!r}: give {stages - 1} layer indices (one per "
                             f"stage after the first of pp x pp_virtual_stages = {stages}), or omit it")
        if split and (split[0] < 1 or any(b <= a for a, b in zip(split, split[1:]))):
            raise ValueError(f"parallel.pp_split = {split!r}: indices must increase from >= 1 (every stage "
                             "needs at least one layer)")


def check_tp_divides(tp: int, field: str, value: int) -> None:
    """ValueError naming ``field`` when tensor-parallel size ``tp`` does not divide its ``value``,
    with the fix that fits the field: attention heads and the MLP width are split over the tp ranks
    (Megatron's layout), and under sequence parallel every sequence length (``model.seq_len``, each
    ``phases[i].seq_len``). (The vocabulary need not divide: DTensor splits it unevenly.)"""
    if value % tp == 0:
        return
    padded = -(-value // tp) * tp
    if "seq_len" in field:
        fix = (f"sequence parallel splits every sequence over the {tp} tensor-parallel ranks: use a length "
               f"that {tp} divides (e.g. {padded}), or set parallel.sequence_parallel = false")
    else:
        fix = f"choose parallel.tp among the divisors of {value}, or change {field.split(' ')[0]}"
    raise ValueError(f"parallel.tp = {tp} does not divide {field} = {value}: {fix}")
