"""Meta-device start: build the model without memory, shard it, then give each rank its own shards.

Under FSDP2 or tensor parallel no rank should ever hold the whole model (a model that does not fit
on one device must still start). So the trainer

  1. builds the model on the ``meta`` device (shapes only, no storage) while recording every
     in-place initialisation the constructor applies to a tensor (``torch.nn.init`` fills parameters
     in place: ``uniform_``, ``normal_``, ``fill_``, ``zero_``; their argument values included);
  2. parallelizes it (``largebatch.parallel.parallelize``: TP/SP, recomputation, compile, FSDP2),
     which lays out every parameter as a DTensor of meta local shards;
  3. materialises: allocates only the local shards on the device (``to_empty``), then replays the
     recorded initialisations IN ORDER on full-size CPU tensors, one tensor at a time, from the CPU
     generator state the one-process build started from, and copies only this rank's slice of each
     into its local shard; non-persistent buffers (the causal mask) are rebuilt by their module.

Replaying the same fills, with the same arguments, on the same CPU generator, in the same order,
draws the same numbers: the parameters equal the one-process build bit for bit, and the generator
is left where the one-process build leaves it. Tied weights stay one tensor (the tie is a Python
object shared by two modules, and ``to_empty`` keeps a DTensor parameter's identity; it replaces a
plain one, so a tie between plain parameters would split, and is refused). Peak extra memory: one
full parameter on the host.

Pipeline stages (pp > 1) start the same way: the meta model is cut to this rank's stages (the
modules of other stages set to None) and parallelized per stage, then materialised. The replay
still runs every recorded call, those of the dropped parameters included, on throwaway full CPU
tensors, so the generator draws exactly what the whole build draws and the kept parameters equal
it bit for bit; only kept parameters are stored. DDP without pipeline stages, one-process runs and
``model.init_from`` starts build the plain way (every rank builds the whole model; see
docs/parallel.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

# in-place Tensor methods whose result does not depend on the tensor's previous content (every
# torch.nn.init function is one too)
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "geometric_",
               "cauchy_", "log_normal_", "bernoulli_", "copy_"}


@dataclass
class InitLog:
    """What a constructor did to its tensors, in call order: (tensor, function, other args, kwargs,
    whether the call sets the whole value), and the CPU generator state it started from."""

    rng_state: torch.Tensor
    calls: list[tuple[torch.Tensor, Callable, tuple, dict, bool]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # id(built parameter) -> its name


class _RecordInits(TorchFunctionMode):
    """Log the outermost in-place call on a meta tensor: a ``torch.nn.init`` function (which hands
    its tensor by keyword) or a ``Tensor.<name>_`` method; what it calls inside is not seen."""

    def __init__(self, log: InitLog):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            call = _split_target(func, args, kwargs)
            if call is not None:
                overwrites = getattr(func, "__module__", None) == "torch.nn.init" or name in _OVERWRITES
                self.log.calls.append((*call, overwrites))
        return func(*args, **kwargs)


def _split_target(func, args: tuple, kwargs: dict):
    """(meta tensor written, func, the other args, kwargs), or None if no meta tensor is written."""
    if getattr(func, "__module__", None) == "torch.nn.init":
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())
        target, rest = values[0], tuple(values[1:])
        kwargs = {}
    else:
        target, rest = (args[0], tuple(args[1:])) if args else (None, ())
    if not (isinstance(target, torch.Tensor) and target.is_meta):
        return None
    if any(isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values())):
        raise ValueError(f"meta-device start: the model initialises a tensor with {func.__name__} "
                         f"from another tensor, which cannot be replayed; use parallel.dp_mode="
                         f"'ddp' or one process, or initialise with torch.nn.init")
    return target, func, rest, dict(kwargs)


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitLog]:
    """``build()`` on the meta device (no parameter storage), with the log that ``materialize``
    replays. Call it where the one-process build would run: the log starts from the CPU generator
    state of that moment."""
    log = InitLog(rng_state=torch.get_rng_state())
    with torch.device("meta"), _RecordInits(log):
        model = build()
    written = {id(t) for t, _, _, _, overwrites in log.calls if overwrites}
    for name, p in model.named_parameters():  # parallelize replaces the objects, not the names
        log.names[id(p)] = name
        if id(p) not in written:
            raise ValueError(f"meta-device start: parameter {name} is never filled in place by its "
                             f"constructor, so its value cannot be rebuilt; initialise it with "
                             f"torch.nn.init, or use parallel.dp_mode='ddp' or one process")
    return model, log


def materialize(model: nn.Module, log: InitLog, device: torch.device) -> None:
    """Allocate ``model``'s local shards on ``device`` and fill them with the one-process values."""
    last_write = {}  # tensor id -> index of the call that starts its final value
    for i, (tensor, _, _, _, overwrites) in enumerate(log.calls):
        if overwrites:
            last_write[id(tensor)] = i
    with_buffers = [m for m in model.modules() if any(b.is_meta for b in m.buffers(recurse=False))]
    for module in with_buffers:  # to_empty leaves buffers allocated but not filled
        if not hasattr(module, "init_buffers"):
            raise ValueError(f"meta-device start: {type(module).__name__} has a buffer but no "
                             f"init_buffers(device) to rebuild it")
    ties: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter object -> every slot that holds it
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                ties.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=device)  # only the local shards: DTensors keep their placements
    for slots in ties.values():  # to_empty gives each slot of a plain tied parameter its own copy
        (first, attr), *rest = slots
        for module, other in rest:
            module._parameters[other] = first._parameters[attr]
    # the built tensors -> the parallelized parameters, looked up after to_empty (a plain meta
    # parameter is replaced by a new object there; tied weights: tied again above, one name, one object); a parameter
    # of a module a pipeline stage dropped (set to None) has none: its inits are replayed for the
    # generator's sake, not stored
    targets = {key: model.get_parameter(name) for key, name in log.names.items() if _held(model, name)}
    unknown = sorted({name for name, _ in model.named_parameters()} - set(log.names.values()))
    if unknown:  # e.g. a tie between plain (not DTensor) parameters that to_empty split in two
        raise ValueError(f"meta-device start: parameters {unknown} were not in the meta build "
                         f"under these names, so their values cannot be rebuilt")
    saved = torch.get_rng_state()
    torch.set_rng_state(log.rng_state)
    try:
        _replay(log.calls, targets, last_write)
    except BaseException:
        torch.set_rng_state(saved)
        raise
    # the generator now stands where the one-process build leaves it
    for module in with_buffers:
        module.init_buffers(device)


def _held(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` is still in ``model``: False where a module on its path was set
    to None (a pipeline stage's dropped module); any other missing name raises as get_parameter does."""
    module: Any = model
    for part in name.split(".")[:-1]:
        if part in module._modules and module._modules[part] is None:
            return False
        module = module.get_submodule(part)
    return True


def _replay(calls, targets: dict[int, torch.Tensor], last_write: dict[int, int]) -> None:
    """Run each recorded call on a full CPU tensor; copy a parameter's final value into its shard."""
    full, owner, final = None, None, False  # the one full tensor alive, whose it is, and whether kept
    with torch.no_grad():
        for i, (tensor, func, args, kwargs, overwrites) in enumerate(calls):
            if overwrites:  # a new value begins: the previous one is done
                _store(full, targets.get(owner), final)
                full = None  # freed before the next is allocated: one full tensor at a time
                full = torch.empty(tensor.shape, dtype=tensor.dtype)  # the CPU, as the plain build
                owner, final = id(tensor), last_write.get(id(tensor)) == i
            elif owner != id(tensor):
                raise ValueError(f"meta-device start: {func.__name__} reads a tensor whose value was "
                                 f"set earlier by another initialisation; cannot replay in order")
            func(full, *args, **kwargs)
        _store(full, targets.get(owner), final)


def _store(full: torch.Tensor | None, param: torch.Tensor | None, final: bool) -> None:
    if full is None or param is None or not final:
        return  # a value later overwritten, or one of a tensor the model no longer holds
    if not isinstance(param, DTensor):
        param.copy_(full)
    elif all(type(p) in (Shard, Replicate) for p in param.placements):
        # this rank's block, cut on the host: every rank holds the same full tensor
        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh,
                                                              param.placements)
        param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    else:  # strided shards (FSDP over tensor parallel): DTensor cuts them, no communication
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())


def meta_init_applies(state: Any, init_from: str | None) -> bool:
    """The trainer builds on the meta device under FSDP2 (over >1 replica), tensor parallel or
    pipeline stages, not under DDP alone, in one process, or when starting from pretrained weights."""
    sharded = (state.dp_mode == "fsdp" and state.dp_size > 1) or state.tp_size > 1 or state.pp_size > 1
    return state.distributed and sharded and not init_from
