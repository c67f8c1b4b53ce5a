"""Worker code for tests/test_meta_init.py: runs INSIDE 2 spawned gloo ranks (1 thread each).

Each case builds a model on the meta device, shards it (FSDP2 over 2 replicas, or tensor + sequence
parallel over 2 ranks), materialises it, and compares with the plain one-process build of the same
seed (and with the plain build sharded the same way); rank 0 and rank 1 each write what they
measured to results_rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from largebatch.models import build_model
from largebatch.optim import LAMB, param_groups
from largebatch.parallel import ParallelConfig, init_distributed, parallelize, rank_guard, shard_optimizer, unwrap
from largebatch.parallel.materialize import build_on_meta, materialize
from largebatch.parallel.pipeline import pipeline_parallelize
from parallel_cases import batch, full, joined, local_batch, loss_and_backward, states, tiny

STEPS = 3


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the floating-point storages that tensors made inside the block hold alive at
    once (a storage is counted once, while any tensor made here still views it; DTensors by their
    local tensor). Integer and bool tensors (indices, the causal mask) are not parameters."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[int, set[int]]] = {}  # data_ptr -> (bytes, live tensor ids)
        self.peak = 0

    def _drop(self, ptr: int, tensor_id: int) -> None:
        nbytes, ids = self.storages[ptr]
        ids.discard(tensor_id)
        if not ids:
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            t = t._local_tensor if isinstance(t, DTensor) else t
            if not isinstance(t, torch.Tensor) or t.is_meta or not t.is_floating_point():
                continue
            storage = t.untyped_storage()
            nbytes, ids = self.storages.setdefault(storage.data_ptr(), (storage.nbytes(), set()))
            if id(t) not in ids:
                ids.add(id(t))
                weakref.finalize(t, self._drop, storage.data_ptr(), id(t))
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self.storages.values()))
        return out


def local_bytes(model) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in unwrap(model).parameters())


def table_bytes(model) -> int:
    """Bytes of the floating-point buffers (the rotary cos/sin tables, whole on every rank; the causal
    mask is bool): allocated by materialising, as the parameters are."""
    return sum(b.nbytes for b in unwrap(model).buffers() if b.is_floating_point())


def global_loss(model, state, idx, targets) -> float:
    """The step's mean loss over the global batch (every rank the same value), after backward."""
    loss_sum = loss_and_backward(model, state, idx, targets).double()
    n = torch.tensor(float((local_batch(state, idx, targets)[1] != -100).sum()), dtype=torch.float64)
    if state.dp_size > 1:
        dist.all_reduce(loss_sum, group=state.dp_group)
        dist.all_reduce(n, group=state.dp_group)
    return float(loss_sum / n)


def train(model, state, idx, targets) -> list[float]:
    opt = shard_optimizer(LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=0.02), state)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(global_loss(model, state, idx, targets))
        opt.step()
    return losses


def rotary_ok(model, reference) -> bool:
    """Every held block's rotary tables (non-persistent buffers, rebuilt by Rotary.init_buffers after
    the meta build) equal the plain build's bit for bit; True where the model has none."""
    pairs = [(b.attn.rotary, r.attn.rotary) for b, r in zip(model.blocks, reference.blocks)
             if b is not None and b.attn.rotary is not None]
    return all(not ours.cos.is_meta and torch.equal(ours.cos, theirs.cos) and torch.equal(ours.sin, theirs.sin)
               for ours, theirs in pairs)


def meta_cases(results: dict) -> None:
    for kind in ("gpt", "bert", "llama", "qwen3", "olmo"):
        cfg = tiny(kind, bias=False)  # no biases: see parallel_cases.optimizer_cases (k.bias noise)
        idx, targets = batch(kind)
        torch.manual_seed(0)
        reference = build_model(cfg)
        rng_after = torch.get_rng_state()
        model0 = copy.deepcopy(reference)
        ref_losses = []
        ref_opt = LAMB(param_groups(reference, weight_decay=0.01), lr=0.02)
        for _ in range(STEPS):
            ref_opt.zero_grad()
            _, loss = reference(idx, targets)
            loss.backward()
            ref_opt.step()
            ref_losses.append(float(loss))
        for mode in ("fsdp", "sp"):
            state, key = states(mode), f"{kind}/{mode}"
            torch.manual_seed(0)
            model, log = build_on_meta(lambda: build_model(cfg))
            model = parallelize(model, state, recompute="selective")
            results[f"meta_before/{key}"] = all(p.is_meta for p in unwrap(model).parameters())
            with LiveBytes() as live:
                materialize(unwrap(model), log, state.device)
            results[f"peak_bytes/{key}"] = live.peak
            results[f"local_bytes/{key}"] = local_bytes(model)
            results[f"table_bytes/{key}"] = table_bytes(model)
            results[f"plain_local_bytes/{key}"] = local_bytes(parallelize(copy.deepcopy(model0), state))
            results[f"rng_same/{key}"] = torch.equal(torch.get_rng_state(), rng_after)
            raw, ref = unwrap(model), dict(model0.named_parameters())
            results[f"param_diff/{key}"] = max(float((full(p.detach()) - ref[n]).abs().max())
                                               for n, p in raw.named_parameters())
            output = raw.head.decoder if kind == "bert" else raw.lm_head
            results[f"tied/{key}"] = output.weight is raw.tok_emb.weight
            results[f"rotary_ok/{key}"] = rotary_ok(raw, model0)
            if kind != "bert":
                mask = raw.blocks[0].attn.core.future
                results[f"mask_ok/{key}"] = bool(torch.equal(
                    mask, torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)))
            losses = train(model, state, idx, targets)
            results[f"loss_rel_err/{key}"] = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
            results[f"param_bytes/{kind}"] = sum(p.nbytes for p in model0.parameters())
            results[f"largest_param_bytes/{kind}"] = max(p.nbytes for p in model0.parameters())


def pipeline_cases(results: dict, config: ParallelConfig, prefix: str) -> None:
    """Pipeline stages started on the meta device: cut to this rank's stage, parallelized,
    materialised; compared with the one-process build and with the plain build cut the same way."""
    for kind in ("gpt", "bert", "llama"):
        cfg = replace(tiny(kind), tie_embeddings=False)  # pipeline stages refuse tied embeddings
        key = f"{prefix}/{kind}"
        torch.manual_seed(0)
        reference = build_model(cfg)
        rng_after = torch.get_rng_state()
        ref = dict(reference.named_parameters())
        state = joined(config)
        plain = pipeline_parallelize(copy.deepcopy(reference), state).model
        torch.manual_seed(0)
        model, log = build_on_meta(lambda: build_model(cfg))
        with LiveBytes() as live:
            model = pipeline_parallelize(model, state, init_log=log).model
        held = dict(model.named_parameters())
        results[f"names/{key}"] = sorted(held)
        results[f"names_same/{key}"] = sorted(held) == sorted(n for n, _ in plain.named_parameters())
        results[f"param_diff/{key}"] = max(float((full(p.detach()) - ref[n]).abs().max()) for n, p in held.items())
        results[f"rng_same/{key}"] = torch.equal(torch.get_rng_state(), rng_after)
        results[f"local_bytes/{key}"] = local_bytes(model)
        results[f"plain_local_bytes/{key}"] = local_bytes(plain)
        results[f"stage_bytes/{key}"] = sum(ref[n].nbytes for n in held)  # the stage, unsharded
        results[f"param_bytes/{key}"] = sum(p.nbytes for p in reference.parameters())
        results[f"largest_param_bytes/{key}"] = max(p.nbytes for p in reference.parameters())
        results[f"peak_bytes/{key}"] = live.peak
        results[f"table_bytes/{key}"] = table_bytes(model)
        results[f"mask_ok/{key}"] = all(  # every kept GPT block's causal mask rebuilt
            torch.equal(b.attn.core.future, torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1))
            for b in model.blocks if b is not None) if kind != "bert" else True
        results[f"rotary_ok/{key}"] = rotary_ok(model, reference)


def run_all(out_dir: str) -> None:
    state = states("fsdp")
    results: dict = {}
    with rank_guard(state):
        meta_cases(results)
        pipeline_cases(results, ParallelConfig(pp=2), "pp")
    (Path(out_dir) / f"results_rank{state.rank}.json").write_text(json.dumps(results, indent=1))


def run_2d(out_dir: str) -> None:
    """4 ranks, FSDP2 over tensor + sequence parallel: the strided shards FSDP lays over the TP
    shards (``_StridedShard``) are cut by DTensor; the values must still equal one process."""
    state = init_distributed(ParallelConfig(dp=2, tp=2, dp_mode="fsdp", sequence_parallel=True))
    results: dict = {}
    with rank_guard(state):
        for kind in ("gpt", "bert", "llama"):
            torch.manual_seed(0)
            plain = build_model(tiny(kind))
            reference = dict(plain.named_parameters())
            torch.manual_seed(0)
            model, log = build_on_meta(lambda: build_model(tiny(kind)))
            model = parallelize(model, state)
            materialize(unwrap(model), log, state.device)
            results[f"param_diff/{kind}"] = max(float((full(p.detach()) - reference[n]).abs().max())
                                                for n, p in unwrap(model).named_parameters())
            results[f"rotary_ok/{kind}"] = rotary_ok(unwrap(model), plain)
            results[f"placements/{kind}"] = sorted({str(p.placements) for p in unwrap(model).parameters()})
        pipeline_cases(results, ParallelConfig(pp=2, tp=2, sequence_parallel=True), "pp_tp")
    (Path(out_dir) / f"results_rank{state.rank}.json").write_text(json.dumps(results, indent=1))
