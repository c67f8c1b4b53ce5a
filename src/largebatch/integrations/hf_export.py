"""largebatch GPT / BERT weights as transformers ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``MistralForCausalLM``, ``MinistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Olmo2ForCausalLM`` or ``Olmo3ForCausalLM`` /
``BertForMaskedLM`` (or the RoBERTa family's masked LM).

The layouts are the same network, so the export is a renaming plus two reshapes:

* GPT -> GPT2LMHeadModel. Pre-LN blocks with a final LayerNorm, learned positions, an output
  projection without bias (tied or not: ``tie_word_embeddings``). GPT-2 fuses q/k/v into one
  ``Conv1D`` whose weight is (in, out): ``c_attn.weight = cat(q.W^T, k.W^T, v.W^T)``, and every
  Conv1D is a transposed Linear.
* Llama-style GPT (model.norm="rmsnorm", position="rope", activation="swiglu"; Touvron et al. 2023)
  -> LlamaForCausalLM, the default type of such a model (``model.hf_model_type`` unset): nn.Linear
  on both sides, so a renaming (largebatch.train.hf_import's table read backwards); grouped-query
  attention as ``num_key_value_heads``, ``head_dim`` = the head size, ``attention_bias`` =
  ``mlp_bias`` = model.bias, ``rope_theta``, ``rms_norm_eps``, ``max_position_embeddings`` = seq_len,
  ``rope_parameters`` with model.rope_scaling's type and factors ("linear"; "llama3": Llama 3.1 and 3.2).
  Llama has dropout on the attention probabilities only: ``attention_dropout`` = model.dropout, and
  the embedding and residual dropout have no place (the same logits in eval). With biases on q, k
  and v alone (model.bias=False, model.qkv_bias=True) -> Qwen2ForCausalLM (Yang et al. 2024), the
  default type of such a model: the same names, the three biases too. Without
  biases and with each query and key head normalised (model.qk_norm) -> Qwen3ForCausalLM (Yang et al.
  2025), the default type of such a model: the same names plus ``self_attn.q_norm`` and ``k_norm``,
  ``attention_bias`` false. Both write the sliding windows as ``use_sliding_window``,
  ``sliding_window`` and ``layer_types`` (each layer "sliding_attention" or "full_attention"). Without
  biases and with a window (model.sliding_window) on every layer -> MistralForCausalLM (Jiang et al.
  2023; ``sliding_window``), on some -> MinistralForCausalLM (``layer_types``). Without biases, with
  the reordered norms (model.norm_position="reordered") and the whole q and k projections normalised
  (model.qk_norm_scope="projection") -> Olmo2ForCausalLM (OLMo et al. 2024; ln1 / ln2 as
  ``post_attention_layernorm`` / ``post_feedforward_layernorm``), with sliding windows ->
  Olmo3ForCausalLM (``layer_types``; the rope table written for both layer types).
* GPT with LayerNorm, rotary positions, a GeLU MLP and biases (Black et al. 2022; Pythia) ->
  GPTNeoXForCausalLM, the default type of such a model: ``use_parallel_residual`` from
  model.norm_position ("parallel": true, "pre": false), ``partial_rotary_factor`` = model.rope_fraction
  and ``rope_theta`` in ``rope_parameters`` (and as ``rotary_pct`` / ``rotary_emb_base``, the keys
  transformers 4 reads), q, k and v fused into ``query_key_value`` head by head ((heads, 3, d) rows),
  ``attention_dropout`` = ``hidden_dropout`` = model.dropout. A mixed layout (rope
  with LayerNorm, learned positions with RMSNorm, GeLU with rope, grouped-query attention under
  GPT-2) maps to no transformers architecture and is refused naming its fields
  (models.config.hf_layout_problem); the trainer refuses it before training when
  ``model.hf_model_type`` asks for one (hf_model_type_problem).
* BERT -> BertForMaskedLM, post-LN only (``model.norm_position="post"``): embedding LayerNorm, LN
  after each residual add, the head dense -> GeLU -> LayerNorm -> decoder with bias. largebatch's
  pre-LN BERT (the default, Cramming's layout) ends in a LayerNorm that BertForMaskedLM has no
  place for, so it is refused. BERT's segment embedding (absent here) is exported as zeros.
* BERT -> RobertaForMaskedLM / XLMRobertaForMaskedLM / CamembertForMaskedLM with
  ``model.hf_model_type`` (init_from sets it from a RoBERTa-family directory; Liu et al. 2019):
  the same blocks under ``roberta.``, the head under ``lm_head``, one segment, and positions from
  ``pad_token_id + 1`` (the tokenizer's pad), so the position table gets pad + 1 rows of zeros in
  front. That head's GeLU is the exact one: only ``model.activation="gelu"`` maps.
* The GeLU follows ``model.activation``: "gelu" (exact, erf) -> ``activation_function`` /
  ``hidden_act`` = "gelu"; "gelu_tanh" -> "gelu_new" (GPT-2's own tanh approximation; the two
  differ by up to 4.7e-4 per activation, which on a barely trained model moves the logits by only
  ~2e-6, so the tests check the config too). ``HF_ACTIVATION`` is the table.
* ``model.bias=False``: transformers' layers always have biases; they are exported as zeros,
  which computes the same function.
* The vocabulary is the model's ``vocab_size`` rows, all kept; the trainer sizes it to the
  tokenizer, so the two match. A model with more rows than the tokenizer (padding) keeps them
  (ids past the tokenizer are never produced); fewer rows than the tokenizer is refused.

The tokenizer is written as a ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json)
with the run's special tokens (``special_tokens``), and text encodes to exactly largebatch's ids.
GPT: the document separator is eos -- ``<|endoftext|>`` is bos/eos/unk as in GPT-2; ``</s>`` is eos
with ``<s>`` as bos where the vocabulary has it -- and [PAD] or <pad> the pad token. BERT: the
masked-LM tokens the samples were built with, BERT's [CLS]/[SEP]/[PAD]/[MASK] or RoBERTa's
<s>/</s>/<pad>/<mask>, and a post-processor that adds cls ... sep as the training samples had them
(``add_special_tokens=False`` gives the bare ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from largebatch.checkpoint.files import atomic_write_text
from largebatch.data.tokenizer import EOT, MASKED_LM_NAMES, document_separator, id_space, masked_lm_tokens
from largebatch.integrations import ExportError
from largebatch.memory.hf import LAYER_TYPES, ROBERTA_LAYOUTS
from largebatch.models.config import (
    HF_MODEL_TYPES,
    ModelConfig,
    default_hf_model_type,
    hf_layout_problem,
    hf_model_type_problem,
)
from largebatch.train.hf_import import HF_LAYOUTS, LLAMA_NORMS

VERIFY_TEXT = ("KING HENRY: Once more unto the breach, dear friends, once more; "
               "or close the wall up with our English dead.")


# model.activation -> transformers' name (activation_function / hidden_act)
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "swiglu": "silu"}


# model.hf_model_type -> the architecture written (the one the import reads); the RoBERTa family's
# masked-LM models are one network (positions from pad_token_id + 1, one segment, the head under lm_head)
HF_TYPE_ARCHITECTURES = {model_type: arch for model_type, (_, _, arch) in HF_LAYOUTS.items()}
# model kind -> the architecture it exports to by default (model.hf_model_type unset): its first type's
HF_ARCHITECTURES = {kind: HF_TYPE_ARCHITECTURES[types[0]] for kind, types in HF_MODEL_TYPES.items()}


def hf_model_type(cfg: ModelConfig) -> str:
    """The transformers model_type ``cfg`` exports as: model.hf_model_type, else its kind's first whose
    blocks are the model's ("llama" for a Llama-style GPT, models.config.default_hf_model_type)."""
    return default_hf_model_type(cfg)


def check_exportable(cfg: ModelConfig) -> str:
    """The transformers architecture ``cfg`` maps to; raises naming the setting that prevents it."""
    if cfg.kind not in HF_ARCHITECTURES:
        known = ", ".join(f"{k!r} ({v})" for k, v in HF_ARCHITECTURES.items())
        raise ExportError(f"model.kind={cfg.kind!r}: the hf format exports {known} only; "
                          f"{cfg.kind!r} maps to no transformers architecture")
    if cfg.kind == "bert" and cfg.norm_position != "post":
        arch = HF_TYPE_ARCHITECTURES.get(cfg.hf_model_type or "bert", "BertForMaskedLM")
        post = cfg.replace(norm_position="post")  # what else would stop it: said at once, not after retraining
        besides = hf_model_type_problem(post, fixed=True) or (hf_layout_problem(post) if cfg.hf_model_type is None
                                                                else None)
        raise ExportError(
            f"model.norm_position={cfg.norm_position!r}: a pre-LN BERT ends in a LayerNorm that "
            f"transformers' {arch} cannot express; only post-LN BERT exports -- train "
            "with --model.norm_position=post" + ("" if besides is None else f" (and besides: {besides})"))
    if (problem := hf_model_type_problem(cfg, fixed=True)) is not None:  # (trained weights: only the type can change)
        raise ExportError(problem)
    if cfg.hf_model_type is None and (problem := hf_layout_problem(cfg)) is not None:
        raise ExportError(problem)
    return HF_TYPE_ARCHITECTURES[hf_model_type(cfg)]


def special_tokens(tokenizer, kind: str) -> dict[str, str]:
    """transformers' special-token arguments (``eos_token``, ``mask_token``, ...) -> the token of
    ``tokenizer`` that plays the part in a ``kind`` run. ExportError naming the missing tokens for a
    BERT tokenizer without its masked-LM tokens (pad included: a fill-mask batch pads)."""
    roles = masked_lm_tokens(tokenizer)
    special = {"pad_token": roles["pad"][0]} if "pad" in roles else {}
    # the unknown token: the vocabulary model's own (WordPiece's [UNK]), else one named so
    unk = next((t for t in (getattr(tokenizer.model, "unk_token", None), "[UNK]", "<unk>")
                if t is not None and tokenizer.token_to_id(t) is not None), None)
    if kind == "gpt":
        separator = document_separator(tokenizer)  # what ends a document in training: eos
        if separator is not None:
            bos = separator[0] if separator[0] == EOT or tokenizer.token_to_id("<s>") is None else "<s>"
            special.update(bos_token=bos, eos_token=separator[0])
            unk = EOT if separator[0] == EOT else unk  # GPT-2's one token for all three
        if unk is not None:
            special["unk_token"] = unk
        return special
    missing = [" or ".join(MASKED_LM_NAMES[r]) for r in ("pad", "cls", "sep", "mask") if r not in roles]
    if missing:
        raise ExportError(f"the run's tokenizer has no {', '.join(missing)} token, which a "
                          "BERT tokenizer needs: pass --tokenizer PATH to the one it trained with")
    special.update(cls_token=roles["cls"][0], sep_token=roles["sep"][0], mask_token=roles["mask"][0])
    if (special["cls_token"], special["sep_token"]) == ("<s>", "</s>"):  # RoBERTa's: they are bos and eos too
        special.update(bos_token="<s>", eos_token="</s>")
    if unk is None and tokenizer.token_to_id(EOT) is not None:
        unk = EOT
    if unk is not None:
        special["unk_token"] = unk
    return special


def roberta_pad(cfg: ModelConfig, special: dict[str, int]) -> int:
    """The pad id a RoBERTa-family export counts positions from (``pad_token_id + 1``): the run's
    tokenizer's pad token; ExportError without a tokenizer to take it from."""
    if special.get("pad_token") is None:
        raise ExportError(f"model.hf_model_type={cfg.hf_model_type!r} counts positions from the pad "
                          "token's id, and the run's tokenizer is unknown: pass --tokenizer PATH to the "
                          "tokenizer.json the run trained with")
    return int(special["pad_token"])


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's ``rope_parameters`` of a rotary model: the base, and the scaling
    (model.rope_scaling) under transformers' names."""
    rope = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
            "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling != "none":
        rope["factor"] = float(cfg.rope_factor)
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=float(cfg.rope_low_freq_factor), high_freq_factor=float(cfg.rope_high_freq_factor),
                    original_max_position_embeddings=cfg.rope_original_seq_len)
    return rope


def first_windowed_layer(cfg: ModelConfig) -> int:
    """Qwen2's ``max_window_layers`` for ``cfg``: the first layer with a sliding window when every layer
    after it has one too (Qwen2Config windows the layers from max_window_layers on), else the layer
    count (no layer by that rule: ``layer_types`` alone, which transformers reads first, says which)."""
    windows = cfg.windows
    first = next((i for i, w in enumerate(windows) if w is not None), cfg.n_layer)
    return first if all(w is not None for w in windows[first:]) else cfg.n_layer


def hf_config(cfg: ModelConfig, special: dict[str, int]):
    """The transformers config of the same network; ``special``: special_tokens' names -> their ids."""
    from transformers import (
        AutoConfig,
        BertConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MinistralConfig,
        MistralConfig,
        Olmo2Config,
        Olmo3Config,
        Qwen2Config,
        Qwen3Config,
    )

    arch = check_exportable(cfg)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "architectures": [arch]}
    tokens = {"bos_token_id": special.get("bos_token"), "eos_token_id": special.get("eos_token"),
              "pad_token_id": special.get("pad_token")}
    if hf_model_type(cfg) in LLAMA_FAMILY:
        blocks = dict(hidden_size=cfg.n_embd, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layer,
                      num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                      hidden_act=HF_ACTIVATION[cfg.activation], max_position_embeddings=cfg.seq_len,
                      rms_norm_eps=cfg.norm_eps, rope_parameters=rope_parameters(cfg), attention_dropout=cfg.dropout,
                      **tokens, **common)
        kind = hf_model_type(cfg)
        # each layer's attention: "sliding_attention" within the window, else "full_attention"
        layer_types = ["full_attention" if w is None else "sliding_attention" for w in cfg.windows]
        windowed = cfg.window_layout != "none"
        if kind == "olmo2":  # no biases, the reordered norms and the projections' q and k norms (no switches)
            config = Olmo2Config(head_dim=cfg.head_dim, attention_bias=False, **blocks)
        elif kind == "olmo3":  # the same, windows by layer_types, a rope table per layer type (both alike);
            # without a window every layer is full_attention, but sliding_window must still be a number:
            # Olmo3Model builds its sliding mask whatever layer_types say (None fails its forward)
            rope = blocks.pop("rope_parameters")
            config = Olmo3Config(head_dim=cfg.head_dim, attention_bias=False,
                                 sliding_window=cfg.sliding_window if windowed else cfg.seq_len,
                                 layer_types=layer_types, rope_parameters={t: dict(rope) for t in LAYER_TYPES},
                                 **blocks)
        elif kind == "llama":
            config = LlamaConfig(head_dim=cfg.head_dim, attention_bias=cfg.bias, mlp_bias=cfg.bias, **blocks)
        elif kind == "mistral":  # Llama's blocks without biases, every layer within the window (or none)
            config = MistralConfig(head_dim=cfg.head_dim, sliding_window=cfg.sliding_window if windowed else None,
                                   **blocks)
        elif kind == "ministral":  # the same, the window on the layers layer_types names
            config = MinistralConfig(head_dim=cfg.head_dim, sliding_window=cfg.sliding_window if windowed else None,
                                     layer_types=layer_types, **blocks)
        else:  # Qwen2 (biases on q, k and v only) or Qwen3 (none; q and k heads normalised): windows by
            # layer_types, and by max_window_layers for readers without them (the first windowed layer
            # where the windowed ones are the last: Qwen2Config's own rule; else layer_types alone says it)
            window = dict(use_sliding_window=windowed, sliding_window=cfg.sliding_window if windowed else None,
                          layer_types=layer_types, max_window_layers=first_windowed_layer(cfg))
            if kind == "qwen3":
                config = Qwen3Config(head_dim=cfg.head_dim, attention_bias=False, **window, **blocks)
            else:
                heads = {"head_dim": cfg.head_dim} if cfg.attention_width != cfg.n_embd else {}
                config = Qwen2Config(**window, **heads, **blocks)
        # transformers 5 writes rope_parameters; the top-level rope_theta too, as transformers 4 (and
        # the tools that read Llama configs without it) expect, or they would rotate with 10000
        config.rope_theta = float(cfg.rope_theta)
        return config
    if hf_model_type(cfg) == "gpt_neox":
        rope = {**rope_parameters(cfg), "partial_rotary_factor": float(cfg.rope_fraction)}
        config = GPTNeoXConfig(hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                               intermediate_size=cfg.ffn, hidden_act=HF_ACTIVATION[cfg.activation],
                               max_position_embeddings=cfg.seq_len, layer_norm_eps=cfg.norm_eps,
                               use_parallel_residual=cfg.norm_position == "parallel", rope_parameters=rope,
                               attention_bias=True, attention_dropout=cfg.dropout, hidden_dropout=cfg.dropout,
                               **tokens, **common)
        # (the keys transformers 4 and GPT-NeoX's own tools read; without them a reader takes 0.25 and 10000)
        config.rotary_pct, config.rotary_emb_base = float(cfg.rope_fraction), float(cfg.rope_theta)
        return config
    if cfg.kind == "gpt":
        return GPT2Config(n_positions=cfg.seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_inner=cfg.ffn,
                          activation_function=HF_ACTIVATION[cfg.activation],
                          resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                          layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                          scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                          bos_token_id=special.get("bos_token"), eos_token_id=special.get("eos_token"),
                          pad_token_id=special.get("pad_token"), **common)
    fields = dict(hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, intermediate_size=cfg.ffn,
                  hidden_act=HF_ACTIVATION[cfg.activation],
                  hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
                  max_position_embeddings=cfg.seq_len, type_vocab_size=2,
                  layer_norm_eps=cfg.norm_eps, pad_token_id=special.get("pad_token"),
                  bos_token_id=special.get("bos_token"), eos_token_id=special.get("eos_token"), **common)
    model_type = hf_model_type(cfg)
    if model_type in ROBERTA_LAYOUTS:  # rows 0..pad come before the first position; one segment
        pad = roberta_pad(cfg, special)
        fields.update(max_position_embeddings=cfg.seq_len + pad + 1, type_vocab_size=1, pad_token_id=pad)
        return AutoConfig.for_model(model_type, **fields)
    return BertConfig(**fields)


def _bias(state: dict[str, torch.Tensor], name: str, size: int) -> torch.Tensor:
    """``name`` or zeros (model.bias=False: the same function with a zero bias)."""
    return state[name] if name in state else torch.zeros(size, dtype=torch.float32)


def gpt_state_dict(model) -> dict[str, torch.Tensor]:
    """largebatch GPT parameters under GPT2LMHeadModel's names and layouts."""
    cfg: ModelConfig = model.config
    s = {k: v.detach().float() for k, v in model.state_dict().items()}
    h, f = cfg.n_embd, cfg.ffn
    out = {"transformer.wte.weight": s["tok_emb.weight"], "transformer.wpe.weight": s["pos_emb.weight"],
           "transformer.ln_f.weight": s["ln_f.weight"],
           "transformer.ln_f.bias": _bias(s, "ln_f.bias", h),
           "lm_head.weight": s["lm_head.weight"]}
    for i in range(cfg.n_layer):
        b, o = f"blocks.{i}.", f"transformer.h.{i}."
        out[o + "ln_1.weight"], out[o + "ln_1.bias"] = s[b + "ln1.weight"], _bias(s, b + "ln1.bias", h)
        out[o + "ln_2.weight"], out[o + "ln_2.bias"] = s[b + "ln2.weight"], _bias(s, b + "ln2.bias", h)
        out[o + "attn.c_attn.weight"] = torch.cat(
            [s[f"{b}attn.{n}.weight"].t() for n in "qkv"], dim=1).contiguous()  # (h, 3h)
        out[o + "attn.c_attn.bias"] = torch.cat([_bias(s, f"{b}attn.{n}.bias", h) for n in "qkv"])
        out[o + "attn.c_proj.weight"] = s[b + "attn.proj.weight"].t().contiguous()
        out[o + "attn.c_proj.bias"] = _bias(s, b + "attn.proj.bias", h)
        out[o + "mlp.c_fc.weight"] = s[b + "mlp.fc1.weight"].t().contiguous()  # (h, f)
        out[o + "mlp.c_fc.bias"] = _bias(s, b + "mlp.fc1.bias", f)
        out[o + "mlp.c_proj.weight"] = s[b + "mlp.fc2.weight"].t().contiguous()  # (f, h)
        out[o + "mlp.c_proj.bias"] = _bias(s, b + "mlp.fc2.bias", h)
    return out


# largebatch's names in a Llama-style block -> LlamaDecoderLayer's (both nn.Linear: no transpose); the two
# norms' names by model.norm_position (hf_import.LLAMA_NORMS)
LLAMA_NAMES = (("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
               ("attn.proj", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.fc1", "mlp.up_proj"),
               ("mlp.fc2", "mlp.down_proj"),
               ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))  # (Qwen3's, OLMo's norms)
LLAMA_FAMILY = ("llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "olmo3")
"""The model types whose layers are LlamaDecoderLayer's under its names (Qwen3's query and key norms besides;
OLMo's with their norms after the sub-layers, LLAMA_NORMS)."""


def llama_state_dict(model) -> dict[str, torch.Tensor]:
    """Llama-style largebatch GPT parameters under LlamaForCausalLM's (and Qwen2's, Qwen3's) names
    (biases where the model has them: every Linear layer's, or q, k and v's; RMSNorm has none; the
    query and key heads' norms where it has them). The
    rotary tables are buffers, not weights: transformers builds its own."""
    cfg: ModelConfig = model.config
    s = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": s["tok_emb.weight"], "model.norm.weight": s["ln_f.weight"],
           "lm_head.weight": s["lm_head.weight"]}
    names = LLAMA_NAMES + tuple(zip(("ln1", "ln2"), LLAMA_NORMS[cfg.norm_position]))
    for i in range(cfg.n_layer):
        b, o = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in names:
            for kind in ("weight", "bias"):
                if f"{b}{ours}.{kind}" in s:
                    out[f"{o}{theirs}.{kind}"] = s[f"{b}{ours}.{kind}"]
    return out


def neox_state_dict(model) -> dict[str, torch.Tensor]:
    """largebatch GPT parameters under GPTNeoXForCausalLM's names: q, k and v fused into
    ``query_key_value`` head by head (rows (heads, 3, d): hf_import._neox cuts them so), the other
    layers renamed (nn.Linear on both sides). The rotary tables are buffers transformers builds."""
    cfg: ModelConfig = model.config
    s = {k: v.detach().float() for k, v in model.state_dict().items()}
    h, a, d = cfg.n_embd, cfg.n_head, cfg.head_dim
    out = {"gpt_neox.embed_in.weight": s["tok_emb.weight"], "gpt_neox.final_layer_norm.weight": s["ln_f.weight"],
           "gpt_neox.final_layer_norm.bias": s["ln_f.bias"], "lm_head.weight": s["lm_head.weight"]}
    for i in range(cfg.n_layer):
        b, o = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        out[o + "attention.query_key_value.weight"] = torch.stack(
            [s[f"{b}attn.{n}.weight"].view(a, d, h) for n in "qkv"], dim=1).reshape(3 * h, h)
        out[o + "attention.query_key_value.bias"] = torch.stack(
            [s[f"{b}attn.{n}.bias"].view(a, d) for n in "qkv"], dim=1).reshape(3 * h)
        for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                             ("attn.proj", "attention.dense"), ("mlp.fc1", "mlp.dense_h_to_4h"),
                             ("mlp.fc2", "mlp.dense_4h_to_h")):
            for kind in ("weight", "bias"):
                out[f"{o}{theirs}.{kind}"] = s[f"{b}{ours}.{kind}"]
    return out


def bert_state_dict(model, pad: int | None = None) -> dict[str, torch.Tensor]:
    """largebatch post-LN BERT parameters under BertForMaskedLM's names, or under the RoBERTa
    family's (model.hf_model_type; ``pad``: its pad token id, the rows before the first position)."""
    cfg: ModelConfig = model.config
    check_exportable(cfg)
    s = {k: v.detach().float() for k, v in model.state_dict().items()}
    h, f = cfg.n_embd, cfg.ffn
    roberta = hf_model_type(cfg) in ROBERTA_LAYOUTS
    prefix = "roberta." if roberta else "bert."
    e = prefix + "embeddings."
    positions = s["pos_emb.weight"]
    if roberta:  # RoBERTa's position ids start at pad + 1; the rows before are never a position
        positions = torch.cat([torch.zeros(pad + 1, h), positions])
    out = {e + "word_embeddings.weight": s["tok_emb.weight"],
           e + "position_embeddings.weight": positions,
           e + "token_type_embeddings.weight": torch.zeros(1 if roberta else 2, h),
           e + "LayerNorm.weight": s["emb_norm.weight"],
           e + "LayerNorm.bias": _bias(s, "emb_norm.bias", h)}
    for i in range(cfg.n_layer):
        b, o = f"blocks.{i}.", f"{prefix}encoder.layer.{i}."
        for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
            out[f"{o}attention.self.{theirs}.weight"] = s[f"{b}attn.{ours}.weight"]
            out[f"{o}attention.self.{theirs}.bias"] = _bias(s, f"{b}attn.{ours}.bias", h)
        pairs = (("attention.output.dense", "attn.proj", h), ("intermediate.dense", "mlp.fc1", f),
                 ("output.dense", "mlp.fc2", h))
        for theirs, ours, size in pairs:
            out[f"{o}{theirs}.weight"] = s[f"{b}{ours}.weight"]
            out[f"{o}{theirs}.bias"] = _bias(s, f"{b}{ours}.bias", size)
        for theirs, ours in (("attention.output.LayerNorm", "ln1"), ("output.LayerNorm", "ln2")):
            out[f"{o}{theirs}.weight"] = s[f"{b}{ours}.weight"]
            out[f"{o}{theirs}.bias"] = _bias(s, f"{b}{ours}.bias", h)
    c, dense, norm = ("lm_head.", "dense", "layer_norm") if roberta else \
        ("cls.predictions.", "transform.dense", "transform.LayerNorm")
    out.update({f"{c}{dense}.weight": s["head.dense.weight"],
                f"{c}{dense}.bias": _bias(s, "head.dense.bias", h),
                f"{c}{norm}.weight": s["head.norm.weight"],
                f"{c}{norm}.bias": _bias(s, "head.norm.bias", h),
                c + "decoder.weight": s["head.decoder.weight"],
                c + "decoder.bias": s["head.decoder.bias"], c + "bias": s["head.decoder.bias"]})
    return out


def hf_model(model, special: dict[str, int]):
    """A transformers model (fp32, eval) computing the same logits as largebatch's ``model``."""
    from transformers import (
        AutoModelForMaskedLM,
        GPT2LMHeadModel,
        GPTNeoXForCausalLM,
        LlamaForCausalLM,
        MinistralForCausalLM,
        MistralForCausalLM,
        Olmo2ForCausalLM,
        Olmo3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )

    cfg: ModelConfig = model.config
    config = hf_config(cfg, special)
    if config.model_type in LLAMA_FAMILY:  # (Qwen2's and Qwen3's names are Llama's, and their own)
        causal_lm = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "ministral": MinistralForCausalLM,
                     "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "olmo2": Olmo2ForCausalLM,
                     "olmo3": Olmo3ForCausalLM}
        hf = causal_lm[config.model_type](config)
        state = llama_state_dict(model)
    elif config.model_type == "gpt_neox":
        hf, state = GPTNeoXForCausalLM(config), neox_state_dict(model)
    elif cfg.kind == "gpt":
        hf, state = GPT2LMHeadModel(config), gpt_state_dict(model)
    else:  # BertForMaskedLM or the RoBERTa family's, by config.model_type
        hf, state = AutoModelForMaskedLM.from_config(config), bert_state_dict(model, config.pad_token_id)
    expected = hf.state_dict()
    unknown = sorted(set(state) - set(expected))
    # buffers transformers builds itself (position_ids, causal masks) are not weights to fill
    missing = sorted(k for k in set(expected) - set(state) if k not in dict(hf.named_buffers()))
    if unknown or missing:
        raise RuntimeError(f"transformers {type(hf).__name__} layout changed: unknown {unknown[:4]}, "
                           f"missing {missing[:4]}")
    for name, tensor in state.items():
        if tuple(expected[name].shape) != tuple(tensor.shape):
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} vs transformers "
                               f"{tuple(expected[name].shape)}")
    hf.load_state_dict(state, strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.float().eval()


def hf_tokenizer(tokenizer, kind: str, max_length: int, one_segment: bool = False):
    """The run's ``tokenizers.Tokenizer`` as a transformers fast tokenizer with its special tokens;
    ``model_max_length`` is the model's context (``max_length``), so ``truncation=True`` cuts there.
    ``one_segment``: the model has one segment (the RoBERTa family): pairs as RoBERTa's, without
    token_type_ids, whatever the special tokens' names."""
    from transformers import PreTrainedTokenizerFast

    if kind == "gpt":
        tok = copy_tokenizer(tokenizer)
        tok.post_processor = None
        return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=["input_ids", "attention_mask"],
                                       model_max_length=max_length, clean_up_tokenization_spaces=False,
                                       **special_tokens(tok, kind))
    tok, special, roberta = masked_lm_encoder(tokenizer, kind, one_segment)
    inputs = ["input_ids", "attention_mask"] if roberta else ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=max_length,
        model_input_names=inputs, clean_up_tokenization_spaces=False, **special)


def copy_tokenizer(tokenizer):
    """A copy of a ``tokenizers.Tokenizer`` (its post-processor and added tokens are the copy's to set)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer.to_str())


def masked_lm_encoder(tokenizer, kind: str, one_segment: bool = False) -> tuple[Any, dict[str, str], bool]:
    """A copy of a masked-LM run's tokenizer that encodes as the exported one does (``transformers``
    not needed): a text as ``[CLS] text [SEP]`` (a pair with the model family's separators), and the
    mask token written in a text read as the mask (``_mask_token``). Returns it, transformers'
    special-token arguments, and whether pairs are RoBERTa's (one segment)."""
    from tokenizers import processors

    tok = copy_tokenizer(tokenizer)
    special = special_tokens(tok, kind)
    cls, sep, mask = special["cls_token"], special["sep_token"], special["mask_token"]
    # a pair as the model family has it: BERT's segment B (type 1, the second row of the exported
    # segment embedding, zeros until fine-tuned) after [SEP]; RoBERTa's </s></s> between, one segment
    roberta = sep == "</s>" or one_segment
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B:1 {sep}:1"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    tok.add_special_tokens([_mask_token(tok, mask)])
    return tok, special, roberta


def _mask_token(tok, mask: str):
    """The mask token as the exported tokenizer adds it. Training replaces one whole token, its
    leading space included (byte-level BPE's "Ġword"), so "the [MASK] of" must not leave a lone space
    token before the mask; but a newline, a tab or a second space before the masked token are tokens
    of their own ("Ċ" before "word"), which stay. RoBERTa's ``lstrip`` takes all of them: here, for a
    byte-level tokenizer (its pre-tokenizer ByteLevel, alone or in a Sequence as Llama 3's), a
    normalizer drops the one space before the mask (a regex that looks ahead, so the mask's offsets
    stay its own characters), and the mask is matched in the normalized text -- as the tokenizer's
    own normalizer writes it (a lowercasing one: "[mask]"). WordPiece drops whitespace either way
    (and may lowercase, so its mask is matched in the raw text, taking what is before it as
    RoBERTa's does), as does a byte-level tokenizer whose normalizer changes the space."""
    import json
    import re

    from tokenizers import AddedToken, Regex, normalizers

    byte_level = "ByteLevel" in _types(json.loads(tok.to_str()).get("pre_tokenizer"))
    written = mask if tok.normalizer is None else tok.normalizer.normalize_str(mask)
    if not byte_level or (tok.normalizer is not None and tok.normalizer.normalize_str(f" {mask}") != f" {written}"):
        return AddedToken(mask, lstrip=True, rstrip=False, normalized=False, special=True)
    space = normalizers.Replace(Regex(f" (?={re.escape(written)})"), "")
    tok.normalizer = space if tok.normalizer is None else normalizers.Sequence([tok.normalizer, space])
    return AddedToken(mask, lstrip=False, rstrip=False, normalized=True, special=True)


def _types(node) -> set[str]:
    """Every "type" in a tokenizer.json component (a Sequence's members included)."""
    if isinstance(node, dict):
        own = {node["type"]} if isinstance(node.get("type"), str) else set()
        return own.union(*map(_types, node.values()))
    if isinstance(node, list):
        return set().union(*map(_types, node))
    return set()


def save_hf(model, tokenizer, out: str | Path, max_length: int | None = None) -> dict[str, Any]:
    """Write config.json, model.safetensors and the tokenizer files for ``model`` into ``out``.
    ``max_length``: the tokenizer's ``model_max_length`` when it is not the model's context (a run
    stopped in a short phase has trained only that many positions)."""
    cfg: ModelConfig = model.config
    arch = check_exportable(cfg)
    out = Path(out)
    ids = id_space(tokenizer) if tokenizer is not None else None
    if ids is not None and ids > cfg.vocab_size:
        raise ExportError(f"the tokenizer has ids up to {ids - 1} but the "
                            f"model's vocabulary model.vocab_size={cfg.vocab_size} is smaller: pass "
                            "--tokenizer PATH to the tokenizer the run trained with")
    special = ({name: tokenizer.token_to_id(token) for name, token in special_tokens(tokenizer, cfg.kind).items()}
               if tokenizer is not None else {})
    hf = hf_model(model, special)
    hf.save_pretrained(out)  # safetensors; tied weights stored once
    if cfg.position == "rope" and cfg.rope_scaling != "none" and hf_model_type(cfg) != "olmo3":
        # (OLMo 3's config applies a rope_scaling to its full-attention layers only: rope_parameters says it)
        # transformers 5 writes the scaling in rope_parameters only; tools that read transformers 4's
        # rope_scaling (GGUF conversion, older transformers) find it there too (5 takes it first: the same)
        path = Path(out) / "config.json"
        raw = json.loads(path.read_text())
        raw["rope_scaling"] = rope_parameters(cfg)
        atomic_write_text(path, json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        hf_tokenizer(tokenizer, cfg.kind, max_length or cfg.seq_len,
                     one_segment=hf_model_type(cfg) in ROBERTA_LAYOUTS).save_pretrained(out)
    # (a model over save_pretrained's max_shard_size, 50 GB, is written as an index and shards)
    if not any((out / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise RuntimeError(f"transformers did not write {out / 'model.safetensors'}")
    return {"architecture": arch, "vocab_size": cfg.vocab_size,
            "tokenizer_vocab_size": ids}


def auto_class(kind: str):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForCausalLM if kind == "gpt" else AutoModelForMaskedLM


@torch.no_grad()
def verify_hf(model, tokenizer, out: str | Path, text: str = VERIFY_TEXT,
              tolerance: float = 1e-4) -> float:
    """Load ``out`` with the Auto classes and compare logits with largebatch's on ``text``;
    returns the largest absolute difference (raises if it exceeds ``tolerance`` times the largest
    logit magnitude, at least 1)."""
    cfg: ModelConfig = model.config
    hf = auto_class(cfg.kind).from_pretrained(str(out)).float().eval()
    if tokenizer is not None:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(out))(text, truncation=True)["input_ids"][:cfg.seq_len]
    else:
        ids = list(range(min(cfg.seq_len, cfg.vocab_size, 32)))
    if cfg.document_mask:  # one document: transformers' model attends across a separator, the run's did not
        ids = [i for i in ids if i != cfg.separator_id] or [1 if cfg.separator_id == 0 else 0]
    idx = torch.tensor([ids], dtype=torch.long)
    ours = model(idx)[0]
    theirs = hf(input_ids=idx).logits
    diff = float((ours - theirs).abs().max())
    limit = tolerance * max(1.0, float(ours.abs().max()))
    if not diff <= limit:
        raise RuntimeError(f"exported logits differ from largebatch's by {diff:.3g} "
                           f"(> {limit:.3g}) on {len(ids)} tokens: the export is wrong")
    return diff
