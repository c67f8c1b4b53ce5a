"""What a training step leaves on the device until the loop logs: a step that does not log never
waits for the accelerator.

Reading a device value on the host (``.item()``, ``float(t)``, ``bool(t)``) waits until every
kernel queued before it has run, so the host stops queueing the next step and the device idles
while it does. The step therefore keeps its loss, gradient norm, noise-scale inputs and
non-finite flag as tensors; the loop reads them together when it logs, evaluates or checkpoints
(``Deferred.settle``). What stays exact:

* ``run.on_nonfinite = "stop"``: the first non-finite step (its number, tokens, loss and gradient
  norm) is recorded on the device with ``torch.where``, and the run stops at the next read,
  naming that step; no checkpoint is written after it (checkpoints read first).
* the noise-scale estimator (McCandlish et al. 2018, App. A.1) receives the same inputs in the same
  order, later: its state at any log, evaluation or checkpoint is the one a per-step update gives.

:class:`HostReads` counts the host reads of a block of code, to check that a step makes none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """Positions with a target (label != -100) in a host batch, counted on the host (no device read)."""
    labels = batch["targets"] if "targets" in batch else batch["labels"]
    return int(np.count_nonzero(labels.numpy() != -100))


class Deferred:
    """The step's device values awaiting the next host read."""

    def __init__(self, device: torch.device):
        # (step, tokens, loss, gradient norm) of the first non-finite step; step -1: none yet
        self.first_nonfinite = torch.full((4,), -1.0, dtype=torch.float64, device=device)
        self.noise_inputs: list[tuple] = []  # ([|G_small|^2, |G_big|^2, kept], B_small, B_big), step order

    def watch(self, finite: torch.Tensor, step: int, tokens: int, loss: torch.Tensor,
              grad_norm: torch.Tensor) -> None:
        """Record this step if it is the first whose loss or gradient norm is not finite (on device)."""
        this = torch.stack([loss.new_full((), step, dtype=torch.float64),  # fills: no host copy
                            loss.new_full((), tokens, dtype=torch.float64),
                            loss.double(), grad_norm.double()])
        first = ~finite & (self.first_nonfinite[0] < 0)
        self.first_nonfinite = torch.where(first, this, self.first_nonfinite)

    def add_noise_inputs(self, small_sq, small_batch: int, big_sq, big_batch: int,
                         keep: torch.Tensor | None = None) -> None:
        """Queue one step's noise-scale inputs (device tensors) for the next ``settle``; ``keep``
        (0-d bool, default true): whether the step counts (false: a skipped non-finite step)."""
        small_sq, big_sq = torch.as_tensor(small_sq).double(), torch.as_tensor(big_sq).double()
        kept = big_sq.new_ones(()) if keep is None else keep.to(big_sq.device).double()  # a fill: no copy
        norms = torch.stack([small_sq.to(big_sq.device), big_sq, kept])
        self.noise_inputs.append((norms, small_batch, big_batch))

    def settle(self, noise) -> tuple[int, int, float, float] | None:
        """One host read: the first non-finite (step, tokens, loss, grad norm), or None after feeding
        the pending noise-scale inputs to ``noise`` (a NoiseScale)."""
        step, tokens, loss, grad_norm = self.first_nonfinite.tolist()
        if step >= 0:
            return int(step), int(tokens), loss, grad_norm
        pending, self.noise_inputs = self.noise_inputs, []
        if pending:
            norms = torch.stack([n.to(self.first_nonfinite.device) for n, _, _ in pending]).tolist()
            for (small_sq, big_sq, keep), (_, small_batch, big_batch) in zip(norms, pending):
                if keep:
                    noise.update(small_sq, small_batch, big_sq, big_batch)
        return None


def read_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its 0-d device tensors as Python floats, read in one transfer."""
    keys = [k for k, v in record.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return record
    values = torch.stack([record[k].detach().double() for k in keys]).tolist()
    return {**record, **dict(zip(keys, values))}


_PYTHON_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__,
                 torch.Tensor.__float__, torch.Tensor.__int__}


class HostReads:
    """Count host reads of tensor values in a block: ``with HostReads() as reads: ...``.

    ``reads.scalar`` counts aten._local_scalar_dense calls, where every ``.item()``, ``float(t)``,
    ``int(t)`` and ``bool(t)`` lands at the dispatcher, whatever the device; ``reads.calls`` names
    the Python-level reads (``item``, ``tolist``, ``cpu``, ``__bool__``, ``__float__``,
    ``__int__``), which also catch a ``.tolist()`` of a CPU tensor (it reads memory without the
    dispatcher), and ``tensor(device=...)``: host values copied to a device from pageable memory,
    which on CUDA waits for the queue like a read. ``reads.total``: scalar reads plus ``.tolist()``
    calls, each one read."""

    def __init__(self):
        self.scalar = 0
        self.calls: list[str] = []
        self._modes = (_ScalarReads(self), _PythonReads(self))

    @property
    def total(self) -> int:
        return self.scalar + self.calls.count("tolist")

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _ScalarReads(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads.scalar += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class _PythonReads(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PYTHON_READS:
            self.reads.calls.append(func.__name__)
        elif func is torch.tensor and (kwargs or {}).get("device") is not None and \
                torch.device(kwargs["device"]).type != "cpu":
            # host values copied to a device without a pinned buffer: on CUDA a blocking copy, which
            # waits for every queued kernel as a read does (largebatch.optim.kernels.host_constant)
            self.reads.calls.append("tensor(device=...)")
        return func(*args, **(kwargs or {}))
