"""Bytes a forward pass saves for backward on this rank, DTensors included (their local shards).

largebatch.memory.measure_forward_bytes watches storages at the dispatcher, which a DTensor (a
wrapper without storage) does not have; this counts, with autograd's saved-tensor hooks, every
distinct storage the autograd graph keeps, parameters excluded. It does not see tensors cached by a
selective-checkpoint context (measure with recompute = "none"). Used to check the activation
memory of Korthikanti et al. 2022 (docs/papers.md: memory) under tensor / sequence parallel.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor


def _storage(t: torch.Tensor):
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_activation_bytes(forward: Callable[[], object], model: torch.nn.Module) -> tuple[object, int]:
    """Run ``forward()`` and return (its result, bytes of the distinct non-parameter storages that
    autograd saved for backward on this rank). Keep the result alive to call backward on it."""
    params = {_storage(p).data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    return result, sum(seen.values())


def peak_saved_activation_bytes(run: Callable[[], object], model: torch.nn.Module) -> tuple[object, int]:
    """Run ``run()`` -- forward AND backward, e.g. a pipeline schedule's step -- and return (its
    result, the PEAK over the run of the bytes of distinct non-parameter storages autograd holds for
    backward on this rank). A storage counts from when it is saved until it is freed (its backward
    ran), so this is the activation memory of the micro-batches in flight (Korthikanti et al. 2022
    §4.2.3)."""
    result, peak, _ = saved_activation_profile(run, model)
    return result, peak


def saved_activation_profile(run: Callable[[], object],
                             model: torch.nn.Module) -> tuple[object, int, Callable[[], dict[int, int]]]:
    """``peak_saved_activation_bytes``, and a function giving the storages saved during ``run()`` that
    are alive when it is called (address: bytes). A buffer torch reuses step after step is the same
    storage each step; a leak is a new one each step."""
    from torch.multiprocessing.reductions import StorageWeakRef

    params = {_storage(p).data_ptr() for p in model.parameters()}
    live: dict[int, tuple[StorageWeakRef, int]] = {}
    peak = 0

    def drop_freed() -> None:
        for ptr in [p for p, (ref, _) in live.items() if ref.expired()]:
            del live[ptr]  # freed by its backward (the address may be reused)

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal peak
        storage = _storage(t)
        if storage.data_ptr() not in params:
            drop_freed()
            live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            peak = max(peak, sum(n for _, n in live.values()))
        # an alias without autograd history: a saved OUTPUT returned as itself would close a cycle
        # (tensor -> its grad_fn -> the saved tensor) that nothing frees once a graph is retained, as
        # the zero-bubble schedules' input-gradient step retains it -- the hook itself would leak
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()

    def alive() -> dict[int, int]:
        drop_freed()
        return {ptr: n for ptr, (_, n) in live.items()}

    return result, peak, alive
