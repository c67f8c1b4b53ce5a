"""Measure the activation memory a forward pass leaves behind for backward, to check the
closed-form model of Korthikanti et al. 2022 (activations.py) against what really happens.

Two independent views, both after the forward pass, both excluding the tensors it returns:
* tensor_bytes: the storages created during the forward (seen by a TorchDispatchMode, so also those
  a selective-checkpoint context caches -- saved_tensors_hooks cannot see those) that are still
  alive: exactly what autograd and the checkpoint machinery hold.
* allocator_bytes: what the allocator holds -- torch.cuda.memory_allocated() on GPU, glibc
  mallinfo2() on Linux CPUs (includes allocator headers and small Python objects); None elsewhere.

And the whole process, for a run's log: :func:`memory_bytes`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _glibc_in_use() -> Callable[[], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd  # heap chunks in use + mmapped chunks

    return in_use


class _NewStorages(TorchDispatchMode):
    """Weak references to every storage an op creates (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:
                    self.created.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        alive = {ptr: n for ref, ptr, n in self.created if not ref.expired() and ptr not in exclude}
        return sum(alive.values())


class _PeakStorages(_NewStorages):
    """_NewStorages that also follows the bytes alive after each op, and their peak."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.created = [c for c in self.created if not c[0].expired()]
        self.peak = max(self.peak, self.alive_bytes(set()))
        return out


def _warm_up() -> None:
    """The first dispatch-mode use in a process allocates ~25 MB, once; what is already garbage goes
    before a measurement."""
    with _NewStorages():
        torch.ones(2).add_(1)
    gc.collect()


def measure_peak_bytes(step: Callable[[], object]) -> int:
    """The most bytes of storages created during ``step()`` (say a forward and backward) alive at
    once, sampled after every op: activations, their gradients, recomputed tensors, workspaces --
    on any device what torch.cuda.max_memory_allocated() adds over the start on a GPU. Tensors that
    exist before the step (parameters, gradients kept from an earlier step) are not counted."""
    _warm_up()
    tracker = _PeakStorages()
    with tracker:
        step()
    return tracker.peak


@dataclass(frozen=True)
class ForwardMemory:
    tensor_bytes: int
    """Bytes of storages created in the forward and still alive, excluding the returned tensors."""
    allocator_bytes: int | None
    """Growth of the allocator's in-use bytes over the forward, minus the returned tensors' bytes."""


def measure_forward_bytes(forward: Callable[[], object], device: str = "cpu") -> tuple[object, ForwardMemory]:
    """Run forward() (which returns tensors, e.g. (logits, loss)) and measure what it leaves held.
    Returns (forward's result, ForwardMemory). Keep the result alive until you have read the numbers
    (and call backward on it if you like). The first measurement of a given set of ops in a process
    also counts one-time Python dispatch caches (~2 MB seen on CPU): measure once to warm up."""
    in_use = (lambda: torch.cuda.memory_allocated()) if device.startswith("cuda") else _glibc_in_use()
    # no garbage collection inside the window: a cycle of earlier tensors freed there made the
    # allocator's growth negative (-14.8 MB for a forward holding 17.0 MB, once in a full test run);
    # what is already garbage goes first (_warm_up)
    _warm_up()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = in_use() if in_use else None
        tracker = _NewStorages()
        with tracker:
            result = forward()
        after = in_use() if in_use else None
    finally:
        if enabled:
            gc.enable()
    returned = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
    allocator = None if before is None else after - before - sum(returned.values())
    return result, ForwardMemory(tracker.alive_bytes(set(returned)), allocator)


def memory_bytes(device: torch.device) -> int:
    """The peak memory so far: on CUDA the peak allocated by torch on the device; on CPU the
    process's peak resident set (``VmHWM``; the interpreter and libraries included, ~0.3 GiB here).
    (On CPU this was the current resident set, read after the step had freed its activations: half
    the peak of a tiny GPT's step.)"""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
