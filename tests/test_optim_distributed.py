"""The sharding hook under real torch.distributed (gloo, 2 processes): each rank holds half of every
tensor (rows split, as FSDP / tensor parallelism would); a ``reduce_norms`` callable all-reduces the
stacked squared norms; the result must equal LAMB and LANS on the whole, unsharded tensors (docs/papers.md,
sharding). Without the hook the ratios would be per shard: the test checks that this differs."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from largebatch.optim import LAMB, LANS

SHAPES = [(6, 5), (8,), (4, 2, 3)]
N_STEPS = 3


def _problem():
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    steps = [[torch.randn(s, generator=gen, dtype=torch.float64) * 2 for s in SHAPES] for _ in range(N_STEPS)]
    return params, steps


def _sum_over_ranks(squared_norms, params):
    dist.all_reduce(squared_norms)  # sum of the shards' partial squared norms
    return squared_norms


def _sharded(optimizer_class):
    return functools.partial(optimizer_class, reduce_norms=_sum_over_ranks)


def _run(optimizer_class, params, steps, rank=None, world=1):
    shard = (lambda t: t.clone()) if rank is None else (lambda t: t.chunk(world)[rank].clone())
    live = [torch.nn.Parameter(shard(p)) for p in params]
    optimizer = optimizer_class(live, lr=0.05, max_grad_norm=1.0)
    for grads in steps:
        for p, g in zip(live, grads):
            p.grad = shard(g)
        optimizer.step()
    return [p.detach() for p in live]


def _worker(rank, world, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params, steps = _problem()
        for name, cls in (("lamb", LAMB), ("lans", LANS)):
            torch.save(_run(_sharded(cls), params, steps, rank, world), os.path.join(results_dir, f"{name}{rank}.pt"))
            torch.save(_run(cls, params, steps, rank, world), os.path.join(results_dir, f"{name}_local{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_sharded_trust_ratios_equal_unsharded(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    params, steps = _problem()
    for name, cls in (("lamb", LAMB), ("lans", LANS)):
        whole = _run(cls, params, steps)
        shards = [torch.load(tmp_path / f"{name}{r}.pt") for r in range(world)]
        local = [torch.load(tmp_path / f"{name}_local{r}.pt") for r in range(world)]
        for i, expected in enumerate(whole):
            err = float((torch.cat([s[i] for s in shards]) - expected).abs().max())
            assert err < 1e-12, (name, i, err)
        differs = max(float((torch.cat([s[i] for s in local]) - w).abs().max()) for i, w in enumerate(whole))
        assert differs > 1e-6, "per-shard norms should give a different algorithm"
