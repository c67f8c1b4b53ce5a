"""CPU tiling of the multi-tensor (foreach) path, and the kept work buffers it writes into.

On CPU every foreach sequence of the default path runs tile by tile, each tile 4 MiB of fp32 per
operand, so a chunk stays in cache (L2/L3) from the moments to its norms instead of coming from DRAM
once per operation. Work buffers are kept between steps on CPU, where a fresh parameter-sized
allocation (page faults) costs several times the arithmetic it holds (docs/optim.md). On other
devices there is one tile of whole tensors and no kept buffer (the caching allocator makes transient
buffers cheap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .kernels import host_constant

# Tiles on CPU: every foreach sequence of the default path runs tile by tile, each tile 4 MiB of fp32
# per operand, so a chunk stays in cache (L2/L3) from the moments to its norms instead of coming from
# DRAM once per operation; in cache an element-wise op costs several times less (lerp_: 0.05 against
# 0.28 ns per element, docs/optim.md). Measured at 21M parameters, 2 threads: LAMB 44 -> 37 ms and
# LANS 70 -> 55 ms a step; 2^19 to 2^21 elements were equally good, 2^17 lost to per-op overhead.
CPU_TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Tile:
    """A run of pieces ``(tensor index, start, stop)`` of a group's flattened tensors, processed together
    by one sequence of foreach operations. A tensor split over tiles is split at element boundaries;
    every quantity the optimizers compute is element-wise or a sum of squares, so pieces combine exactly
    by adding their partial squared norms."""

    pieces: tuple[tuple[int, int, int], ...]
    whole: tuple[bool, ...]  # per piece: covers its whole tensor (then views() hands out the tensor itself)

    @property
    def index(self) -> list[int]:
        return [i for i, _, _ in self.pieces]

    def views(self, tensors: list[Tensor]) -> list[Tensor]:
        """The pieces of ``tensors`` (one per group tensor): the tensors themselves, or 1-D views."""
        return [tensors[i] if whole else tensors[i].view(-1)[start:stop]
                for (i, start, stop), whole in zip(self.pieces, self.whole)]

    def pick(self, values: list) -> list:
        """Per-tensor host values, one per piece."""
        return [values[i] for i in self.index]


def make_tiles(tensors: list[Tensor], size: int | None) -> list[Tile]:
    """Cut ``tensors`` into tiles of at most ``size`` elements (small tensors share a tile; a large one
    is split). ``size=None``: one tile of the whole tensors, the plain multi-tensor path (GPUs, where
    one kernel launch per operation over the whole group is what matters). Non-contiguous tensors are
    never split (a split needs a flat view)."""
    if size is None:
        return [Tile(tuple((i, 0, t.numel()) for i, t in enumerate(tensors)), (True,) * len(tensors))]
    tiles, pieces, filled = [], [], 0
    for i, t in enumerate(tensors):
        n, start = t.numel(), 0
        while True:  # at the top, filled < size: every full tile was closed
            take = min(n - start, size - filled) if t.is_contiguous() else n
            pieces.append((i, start, start + take))
            start, filled = start + take, filled + take
            if filled >= size:
                tiles.append(pieces)
                pieces, filled = [], 0
            if start >= n:
                break
    if pieces:
        tiles.append(pieces)
    sizes = [t.numel() for t in tensors]
    return [Tile(tuple(p), tuple(a == 0 and b == sizes[i] for i, a, b in p)) for p in tiles]


def tile_scalars(values: Tensor, tile: Tile) -> list[Tensor]:
    """Per-tensor device values (n,) as one 0-d tensor per piece of ``tile``."""
    if len(tile.pieces) == values.numel() and tile.index == list(range(values.numel())):
        return list(values.unbind())
    return list(values[host_constant(tuple(tile.index), values.device)].unbind())



class Workspace:
    """Parameter-sized work buffers kept between steps, keyed by parameter (CPU only). Never part of
    the optimizer's state_dict, deepcopy or pickle: rebuilt on first use."""

    def __init__(self) -> None:
        # weakly keyed: a parameter dropped from the model and the optimizer takes its buffers with it
        # (by identity: a WeakKeyDictionary compares keys with ==, elementwise for tensors)
        self._buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __len__(self) -> int:
        return len(self._buffers)

    def keep_only(self, keys: set[int]) -> None:
        """Free the buffers of every parameter whose id is not in ``keys`` (frozen, or removed from
        the optimizer's groups while the model keeps it)."""
        for key in [k for k in self._buffers.keys() if id(k) not in keys]:
            del self._buffers[key]

    def buffers(self, keys: list[Tensor], like: list[Tensor], slot: int) -> list[Tensor] | None:
        """Buffer ``slot`` for each key, shaped like ``like`` (flat views); None off CPU."""
        if not like or like[0].device.type != "cpu":
            return None
        out = []
        for key, x in zip(keys, like):
            slots = self._buffers.setdefault(key, [])
            while len(slots) <= slot:
                slots.append(torch.empty(x.numel(), dtype=x.dtype, device=x.device))
            buffer = slots[slot]
            if buffer.dtype != x.dtype or buffer.numel() != x.numel():  # the parameter changed dtype
                buffer = slots[slot] = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            out.append(buffer.view(x.shape))
        return out


def cpu_tiles(tensors: list[Tensor]) -> list[Tile]:
    """Tiles of CPU_TILE_ELEMENTS on CPU, one tile of whole tensors elsewhere, none for no tensors."""
    if not tensors:
        return []
    return make_tiles(tensors, CPU_TILE_ELEMENTS if tensors[0].device.type == "cpu" else None)
