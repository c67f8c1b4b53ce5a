"""The per-tensor math of the optimizers, written once, and the three ways it runs.

A kernel is a plain function of tensors: the update of ONE tensor (``seg is None``: per-tensor
values are 0-d, sums are ``t.sum()``), or of a flat BUCKET of many small tensors concatenated
(``seg``: the (N,) tensor index of every element; per-tensor values (n, ...) are gathered with
``at(values, seg)``; sums are per-tensor segment sums). The same function serves

* the single-tensor path (``foreach=False``): eager, one call per tensor;
* small tensors on the default path: eager, one call per flat bucket (a few operations for any
  number of tensors, instead of a few per tensor);
* the fused path (``fused=True``): compiled by ``torch.compile`` -- one graph per kernel for all
  large tensors (dynamic shapes, every tensor seen as 1-D) and one per kernel for all flat
  buckets, so the number of graphs does not grow with the number of distinct parameter shapes.
  Hyperparameters arrive as device tensors, so a new learning rate never recompiles.

The multi-tensor path of large tensors (multi_tensor.py, tiling.py) restates the same formulas in
``torch._foreach_*`` operations for speed; tests check every path against float64 references.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# Tensors below this many elements are updated in flat buckets on the default and fused paths; a
# bucket holds at most FLAT_BUCKET_ELEMENTS elements on a GPU (one kernel launch per operation for
# many tensors) and CPU_FLAT_BUCKET_ELEMENTS on CPU, where an operation below torch's parallel grain
# (32768 elements) runs on one thread, in cache, without waiting for a thread pool.
FLAT_MAX_ELEMENTS = 1 << 15
FLAT_BUCKET_ELEMENTS = 1 << 20
CPU_FLAT_BUCKET_ELEMENTS = 1 << 15

# Column layout of the (n, 9) hyperparameter tensor of the Adam-style kernels (LAMB, LANS): column 0
# is the LR (applied by the caller's step, not read inside a kernel), then these.
(HP_BETA1, HP_ONE_MINUS_BETA1, HP_BETA2, HP_ONE_MINUS_BETA2, HP_EPS, HP_WD, HP_INV_BC1,
 HP_INV_BC2) = range(1, 9)  # HP_INV_BC*: 1/(1 - beta^t)


def device_tensor(rows: list, like: Tensor) -> Tensor:
    """Host numbers as a tensor on ``like``'s device and dtype, copied without a host sync."""
    host = torch.tensor(rows, dtype=like.dtype, device="cpu")  # not torch's default device
    if like.device.type == "cuda":
        return host.pin_memory().to(like.device, non_blocking=True)
    return host.to(like.device)


_CONSTANTS: dict[tuple, Tensor] = {}


def _once(key: tuple, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, made once per ``key`` and kept (bounded: the buckets and meshes of this process's
    optimizers); callers must not write into the result."""
    cached = _CONSTANTS.get(key)
    if cached is None:
        if len(_CONSTANTS) >= 1024:
            _CONSTANTS.clear()
        cached = _CONSTANTS[key] = make()
    return cached


def host_constant(values: tuple, device: torch.device) -> Tensor:
    """An index or mask known on the host (a bucket's tensor indices, sizes, which shards count) as a
    tensor on ``device``, made once per distinct (values, device) and reused by every later step.
    Made every step, ``torch.tensor(values, device=...)`` would be a blocking host-to-device copy,
    which on CUDA waits for every queued kernel (a stream synchronisation, like a read). The key
    holds the values' types too: ``(True,) == (1,)`` in Python, and a mask must never come back
    as an index (or 1.0 as 1)."""
    return _once((values, frozenset(map(type, values)), device), lambda: torch.tensor(values, device=device))


Steps = list[int] | list[Tensor]  # t per tensor: host ints, or 0-d device tensors (capturable)


def on_device(steps: Steps) -> bool:
    """Whether the step counts are device tensors (``capturable=True``): then nothing about them is
    read on the host, and bias corrections are computed on the device."""
    return bool(steps) and isinstance(steps[0], Tensor)


def bias_corrections(steps: list[int], betas, enabled: bool) -> tuple[list[float], list[float]]:
    """(1 - beta1^t, 1 - beta2^t) per tensor in float64 on the host; ones when disabled."""
    if not enabled:
        return [1.0] * len(steps), [1.0] * len(steps)
    beta1, beta2 = betas
    return [1.0 - beta1**t for t in steps], [1.0 - beta2**t for t in steps]


def device_bias_corrections(steps: list[Tensor], betas, enabled: bool, like: Tensor) -> tuple[Tensor, Tensor]:
    """(1 - beta1^t, 1 - beta2^t) per tensor, (n,) each, in float64 on ``like``'s device from device
    step counts (no host read); ones when disabled. torch's float64 pow may differ from the host's in
    the last bit (31 of 20000 steps at beta 0.999); cast to float32, none did
    (tests/test_optim_capturable.py)."""
    n = len(steps)
    if not enabled:
        ones = torch.ones(n, dtype=torch.float64, device=like.device)
        return ones, ones
    t = packed(steps)  # the counts' own buffer when they are consecutive views of one
    t = (torch.stack(steps) if t is None else t).to(like.device, torch.float64).unsqueeze(1)  # (n, 1)
    beta = device_tensor(list(betas), like.new_empty(0, dtype=torch.float64))  # (2,)
    corrections = 1 - torch.pow(beta, t)  # (n, 2)
    return corrections[:, 0], corrections[:, 1]


class Rows:
    """Per-tensor hyperparameter rows (n, k) on the device, with their host copy: a flat bucket whose
    tensors share one row (the usual case: one group, one step count) gets that row alone, (k,), so
    its kernels read scalars instead of gathering a row per element."""

    def __init__(self, rows: list[list[float]] | None, like: Tensor, device: Tensor | None = None):
        self.host = rows  # None: rows computed on the device (device step counts); never read here
        self.device = device_tensor(rows, like) if device is None else device

    def __getitem__(self, i: int) -> Tensor:
        return self.device[i]

    def for_bucket(self, chunk: list[int], index: Tensor) -> Tensor:
        if self.host is None:
            return self.device[index]
        first = self.host[chunk[0]]
        return self.device[chunk[0]] if all(self.host[i] == first for i in chunk) else self.device[index]


def adam_hyperparameters(lr: float, betas, eps: float, weight_decay: float, bias_correction: bool,
                         steps: Steps, like: Tensor) -> Rows:
    """One row per tensor (n, 9), computed in float64 on the host and copied once per bucket and step;
    with device step counts, computed in float64 on the device (no host read) and cast once."""
    beta1, beta2 = betas
    if isinstance(lr, Tensor):  # (the kernels take the LR through the step's scale, never this column:
        lr = 0.0                # a device LR is not read on the host to fill it)
    if on_device(steps):
        return Rows(None, like, device_adam_rows(lr, betas, eps, weight_decay, bias_correction, steps, like))
    if min(steps) < 1:
        raise ValueError(f"steps: t = {min(steps)} for a tensor; t counts this update (1 on the first "
                         "step) and is not incremented here: pass the count after the update (torch's "
                         "functional adamw takes the count before it and adds 1)")
    bc1, bc2 = bias_corrections(steps, betas, bias_correction)
    rows = [[lr, beta1, 1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 / c1, 1 / c2]
            for c1, c2 in zip(bc1, bc2)]  # reciprocals: kernels multiply (divisions bound the CPU kernels)
    return Rows(rows, like)


def device_adam_rows(lr: float, betas, eps: float, weight_decay: float, bias_correction: bool,
                     steps: list[Tensor], like: Tensor) -> Tensor:
    """adam_hyperparameters' rows (n, 9) from device step counts: 1/(1 - beta^t) in float64 on the
    device, then one cast to ``like``'s dtype, as the host rows are cast."""
    beta1, beta2 = betas
    base = device_tensor([lr, beta1, 1 - beta1, beta2, 1 - beta2, eps, weight_decay],
                         like.new_empty(0, dtype=torch.float64)).expand(len(steps), 7)
    bc1, bc2 = device_bias_corrections(steps, betas, bias_correction, like)
    return torch.cat([base, torch.stack([1 / bc1, 1 / bc2], dim=1)], dim=1).to(like.dtype)


class Segments(NamedTuple):
    """A flat bucket's ``seg`` on the eager paths: the tensor index of every element (N,) and the
    tensors' sizes (n,), so that segment sums need no scatter (see ``sums``). The compiled path gets
    the plain index tensor (inductor fuses its index_add_ into the kernel's loop)."""

    ids: Tensor
    lengths: Tensor


def _ids(seg: Tensor | Segments) -> Tensor:
    return seg.ids if isinstance(seg, Segments) else seg


def at(values: Tensor, seg: Tensor | Segments | None) -> Tensor:
    """Per-tensor ``values`` at every element: as given for one tensor, gathered by ``seg`` for a bucket
    (index_select: on CPU ~3.6x faster than indexing with ``seg``, the same values)."""
    return values if seg is None else torch.index_select(values, 0, _ids(seg))


def row(rows: Tensor, seg: Tensor | Segments | None) -> Tensor:
    """Hyperparameters at every element: one row (k,) serves all, (n, k) rows are gathered by ``seg``."""
    return rows if seg is None or rows.dim() == 1 else torch.index_select(rows, 0, _ids(seg))


def sums(t: Tensor, seg: Tensor | Segments | None, n: int | None) -> Tensor:
    """Sum of ``t`` per tensor: 0-d for one tensor, (n,) segment sums for a bucket. Eager buckets sum
    each segment with torch.segment_reduce: on CPU 17 us against index_add_'s 78 us for a bucket of
    25k elements in 7 tensors (index_add_ scatters element by element; docs/optim.md)."""
    if seg is None:
        return t.sum()
    if isinstance(seg, Segments):
        return torch.segment_reduce(t, "sum", lengths=seg.lengths)
    return t.new_zeros(n).index_add_(0, seg, t)


def adam_moments(m: Tensor, v: Tensor, g: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """The new b1*m + (1-b1)*g and b2*v + (1-b2)*g^2 (h: hyperparameters at every element, (..., 9)).
    Functional: the kernels write them back with copy_ at their end, which inductor fuses into the
    kernel's one loop."""
    return (m * h[..., HP_BETA1] + g * h[..., HP_ONE_MINUS_BETA1],
            v * h[..., HP_BETA2] + g * g * h[..., HP_ONE_MINUS_BETA2])


def squared_norms_kernel(t: Tensor, seg: Tensor | None, n: int | None) -> Tensor:
    """[||t||^2] per tensor: (1,) or (1, n)."""
    return torch.stack([sums(t * t, seg, n)])


def fresh_buffers(like: list[Tensor]) -> Callable[[int, list[int]], list[Tensor] | None]:
    """Work buffers for callers of the functional forms that keep none: (slot, indices) -> new ones
    for those tensors on CPU (where pass 1 stores what pass 2 reads), None elsewhere (recomputed)."""
    return lambda slot, index: [torch.empty_like(like[i]) for i in index] if like[0].device.type == "cpu" else None


_COMPILED: dict[Callable, Callable] = {}


def compiled(kernel: Callable) -> Callable:
    """The torch.compile'd version of a kernel, built once per process and shared by all instances."""
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, dynamic=True, fullgraph=True)
    return _COMPILED[kernel]


def packed(tensors: list[Tensor]) -> Tensor | None:
    """The 1-D tensor that ``tensors`` are consecutive pieces of (in order, in one storage), or None.
    Optimizer state of small tensors is kept that way (LayerwiseOptimizer._pack_state), so a flat
    bucket reads and updates it in place instead of gathering and scattering it every step."""
    first = tensors[0]
    base = first._base  # views of one buffer share their base (checked before any pointer)
    if base is None:
        return None
    expected, size = first.data_ptr(), first.element_size()
    for t in tensors:
        if t._base is not base or t.data_ptr() != expected or not t.is_contiguous():
            return None
        expected += t.numel() * size
    total = (expected - first.data_ptr()) // size
    return base.view(-1)[first.storage_offset() - base.storage_offset():][:total]


# (name, bucket indices, views of the updated flat bucket) -> whether the caller now keeps the views
Rebind = Callable[[str, list[int], list[Tensor]], bool]


class Layout:
    """Which tensors of a same-device, same-dtype bucket run how: ``kernel`` indices one tensor per
    call; ``chunks``: flat buckets of small tensors; ``foreach``: indices for the multi-tensor path.

    mode "single": every tensor through the kernels, one at a time; "foreach": small tensors in flat
    buckets, the rest multi-tensor; "fused": small tensors in flat buckets, the rest one at a time,
    everything compiled."""

    def __init__(self, tensors: list[Tensor], mode: str):
        self.n, self.mode = len(tensors), mode
        self.kernel: list[int] = []
        self.foreach: list[int] = []
        self.chunks: list[list[int]] = []
        self.sizes: list[list[int]] = []  # numel of each tensor of each chunk
        limit = CPU_FLAT_BUCKET_ELEMENTS if tensors and tensors[0].device.type == "cpu" else FLAT_BUCKET_ELEMENTS
        filled = limit
        for i, t in enumerate(tensors):
            numel = t.numel()
            if mode == "single" or numel >= FLAT_MAX_ELEMENTS:
                (self.foreach if mode == "foreach" else self.kernel).append(i)
                continue
            if not self.chunks or filled + numel > limit:  # (a first tensor without elements too)
                self.chunks.append([])
                self.sizes.append([])
                filled = 0
            self.chunks[-1].append(i)
            self.sizes[-1].append(numel)
            filled += numel
        for c in [c for c, chunk in enumerate(self.chunks) if len(chunk) == 1][::-1]:  # a bucket of one is
            self.kernel.extend(self.chunks.pop(c))  # just that tensor
            self.sizes.pop(c)
        self.kernel.sort()

    @property
    def compiled(self) -> bool:
        return self.mode == "fused"


class KernelRun:
    """Runs kernels over a Layout's ``kernel`` tensors (one call each, on 1-D views: one dynamic shape for
    every tensor) and ``chunks`` (one call per flat bucket), then writes the flat buckets back into the
    tensors they were gathered from (or lets the caller keep them, see ``finish``).

    ``tensors``: name -> one tensor per bucket index (all same device and dtype, contiguous). Names in
    ``write`` are written back by ``finish()``."""

    def __init__(self, layout: Layout, tensors: dict[str, list[Tensor] | None], write: tuple[str, ...]):
        self.layout, self.tensors, self.write = layout, tensors, write
        like = next(t for ts in tensors.values() if ts for t in ts)
        self.flat: list[dict[str, Tensor | None]] = []
        self.segments: list[tuple[Tensor, Segments]] = []  # (indices (n_c,), seg)
        self.in_place: set[tuple[int, str]] = set()  # (bucket, name) whose flat tensor IS the tensors
        for chunk, layout_sizes in zip(layout.chunks, layout.sizes):
            sizes, n = host_constant(tuple(layout_sizes), like.device), len(chunk)
            index = host_constant(tuple(chunk), like.device)
            seg = _once(("segment ids", tuple(layout_sizes), like.device),
                        # output_size from the host: no device sync to read it, and meta tensors work
                        lambda: torch.repeat_interleave(torch.arange(n, device=like.device), sizes,
                                                        output_size=sum(layout_sizes)))
            self.segments.append((index, Segments(seg, sizes)))
            flat = {}
            for name, ts in tensors.items():
                pieces = None if ts is None else [ts[i] for i in chunk]
                flat[name] = None if pieces is None else packed(pieces)
                if flat[name] is None and pieces is not None:
                    flat[name] = _flatten_dense_tensors(pieces)
                else:
                    self.in_place.add((len(self.flat), name))
            self.flat.append(flat)

    def add(self, name: str, buffers: list[Tensor] | None) -> None:
        """A work tensor (e.g. a direction stored by pass 1): ``buffers`` for the one-at-a-time tensors,
        in the order of ``layout.kernel`` (None: the kernels recompute instead), a fresh flat buffer for
        every bucket."""
        if buffers is None:
            self.tensors[name] = None
        else:
            full: list = [None] * self.layout.n
            for i, buffer in zip(self.layout.kernel, buffers):
                full[i] = buffer
            self.tensors[name] = full
        for flat in self.flat:
            flat[name] = torch.empty_like(flat["x"])

    def __call__(self, kernel: Callable, names: tuple[str, ...], per_tensor: tuple, shared: tuple,
                 out: Tensor | None = None, buckets_only: bool = False) -> None:
        """``kernel(*tensors[names], *per_tensor values, *shared, seg, n)`` everywhere (``buckets_only``:
        on the flat buckets alone); where it returns (k,) / (k, n_c) sums, they are written into the
        columns of ``out`` (k, layout.n)."""
        fn = compiled(kernel) if self.layout.compiled else kernel
        for i in ([] if buckets_only else self.layout.kernel):
            args = [None if self.tensors[name] is None else self.tensors[name][i].view(-1) for name in names]
            result = fn(*args, *(None if v is None else v[i] for v in per_tensor), *shared, None, None)
            if out is not None:
                out[:, i] = result
        for chunk, (index, seg), flat in zip(self.layout.chunks, self.segments, self.flat):
            values = (None if v is None else v.for_bucket(chunk, index) if isinstance(v, Rows) else v[index]
                      for v in per_tensor)
            result = fn(*(flat[name] for name in names), *values, *shared,
                        seg.ids if self.layout.compiled else seg, len(index))
            if out is not None:
                out[:, index] = result

    def finish(self, rebind: Rebind | None = None) -> None:
        """Write the flat buckets' updated tensors back (one multi-tensor copy per name and bucket), or,
        for the names ``rebind`` accepts, hand it views of the flat bucket to keep instead (optimizer
        state: from then on the bucket updates it in place, see ``packed``)."""
        for c, (chunk, flat) in enumerate(zip(self.layout.chunks, self.flat)):
            for name in self.write:
                if (c, name) in self.in_place:
                    continue
                targets = [self.tensors[name][i] for i in chunk]
                views = _unflatten_dense_tensors(flat[name], targets)
                if rebind is None or not rebind(name, chunk, list(views)):
                    torch._foreach_copy_(targets, views)
