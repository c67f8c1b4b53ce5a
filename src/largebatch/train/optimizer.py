"""From ``[optim]`` to an optimizer: parameter groups by largebatch.optim.param_groups (weight decay
on weights and embeddings; trust ratios on the categories of ``optim.adapt``)."""

from __future__ import annotations

import torch

from largebatch.optim import LAMB, LANS, LARS, param_groups
from largebatch.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; LR is set by the schedule each step."""
    groups = param_groups(model, weight_decay=cfg.weight_decay, adapt=cfg.adapted_categories())
    lr = 0.0  # placeholder: the trainer writes the scheduled LR into every group before each step
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
