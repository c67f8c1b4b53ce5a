"""From ``[optim]`` to an optimizer, by name from one table.

:data:`OPTIMIZERS` is the one place an optimizer is declared: its constructor, the ``[optim]``
fields it reads, its parameter-group policy (which categories take a trust ratio when
``optim.adapt`` is not set; None: no trust ratio at all) and its fp32 state bytes per parameter
(for the memory check before a run, and recorded in the memory model's
``largebatch.memory.OPTIMIZER_STATE_BYTES``, whose names ``largebatch memory --optim.name`` takes:
the memory layer cannot import the trainer). ``optim.name``'s choices, ``--help-config`` and the
trainer all read this table, so an optimizer added with :func:`register_optimizer` -- from any module
imported before the config is loaded -- is accepted, listed and built like the shipped ones.

Parameter groups come from largebatch.optim.param_groups (weight decay on weights and embeddings;
trust ratios on the adapted categories), each with an ``lr_mult`` (optim.no_decay_lr_mult,
optim.unadapted_lr_mult) that scales the scheduled LR.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from largebatch.memory.estimate import OPTIMIZER_STATE_BYTES
from largebatch.optim import LAMB, LANS, LARS, LayerwiseOptimizer, param_groups
from largebatch.optim.groups import ADAPT_DEFAULT, CATEGORIES
from largebatch.typed_config import check_registration

if TYPE_CHECKING:  # train.config reads OPTIMIZERS for optim.name's choices
    from largebatch.train.config import OptimConfig

Builder = Callable[[list[dict], "OptimConfig"], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Builder
    """(parameter groups, the [optim] config) -> the optimizer; its LR is set by the trainer each step."""
    summary: str
    """One line for --help-config: what it is, with its paper."""
    fields: tuple[str, ...]
    """The [optim] fields ``build`` reads (beyond the groups' weight_decay and lr_mult)."""
    adapt_default: tuple[str, ...] | None
    """Categories whose step is scaled by the trust ratio when optim.adapt is None; None: the
    optimizer has no trust ratio (optim.adapt and optim.unadapted_lr_mult are refused)."""
    state_bytes: int
    """fp32 optimizer-state bytes per parameter (8: two moments; 4: one)."""
    title: str
    """How messages name it (e.g. 'AdamW')."""

    @property
    def help(self) -> str:
        return f"{self.summary}; reads {', '.join(self.fields)}"


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(name: str, build: Builder, *, summary: str, fields: tuple[str, ...],
                       adapt_default: tuple[str, ...] | None, state_bytes: int,
                       title: str | None = None) -> OptimizerSpec:
    """Declare an optimizer under ``name`` (replacing one of that name, with a warning); the
    arguments are checked here, and the builder once on a small model before a run starts
    (largebatch.train.preflight.check_optimizer)."""
    check_registration("register_optimizer", name, OPTIMIZERS, {"build": build},
                       {"summary": summary, **({} if title is None else {"title": title})})
    where = f"register_optimizer({name!r})"
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise ValueError(f"{where}: fields={fields!r} must be a tuple of [optim] field names, e.g. "
                         "('betas', 'eps')")
    if adapt_default is not None and (isinstance(adapt_default, str) or set(adapt_default) - set(CATEGORIES)):
        raise ValueError(f"{where}: adapt_default={adapt_default!r} must be None (no trust ratio) or a tuple "
                         f"of the parameter categories {', '.join(map(repr, CATEGORIES))}")
    if isinstance(state_bytes, bool) or not isinstance(state_bytes, int) or state_bytes < 0:
        raise ValueError(f"{where}: state_bytes={state_bytes!r} must be a whole number >= 0 (fp32 optimizer-"
                         "state bytes per parameter: 8 for two moments, 4 for one)")
    spec = OptimizerSpec(name, build, summary, tuple(fields),
                         None if adapt_default is None else tuple(adapt_default), state_bytes, title or name)
    OPTIMIZERS[name] = spec
    OPTIMIZER_STATE_BYTES[name] = state_bytes  # the memory model sizes it: `largebatch memory --optim.name`
    return spec


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, capturable: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; LR is set by the schedule each step.
    ``capturable``: LAMB, LANS and LARS keep their step counts on the device (run.on_nonfinite='skip'
    takes a skipped step back on the device, counts included: largebatch.train.skip)."""
    groups = param_groups(model, weight_decay=cfg.weight_decay, adapt=cfg.adapted_categories())
    for group in groups:  # saved with the optimizer's state, so a resume keeps the ratios
        group["lr_mult"] = ((cfg.no_decay_lr_mult if group["weight_decay"] == 0 else 1.0)
                            * (cfg.unadapted_lr_mult if not group["adapt"] else 1.0))
    optimizer = OPTIMIZERS[cfg.name].build(groups, cfg)
    if capturable and isinstance(optimizer, LayerwiseOptimizer):
        optimizer.capturable = True  # (no state yet: the counts are created on the device)
    elif capturable:
        device_step_counts(optimizer)
    return optimizer


def device_step_counts(optimizer: torch.optim.Optimizer, supported: frozenset[str] | None = None) -> None:
    """torch's own optimizers with a ``capturable`` option (AdamW, Adam): turned on for every group
    whose parameters sit where torch allows it (an accelerator: CUDA, XPU, ...), and any step count
    already kept on the host moved to its parameter's device (a state loaded from a checkpoint). Its
    default path keeps each count on the host there, out of reach of a take-back on the device
    (largebatch.train.skip): an fp16 overflow would advance it until the next host read. On CPU the
    counts are CPU tensors already, beside the flag, and torch refuses capturable: left as they are.
    ``supported``: the device types (default: torch's list)."""
    if supported is None:
        from torch.optim.optimizer import _get_capturable_supported_devices

        supported = frozenset(_get_capturable_supported_devices())
    for group in optimizer.param_groups:
        params = group["params"]
        if "capturable" not in group or group.get("fused") or not params:
            continue
        if not all(p.device.type in supported for p in params):
            continue
        group["capturable"] = True
        for p in params:
            count = optimizer.state.get(p, {}).get("step")
            if isinstance(count, torch.Tensor) and count.device != p.device:
                optimizer.state[p]["step"] = count.to(p.device)


# lr=0.0 below: a placeholder; each step the trainer sets every group to the scheduled LR x its lr_mult

register_optimizer(
    "lamb", lambda groups, cfg: LAMB(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     fused=cfg.fused, track_trust_ratios=cfg.log_trust_ratios),
    summary="LAMB (You et al. 2019)", fields=("betas", "eps", "weight_decay", "fused", "log_trust_ratios"),
    adapt_default=ADAPT_DEFAULT, state_bytes=OPTIMIZER_STATE_BYTES["lamb"], title="LAMB")
register_optimizer(
    "lans", lambda groups, cfg: LANS(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     fused=cfg.fused, track_trust_ratios=cfg.log_trust_ratios),
    summary="LANS (Zheng et al. 2020)", fields=("betas", "eps", "weight_decay", "fused", "log_trust_ratios"),
    adapt_default=ADAPT_DEFAULT, state_bytes=OPTIMIZER_STATE_BYTES["lans"], title="LANS")
register_optimizer(
    "lars", lambda groups, cfg: LARS(groups, lr=0.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                     trust_coefficient=cfg.trust_coefficient, eps=cfg.eps,
                                     track_trust_ratios=cfg.log_trust_ratios),
    # all four categories, as in LARS's Algorithm 1 (docs/optim.md measures leaving some out)
    summary="LARS (You et al. 2017)", fields=("momentum", "trust_coefficient", "eps", "weight_decay",
                                              "log_trust_ratios"),
    adapt_default=CATEGORIES, state_bytes=OPTIMIZER_STATE_BYTES["lars"], title="LARS")
register_optimizer(
    # param_groups' extra keys ('adapt', 'names') are ignored by torch.optim
    "adamw", lambda groups, cfg: torch.optim.AdamW(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps,
                                                   weight_decay=cfg.weight_decay, fused=cfg.fused or None),
    summary="torch.optim.AdamW, the baseline", fields=("betas", "eps", "weight_decay", "fused"),
    adapt_default=None, state_bytes=OPTIMIZER_STATE_BYTES["adamw"], title="AdamW")

_SHIPPED = dict(OPTIMIZERS)  # the optimizers above, tested with the package: no probe before a run


def probe_optimizer(cfg: OptimConfig) -> str | None:
    """What is wrong with a registered optimizer's builder, tried on a small model (an embedding, a
    linear layer, a norm): it must build from the parameter groups, be a ``torch.optim.Optimizer``
    (or have its ``param_groups``, ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``), take
    a step, and give a state that a copy built the same way loads (a checkpoint saves and restores
    it). None when all holds, or for an optimizer that ships with the package."""
    import copy

    spec = OPTIMIZERS[cfg.name]
    if _SHIPPED.get(cfg.name) is spec:
        return None
    known = {f.name for f in dataclasses.fields(cfg)}
    unknown = [name for name in spec.fields if name not in known]
    if unknown:
        return (f"its registration (register_optimizer) lists [optim] field(s) {', '.join(map(repr, unknown))} "
                "that [optim] does not have")
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    stage = "building it from the parameter groups"
    try:
        optimizer = build_optimizer(model, cfg)
        missing = [a for a in ("param_groups", "step", "zero_grad", "state_dict", "load_state_dict")
                   if not hasattr(optimizer, a)]
        if missing:
            return (f"its builder (register_optimizer) returned a {type(optimizer).__name__}, without "
                    f"{', '.join(missing)}: return a torch.optim.Optimizer")
        stage = "a step"
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * group.get("lr_mult", 1.0)
        model(torch.tensor([[1, 2, 3]])).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stage = "state_dict() and a copy's load_state_dict() (what a checkpoint does)"
        state = copy.deepcopy(optimizer.state_dict())
        build_optimizer(model, cfg).load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 -- a user's code: whatever it raises is the answer
        return f"its optimizer failed on a small model at {stage}: {type(exc).__name__}: {exc}"
    return None
