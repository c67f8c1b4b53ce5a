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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from largebatch.memory.estimate import OPTIMIZER_STATE_BYTES
from largebatch.optim import LAMB, LANS, LARS, LayerwiseOptimizer, param_groups
from largebatch.optim.groups import ADAPT_DEFAULT, CATEGORIES

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
    """Declare an optimizer under ``name`` (replacing one of that name)."""
    spec = OptimizerSpec(name, build, summary, tuple(fields), adapt_default, state_bytes, title or name)
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
    return optimizer


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
