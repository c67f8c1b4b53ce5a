"""The built-in model kinds, "gpt" and "bert", declared without importing torch.

What the rest of the library asks of a kind (largebatch.models.registry: FLOPs, activation memory,
pipeline stage parameters, the tensor-parallel plan) is arithmetic on the config and module names;
only ``build`` needs the modules (largebatch.models.gpt, largebatch.models.bert), and it imports
them on first use. So a command that plans or checks a config (``largebatch memory``, ``--help``)
starts without loading torch (~2 s). The registry imports this module when it is imported itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from largebatch.models.registry import register_model

if TYPE_CHECKING:
    import torch.nn as nn

    from largebatch.models.config import ModelConfig


BLOCK_TP_PLAN = {f"blocks.*.{name}": role for name, role in (
    ("attn", "enter"), ("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"), ("attn.proj", "rowwise"),
    ("mlp", "enter"), ("mlp.fc1", "colwise"), ("mlp.fc2", "rowwise"), ("ln1", "norm"), ("ln2", "norm"))}
"""Tensor-parallel roles of a Block's modules (largebatch.models.registry.TP_ROLES): q, k, v and fc1
split by columns, proj and fc2 by rows, one gathered input per sub-layer, the norms sequence-split."""


def block_tp_plan(config: ModelConfig) -> dict[str, str]:
    """BLOCK_TP_PLAN, with the gated MLP's gate split by columns as fc1 is."""
    if config.activation != "swiglu":
        return dict(BLOCK_TP_PLAN)
    return {**BLOCK_TP_PLAN, "blocks.*.mlp.gate": "colwise"}


def norm_kept_values(config: ModelConfig, dtype_bytes: float, fused: bool = False) -> float:
    """h-wide values of ``dtype_bytes`` bytes one of the model's norms keeps per token for backward
    (measured, tests/test_memory_llama.py): a LayerNorm its input, 1. An RMSNorm (layers.RMSNorm):
    a 16-bit input is normalised in fp32, so it keeps that fp32 copy and the d-byte normalised
    tensor the gain's gradient needs, 4/d + 1 (3 at 16 bits); a 32-bit input its input and that
    normalised tensor on torch's composite path (CPU), 2, or its input only with the fused kernel
    (``fused``: CUDA, input and gain of one dtype), 1."""
    if config.norm != "rmsnorm":
        return 1.0
    if dtype_bytes < 4:
        return 4.0 / dtype_bytes + 1.0
    return 1.0 if fused else 2.0


def norm_parameters(config: ModelConfig) -> int:
    """Parameters of one LayerNorm (a gain, and a bias when config.bias) or RMSNorm (a gain)."""
    return (2 if config.bias and config.norm == "layernorm" else 1) * config.n_embd


# ------------------------------------------------------------------------------------------- GPT
def _build_gpt(config: ModelConfig) -> nn.Module:
    from largebatch.models.gpt import GPT

    return GPT(config)


def _gpt_stage_parameters(config: ModelConfig, tp: int, first: bool, last: bool) -> float:
    if not last:
        return 0.0
    untied = 0 if config.tie_embeddings else config.vocab_size * config.n_embd / tp
    return norm_parameters(config) + untied  # final LayerNorm, an untied output projection


def gpt_output_activations(config: ModelConfig, dtype_bytes: float, tp: int, t_rep: int,
                           mask_fraction: float) -> float:
    """Per token: the final-norm input (split by t_rep under sequence parallel), the projection input
    and fp32 logits (vocabulary-parallel). The projection input is whole on every rank: the output
    layer all-gathers the sequence and keeps the gathered input for its weight gradient."""
    final_norm = norm_kept_values(config, dtype_bytes)  # (the composite count: no device here)
    return config.n_embd * dtype_bytes * (final_norm / t_rep + 1) + 4 * config.vocab_size / tp


def gpt_tp_plan(model: nn.Module) -> dict[str, str]:
    """The final norm stays in the sequence-parallel region; the output layer reads the stream."""
    return {"tok_emb": "vocab_embedding", "drop": "sequence_start", "ln_f": "norm", "lm_head": "output",
            **block_tp_plan(model.config)}


register_model(
    "gpt", build=_build_gpt, objective="causal", help="causal language model, pre-LN blocks (Radford et al. 2019)",
    head_flops=lambda config, mask_fraction: 2.0 * config.n_embd * config.vocab_size,
    output_activations=gpt_output_activations, stage_parameters=_gpt_stage_parameters,
    tp_plan=gpt_tp_plan, pipeline_first=("tok_emb", "pos_emb", "drop"), pipeline_last=("ln_f", "lm_head"))


# ------------------------------------------------------------------------------------------ BERT
def _build_bert(config: ModelConfig) -> nn.Module:
    from largebatch.models.bert import BERT

    return BERT(config)


def _post_ln(config: ModelConfig) -> bool:
    return config.norm_position == "post"


def _bert_stage_parameters(config: ModelConfig, tp: int, first: bool, last: bool) -> float:
    h, v, norm = config.n_embd, config.vocab_size, norm_parameters(config)
    n = norm if first and _post_ln(config) else 0.0  # embedding LayerNorm
    if last:
        n += 0 if _post_ln(config) else norm  # final LayerNorm
        n += 0 if config.tie_embeddings else v * h / tp  # untied decoder
        # head: dense (replicated: it reads the whole masked rows), its LayerNorm, the decoder's bias
        # (split over the vocabulary with the decoder)
        n += h * h + (h if config.bias else 0) + norm + v / tp
    return n


def _bert_embedding_activations(config: ModelConfig, dtype_bytes: float) -> float:
    norm = norm_kept_values(config, dtype_bytes)  # the embedding LayerNorm's input (and more for an RMSNorm)
    return norm * config.n_embd * dtype_bytes if _post_ln(config) else 0.0


def _bert_output_activations(config: ModelConfig, dtype_bytes: float, tp: int, t_rep: int,
                             mask_fraction: float) -> float:
    """Per token: the final-norm input (pre-LN), then the head on the masked positions only (dense,
    GeLU, LayerNorm and decoder inputs, fp32 logits)."""
    h, v, norm = config.n_embd, config.vocab_size, norm_kept_values(config, dtype_bytes)
    final_norm = 0.0 if _post_ln(config) else norm * h * dtype_bytes / t_rep
    return final_norm + mask_fraction * ((3 + norm) * h * dtype_bytes + 4 * v / tp)


def _bert_tp_plan(model: nn.Module) -> dict[str, str]:
    """The head picks the masked positions (x[mask]), so it runs on the whole sequence."""
    return {"tok_emb": "vocab_embedding", "drop": "sequence_start", "ln_f": "gather",
            "head.decoder": "output_whole", **block_tp_plan(model.config)}


register_model(
    "bert", build=_build_bert, objective="masked",
    help="masked language model, bidirectional; pre-LN (Cramming) or post-LN (Devlin et al. 2019)",
    head_flops=lambda config, mask_fraction: mask_fraction * 2.0 * (config.n_embd ** 2 + config.n_embd
                                                                    * config.vocab_size),
    output_activations=_bert_output_activations, stage_parameters=_bert_stage_parameters,
    embedding_activations=_bert_embedding_activations, tp_plan=_bert_tp_plan,
    pipeline_first=("tok_emb", "pos_emb", "emb_norm", "drop"), pipeline_last=("ln_f", "head"))
