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
    """BLOCK_TP_PLAN, with the gated MLP's gate split by columns as fc1 is, and the query and key
    heads' norms (qk_norm) run on each rank's heads (over each head, or over the rank's share of the
    projection with the statistic summed over the ranks)."""
    plan = dict(BLOCK_TP_PLAN)
    if config.activation == "swiglu":
        plan["blocks.*.mlp.gate"] = "colwise"
    if config.qk_norm:  # each head's values, or the whole projection's (split by heads as q and k are)
        role = "projection_norm" if config.qk_norm_layout == "projection" else "head_norm"
        plan.update({"blocks.*.attn.q_norm": role, "blocks.*.attn.k_norm": role})
    return plan


def norm_parameters(config: ModelConfig, width: int | None = None) -> int:
    """Parameters of one LayerNorm (a gain, and a bias when config.bias) or RMSNorm (a gain) over
    ``width`` values (n_embd when None)."""
    return (2 if config.bias and config.norm == "layernorm" else 1) * (config.n_embd if width is None else width)


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
    return config.n_embd * dtype_bytes * (1 / t_rep + 1) + 4 * config.vocab_size / tp


def gpt_tp_plan(model: nn.Module) -> dict[str, str]:
    """The final norm stays in the sequence-parallel region; the output layer reads the stream."""
    return {"tok_emb": "vocab_embedding", "drop": "sequence_start", "ln_f": "norm", "lm_head": "output",
            **block_tp_plan(model.config)}


register_model(
    "gpt", build=_build_gpt, objective="causal",
    help="causal language model, pre-LN blocks (Radford et al. 2019) or OLMo 2's reordered norms",
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
    return config.n_embd * dtype_bytes if _post_ln(config) else 0.0  # the embedding norm's input


def _bert_output_activations(config: ModelConfig, dtype_bytes: float, tp: int, t_rep: int,
                             mask_fraction: float) -> float:
    """Per token: the final-norm input (pre-LN), then the head on the masked positions only (dense,
    GeLU, LayerNorm and decoder inputs, fp32 logits)."""
    h, v = config.n_embd, config.vocab_size
    final_norm = 0.0 if _post_ln(config) else h * dtype_bytes / t_rep
    return final_norm + mask_fraction * (4 * h * dtype_bytes + 4 * v / tp)


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
