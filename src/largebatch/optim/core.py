"""The shared per-tensor core of the layer-wise adaptive optimizers (LAMB, LANS, LARS).

PAPERS.md §1: every trust ratio is a ratio of L2 norms of WHOLE tensors ("blocks"). This module owns
what the three optimizers have in common, so each technique module only writes its own update:

* ``LayerwiseOptimizer`` -- a ``torch.optim.Optimizer`` base class: argument checks, state, the
  step loop, fp32 math for bf16/fp16 parameters, bit-identical ``state_dict`` resume, optional
  global gradient pre-clipping, the opt-in trust-ratio diagnostics and the three execution paths:

  - ``foreach=True`` (default): multi-tensor ``torch._foreach_*`` kernels over a whole group; on
    CPU in cache-sized tiles (``Tile``, ``make_tiles``) with kept work buffers;
  - ``foreach=False``: a plain loop over tensors calling the per-tensor kernels of the technique;
  - ``fused=True``: the same per-tensor kernels compiled by ``torch.compile`` (inductor), one fused
    kernel per tensor and pass, shapes dynamic and hyperparameters packed in a device tensor, so a
    new learning rate (or a new parameter shape) never recompiles.

  No path synchronises a GPU with the host: norms are stacked on the device and the trust ratios
  are applied as 0-d device tensors. (On CPU, where there is no device to wait for, LANS reads its
  per-tensor gradient normalisation as host floats.)

* ``trust_ratio`` -- ``numerator / denominator``, pinned to 1 where either norm is zero, with the
  optional clips (timm's LAMBC clip of the ratio, torch-optimizer's clamp of ||x||).

Sharding hook (for FSDP / tensor parallelism, PAPERS.md §1 "Sharding")
----------------------------------------------------------------------
Every per-tensor squared norm the optimizers need is computed as ONE stacked 1-D tensor per group
(the concatenation of k blocks of ``len(params)`` entries, one block per quantity: e.g. LAMB's
``[||x_1||^2..||x_n||^2, ||r_1||^2..||r_n||^2]``) and passed through
``self._reduce_squared_norms(squared_norms, params)`` BEFORE any square root or ratio. The global
gradient norm of ``max_grad_norm`` goes through the same hook. The default is the identity. For a
sharded model it becomes one line, e.g.::

    class ShardedLAMB(LAMB):
        def _reduce_squared_norms(self, squared_norms, params):
            torch.distributed.all_reduce(squared_norms, group=self.shard_group)  # sum over shards
            return squared_norms

Every entry is a plain sum of squares over the local shard, so a SUM all-reduce is correct for any k.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_hyperparameters(where: str, lr, betas=None, eps=None, weight_decay=None, momentum=None) -> None:
    """Raise ValueError naming the argument, its value and the fix. ``where`` prefixes the message."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0.0 or math.isinf(lr):
        raise ValueError(f"{where}lr={lr!r}: the learning rate must be a finite float >= 0")
    if betas is not None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{where}betas={betas!r}: expected a pair (beta1, beta2), e.g. (0.9, 0.999)")
        for i, beta in enumerate(betas):
            if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise ValueError(f"{where}betas[{i}]={beta!r}: each beta must lie in [0, 1)")
    if eps is not None and (not isinstance(eps, (int, float)) or not eps > 0.0):
        raise ValueError(f"{where}eps={eps!r}: eps must be > 0 (e.g. 1e-6)")
    if weight_decay is not None and (not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0):
        raise ValueError(f"{where}weight_decay={weight_decay!r}: weight decay must be >= 0")
    if momentum is not None and (not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0):
        raise ValueError(f"{where}momentum={momentum!r}: momentum must lie in [0, 1)")


def check_optional_positive(name: str, value) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not value > 0.0):
        raise ValueError(f"{name}={value!r}: must be None (off) or a number > 0")


def trust_ratio(
    numerator: Tensor,  # (n,) e.g. ||x||
    denominator: Tensor,  # (n,) e.g. ||r||
    *,
    numerator_clip: float | None = None,
    ratio_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-tensor trust ratios (n,) and the mask (n,) of those pinned to 1 by a zero norm.

    ``numerator_clip`` clamps the numerator (torch-optimizer clamps ||x|| at 10); ``ratio_clip``
    clamps the ratio from above (timm's LAMBC uses 1.0). Pinning is decided before either clip.
    """
    pinned = (numerator == 0) | (denominator == 0)  # (n,)
    if numerator_clip is not None:
        numerator = numerator.clamp(max=numerator_clip)
    ratio = torch.where(pinned, torch.ones_like(numerator), numerator / denominator.masked_fill(pinned, 1.0))
    if ratio_clip is not None:
        ratio = ratio.clamp(max=ratio_clip)
    return ratio, pinned


def stacked_squared_norms(tensors: list[Tensor], foreach: bool) -> Tensor:
    """Squared L2 norms of ``tensors`` as one 1-D tensor (len(tensors),), no host sync.

    On CPU each is ``torch.dot(t, t)``: twice as fast as ``linalg.vector_norm`` on cached data and,
    measured on N(0.01, 0.02^2) float32 data, more accurate (relative error 1.9e-6 vs 2.2e-5 at 2^20
    elements, 2.8e-4 vs 2.2e-3 at 21M; CPU tiles keep pieces at <= 2^20)."""
    if tensors[0].device.type == "cpu":
        return torch.stack([torch.dot(f, f) for f in (t.reshape(-1) for t in tensors)])
    if foreach:
        norms = torch._foreach_norm(tensors)
    else:
        norms = [torch.linalg.vector_norm(t) for t in tensors]
    like = tensors[0]
    return torch.stack([n.to(like.device, like.dtype) for n in norms]).square()


def scalar_or_list(values: list[float]) -> float | list[float]:
    """One Python scalar when all tensors of a group share it (the usual case), else a ScalarList."""
    return float(values[0]) if all(v == values[0] for v in values) else values


def per_tensor(values: list[float], like: Tensor) -> float | Tensor:
    """A Python float when all values are equal, else a (n,) device tensor for broadcasting."""
    c = scalar_or_list(values)
    return c if isinstance(c, float) else device_tensor(values, like)


def add_scaled_(dst: list[Tensor], src: list[Tensor], coefficients: list[float]) -> None:
    """dst += c * src per tensor: one pass when all c are equal, else a scaled copy first."""
    c = scalar_or_list(coefficients)
    if isinstance(c, float):
        torch._foreach_add_(dst, src, alpha=c)
    else:
        torch._foreach_add_(dst, torch._foreach_mul(src, c))


def device_tensor(rows: list, like: Tensor) -> Tensor:
    """Host numbers as a tensor on ``like``'s device and dtype, copied without a host sync."""
    host = torch.tensor(rows, dtype=like.dtype)
    if like.device.type == "cuda":
        return host.pin_memory().to(like.device, non_blocking=True)
    return host.to(like.device)


def bias_corrections(steps: list[int], betas, enabled: bool) -> tuple[list[float], list[float]]:
    """(1 - beta1^t, 1 - beta2^t) per tensor in float64 on the host; ones when disabled."""
    if not enabled:
        return [1.0] * len(steps), [1.0] * len(steps)
    beta1, beta2 = betas
    return [1.0 - beta1**t for t in steps], [1.0 - beta2**t for t in steps]


# Column layout of the (n, 9) hyperparameter tensor handed to the Adam-style per-tensor kernels.
(HP_LR, HP_BETA1, HP_ONE_MINUS_BETA1, HP_BETA2, HP_ONE_MINUS_BETA2, HP_EPS, HP_WD, HP_INV_BC1,
 HP_INV_BC2) = range(9)  # HP_INV_BC*: 1/(1 - beta^t)


def adam_hyperparameters(group: dict, steps: list[int], like: Tensor) -> Tensor:
    """One row per tensor (n, 9), computed in float64 on the host and copied once per group and step.
    Kernels read their scalars from it, so a changed lr/beta/eps never recompiles a fused kernel."""
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias_corrections(steps, group["betas"], group.get("bias_correction", True))
    rows = [[group["lr"], beta1, 1 - beta1, beta2, 1 - beta2, group["eps"], group["weight_decay"], 1 / c1, 1 / c2]
            for c1, c2 in zip(bc1, bc2)]  # reciprocals: kernels multiply (divisions bound the CPU kernels)
    return device_tensor(rows, like)


def adam_moments(m: Tensor, v: Tensor, g: Tensor, hp: Tensor) -> tuple[Tensor, Tensor]:
    """One tensor: the new b1*m + (1-b1)*g and b2*v + (1-b2)*g^2 (hp: one (9,) row). Functional: the
    kernels write them back with copy_ at their end, which inductor fuses into the kernel's one loop
    (an in-place lerp_ read back later made it materialise and copy a temporary)."""
    return (m * hp[HP_BETA1] + g * hp[HP_ONE_MINUS_BETA1],
            v * hp[HP_BETA2] + g * g * hp[HP_ONE_MINUS_BETA2])


def foreach_adam_moments_(m: list[Tensor], v: list[Tensor], g: list[Tensor], betas) -> None:
    """Multi-tensor, in-place version of adam_moments."""
    beta1, beta2 = betas
    torch._foreach_lerp_(m, g, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)


def adam_moments_scaled_(m: list[Tensor], v: list[Tensor], g: list[Tensor], coefficients: list[float],
                         betas) -> None:
    """In place, per tensor: m = b1*m + (1-b1)*c*g ; v = b2*v + (1-b2)*c^2*g^2 with a host float c
    (CPU: LANS's normalised gradient c*g is never written out)."""
    beta1, beta2 = betas
    for mi, vi, gi, c in zip(m, v, g, coefficients):
        mi.mul_(beta1).add_(gi, alpha=(1 - beta1) * c)
        vi.mul_(beta2).addcmul_(gi, gi, value=(1 - beta2) * c * c)


def foreach_folded_denominator(v: list[Tensor], eps: float, bc2: list[float],
                               scratch: list[Tensor] | None) -> list[Tensor]:
    """sqrt(v) + eps*sqrt(bc2) = sqrt(bc2) * (sqrt(v^) + eps): the bias correction of v folded into a
    per-tensor scalar the caller applies to the (small) norms and step sizes, saving two passes."""
    denom = sqrt_into(v, scratch)
    torch._foreach_add_(denom, scalar_or_list([eps * math.sqrt(c2) for c2 in bc2]))
    return denom


def sqrt_into(v: list[Tensor], scratch: list[Tensor] | None) -> list[Tensor]:
    """sqrt(v) written into ``scratch`` (CPU) or into fresh tensors from the caching allocator."""
    if scratch is None:
        return torch._foreach_sqrt(v)
    for vi, out in zip(v, scratch):
        torch.sqrt(vi, out=out)
    return scratch


def scaled_copy(tensors: list[Tensor], scale: Tensor | float | list[Tensor], scratch: list[Tensor] | None):
    """tensors * scale (one 0-d tensor or float, or one 0-d tensor per tensor) into ``scratch`` (CPU) or
    fresh tensors; the inputs (e.g. p.grad) are never modified."""
    if scratch is None:
        return torch._foreach_mul(tensors, scale)
    scales = scale if isinstance(scale, list) else [scale] * len(tensors)
    for t, c, out in zip(tensors, scales, scratch):
        torch.mul(t, c, out=out)
    return scratch


def divide_into(numerators: list[Tensor], denominators: list[Tensor], out: list[Tensor] | None) -> list[Tensor]:
    """numerators / denominators, written into ``out`` (CPU work buffers, which may be the denominators
    themselves: element-wise) or into new tensors when None."""
    if out is None:
        return torch._foreach_div(numerators, denominators)
    for n, d, o in zip(numerators, denominators, out):
        torch.div(n, d, out=o)
    return out


# direction_plus_decay's one-pass form computes u = x + (c/wd)*n/d; past this c/wd, u's squared
# norm could leave float32's range (|n/d| is O(1), so |u| ~ c/wd), and it keeps the two-pass form.
_MAX_AMPLIFICATION = 1e8


def direction_plus_decay(x: list[Tensor], numerators: list[Tensor], denominators: list[Tensor],
                         coefficients: list[float], wd: float, out: list[Tensor] | None
                         ) -> tuple[list[Tensor], list[float]]:
    """(u, s) per tensor with s*u = c*numerator/denominator + wd*x, the decoupled-decay direction, in
    ONE pass where it can: u = x + (c/wd)*numerator/denominator (addcdiv) and s = wd. With wd = 0,
    u = numerator/denominator and s = c, and likewise when c/wd > _MAX_AMPLIFICATION (a tiny decay or a
    huge c), where u = n/d + (wd/c)*x in two passes. The form is chosen per tensor from its own c, so
    the pieces of a tensor split over tiles all get the same one. ``out``: CPU work buffers to write u
    into (they may be the numerators or the denominators themselves: the operation is element-wise);
    None: new tensors."""
    one_pass = [wd > 0 and abs(c) <= _MAX_AMPLIFICATION * wd for c in coefficients]
    scales = [wd if fast else c for fast, c in zip(one_pass, coefficients)]
    groups = {True: [j for j, fast in enumerate(one_pass) if fast],
              False: [j for j, fast in enumerate(one_pass) if not fast]}
    u: list[Tensor | None] = list(out) if out is not None else [None] * len(x)
    for fast, index in groups.items():
        if not index:
            continue
        xs, ns, ds = [x[j] for j in index], [numerators[j] for j in index], [denominators[j] for j in index]
        if fast:
            values = [coefficients[j] / wd for j in index]
            if out is None:
                result = torch._foreach_addcdiv(xs, ns, ds, values)
            else:
                result = [torch.addcdiv(xi, n, d, value=value, out=u[j])
                          for xi, n, d, value, j in zip(xs, ns, ds, values, index)]
        else:
            result = divide_into(ns, ds, None if out is None else [u[j] for j in index])
            if wd != 0:  # u = n/d + (wd/c)*x
                add_scaled_(result, xs, [wd / coefficients[j] for j in index])
        for j, tensor in zip(index, result):
            u[j] = tensor
    return u, scales


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
    return list(values[torch.tensor(tile.index, device=values.device)].unbind())


_COMPILED: dict[Callable, Callable] = {}


def compiled(kernel: Callable) -> Callable:
    """The torch.compile'd version of a per-tensor kernel, built once per process and shared."""
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, dynamic=True, fullgraph=True)
    return _COMPILED[kernel]


@dataclass
class GroupTensors:
    """The tensors one group updates this step (only parameters with a gradient)."""

    params: list[Tensor]  # the parameters themselves (any float dtype)
    x: list[Tensor]  # compute copies: the params, or fp32 copies of bf16/fp16 params
    grads: list[Tensor]  # in the compute dtype
    states: list[dict]  # self.state[p] per parameter
    steps: list[int] = field(default_factory=list)  # per-parameter step t after this update (>= 1)
    copied: list[int] = field(default_factory=list)  # indices whose x is a copy, written back after the step

    def state_list(self, key: str) -> list[Tensor]:
        return [s[key] for s in self.states]


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Base class of LAMB, LANS and LARS; see the module docstring. Subclasses define
    ``_state_keys``, ``_check_group`` and ``_update_group``.
    """

    _state_keys: tuple[str, ...] = ()
    cpu_tile_elements: int = CPU_TILE_ELEMENTS  # tile size of the foreach path on CPU (see CPU_TILE_ELEMENTS)

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        max_grad_norm: float | None,
        foreach: bool | None,
        fused: bool,
        track_trust_ratios: bool,
    ) -> None:
        check_optional_positive("max_grad_norm", max_grad_norm)
        if fused and foreach:
            raise ValueError("fused=True, foreach=True: choose one path (fused already batches per tensor)")
        self.max_grad_norm = max_grad_norm
        self.fused = bool(fused)
        self.foreach = not self.fused if foreach is None else bool(foreach)
        self.track_trust_ratios = bool(track_trust_ratios)
        self._last_ratios: list[tuple[Tensor, Tensor]] = []  # (ratio (n,), pinned (n,)) per group
        self._scratch_buffers: dict[Tensor, list[Tensor]] = {}  # CPU work buffers, never in state_dict
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------- groups and checks
    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        for i, p in enumerate(params):
            p_tensor = p[1] if isinstance(p, tuple) else p
            if id(p_tensor) in seen:
                raise ValueError(
                    f"params: parameter {i} of group {index} (shape {tuple(p_tensor.shape)}) is already in "
                    f"group {seen[id(p_tensor)]}; a parameter may be in one group only "
                    "(largebatch.optim.param_groups(model) builds disjoint groups)"
                )
            seen[id(p_tensor)] = index
        super().add_param_group({**param_group, "params": params})
        self._check_group(self.param_groups[-1], f"param_groups[{index}]: ")

    def _check_group(self, group: dict, where: str) -> None:
        """Checked at construction and again at every step (groups may be edited between steps)."""
        check_hyperparameters(where, group["lr"], group.get("betas"), group["eps"], group["weight_decay"],
                              group.get("momentum"))
        for key in ("trust_clip", "weight_norm_clip"):
            check_optional_positive(where + key, group.get(key))
        if not isinstance(group["adapt"], bool):
            raise ValueError(f"{where}adapt={group['adapt']!r}: must be True (trust ratio) or False (plain step)")

    @staticmethod
    def _adapts(group: dict) -> bool:
        """Whether this group's step is scaled by a trust ratio."""
        return group["adapt"] and not (group.get("skip_adapt_if_no_decay", False) and group["weight_decay"] == 0)

    @staticmethod
    def _group_trust_ratio(group: dict, numerator: Tensor, denominator: Tensor) -> tuple[Tensor, Tensor]:
        return trust_ratio(numerator, denominator, numerator_clip=group.get("weight_norm_clip"),
                           ratio_clip=group.get("trust_clip"))

    # -------------------------------------------------------------------------------- sharding hook
    def _reduce_squared_norms(self, squared_norms: Tensor, params: list[Tensor]) -> Tensor:
        """Identity. Override to all-reduce (SUM) partial squared norms of sharded tensors."""
        return squared_norms

    def _reduced_norms(self, tensors_by_quantity: list[list[Tensor]], params: list[Tensor]) -> list[Tensor]:
        """L2 norms, one (n,) tensor per quantity, from ONE stacked squared-norm tensor via the hook."""
        return self._hooked_norms(self._tile_squared_norms(tensors_by_quantity, self.foreach), params)

    def _hooked_norms(self, squared: Tensor, params: list[Tensor]) -> list[Tensor]:
        """(k, n) squared norms -> k norm tensors (n,), through the sharding hook as ONE (k*n,) tensor."""
        k = squared.shape[0]
        return list(self._reduce_squared_norms(squared.reshape(-1), params).sqrt().view(k, -1))

    def _tiles(self, b: GroupTensors) -> list[Tile]:
        """Tiles of the group's tensors for the foreach path: CPU_TILE_ELEMENTS-sized on CPU (see there),
        one tile of whole tensors elsewhere."""
        size = self.cpu_tile_elements if b.x[0].device.type == "cpu" else None
        return make_tiles(b.x, size)

    @staticmethod
    def _tile_squared_norms(tensors_by_quantity: list[list[Tensor]], foreach: bool) -> Tensor:
        """(k, pieces) squared norms of one tile's pieces, one row per quantity."""
        return torch.stack([stacked_squared_norms(t, foreach) for t in tensors_by_quantity])

    def _reduced_tiled_norms(self, tiles: list[Tile], squared: list[Tensor], params: list[Tensor]) -> list[Tensor]:
        """L2 norms, one (n,) tensor per quantity, from each tile's (k, pieces) partial squared norms:
        pieces of one tensor are summed, then ONE stacked (k*n,) tensor goes through the hook."""
        partial = torch.cat(squared, dim=1)  # (k, all pieces)
        index = [i for tile in tiles for i in tile.index]
        if index != list(range(len(params))):
            summed = partial.new_zeros(partial.shape[0], len(params))
            partial = summed.index_add_(1, torch.tensor(index, device=partial.device), partial)
        return self._hooked_norms(partial, params)

    def _reduced_kernel_norms(self, squared: Tensor, params: list[Tensor]) -> list[Tensor]:
        """L2 norms from per-tensor kernel outputs ``squared`` (n, k): k tensors (n,), via the hook."""
        return self._hooked_norms(squared.T, params)

    # ------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches = [(group, self._collect(group)) for group in self.param_groups]
        batches = [(group, b) for group, b in batches if b.params]
        grad_scale = self._global_grad_scale([b for _, b in batches])  # 0-d tensor or None
        self._last_ratios = []
        with self._compile_limits():
            for index, (group, batch) in enumerate(batches):
                self._check_group(group, f"param_groups[{index}]: ")
                ratios = self._update_group(group, batch, grad_scale)
                if batch.copied:
                    torch._foreach_copy_([batch.params[i] for i in batch.copied], [batch.x[i] for i in batch.copied])
                if self.track_trust_ratios and ratios is not None:
                    self._last_ratios.append(ratios)
        return loss

    def _compile_limits(self):
        """fused=True: room for the kernels' few specialisations. Dynamic shapes still specialise a
        size-1 tensor, a hyperparameter row at storage offset 0 (and at an offset equal to its length:
        duck sizing), the ``None``-or-tensor arguments and the Python-bool switches: up to ~12 variants
        of one kernel in an ordinary model, each compiled once, against dynamo's default limit of 8
        per function (past it, fullgraph=True fails)."""
        if not self.fused:
            return contextlib.nullcontext()
        return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64))

    def _collect(self, group: dict) -> GroupTensors:
        batch = GroupTensors([], [], [], [])
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(
                    f"sparse gradient for a parameter of shape {tuple(p.shape)}: {type(self).__name__} "
                    "needs dense gradients (use torch.optim.SparseAdam, or nn.Embedding(sparse=False))"
                )
            compute_dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
            state = self.state[p]
            if not state:
                state["step"] = 0
                for key in self._state_keys:
                    state[key] = torch.zeros_like(p, dtype=compute_dtype, memory_format=torch.contiguous_format)
            state["step"] += 1
            if p.dtype != compute_dtype or not p.is_contiguous():  # fp32 math on a contiguous copy
                batch.copied.append(len(batch.params))
                batch.x.append(p.to(compute_dtype, memory_format=torch.contiguous_format, copy=True))
            else:
                batch.x.append(p)
            batch.params.append(p)
            batch.grads.append(p.grad.to(compute_dtype, memory_format=torch.contiguous_format))
            batch.states.append(state)
            batch.steps.append(state["step"])
        return batch

    def _global_grad_scale(self, batches: list[GroupTensors]) -> Tensor | None:
        """1 / max(||g||_global / max_grad_norm, 1) as a 0-d tensor (apex / timm pre-clipping)."""
        if self.max_grad_norm is None or not batches:
            return None
        grads = [g for b in batches for g in b.grads]
        params = [p for b in batches for p in b.params]
        squared = self._reduce_squared_norms(stacked_squared_norms(grads, self.foreach), params)  # (n,)
        global_norm = squared.sum().sqrt()
        return 1.0 / torch.clamp(global_norm / self.max_grad_norm, min=1.0)

    def _update_group(self, group: dict, batch: GroupTensors, grad_scale: Tensor | None):
        """Update one group in place; return (trust ratios (n,), pinned (n,)) or None."""
        raise NotImplementedError

    def _scratch(self, b: GroupTensors, slot: int) -> list[Tensor] | None:
        """Parameter-sized work buffers for the foreach path on CPU, kept between steps: there a fresh
        allocation (page faults) costs several times the arithmetic it holds (docs/optim.md). None
        on other devices, where the caching allocator makes transient buffers cheap and holding them
        would cost memory."""
        if b.x[0].device.type != "cpu":
            return None
        buffers = []
        for p, x in zip(b.params, b.x):
            slots = self._scratch_buffers.setdefault(p, [])
            while len(slots) <= slot:
                slots.append(torch.empty_like(x, memory_format=torch.contiguous_format))
            buffers.append(slots[slot])
        return buffers

    def _stored_directions(self, b: GroupTensors, slot: int) -> list[Tensor] | None:
        """Flat work buffers that the per-tensor/fused path's pass 1 writes its update direction into,
        on CPU; None elsewhere. On CPU the compiled kernels are bound by arithmetic (sqrt, division),
        not by memory, so reading a stored direction back beats recomputing it (docs/optim.md); on a
        GPU the two cost the same traffic and recomputing holds no extra memory."""
        scratch = self._scratch(b, slot)
        return None if scratch is None else self._flat(scratch)

    def _kernel(self, kernel: Callable) -> Callable:
        """The per-tensor kernel as called on the per-tensor path: compiled when fused=True."""
        return compiled(kernel) if self.fused else kernel

    @staticmethod
    def _flat(tensors: list[Tensor]) -> list[Tensor]:
        """1-D views (compiled kernels then see one dynamic shape for every tensor). All compute
        tensors are contiguous (see _collect), so these are views and in-place updates land."""
        return [t.view(-1) for t in tensors]

    # ---------------------------------------------------------------------------------- diagnostics
    def trust_ratio_summary(self) -> dict | None:
        """min / median / max of the last step's trust ratios and how many were pinned to 1 by a zero
        norm (adapted tensors only). One host sync, here. None unless track_trust_ratios=True."""
        if not self.track_trust_ratios or not self._last_ratios:
            return None
        ratio = torch.cat([r.float() for r, _ in self._last_ratios])
        pinned = torch.cat([p for _, p in self._last_ratios])
        stats = torch.stack([ratio.min(), ratio.median(), ratio.max(), pinned.sum().float()]).tolist()
        return {"min": stats[0], "median": stats[1], "max": stats[2], "pinned": int(stats[3]),
                "count": int(ratio.numel())}

    # ------------------------------------------------------------------------------- state resume
    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but moments keep their saved dtype (fp32 for bf16 params): bit-identical resume."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for param_id, p in zip(saved_ids, params):
            for key, value in saved.get(param_id, {}).items():
                if isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
