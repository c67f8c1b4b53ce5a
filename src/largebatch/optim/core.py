"""The shared core of the layer-wise adaptive optimizers (LAMB, LANS, LARS): the torch.optim class.

docs/papers.md (layer-wise adaptive optimizers): every trust ratio is a ratio of L2 norms of WHOLE
tensors. Each technique module holds a functional form of its update (``lamb(...)``, ``lans(...)``,
``lars(...)``, as torch's ``adamw(...)``) that dispatches to the single-tensor, multi-tensor and
fused implementations (kernels.py states the per-tensor math once; multi_tensor.py and tiling.py
are the multi-tensor path of large tensors). This module is the thin class around them:

* argument checks (checks.py) of EVERY group before any tensor changes, so a rejected step
  changes nothing; numpy and 0-d tensor scalars are accepted;
* the step: gradients and state gathered per group and bucketed by device and dtype (a float64
  tensor beside float32 ones keeps float64 accuracy), fp32 math on contiguous copies for bf16/fp16
  or non-contiguous parameters, complex parameters as ``torch.view_as_real``, DTensor parameters as
  their local shards; optional global gradient pre-clipping (``max_grad_norm``);
* the torch.optim contract: deepcopy/pickle keep every constructor option; ``load_state_dict``
  puts state in the parameter's compute dtype (fp32 moments for bf16/fp16 parameters) and honours
  torch's load hooks; hooks of ``step`` and ``state_dict`` are torch's own;
* ``capturable=True`` (torch's meaning): step counts are 0-d float32 tensors on the parameter's
  device and bias corrections are computed there, so ``step()`` reads nothing on the host and a
  ``torch.where`` over the state can take a step back exactly (run.on_nonfinite='skip'). A state
  dict saved in either mode loads in either (the count becomes a tensor or an int).

Sharding (norm reduction)
-------------------------
Every per-tensor squared norm is computed as ONE stacked 1-D tensor per bucket, ``k`` blocks of
``n`` entries (e.g. LAMB's ``[||x_1||^2..||x_n||^2, ||r_1||^2..||r_n||^2]``), and handed to
``reduce_norms(squared_norms, params)`` BEFORE any square root or ratio, as is the global gradient
norm of ``max_grad_norm``. The default (``None``) is ``mesh_squared_norms`` for a bucket holding
DTensor parameters (FSDP2, tensor parallel: the sum over each tensor's own device mesh, read from
its placements; a user's ``fully_shard`` model needs nothing more) and the identity otherwise. A
callable replaces it, e.g. ``largebatch.parallel.sharded_norms(state)`` (the trainer's mesh), or::

    def reduce_norms(squared_norms, params):
        torch.distributed.all_reduce(squared_norms, group=shard_group)  # each entry: a local sum of squares
        return squared_norms

    optimizer = LAMB(params, lr=2e-3, reduce_norms=reduce_norms)
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import ParamsT, required

from . import checks
from .kernels import Rebind, host_constant, packed
from .multi_tensor import stacked_squared_norms
from .tiling import Workspace

_LOW_PRECISION = (torch.bfloat16, torch.float16)

NormReduction = Callable[[Tensor, list[Tensor]], Tensor]


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


def hooked_norms(squared: Tensor, reduce: NormReduction | None, params: list[Tensor]) -> list[Tensor]:
    """(k, n) squared norms -> k norm tensors (n,), through ``reduce(flat, params)`` as ONE (k*n,) tensor."""
    k = squared.shape[0]
    flat = squared.reshape(-1)
    if reduce is not None:
        flat = reduce(flat, params)
    return list(flat.sqrt().view(k, -1))


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor (about a second, a third
    of importing torch): a DTensor exists only once that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def mesh_squared_norms(squared_norms: Tensor, params: list[Tensor]) -> Tensor:
    """The default ``reduce_norms`` of a bucket with DTensor parameters: each entry of ``squared_norms``
    ((k * n,): k quantities for the n ``params``, each a sum of squares over this rank's shard) summed
    over its tensor's shards, every element once. From each parameter's own mesh and placements: along
    a mesh dimension where it is replicated only coordinate 0 contributes, and the sums are
    all-reduced over every dimension of the mesh (one collective per mesh dimension and distinct mesh;
    every rank of the mesh steps the same buckets). Plain tensors beside them are whole on every rank
    and stay as they are. Without this, a model sharded by FSDP2's ``fully_shard`` took every trust
    ratio from the local shard alone."""
    n = len(params)
    meshes: dict[int, tuple] = {}  # id(mesh) -> (mesh, [indices])
    for i, p in enumerate(params):
        if is_dtensor(p):
            meshes.setdefault(id(p.device_mesh), (p.device_mesh, []))[1].append(i)
    if not meshes:
        return squared_norms
    out = squared_norms.view(-1, n).clone()
    for mesh, index in meshes.values():
        keep = []
        for i in index:
            alone = True  # this rank's shard enters the sum
            for dim, placement in enumerate(params[i].placements):
                if placement.is_partial():
                    raise ValueError(f"a parameter of shape {tuple(params[i].shape)} with placement {placement}: "
                                     "a Partial parameter has no defined norm (expected Shard or Replicate)")
                if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
                    alone = False
            keep.append(alone)
        columns, mask = host_constant(tuple(index), out.device), host_constant(tuple(keep), out.device)
        summed = torch.where(mask, out[:, columns], torch.zeros((), dtype=out.dtype, device=out.device))
        for dim in range(mesh.ndim):
            dist.all_reduce(summed, group=mesh.get_group(dim))
        out[:, columns] = summed
    return out.view(-1)


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(p: Tensor) -> Tensor:
    """The gradient of ``p`` on this rank's shard (a DTensor gradient with a pending partial sum, or
    placed unlike its parameter, is redistributed first)."""
    g = p.grad
    if is_dtensor(g) and is_dtensor(p) and g.placements != p.placements:
        g = p.grad = g.redistribute(p.device_mesh, p.placements)
    return local_shard(g)


def _real(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def step_count(value: int | Tensor, device: torch.device, capturable: bool) -> int | Tensor:
    """A step count as the optimizer keeps it: a Python int, or with ``capturable`` a 0-d float32
    tensor on the parameter's device (as torch's capturable optimizers keep theirs; exact to 2^24
    steps). Turning a device tensor into an int reads it (only on a load or a change of mode)."""
    if capturable:
        if isinstance(value, Tensor):
            return value.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
        return torch.tensor(float(value), dtype=torch.float32, device=device)
    return int(value.item()) if isinstance(value, Tensor) else int(value)


def packed_counts(counts: list[Tensor]) -> list[Tensor]:
    """Device step counts as views of one new buffer per device, in order, so that one operation
    advances a group's counts (kernels.packed finds the buffer) instead of one per parameter."""
    out = list(counts)
    by_device: dict[torch.device, list[int]] = {}
    for i, count in enumerate(counts):
        by_device.setdefault(count.device, []).append(i)
    for index in by_device.values():
        for i, view in zip(index, torch.stack([counts[i] for i in index]).unbind()):
            out[i] = view
    return out


def state_dtype(p: Tensor) -> torch.dtype:
    """The dtype of the optimizer state of ``p``: fp32 for bf16/fp16 parameters, else p's own."""
    if p.dtype in _LOW_PRECISION:
        return torch.float32
    return torch.complex64 if p.dtype == torch.complex32 else p.dtype


@dataclass
class Bucket:
    """The tensors of one group that one update handles together: those with a gradient, of one
    device and compute dtype. ``x``, ``grads`` and ``states`` are real, contiguous, local tensors."""

    params: list[Tensor] = field(default_factory=list)  # the parameters as given to the optimizer
    x: list[Tensor] = field(default_factory=list)  # what the math updates in place
    grads: list[Tensor] = field(default_factory=list)
    states: dict[str, list[Tensor]] = field(default_factory=dict)
    steps: list = field(default_factory=list)  # t after this update (>= 1): ints, or 0-d device tensors
    copies: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (parameter view, x): written back


_Loss = TypeVar("_Loss")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Base class of LAMB, LANS and LARS; see the module docstring. Subclasses define ``_state_keys``,
    ``_spec`` (hyperparameter checks) and ``_update(h, bucket, grad_scale, reduce)``."""

    _state_keys: tuple[str, ...] = ()
    _kernel_names: tuple[str, ...] = ()  # what the functional form calls each state key
    _spec: dict[str, checks.Check] = {}
    _options = ("max_grad_norm", "foreach", "fused", "track_trust_ratios", "reduce_norms", "capturable")

    def __init__(self, params: ParamsT, defaults: dict, *, max_grad_norm: float | None, foreach: bool | None,
                 fused: bool, track_trust_ratios: bool, reduce_norms: NormReduction | None,
                 capturable: bool = False, differentiable: bool = False) -> None:
        if differentiable:
            raise ValueError(f"differentiable=True: {type(self).__name__} does not support differentiating "
                             "through step() (its trust ratios run under no_grad); pass differentiable=False")
        if isinstance(params, set):
            raise TypeError("params: a set has no stable order (state_dict and resume need one); "
                            "pass a list, e.g. list(model.parameters())")
        self.max_grad_norm = checks.optional_positive("max_grad_norm", max_grad_norm)
        if fused and foreach:
            raise ValueError("fused=True, foreach=True: choose one path (fused already batches per tensor)")
        checks.optional_callable("reduce_norms", reduce_norms)
        self.fused = bool(fused)
        self.foreach = not self.fused if foreach is None else bool(foreach)
        self.track_trust_ratios = bool(track_trust_ratios)
        self.reduce_norms = reduce_norms
        self.capturable = bool(capturable)
        self._workspace = Workspace()
        self._stepped = 0  # tensors with a gradient in the last step
        self._last_ratios: list[tuple[Tensor, Tensor]] = []  # (ratio (n,), pinned (n,)) per bucket
        super().__init__(params, defaults)

    # ------------------------------------------------------------------------- copy, pickle, groups
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._options})
        return state

    def __setstate__(self, state: dict) -> None:
        """torch's, and (as torch's optimizers do for keys added in later versions) groups saved without
        one of this optimizer's hyperparameters -- an older checkpoint, or another optimizer's state
        dict -- take the constructor's value. A key with no default is reported at the next step."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key in self._spec:
                default = self.defaults.get(key, required)
                if default is not required:
                    group.setdefault(key, default)
        self._workspace = Workspace()
        self._stepped = 0
        self._last_ratios = []

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(f"param_groups[{index}]['params']: a set has no stable order; pass a list")
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        for i, p in enumerate(params):
            p_tensor = p[1] if isinstance(p, tuple) else p
            if id(p_tensor) in seen:
                where = ("appears twice in that group (torch warns and would step it twice)"
                         if seen[id(p_tensor)] == index else f"is already in group {seen[id(p_tensor)]}")
                raise ValueError(
                    f"params: parameter {i} of group {index} (shape {tuple(p_tensor.shape)}) {where}; a "
                    "parameter may be in one group only, once (largebatch.optim.param_groups(model) builds "
                    "disjoint groups)"
                )
            seen[id(p_tensor)] = index
        for key, default in self.defaults.items():
            if default is required and key not in param_group:
                raise ValueError(f"param_groups[{index}]: no {key!r}; {type(self).__name__} has no default {key}: "
                                 f"pass {key}=... to the constructor or set {key!r} in every parameter group")
        # checked before it joins: a refused group leaves the optimizer as it was (it stayed, and
        # every later step raised, and re-adding its parameters said "already in group")
        trial = {**{k: v for k, v in self.defaults.items() if v is not required}, **param_group}
        self._resolve(trial, index)
        if self._device_lr(trial):  # checked here, once: the step leaves it on its device
            checks.learning_rate(f"param_groups[{index}]: lr", trial["lr"])
        super().add_param_group({**param_group, "params": params})

    def _resolve(self, group: dict, index: int) -> dict:
        """The group's hyperparameters, checked, as Python values (ValueError naming the group)."""
        missing = [key for key in self._spec if key not in group]
        if missing:
            raise ValueError(f"param_groups[{index}]: no {missing[0]!r} and {type(self).__name__} has no default "
                             f"for it; set param_groups[{index}][{missing[0]!r}] (a state dict saved without it "
                             "cannot supply it)")
        if not self._device_lr(group):
            return checks.resolve(group, self._spec, f"param_groups[{index}]: ")
        resolved = checks.resolve(group, {k: v for k, v in self._spec.items() if k != "lr"},
                                  f"param_groups[{index}]: ")
        return {**resolved, "lr": group["lr"]}

    def _device_lr(self, group: dict) -> bool:
        """With ``capturable``, a 0-d floating-point tensor LR is used where it lives, never read on the
        host (a read would synchronise a device, and a CUDA graph could not hold the step); it is
        checked once, when its group is added (a scheduler then sets it in place, as torch's do)."""
        lr = group.get("lr")
        return self.capturable and isinstance(lr, Tensor) and lr.dim() == 0 and lr.is_floating_point()

    @staticmethod
    def _adapts(h: dict) -> bool:
        """Whether this group's step is scaled by a trust ratio."""
        return h["adapt"] and not (h.get("skip_adapt_if_no_decay", False) and h["weight_decay"] == 0)

    # ------------------------------------------------------------------------------------ the step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...  # what the closure returns (a loss tensor)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        resolved = [self._resolve(group, i) for i, group in enumerate(self.param_groups)]  # all, first
        for i, group in enumerate(self.param_groups):
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                self._refuse_sparse(group, i)
        work = [(h, bucket) for group, h in zip(self.param_groups, resolved) for bucket in self._buckets(group)]
        stepped = sum(len(b.params) for _, b in work)
        if stepped != self._stepped and len(self._workspace):  # which tensors have gradients changed:
            # the work buffers of those frozen or out of the groups are freed
            self._workspace.keep_only({id(p) for g in self.param_groups for p in g["params"] if p.requires_grad})
        self._stepped = stepped
        grad_scale = self._global_grad_scale([b for _, b in work])  # 0-d float64 tensor or None
        self._last_ratios = []
        with self._compile_limits():
            for h, bucket in work:
                scale = None if grad_scale is None else grad_scale.to(bucket.x[0].dtype)
                ratios = self._update(h, bucket, scale, self._reduction(bucket))
                if bucket.copies:
                    torch._foreach_copy_([target for target, _ in bucket.copies], [x for _, x in bucket.copies])
                if self.track_trust_ratios and ratios is not None:
                    self._last_ratios.append(ratios)
        return loss

    def _compile_limits(self):
        """fused=True: room for the kernels' few specialisations. Besides the dtype, a compiled kernel
        specialises on a bucket's shared or per-tensor hyperparameter row, a tensor below inductor's
        4097-element reduction threshold, and the None-or-tensor arguments (global clip scale, stored
        direction): a few dozen variants per kernel at most, whatever the shapes, each compiled once,
        against dynamo's default limit of 8 per function (past it, fullgraph=True fails)."""
        if not self.fused:
            return contextlib.nullcontext()
        return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64))

    def _refuse_sparse(self, group: dict, index: int) -> None:
        p = next(p for p in group["params"] if p.grad is not None and p.grad.is_sparse)
        raise ValueError(
            f"param_groups[{index}]: sparse gradient for a parameter of shape {tuple(p.shape)}: "
            f"{type(self).__name__} needs dense gradients (use torch.optim.SparseAdam, or "
            "nn.Embedding(sparse=False))"
        )

    def _buckets(self, group: dict) -> list[Bucket]:
        """The group's parameters with a gradient, bucketed by (device, compute dtype); state created
        on first use, step counts advanced. (Runs once per parameter and step: kept lean.)"""
        buckets: dict[tuple, Bucket] = {}
        keys = self._state_keys
        maximize = group.get("maximize", False)
        counts: list[Tensor] = []  # device step counts (capturable)
        if self.capturable:  # fresh counts share one buffer
            fresh = [_real(local_shard(p)).device for p in group["params"]
                     if p.grad is not None and not self.state.get(p)]
            new_counts = iter(packed_counts([torch.zeros((), device=device) for device in fresh]))
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            state = self.state[p]
            plain = not is_dtensor(p) and not p.is_complex()
            target = p if plain else _real(local_shard(p))  # the parameter's values as a real local tensor
            dtype = target.dtype
            compute = torch.float32 if dtype in _LOW_PRECISION else dtype
            if not state:
                state["step"] = next(new_counts) if self.capturable else 0
                for key in keys:
                    state[key] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.contiguous_format)
            else:
                if isinstance(state["step"], Tensor) != self.capturable:  # `capturable` changed since
                    state["step"] = step_count(state["step"], target.device, self.capturable)
                if plain:  # the model moved or changed dtype since (model.double(), .to(device)): the
                    where = p.get_device()  # state follows, as a load puts it (it stayed, or failed later)
                    for key in keys:
                        held = state[key]
                        if held.dtype != compute or held.get_device() != where:
                            state[key] = held.to(device=p.device, dtype=compute)
            if self.capturable:
                counts.append(state["step"])  # advanced below, all at once
            else:
                state["step"] += 1
            b = buckets.get((target.device, compute))
            if b is None:
                b = buckets[(target.device, compute)] = Bucket(states={key: [] for key in keys})
            if dtype == compute and target.is_contiguous():
                x = target
            else:  # fp32 math on a contiguous copy, written back after the update
                x = target.to(compute, memory_format=torch.contiguous_format, copy=True)
                b.copies.append((target, x))
            if not plain:
                grad = _real(local_grad(p))
            if grad.dtype != compute or not grad.is_contiguous():
                grad = grad.to(compute).contiguous()
            if maximize:  # ascend: the update of -g (torch's maximize), never touching p.grad
                grad = torch.neg(grad)
            b.params.append(p)
            b.x.append(x)
            b.grads.append(grad)
            for key in keys:  # contiguous: created so, and made so by load_state_dict
                b.states[key].append(state[key] if plain else _real(local_shard(state[key])))
            b.steps.append(state["step"])
        if counts:  # one add for counts in one buffer, else one multi-tensor add (torch's capturable AdamW)
            flat = packed(counts)
            if flat is not None:
                flat.add_(1.0)
            else:
                torch._foreach_add_(counts, 1.0)
        return list(buckets.values())

    def _rebind(self, bucket: Bucket) -> Rebind:
        """Let a flat bucket of small tensors keep their optimizer state as views of its flat buffer, so
        from the next step on it updates the state in place instead of gathering and scattering it
        (kernels.packed). Plain real tensors only: DTensor and complex state stay as they are."""
        names = dict(zip(self._kernel_names, self._state_keys))

        def rebind(name: str, index: list[int], views: list[Tensor]) -> bool:
            key = names.get(name)
            params = [bucket.params[i] for i in index]
            if key is None or any(is_dtensor(p) or p.is_complex() for p in params):
                return False
            left = set()  # the flat buffers these tensors' state was a view of until now
            for p, view in zip(params, views):
                old = self.state[p].get(key)
                if isinstance(old, Tensor) and old._base is not None:
                    left.add(old.untyped_storage().data_ptr())
                self.state[p][key] = view
            if left:
                self._release_buffers(key, left)
            return True
        return rebind

    def _release_buffers(self, key: str, buffers: set[int]) -> None:
        """Give the state ``key`` of every tensor that is still a view of one of ``buffers`` (flat
        buffers identified by their storage's address) storage of its own, so a buffer left by a
        bucket's other tensors is freed, not kept whole (and saved whole by ``state_dict``) for them.
        A bucket's membership changes when some tensors have no gradient in a step (frozen layers,
        routed experts); without this, state memory grew to 2.6-5x its size."""
        for state in self.state.values():
            t = state.get(key)
            if isinstance(t, Tensor) and t._base is not None and t.untyped_storage().data_ptr() in buffers:
                state[key] = t.clone()

    def _reduction(self, bucket: Bucket) -> NormReduction | None:
        """``reduce_norms`` for the bucket (None: the identity); by default the sum over the device
        meshes of DTensor parameters (``mesh_squared_norms``). It is handed the bucket's parameters as
        given to the optimizer (DTensors carry their placements), not the local tensors the update
        function passes on."""
        reduce = self.reduce_norms
        if reduce is None:
            if not any(is_dtensor(p) for p in bucket.params):
                return None
            reduce = mesh_squared_norms
        return lambda squared, _local: reduce(squared, bucket.params)

    def _global_grad_scale(self, buckets: list[Bucket]) -> Tensor | None:
        """1 / max(||g||_global / max_grad_norm, 1) as a 0-d float64 tensor (apex / timm pre-clipping)."""
        if self.max_grad_norm is None or not buckets:
            return None
        total = None
        # beside a float64 tensor the other buckets' squares are summed in float64 too: the clip
        # factor scales the float64 tensor's update, which keeps float64 accuracy
        wide = any(b.grads[0].dtype == torch.float64 for b in buckets)
        for b in buckets:
            grads = [g.double() for g in b.grads] if wide and b.grads[0].dtype != torch.float64 else b.grads
            squared = stacked_squared_norms(grads, self.foreach)  # (n,)
            reduce = self._reduction(b)
            part = (squared if reduce is None else reduce(squared, b.x)).double().sum()
            total = part if total is None else total + part.to(total.device)
        return 1.0 / torch.clamp(total.sqrt() / self.max_grad_norm, min=1.0)

    def _update(self, h: dict, bucket: Bucket, grad_scale: Tensor | None, reduce) -> tuple[Tensor, Tensor] | None:
        """Update one bucket in place; return (trust ratios (n,), pinned (n,)) or None."""
        raise NotImplementedError

    def _work_buffers(self, bucket: Bucket) -> Callable[[int, list[int]], list[Tensor] | None]:
        """(slot, indices) -> one kept CPU work buffer per listed tensor of the bucket (None off CPU)."""
        return lambda slot, index: self._workspace.buffers([bucket.params[i] for i in index],
                                                           [bucket.x[i] for i in index], slot)

    def _paths(self) -> dict:
        return {"foreach": self.foreach, "fused": self.fused}

    # ---------------------------------------------------------------------------------- diagnostics
    def trust_ratio_summary(self, group=None) -> dict | None:
        """min / median / max of the last step's trust ratios and how many were pinned to 1 by a zero
        norm (adapted tensors only). One host sync, here. None unless track_trust_ratios=True.

        ``group``: a process group whose ranks hold the model's other parts (pipeline stages): their
        ratios join this rank's first, so every rank of the group summarises the whole model (every
        rank of it must call)."""
        if not self.track_trust_ratios:
            return None
        if self._last_ratios:
            ratio = torch.cat([r.float().to(self._last_ratios[0][0].device) for r, _ in self._last_ratios])
            pinned = torch.cat([p.to(ratio.device) for _, p in self._last_ratios])
        else:
            ratio, pinned = torch.empty(0), torch.empty(0, dtype=torch.bool)
        if group is not None and dist.get_world_size(group) > 1:
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, (ratio.cpu(), pinned.cpu()), group=group)
            ratio, pinned = torch.cat([r for r, _ in parts]), torch.cat([p for _, p in parts])
        if not ratio.numel():
            return None
        # the median of an even count is the mean of the two middle values (torch's median is the lower)
        stats = torch.stack([ratio.min(), ratio.float().quantile(0.5).to(ratio.dtype), ratio.max(),
                             pinned.sum().float()]).tolist()
        return {"min": stats[0], "median": stats[1], "max": stats[2], "pinned": int(stats[3]),
                "count": int(ratio.numel())}

    # ------------------------------------------------------------------------------- state resume
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (hooks included), except that bf16/fp16 parameters keep fp32 moments: the
        saved fp32 values are put back after torch's cast to the parameter dtype, before the user's
        post-hooks run, so a resume is bit-identical."""
        kept: dict[tuple[int, str], Tensor] = {}
        params = [p for group in self.param_groups for p in group["params"]]

        def keep_fp32_moments(optimizer, loaded: dict) -> None:  # runs after the user's pre-hooks
            ids = [i for group in loaded["param_groups"] for i in group["params"]]
            for index, (param_id, p) in enumerate(zip(ids, params)):
                for key, value in loaded["state"].get(param_id, {}).items():
                    if key not in self._state_keys or not isinstance(value, Tensor):
                        continue
                    if value.shape != p.shape:  # the kernels see flat tensors: it would pair wrong elements
                        raise ValueError(
                            f"load_state_dict: state {key!r} of parameter {index} has shape {tuple(value.shape)}, "
                            f"the parameter {tuple(p.shape)}; the state dict is of another model or parameter "
                            "order (nothing was loaded)")
                    if state_dtype(p) != p.dtype:
                        kept[(index, key)] = value

        def restore(optimizer) -> None:  # runs before the user's post-hooks
            counted = [(p, self.state[p]) for p in params if "step" in self.state.get(p, {})]
            for p, state in counted:  # a step count saved in either mode, in this optimizer's
                state["step"] = step_count(state["step"], _real(local_shard(p)).device, self.capturable)
            if self.capturable:
                for (_, state), count in zip(counted, packed_counts([state["step"] for _, state in counted])):
                    state["step"] = count
            for (index, key), value in kept.items():
                p = params[index]
                if p in self.state and key in self.state[p]:
                    self.state[p][key] = value.to(device=p.device, dtype=state_dtype(p), copy=True)
            for state in self.state.values():  # the update works on contiguous state
                for key in self._state_keys:
                    if key in state and not state[key].is_contiguous():
                        state[key] = state[key].contiguous()

        pre = self.register_load_state_dict_pre_hook(keep_fp32_moments)
        post = self.register_load_state_dict_post_hook(restore, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()
