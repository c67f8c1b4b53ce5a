"""Many processes: data, tensor and sequence parallel, with shard-correct optimizers and checkpoints.

    from largebatch.parallel import ParallelConfig, init_distributed, parallelize, shard_optimizer, unwrap
    state = init_distributed(ParallelConfig(tp=2, sequence_parallel=True))   # under torchrun
    model = parallelize(build_model(cfg).to(state.device), state, recompute="selective")
    optimizer = shard_optimizer(LAMB(param_groups(unwrap(model)), lr=2e-3), state)

The order of techniques is fixed (torchtitan): tensor/sequence parallel -> recomputation -> compile
-> DDP/FSDP2. Papers: docs/papers.md: sharding (norms summed over shards before any trust ratio),
§2 and Korthikanti et al. 2022 §4.2.2 (sequence parallelism). See docs/parallel.md.
"""

# ruff: noqa: E402 -- the package's imports follow the torch check
from largebatch import require_torch

require_torch("largebatch's parallel layer (the trainer; data, tensor, sequence and pipeline parallel)")

from largebatch.parallel.config import ParallelConfig
from largebatch.parallel.launch import spawn
from largebatch.parallel.mesh import ParallelState, RankFailure, init_distributed, rank_guard, seed_ranks, shutdown
from largebatch.parallel.norms import clip_grad_norm_, global_grad_norm, shard_optimizer, sharded_norms
from largebatch.parallel.parallelize import (
    gradient_sync,
    parallelize,
    quiet_fsdp_view_warning,
    settle_ddp_buckets,
    unwrap,
)
from largebatch.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["ParallelConfig", "ParallelState", "RankFailure", "apply_tensor_parallel", "clip_grad_norm_",
           "global_grad_norm", "gradient_sync", "init_distributed", "parallelize", "quiet_fsdp_view_warning",
           "rank_guard", "seed_ranks", "settle_ddp_buckets", "shard_optimizer", "sharded_norms", "shutdown", "spawn",
           "unwrap"]
