"""GPT and BERT on one shared transformer block, with FLOP counts per token.

    from largebatch.models import ModelConfig, build_model, preset
    model = build_model(preset("demo", dropout=0.1))
    logits, loss = model(idx, targets)
    model.flops_per_token()                   # model FLOPs (MFU)
    model.flops_per_token(recompute="full")   # hardware FLOPs (HFU)

The layer layout and the FLOP formula follow Korthikanti et al. 2022 (docs/papers.md: memory).
"""

from __future__ import annotations

from largebatch.models.bert import BERT
from largebatch.models.config import PRESETS, ModelConfig, preset
from largebatch.models.flops import RECOMPUTE_POLICIES, flops_per_token, per_layer_policies, utilization
from largebatch.models.gpt import GPT
from largebatch.models.layers import Block, CoreAttention

__all__ = ["BERT", "GPT", "PRESETS", "RECOMPUTE_POLICIES", "Block", "CoreAttention", "ModelConfig",
           "build_model", "flops_per_token", "per_layer_policies", "preset", "utilization"]


def build_model(config: ModelConfig) -> GPT | BERT:
    """GPT for kind="gpt", BERT for kind="bert"."""
    return GPT(config) if config.kind == "gpt" else BERT(config)
