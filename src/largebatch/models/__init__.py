"""GPT and BERT on one shared transformer block, with FLOP counts per token; model kinds by name.

    from largebatch.models import ModelConfig, build_model, preset
    model = build_model(preset("demo", dropout=0.1))
    logits, loss = model(idx, targets)
    model.flops_per_token()                   # model FLOPs (MFU)
    model.flops_per_token(recompute="full")   # hardware FLOPs (HFU)
    register_model("my-kind", build=..., objective="causal", ...)   # model.kind = "my-kind"

The layer layout and the FLOP formula follow Korthikanti et al. 2022 (docs/papers.md: memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from largebatch.models.config import ModelConfig
from largebatch.models.flops import RECOMPUTE_POLICIES, flops_per_token, per_layer_policies, utilization
from largebatch.models.presets import PRESETS, preset
from largebatch.models.registry import MODELS, ModelSpec, model_spec, register_model

__all__ = ["BERT", "GPT", "MODELS", "PRESETS", "RECOMPUTE_POLICIES", "Block", "CoreAttention", "ModelConfig",
           "ModelSpec", "build_model", "flops_per_token", "model_spec", "per_layer_policies", "preset",
           "register_model", "utilization"]


def build_model(config: ModelConfig) -> nn.Module:
    """The model of the registered kind ``config.kind`` (GPT for "gpt", BERT for "bert")."""
    return model_spec(config.kind).build(config)


if TYPE_CHECKING:  # what __getattr__ serves, for type checkers (imported on first use at run time)
    from torch import nn

    from largebatch.models.bert import BERT
    from largebatch.models.gpt import GPT
    from largebatch.models.layers import Block, CoreAttention

_MODULES = {"BERT": "largebatch.models.bert", "GPT": "largebatch.models.gpt", "Block": "largebatch.models.layers",
            "CoreAttention": "largebatch.models.layers"}


def __getattr__(name: str):
    """The torch modules on first use: configs, presets, FLOP counts and the kinds' memory terms need
    no torch (a planning command starts in a fraction of a second instead of ~2 s)."""
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
