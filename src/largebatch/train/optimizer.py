"""From ``[optim]`` to an optimizer: parameter groups by largebatch.optim.param_groups (weight decay
on weights and embeddings; trust ratios on the categories of ``optim.adapt``), each with an
``lr_mult`` (optim.no_decay_lr_mult, optim.unadapted_lr_mult) that scales the scheduled LR."""

from __future__ import annotations

import torch

from largebatch.optim import LAMB, LANS, LARS, param_groups
from largebatch.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; LR is set by the schedule each step."""
    groups = param_groups(model, weight_decay=cfg.weight_decay, adapt=cfg.adapted_categories())
    for group in groups:  # saved with the optimizer's state, so a resume keeps the ratios
        group["lr_mult"] = ((cfg.no_decay_lr_mult if group["weight_decay"] == 0 else 1.0)
                            * (cfg.unadapted_lr_mult if not group["adapt"] else 1.0))
    lr = 0.0  # placeholder: each step the trainer sets every group to the scheduled LR x its lr_mult
    if cfg.name == "lamb":
        return LAMB(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    fused=cfg.fused, track_trust_ratios=cfg.log_trust_ratios)
    if cfg.name == "lans":
        return LANS(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    fused=cfg.fused, track_trust_ratios=cfg.log_trust_ratios)
    if cfg.name == "lars":
        return LARS(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    trust_coefficient=cfg.trust_coefficient, eps=cfg.eps,
                    track_trust_ratios=cfg.log_trust_ratios)
    # AdamW: param_groups' extra keys ('adapt', 'names') are ignored by torch.optim
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=cfg.fused or None)
