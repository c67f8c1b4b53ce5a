"""Hugging Face configs for the memory model: `config_from_hf` maps a GPT-2, BERT, GPT-NeoX or Llama-family
`config.json` (a path, a directory holding one, or the dict) to a ModelConfig, without importing
transformers, and `hf_eager_bytes_per_layer` counts what transformers' own eager layers keep, which
is more than the closed form of Korthikanti et al. 2022 (docs/papers.md: memory) counts for
largebatch's layers.

What transformers' eager GPT-2 / BERT layers keep beyond the closed form (found by walking the
autograd graph of GPT2LMHeadModel and BertForMaskedLM, docs/memory.md):
* activation "gelu_new" (GPT-2's default) is written as pointwise ops, 0.5 x (1 + tanh(...)), and
  keeps three more f-wide tensors per token than a fused GeLU: the tanh output, 0.5 x and 1 + tanh.
  BERT's "gelu" is torch's GeLU, which keeps only its input.
* nn.Dropout calls F.dropout, which on CPU keeps a mask in the activation dtype (d bytes), not a
  1-byte bool mask: three masks per layer (attention probabilities, two residual branches).
No attention mask or bias is kept (transformers 5 adds the causal/padding mask), and the softmax
runs in the activation dtype (GPT-2's `reorder_and_upcast_attn` is refused below).

transformers' Llama layers (LlamaForCausalLM; MistralForCausalLM and MinistralForCausalLM, whose
sliding windows add what an sdpa layer keeps with a mask -- below -- and Qwen2ForCausalLM, whose q/k/v
biases keep nothing, run the same layer; Qwen3ForCausalLM adds the
query and key heads' norms, Olmo2ForCausalLM and Olmo3ForCausalLM reorder the norms and normalise
the whole q and k projections, below), found by walking the graph
of a tiny model and measured to the byte (tests/test_memory_hf.py), per token with d bytes a value,
a_kv key/value heads, h_kv = h a_kv / a, m bytes a dropout mask (d on CPU, 1 on CUDA), p > 0 the
attention dropout (the only dropout those layers have):
* LlamaRMSNorm is written out: x.to(fp32) (the input itself in fp32), pow, mean, rsqrt, multiply,
  cast back, times the gain: each of the two keeps the fp32 input (4 h bytes), the d-byte normalised
  tensor the gain's gradient needs (h d) and its fp32 rsqrt (4 bytes): (4 + d) h + 4;
* the Q/K/V input and the MLP input (h d each, the norms' outputs); q after the rotation (h d), the
  o_proj input (h d); the rotary cos/sin are computed once per model and shared by every layer;
* eager attention: repeat_kv copies K and V to all a heads and Q K^T and P V keep the copies, so
  K and V are kept h wide whatever a_kv (2 h d; the a_kv-wide ones are not kept); the softmax runs in
  fp32 and is cast back: a s (4 + d) bytes (4 in fp32, where the cast is no copy); with dropout the
  cast output is consumed by the dropout, which keeps its mask and P V its output: a s (4 + m + d);
* sdpa (torch's fused kernel, enable_gqa where transformers asks for it: no padding mask): K and V at
  a_kv heads (2 h_kv d) and a 4-byte log-sum-exp per head, 4 a;
* SwiGLU: the gate output (SiLU's input), the SiLU output, the up output, the down input: 4 f d;
* OLMo 2 and 3 (Olmo2RMSNorm): the gain multiplies the fp32 normalised tensor before the cast back,
  so each norm keeps that fp32 tensor (4 h) in place of the d-byte one; their q_norm and k_norm over
  the whole projections keep the same per value and one rsqrt a token each.
Under selective recomputation (apply_recompute checkpoints the attention function) the layer keeps
the function's inputs -- q, and K and V un-repeated (2 h_kv d) -- and none of the a s terms; full
recomputation keeps the layer input, h d.

transformers' GPT-NeoX layer (GPTNeoXForCausalLM, Pythia; neox_layer_bytes), found the same way and
measured to the byte (tests/test_memory_hf.py), per token, with m the dropout masks' bytes as above
and sigma a LayerNorm statistic's bytes (d on CPU, where torch casts the mean and 1/std to the input's
dtype; 4 on a GPU):
* the LayerNorms keep their inputs -- the parallel layer's two norms read the same input, kept once
  (h d); the sequential one's second reads attention output + input (2 h d) -- their outputs, the
  fused query_key_value input and the MLP input (2 h d), and a mean and 1/std each (4 sigma);
* the rotation turns the first rope_fraction of each head and concatenates the rest back: q and k
  are new tensors whatever the fraction (2 h d); the cos/sin tables are the model's, shared;
* eager attention: v is a strided chunk of the fused (b, s, 3h) output, which the P V matmul copies
  to fold its batch dimensions: that copy is kept (h d) and the fused output is freed; the fp32
  softmax and what P V keeps as Llama's: a s (4 + d) (a s 4 in fp32), with dropout a s (4 + m + d);
  the dense input (h d);
* sdpa reads v as the chunk view, so the whole fused output stays alive (3 h d), with its own output
  (h d) beside the dense input's contiguous copy (h d) and a 4-byte log-sum-exp per head (4 a);
* the GeLU MLP keeps the GeLU input and the dense_4h_to_h input (2 f d; "gelu_new" 3 f d more, as
  GPT-2's); dropout (attention_dropout and hidden_dropout) keeps two residual-branch masks (2 h m)
  besides the attention one.
Under selective recomputation the checkpoint keeps the attention function's inputs, q, k and v --
a view of the fused output, so all of it (3 h d) -- and the dense input: more than no recomputation
keeps whenever 2 h d exceeds the eager softmax's bytes (short sequences). Full recomputation keeps
the layer input, h d. The embedding dropout and the final norm are the model's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from largebatch.memory.activations import activation_bytes_per_layer
from largebatch.models.config import HF_MODEL_TYPES, ModelConfig
from largebatch.models.registry import model_spec

# Families that are not GPT-2 / BERT / Llama layouts, and what in them the closed form does not describe.
UNSUPPORTED = {
    "mixtral": "mixture-of-experts gated MLPs, RMSNorm, rotary embeddings, grouped-query attention",
    "gemma": "gated MLP (GeGLU), RMSNorm, rotary embeddings and multi-query attention",
    "phi": "parallel attention and MLP branches sharing one LayerNorm, partial rotary embeddings",
    "gptj": "parallel attention and MLP branches and rotary embeddings",
    "falcon": "parallel attention and MLP branches, rotary embeddings and multi-query attention",
    "t5": "an encoder-decoder with cross-attention, relative position biases and RMSNorm",
    "bart": "an encoder-decoder with cross-attention",
}

# Llama's family: the same decoder layer (RMSNorm, rotary positions, SwiGLU, grouped-query
# attention) as transformers writes it; Mistral and Ministral (sliding windows: llama_layer_bytes and
# hf_mask_bytes count what the window's mask adds), Qwen2, whose q/k/v biases keep nothing (measured:
# its layers keep Llama's bytes exactly), and Qwen3 (its q/k norms counted)
LLAMA_TYPES = ("llama", "mistral", "ministral")
# OLMo 2 and OLMo 3 (OLMo et al. 2024): Llama's layer with each sub-layer's output normalised before the
# residual add (model.norm_position="reordered", no input norm) and the whole q and k projections
# normalised (model.qk_norm_scope="projection"), OLMo 3 with Ministral's sliding windows on most layers
OLMO_TYPES = ("olmo2", "olmo3")
LLAMA_LAYOUTS = (*LLAMA_TYPES, "qwen2", "qwen3", *OLMO_TYPES)
# Llama's gated MLP: SiLU(gate) * up; transformers' "swish" is the same function
LLAMA_ACTIVATIONS = ("silu", "swish")
_LLAMA_ARCHITECTURES = {"Llama": "llama", "Mistral": "mistral", "Ministral": "ministral", "Qwen2": "qwen2",
                        "Qwen3": "qwen3", "Olmo2": "olmo2", "Olmo3": "olmo3"}
# (head_dim where config.json has none: Qwen3Config's 128; the others' hidden_size / num_attention_heads)
HEAD_DIM_DEFAULTS = {"qwen3": 128}


def _positive_ints(**values) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in values.values())


def llama_fields(raw: dict, need, refuse) -> dict:
    """The ModelConfig fields of a Llama-family config.json (LLAMA_LAYOUTS) that both the memory
    model and ``model.init_from`` read: the shapes (``num_key_value_heads`` -> n_kv_head), RMSNorm,
    rotary positions, the SwiGLU MLP, ``head_dim`` (model.head_size where it is not hidden_size /
    num_attention_heads), Qwen3's query and key norms (model.qk_norm), the sliding windows
    (model.sliding_window, model.full_attention_layers). Refused through
    ``refuse(what, why)`` (an exception to raise): a ``hidden_act`` other than SiLU, a
    malformed sliding window (``sliding_windows``, which maps the windows). ``need(name)``: the value
    of a required field, or raises naming it. The biases, dropout and rotary base are the caller's."""
    model_type = raw.get("model_type")
    h, heads = need("hidden_size"), need("num_attention_heads")
    kv = raw.get("num_key_value_heads") or heads
    if not _positive_ints(h=h, heads=heads, kv=kv):
        raise refuse(f"hidden_size={h!r}, num_attention_heads={heads!r}, num_key_value_heads={kv!r}",
                     "each must be a positive integer")
    head = raw.get("head_dim")
    head = HEAD_DIM_DEFAULTS.get(model_type) if head is None else head
    if head is None and h % heads:
        raise refuse(f"hidden_size={h}, num_attention_heads={heads} and no head_dim",
                     "the heads are hidden_size / num_attention_heads wide without head_dim, so "
                     "num_attention_heads must divide hidden_size")
    if head is not None and not _positive_ints(head=head):
        raise refuse(f"head_dim={head!r}", "it must be a positive integer")
    if heads % kv:
        raise refuse(f"num_attention_heads={heads}, num_key_value_heads={kv}",
                     "largebatch's attention needs num_key_value_heads to divide num_attention_heads")
    act = raw.get("hidden_act", "silu")
    if act not in LLAMA_ACTIVATIONS:
        raise refuse(f"hidden_act={act!r}", "largebatch's gated MLP is SwiGLU, SiLU(gate) * up (hidden_act='silu')")
    seq_len = need("max_position_embeddings")
    window, full = sliding_windows(raw, need("num_hidden_layers"), refuse)
    olmo = model_type in OLMO_TYPES
    return {"kind": "gpt", "n_layer": need("num_hidden_layers"), "n_embd": h, "n_head": heads,
            "n_kv_head": None if kv == heads else kv, "ffn_hidden": need("intermediate_size"), "seq_len": seq_len,
            "norm_position": "reordered" if olmo else "pre", "norm": "rmsnorm",
            "norm_eps": float(raw.get("rms_norm_eps", 1e-5 if olmo else 1e-6)),  # (the config classes' defaults)
            "position": "rope", "activation": "swiglu",
            "qk_norm": model_type == "qwen3" or olmo, "qk_norm_scope": "projection" if olmo else "head",
            "head_size": None if head is None or head * heads == h else head,
            "sliding_window": window, "full_attention_layers": full}


def neox_fields(raw: dict, need, refuse, scaled: bool = False) -> dict:
    """The ModelConfig fields of a GPT-NeoX config.json (GPTNeoXForCausalLM; Pythia) that both the
    memory model and ``model.init_from`` read, as transformers 5 reads them: LayerNorm
    (``layer_norm_eps``), rotary positions on the first ``partial_rotary_factor`` of each head
    (``rope_parameters`` or ``rope_scaling``, else the top-level ``rotary_pct``, 0.25 where none is
    given, as GPTNeoXConfig) at base ``rope_theta`` (else ``rotary_emb_base``, 10000), a GeLU MLP
    (``hidden_act``), biases on every layer (``attention_bias``), untied by default, and the layer
    ``use_parallel_residual`` says: x + attn(LN1(x)) + mlp(LN2(x)) (true, its default:
    model.norm_position="parallel") or pre-LN ("pre"). Refused through ``refuse(what, why)``:
    ``attention_bias`` false (the MLP and norms keep theirs, and largebatch's model.bias covers them
    all), another activation, heads that do not divide hidden_size, a rope scaling largebatch does
    not compute (``scaled``: read past it, as the memory model does). ``need(name)``: a required
    field's value, or raises naming it. Dropout is the caller's."""
    h, heads = need("hidden_size"), need("num_attention_heads")
    if not _positive_ints(h=h, heads=heads) or h % heads:
        raise refuse(f"hidden_size={h!r}, num_attention_heads={heads!r}",
                     "GPT-NeoX's heads are hidden_size / num_attention_heads wide, so both must be positive "
                     "integers and the heads must divide the width")
    if not raw.get("attention_bias", True):
        raise refuse("attention_bias=False", "GPT-NeoX then has no biases in its attention but keeps those of "
                     "its MLP and LayerNorms, and largebatch's model.bias covers them all")
    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATION:
        raise refuse(f"hidden_act={act!r}", f"largebatch's GeLU MLP computes {', '.join(_ACTIVATION)}")
    name, table, kind = _rope_table(raw, refuse)
    if kind not in ("default", *ROPE_SCALINGS) and not scaled:
        raise refuse(f"{name} with rope_type={kind!r}", "largebatch's rotary embedding computes rope_type "
                     "'default', 'linear' and 'llama3'; dynamic, yarn and longrope scaling rotate by other angles")
    theta = table.get("rope_theta", raw.get("rotary_emb_base", 10000.0))
    fraction = table.get("partial_rotary_factor", raw.get("rotary_pct", 0.25))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise refuse(f"rope_theta={theta!r}", "the rotary base must be a number > 1")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise refuse(f"partial_rotary_factor={fraction!r}", "it is the share of each head the rotation turns, "
                     "a number in (0, 1]")
    fields = {"kind": "gpt", "n_layer": need("num_hidden_layers"), "n_embd": h, "n_head": heads,
              "n_kv_head": None, "head_size": None, "ffn_hidden": need("intermediate_size"),
              "seq_len": need("max_position_embeddings"),
              "norm_position": "parallel" if raw.get("use_parallel_residual", True) else "pre",
              "norm": "layernorm", "norm_eps": float(raw.get("layer_norm_eps", 1e-5)), "position": "rope",
              "rope_theta": float(theta), "rope_fraction": float(fraction), "activation": _ACTIVATION[act],
              "bias": True, "qkv_bias": None, "qk_norm": False, "qk_norm_scope": "head", "sliding_window": None,
              "full_attention_layers": (), "tie_embeddings": bool(raw.get("tie_word_embeddings", False))}
    return {**fields, **(rope_scaling(raw, refuse) if kind in ROPE_SCALINGS else {"rope_scaling": "none"})}


def sliding_windows(raw: dict, n_layer: int, refuse) -> tuple[int | None, tuple[int, ...]]:
    """(model.sliding_window, model.full_attention_layers) of a Llama-family config.json, as
    transformers builds its layers: Mistral's ``sliding_window`` on every layer (4096 where
    config.json has no such key, MistralConfig's default; null: none); Ministral's on the layers its
    ``layer_types`` name "sliding_attention" (without layer_types: every layer); Qwen2's and Qwen3's
    only with ``use_sliding_window``, on the layers ``layer_types`` names, or without it on layers
    max_window_layers and up (Qwen2Config's rule); OLMo 3's on the layers ``layer_types`` names (without
    it, three of every four: Olmo3Config's default); Llama's and OLMo 2's never."""
    model_type = raw.get("model_type")
    if model_type not in ("mistral", "ministral", "qwen2", "qwen3", "olmo3"):
        return None, ()
    window = raw.get("sliding_window", 4096)  # (the configs' default where config.json has no such key)
    types = raw.get("layer_types")
    if model_type == "olmo3" and types is None:  # Olmo3Config's default: every fourth layer attends to all
        types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layer)]
    off = model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False)
    if (off or window is None) and isinstance(types, list) and "sliding_attention" in types:
        state = (f"use_sliding_window={raw.get('use_sliding_window', False)!r} (sliding_window={window!r})" if off
                 else "sliding_window=None")
        fix = "set use_sliding_window true and a sliding_window" if off else "set a sliding_window"
        raise refuse(f"layer_types naming sliding layers with {state}",
                     f"transformers' own model cannot run that (it finds no window for those layers); {fix}, "
                     "or make every layer full_attention")
    if off or window is None:
        return None, ()
    if not _positive_ints(sliding_window=window):
        raise refuse(f"sliding_window={window!r}", "it must be a positive number of positions, or null")
    if model_type == "mistral":  # (every layer: a config.json with layer_types is read as a Ministral,
        return window, ()        # as_transformers_reads)
    if types is None:
        if model_type == "ministral":
            return window, ()
        first = raw.get("max_window_layers", 28)
        return (None, ()) if first >= n_layer else (window, tuple(range(first)))  # (windows from layer `first` on)
    if not isinstance(types, list) or len(types) != n_layer or not set(types) <= {"sliding_attention",
                                                                                 "full_attention"}:
        raise refuse(f"layer_types={types!r}", f"it must list 'sliding_attention' or 'full_attention' for each "
                     f"of the num_hidden_layers={n_layer} layers")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    return (None, ()) if len(full) == n_layer else (window, full)  # (no windowed layer: no window)


# the rope_types largebatch's rotary embedding computes (ModelConfig.rope_scaling), and the keys each reads
ROPE_SCALINGS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


# the layer types a config may give a rope table each (OLMo 3's rope_parameters)
LAYER_TYPES = ("sliding_attention", "full_attention")


def _rope_table(raw: dict, refuse) -> tuple[str, dict, str]:
    """(name, table, rope_type) of the rope table transformers 5 reads from a config.json:
    ``rope_scaling`` where it is set (transformers 4's key, which it takes first), else
    ``rope_parameters``, else none ({}, "default"). OLMo 3 has a table per layer type
    (``_olmo3_tables``): one table where the types the model's layers have agree, refused where they
    do not (one rotary embedding serves every layer here)."""
    if raw.get("model_type") == "olmo3":
        table = _one_table(raw, _olmo3_tables(raw, refuse), refuse)
        return "rope_parameters", table, table["rope_type"]
    for name in ("rope_scaling", "rope_parameters"):
        table = raw.get(name)
        if table is None or table == {}:
            continue
        if not isinstance(table, dict):
            raise refuse(f"{name}={table!r}", "largebatch reads a dict with a rope_type")
        return name, table, table.get("rope_type", table.get("type", "default"))
    return "rope_parameters", {}, "default"


OLMO3_THETA = 500000.0  # Olmo3Config's default_theta


def _olmo3_tables(raw: dict, refuse) -> dict:
    """OLMo 3's rope table per layer type as Olmo3Config builds them from config.json: rope_parameters'
    "sliding_attention" and "full_attention" tables (its other keys -- a flat table -- are not read),
    a ``rope_scaling`` merged into the full-attention table only, and a table without a rope_theta
    given the top-level ``rope_theta`` (the full-attention table only: Olmo3Config takes it once) or
    500000."""
    given = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    for name, value in (("rope_parameters", given), ("rope_scaling", scaling or {})):
        if not isinstance(value, dict):
            raise refuse(f"{name}={value!r}", "largebatch reads a dict")
    tables = {t: dict(given.get(t) or {}) for t in LAYER_TYPES}
    tables["full_attention"].update(scaling or {})
    tables["full_attention"].setdefault("rope_theta", raw.get("rope_theta", OLMO3_THETA))
    tables["sliding_attention"].setdefault("rope_theta", OLMO3_THETA)
    for table in tables.values():
        table.setdefault("rope_type", table.pop("type", "default"))
    return tables


def _one_table(raw: dict, tables: dict, refuse) -> dict:
    """The one rope table of a model with a table per layer type (``_olmo3_tables``), over the layer
    types the model's layers have (a type no layer has is never read); refused when those differ."""
    n_layer = raw.get("num_hidden_layers")
    window, full = sliding_windows(raw, n_layer, refuse) if _positive_ints(n=n_layer) else (None, ())
    used = (["sliding_attention"] if window is not None and len(full) < n_layer else []) + (
        ["full_attention"] if window is None or full else [])
    read = [tables[t] for t in used]
    if any(t != read[0] for t in read[1:]):
        raise refuse(f"rope tables {dict(zip(used, read))!r} (rope_parameters, rope_scaling and rope_theta as "
                     "Olmo3Config reads them)", "its full-attention and sliding-window layers rotate by "
                     "different angles (one rope table for both layer types would load), and largebatch "
                     "rotates every layer alike")
    return read[0]


def rope_scaling(raw: dict, refuse) -> dict:
    """The ModelConfig rope scaling fields of a Llama-family config.json, read as transformers 5
    reads them (``_rope_table``): rope_scaling "none", or "linear" / "llama3" with their factors
    (ROPE_SCALINGS; llama3's original context from a top-level ``original_max_position_embeddings``
    first, as transformers takes it, else the table's, else ``max_position_embeddings``); a missing
    factor refused through ``refuse(what, why)``."""
    name, table, kind = _rope_table(raw, refuse)
    if kind not in ROPE_SCALINGS:
        return {"rope_scaling": "none"}
    missing = [key for key in ROPE_SCALINGS[kind] if key not in table]
    if missing:
        raise refuse(f"{name} with rope_type={kind!r} without {', '.join(missing)}",
                     f"the {kind} scaling reads {', '.join(ROPE_SCALINGS[kind])}")
    fields = {"rope_scaling": kind, "rope_factor": table["factor"]}
    if kind == "llama3":
        original = raw.get("original_max_position_embeddings",
                           table.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
        fields.update(rope_low_freq_factor=table["low_freq_factor"], rope_high_freq_factor=table["high_freq_factor"],
                      rope_original_seq_len=original)
    return fields


def rope_theta(raw: dict, refuse, scaled: bool = False) -> float:
    """The rotary base of a Llama-family config.json, as transformers 5 reads it: the rope table's
    ``rope_theta`` (``_rope_table``: transformers 4's ``rope_scaling`` where set, else 5's
    ``rope_parameters``), else the top-level ``rope_theta``, else 10000. ``scaled=False``: a
    scaling other than ROPE_SCALINGS' (YaRN, dynamic, longrope) or a partial rope refused through
    ``refuse(what, why)`` (they rotate by other angles than largebatch's rotary embedding computes;
    ``rope_scaling`` reads the ones it does); True (the memory model): read past them -- a rope's
    angles change no tensor a layer keeps."""
    name, table, kind = _rope_table(raw, refuse)
    if kind not in ("default", *ROPE_SCALINGS) and not scaled:
        raise refuse(f"{name} with rope_type={kind!r}", "largebatch's rotary embedding computes rope_type "
                     "'default', 'linear' and 'llama3' (Llama 3.1 and 3.2); dynamic, yarn and longrope "
                     "scaling rotate by other angles")
    partial = table.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not scaled:
        raise refuse(f"partial_rotary_factor={partial!r}", "largebatch rotates every dimension of a head")
    theta = table.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise refuse(f"rope_theta={theta!r}", "the rotary base must be a number > 1")
    return float(theta)


# BERT's layout under other model types: RoBERTa (Liu et al. 2019), XLM-R and CamemBERT (RoBERTa
# trained on other corpora) are BERT's post-LN blocks, with positions counted from pad_token_id + 1
# (RobertaEmbeddings: rows 0 .. pad_token_id are never used by a sequence without padding), so
# max_position_embeddings - (pad_token_id + 1) positions are usable
ROBERTA_LAYOUTS = HF_MODEL_TYPES["bert"][1:]  # ("roberta", "xlm-roberta", "camembert")
BERT_LAYOUTS = ("bert", *ROBERTA_LAYOUTS)


def position_offset(raw: dict) -> int:
    """The first position row a sequence uses in a BERT-layout config: 0 for BERT, pad_token_id + 1
    for RoBERTa's family (ROBERTA_LAYOUTS)."""
    if raw.get("model_type") in ROBERTA_LAYOUTS:
        pad = raw.get("pad_token_id")
        return (1 if pad is None else int(pad)) + 1
    return 0


def bert_positions(raw: dict, where: str) -> int:
    """The positions a BERT-layout config can embed (its model.seq_len); ValueError when none is
    left after the offset. ``where``: the config named in the message."""
    count = raw.get("max_position_embeddings")
    if count is None:
        raise ValueError(f"{where}: field 'max_position_embeddings' is missing: a {raw.get('model_type')} "
                         "config.json needs it.")
    usable = int(count) - position_offset(raw)
    if usable < 1:
        raise ValueError(f"{where}: max_position_embeddings={count} leaves no position after the "
                         f"{position_offset(raw)} rows {raw.get('model_type')} skips (pad_token_id + 1)")
    return usable

# torch's GeLU, exact or tanh (gelu_pytorch_tanh, one kernel): keeps its input only, as the closed
# form counts (measured, tests/test_memory_hf.py)
_GELU_EXACT = ("gelu", "gelu_pytorch_tanh")
_GELU_POINTWISE = ("gelu_new",)   # transformers' NewGELUActivation: three more f-wide tensors


HF_ACTIVATIONS = _GELU_EXACT + _GELU_POINTWISE + LLAMA_ACTIVATIONS
"""transformers' activation names whose eager layers the memory model counts (silu / swish: the
Llama family's SwiGLU layers)."""
# each as largebatch's model.activation: the same function ("gelu_new" is the tanh formula written
# out, "gelu_pytorch_tanh" torch's tanh kernel)
_ACTIVATION = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def check_activation(activation, name: str = "activation") -> str:
    """``activation`` if it is one of HF_ACTIVATIONS, else ValueError naming ``name`` (a misspelt
    "gelu-new" would otherwise be counted as a fused GeLU: ~10% fewer bytes for GPT-2)."""
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"{name}={activation!r}: not a transformers activation the memory model counts; "
                         f"choose one of {', '.join(HF_ACTIVATIONS)} (GPT-2's default is gelu_new, BERT's gelu, "
                         "Llama's silu)")
    return activation


def as_transformers_reads(raw: dict) -> dict:
    """``raw`` (a config.json's fields) as transformers' AutoConfig reads it: a "mistral" config
    with a ``layer_types`` key is built as a "ministral" one (MinistralForCausalLM: the windows on the
    layers layer_types names; a MistralConfig would window them all)."""
    if isinstance(raw, dict) and raw.get("model_type") == "mistral" and "layer_types" in raw:
        return {**raw, "model_type": "ministral"}
    return raw


def _load(source) -> dict:
    return as_transformers_reads(_load_raw(source))


def _load_raw(source) -> dict:
    if isinstance(source, Mapping):
        return dict(source)
    if callable(getattr(source, "to_dict", None)) and not isinstance(source, (str, Path)):
        raw = source.to_dict()  # a transformers config object (GPT2Config, BertConfig, ...)
        if isinstance(raw, Mapping):
            return dict(raw)
    if not isinstance(source, (str, Path)):
        raise ValueError(f"hf config {source!r}: expected a config.json path, a directory holding one, its "
                         "dict, or a transformers config object (GPT2Config(...), BertConfig(...))")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"hf config {str(source)!r}: no such file; give a config.json or a "
                         "directory holding one.")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"hf config {str(path)!r}: not valid JSON ({err.msg} at line {err.lineno}); "
                         "give a Hugging Face config.json.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"hf config {str(path)!r}: holds a JSON {type(raw).__name__}, not an object of "
                         "fields; give a Hugging Face config.json.")
    return raw


def _model_type(raw: dict) -> str:
    model_type = raw.get("model_type")
    if not model_type:
        arch = " ".join(raw.get("architectures") or [])
        model_type = ("gpt2" if arch.startswith("GPT2") else "gpt_neox" if arch.startswith("GPTNeoXFor")
                      else "bert" if arch.startswith("Bert") else None) or next(
            (t for prefix, t in _LLAMA_ARCHITECTURES.items() if arch.startswith(prefix + "For")), None)
    if model_type in ("gpt2", "gpt_neox") or model_type in BERT_LAYOUTS or model_type in LLAMA_LAYOUTS:
        return model_type
    why = UNSUPPORTED.get(model_type)
    what = f"model_type={model_type!r}" if model_type else \
        f"architectures={raw.get('architectures')!r} (no model_type)"
    raise ValueError(f"hf config {what}: not supported; the memory model describes GPT-2, BERT "
                     "(RoBERTa, XLM-R, CamemBERT), GPT-NeoX (Pythia) and Llama (Mistral, Ministral, Qwen2, "
                     "Qwen3, OLMo 2, OLMo 3) layers as transformers' layers keep them (LayerNorm and a GeLU MLP, "
                     "sequential or GPT-NeoX's parallel; or RMSNorm and a SwiGLU MLP)"
                     + (f", and this model has {why}" if why else "")
                     + ". Describe the model with --layers/--hidden/--heads/--ffn (and --model.norm, "
                       "--model.position, --model.activation, --model.n_kv_head, --model.head_size, "
                       "--model.qk_norm, --model.sliding_window) only if its layers are "
                       "largebatch's.")


def _field(raw: dict, name: str, default=None):
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"hf config field {name!r} is missing: a {raw.get('model_type')} "
                         "config.json needs it.")
    return value


# transformers' dropout fields per model type (each defaults to 0.1 in its config class)
HF_DROPOUTS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"), "gpt_neox": ("attention_dropout", "hidden_dropout"),
               **dict.fromkeys(BERT_LAYOUTS, ("hidden_dropout_prob", "attention_probs_dropout_prob"))}


def _dropout(raw: dict, names: tuple[str, ...], default: float = 0.1) -> float:
    """One dropout probability for the model: the memory model only needs to know whether the masks
    exist, so equal-or-not probabilities are fine, but some on and some off is not describable.
    ``default``: a missing field's value (0.1 in GPT2Config / BertConfig, 0 in LlamaConfig)."""
    probs = {}
    for name in names:
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"hf config field {name!r}={value!r}: expected a dropout probability, a number "
                             "in [0, 1)")
        probs[name] = float(value)
    on = [n for n, p in probs.items() if p > 0]
    if on and len(on) < len(probs):
        off = [n for n in probs if n not in on]
        raise ValueError(f"hf config dropout {probs}: {', '.join(off)} = 0 while {', '.join(on)} > 0; "
                         "the memory model puts dropout in every place or none: set them all to 0 or "
                         "all above 0.")
    return max(probs.values())


def _activation(raw: dict, name: str, default: str) -> str:
    act = raw.get(name, default)
    if act not in _GELU_EXACT + _GELU_POINTWISE:
        raise ValueError(f"hf config field {name!r}={act!r}: not supported; the closed form and the "
                         f"measured transformers terms cover {', '.join(_GELU_EXACT + _GELU_POINTWISE)}.")
    return act


def _ffn(width, hidden, name: str) -> int | None:
    """ModelConfig's ffn_hidden: None for the 4h default (as the presets write it); ``name``: the
    config.json field, named in the error for a width that is no positive integer."""
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
        raise ValueError(f"hf config field {name!r}={width!r}: expected the MLP's width, a positive integer "
                         "(or null for 4 x the hidden size)")
    return None if width is None or width == 4 * hidden else width


def _llama_config(raw: dict) -> ModelConfig:
    """A Llama / Mistral / Qwen2 / Qwen3 config.json as the Llama-style GPT (llama_fields, shared with
    ``model.init_from``). Unlike the import, a scaled rope (its angles change no kept tensor: a YaRN
    config kept the unscaled one's bytes exactly) and unequal biases (they keep nothing: only the
    parameter count sees them) are read: ``model.bias`` is attention_bias or mlp_bias, and Qwen2's
    biases on q, k and v alone are model.qkv_bias (as ``model.init_from`` reads them); Qwen3's
    attention_bias (on q, k, v and o_proj, none in the MLP) is counted as q, k and v's
    (model.qkv_bias: its o_proj bias, h a layer, left out). ``attention_dropout``
    is model.dropout, the layers' only dropout (the whole-model count's embedding mask, s b h bytes
    with dropout on, is one transformers' Llama does not keep)."""
    def refuse(what: str, why: str) -> ValueError:
        return ValueError(f"hf config model_type={raw.get('model_type')!r} has {what}; {why}, so the memory "
                          "model does not describe it")

    fields = llama_fields(raw, lambda name: _field(raw, name), refuse)
    attention_only = raw.get("model_type") in ("qwen3", *OLMO_TYPES)  # (attention_bias: q, k, v and o; no MLP's)
    return ModelConfig(**fields, rope_theta=rope_theta(raw, refuse, scaled=True),
                       vocab_size=_field(raw, "vocab_size"), dropout=_dropout(raw, ("attention_dropout",), 0.0),
                       bias=bool(not attention_only and (raw.get("attention_bias") or raw.get("mlp_bias"))),
                       qkv_bias=True if raw.get("model_type") == "qwen2"
                       or (attention_only and raw.get("attention_bias")) else None,
                       tie_embeddings=bool(raw.get("tie_word_embeddings", False)))


def _neox_config(raw: dict) -> ModelConfig:
    """A GPT-NeoX config.json (GPTNeoXForCausalLM, Pythia) as largebatch's GPT with the same layers
    (neox_fields, shared with ``model.init_from``; a rope scaling read past, as the Llama family's);
    ``attention_dropout`` and ``hidden_dropout`` are model.dropout (both on or both off)."""
    def refuse(what: str, why: str) -> ValueError:
        return ValueError(f"hf config model_type='gpt_neox' has {what}; {why}, so the memory model does not "
                          "describe it")

    fields = neox_fields(raw, lambda name: _field(raw, name), refuse, scaled=True)
    fields["ffn_hidden"] = _ffn(fields["ffn_hidden"], fields["n_embd"], "intermediate_size")  # (4h: None, as presets)
    return ModelConfig(**fields, vocab_size=_field(raw, "vocab_size"),
                       dropout=_dropout(raw, HF_DROPOUTS["gpt_neox"], 0.0))


def config_from_hf(source: str | Path | Mapping) -> ModelConfig:
    """A ModelConfig for a Hugging Face GPT-2, BERT (RoBERTa, XLM-R, CamemBERT), Llama (Mistral,
    Ministral, Qwen2, Qwen3, OLMo 2 and 3; sliding windows included) or GPT-NeoX (Pythia) config: a config.json
    path, a directory holding one, its dict,
    or the transformers config object (`GPT2Config(...)`). The activation is largebatch's name for
    transformers' (gelu_new -> gelu_tanh, as `hf:` imports it; silu -> swiglu, the gated MLP).
    Refuses other architectures, naming what in them the closed form does not describe. Attention is
    "explicit" (transformers' eager layout); pass the result through `.replace(attention="sdpa")` for
    a fused kernel."""
    raw = _load(source)
    model_type = _model_type(raw)
    if model_type in LLAMA_LAYOUTS:
        return _llama_config({**raw, "model_type": model_type})  # (named by its architecture alone: its type)
    if model_type == "gpt_neox":
        return _neox_config(raw)
    for flag in ("add_cross_attention", "reorder_and_upcast_attn"):
        if raw.get(flag):
            raise ValueError(f"hf config field {flag!r}=True: not supported (extra cross-attention or "
                             "fp32 attention tensors the closed form does not count); set it to false.")
    if model_type == "gpt2":
        act = _activation(raw, "activation_function", "gelu_new")
        return ModelConfig(activation=_ACTIVATION[act],
            kind="gpt", n_layer=_field(raw, "n_layer"), n_embd=_field(raw, "n_embd"),
            n_head=_field(raw, "n_head"), ffn_hidden=_ffn(raw.get("n_inner"), raw["n_embd"], "n_inner"),
            seq_len=_field(raw, "n_positions"), vocab_size=_field(raw, "vocab_size"),
            dropout=_dropout(raw, HF_DROPOUTS["gpt2"]),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)), norm_position="pre",
            norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)))
    act = _activation(raw, "hidden_act", "gelu")
    position = raw.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"hf config field 'position_embedding_type'={position!r}: not supported "
                         "(relative position scores add tensors the closed form does not count); "
                         "use 'absolute'.")
    return ModelConfig(
        kind="bert", activation=_ACTIVATION[act], n_layer=_field(raw, "num_hidden_layers"),
        n_embd=_field(raw, "hidden_size"),
        n_head=_field(raw, "num_attention_heads"),
        ffn_hidden=_ffn(raw.get("intermediate_size"), raw["hidden_size"], "intermediate_size"),
        seq_len=bert_positions(raw, "hf config"), vocab_size=_field(raw, "vocab_size"),
        dropout=_dropout(raw, HF_DROPOUTS["bert"]),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)), norm_position="post",
        norm_eps=float(raw.get("layer_norm_eps", 1e-12)))


def hf_activation(source: str | Path | Mapping) -> str:
    """transformers' activation name of a GPT-2 / BERT / GPT-NeoX / Llama config ("gelu_new" is GPT-2's
    default, "gelu" BERT's and GPT-NeoX's -- its ``hidden_act`` --, "silu" Llama's)."""
    raw = _load(source)
    model_type = _model_type(raw)
    if model_type in LLAMA_LAYOUTS:
        _llama_config({**raw, "model_type": model_type})  # (its refusals first)
        return raw.get("hidden_act", "silu")
    if model_type == "gpt_neox":
        _neox_config(raw)  # (its refusals first)
        return raw.get("hidden_act", "gelu")
    if model_type == "gpt2":
        return _activation(raw, "activation_function", "gelu_new")
    return _activation(raw, "hidden_act", "gelu")


def hf_eager_layer_bytes(config: ModelConfig, activation: str, micro_batch: int,
                         recompute: str = "none", *, seq_len: int | None = None,
                         dtype_bytes: float = 2, device: str = "cuda", layer: int = 0) -> float:
    """Bytes one transformers eager layer of ``config`` keeps under a recompute policy:
    "none" the measured terms below (hf_eager_bytes_per_layer); "selective" those minus the core
    attention (softmax output, its dropout mask and output, recomputed as in the closed form);
    "full" the layer input, s b h d. ``activation``: transformers' name ("gelu" or "gelu_new"; "silu"
    or "swish" for a Llama-family ``config``, counted by llama_layer_bytes, eager or sdpa as
    ``config.attention`` says, for its layer ``layer``: its sliding window). A GPT-NeoX ``config``
    (LayerNorm and rotary positions, config_from_hf's of a gpt_neox config.json) is counted by
    neox_layer_bytes, eager or sdpa as ``config.attention`` says."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: transformers' layers are counted for "
                         "none, selective and full only.")
    check_activation(activation)
    llama_layer = config.activation == "swiglu" and config.norm == "rmsnorm" and config.position == "rope"
    if (activation in LLAMA_ACTIVATIONS) != llama_layer:
        raise ValueError(f"activation={activation!r} with model.activation={config.activation!r}, "
                         f"model.norm={config.norm!r}, model.position={config.position!r}: transformers' "
                         "silu/swish layers are Llama's (swiglu, rmsnorm, rope) and its GeLU layers GPT-2's or "
                         "BERT's (layernorm, learned positions) or GPT-NeoX's (layernorm, rope); give the config "
                         "config_from_hf made")
    if llama_layer:
        return llama_layer_bytes(config, micro_batch, recompute, seq_len=seq_len, dtype_bytes=dtype_bytes,
                                 device=device, layer=layer)
    if config.norm == "layernorm" and config.position == "rope":
        return neox_layer_bytes(config, activation, micro_batch, recompute, seq_len=seq_len,
                                dtype_bytes=dtype_bytes, device=device)
    s = config.seq_len if seq_len is None else seq_len
    h, a, f, b, d = config.n_embd, config.n_head, config.ffn, micro_batch, dtype_bytes
    if recompute == "full":
        return s * b * h * d
    dropout = config.dropout > 0
    mask_bytes = dtype_bytes if device == "cpu" else 1
    base = activation_bytes_per_layer(s, b, h, a, ffn_hidden=f, dtype_bytes=d,
                                      mask_bytes=mask_bytes, dropout=dropout, recompute=recompute)
    gelu_extra = 3 * f * d if activation in _GELU_POINTWISE else 0
    return base + s * b * gelu_extra


def llama_layer_bytes(config: ModelConfig, micro_batch: int, recompute: str = "none", *,
                      seq_len: int | None = None, dtype_bytes: float = 2, device: str = "cuda",
                      layer: int = 0) -> float:
    """Bytes one transformers Llama decoder layer (LlamaDecoderLayer, Mistral's, Qwen2's, Qwen3's) keeps for
    backward in training: the terms of Korthikanti et al. 2022 (Table 2, docs/papers.md: memory) as
    transformers' layer keeps them, per token (module docstring; measured to the byte on CPU in fp32 and bf16,
    tests/test_memory_hf.py), with d = ``dtype_bytes``, h_kv = h a_kv / a, m the dropout mask's bytes
    (d on the CPU, where F.dropout multiplies by a float mask; 1 elsewhere, native_dropout's bool):
        2 RMSNorms (4 + d) h + 8, Q/K/V and MLP inputs 2 h d, q and the o_proj input 2 w d, MLP 4 f d,
        K and V: eager 2 w d (repeat_kv's copies at all a heads), sdpa and selective 2 w_kv d,
        core (none only): eager a s (4 + d) (a s 4 in fp32), with dropout a s (4 + m + d); sdpa 4 a,
        Qwen3's query and key norms (model.qk_norm), written out as the layer norms: (4 + d) (w + w_kv)
        + 4 (a + a_kv) (an fp32 input, the normalised tensor and a 4-byte rsqrt per head),
        OLMo 2's and 3's (model.norm_position="reordered"): each RMSNorm multiplies by its gain in fp32
        before rounding back, so keeps the fp32 normalised tensor: (4 + 4) h + 4 for each layer norm,
        and its query and key norms over the whole projections (4 + 4) (w + w_kv) + 2 4,
    with w = a d_h and w_kv = a_kv d_h (h and h_kv unless model.head_size makes them other).
    ``config.attention``: "explicit" (transformers' eager) or "sdpa" (fused: no padding mask, so
    transformers passes enable_gqa; sdpa with dropout on CPU runs torch's unfused math kernel and
    is refused, as config_layer_kwargs does). recompute: "none", "selective" (apply_recompute's
    checkpoint of the attention function keeps its inputs q, K, V un-repeated), "full" (h d).
    ``layer``: which layer (its sliding window, ModelConfig.layer_window). An sdpa layer whose window
    is shorter than s gets the window's mask, and transformers then passes no enable_gqa: under
    "none" it keeps K and V at all a heads (2 w d) and sdpa's float copy of the mask (s d a token);
    eager layers keep neither (the mask is added, not kept). The bool mask itself, shared by the
    layers, is the model's (``hf_mask_bytes``)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: transformers' Llama layers are counted for none, "
                         "selective and full only.")
    s = config.seq_len if seq_len is None else seq_len
    h, a, f, b, d = config.n_embd, config.n_head, config.ffn, micro_batch, dtype_bytes
    if recompute == "full":
        return s * b * h * d
    dropout = config.dropout > 0
    eager = config.attention == "explicit"
    if not eager and dropout and device == "cpu":
        raise ValueError("attention='sdpa' with attention_dropout on CPU runs PyTorch's unfused math kernel, "
                         "which the memory model does not describe: use attention='explicit' (eager) or "
                         "attention_dropout=0 for CPU memory estimates.")
    w, w_kv = config.attention_width, config.kv_heads * config.head_dim
    masked_sdpa = not eager and config.windows_at(s)[layer] is not None and recompute == "none"
    # repeat_kv's copies are what's kept (of one K/V head it makes a view, which sdpa reads uncopied;
    # eager's matmuls still keep a copy at all heads)
    kv = w if recompute == "none" and (eager or (masked_sdpa and config.kv_heads > 1)) else w_kv
    normalised = hf_normalised_bytes(config, d)
    per_token = 2 * ((4 + normalised) * h + 4) + 2 * h * d + 2 * w * d + 2 * kv * d + 4 * f * d
    if masked_sdpa:  # sdpa's float copy of the window's (bool) mask, in the queries' dtype
        per_token += s * d
    if config.qk_norm_layout == "head":
        per_token += (4 + d) * (w + w_kv) + 4 * (a + config.kv_heads)
    elif config.qk_norm_layout == "projection":  # OLMo's: one rsqrt a token for q and for k
        per_token += (4 + normalised) * (w + w_kv) + 2 * 4
    if recompute == "none":
        if not eager:
            per_token += 4 * a
        elif dropout:
            per_token += a * s * (4 + (d if device == "cpu" else 1) + d)
        else:
            per_token += a * s * (4 + (0 if d == 4 else d))
    return s * b * per_token


def neox_layer_bytes(config: ModelConfig, activation: str, micro_batch: int, recompute: str = "none", *,
                     seq_len: int | None = None, dtype_bytes: float = 2, device: str = "cuda") -> float:
    """Bytes one transformers GPT-NeoX layer (GPTNeoXLayer: Pythia) keeps for backward in training, per
    token (module docstring; measured to the byte on CPU in fp32 and bf16, both residual layouts, with
    and without dropout, tests/test_memory_hf.py), with d = ``dtype_bytes``, m the dropout masks' bytes
    (d on the CPU, F.dropout's float mask; 1 elsewhere), sigma a LayerNorm statistic's (d on the CPU,
    where torch casts the mean and 1/std to the input's dtype; 4 elsewhere, fp32), P = 1 for the
    parallel layer (model.norm_position "parallel": both norms read the layer input, kept once), 2 for
    the sequential one:
        LayerNorm inputs P h d, their statistics 4 sigma, their outputs (fused Q/K/V and MLP inputs) 2 h d,
        q and k after the partial rotation's concatenation 2 h d, the dense input h d,
        V: eager h d (P V's contiguous copy of the strided chunk; the fused output is freed),
           sdpa 3 h d + h d (the chunk view keeps the whole fused output; sdpa's own output),
        MLP 2 f d (the GeLU input, the dense_4h_to_h input; 3 f d more for "gelu_new"),
        dropout 2 h m (the two residual branches),
        core (none only): eager a s (4 + d) (a s 4 in fp32), with dropout a s (4 + m + d); sdpa 4 a.
    recompute "selective" (apply_recompute's checkpoint of the attention function): the core and V's
    terms give way to the function's inputs, of which v is a view of the fused output: 3 h d -- eager
    or sdpa alike. "full": the layer input, h d. The rotary fraction changes no term (q and k are new
    tensors whatever it is). ``config.attention``: "explicit" (eager) or "sdpa" (torch's fused kernel;
    with dropout on CPU its unfused math kernel, refused as for the Llama family). ``activation``:
    transformers' hidden_act (a GeLU: "gelu", "gelu_pytorch_tanh" or "gelu_new")."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: transformers' GPT-NeoX layers are counted for none, "
                         "selective and full only.")
    check_activation(activation)
    if activation in LLAMA_ACTIVATIONS or config.activation == "swiglu":
        raise ValueError(f"activation={activation!r} with model.activation={config.activation!r}: "
                         "transformers' GPT-NeoX layers have a GeLU MLP; give the config config_from_hf made")
    s = config.seq_len if seq_len is None else seq_len
    h, a, f, b, d = config.n_embd, config.n_head, config.ffn, micro_batch, dtype_bytes
    if recompute == "full":
        return s * b * h * d
    dropout = config.dropout > 0
    eager = config.attention == "explicit"
    if not eager and dropout and device == "cpu":
        raise ValueError("attention='sdpa' with attention_dropout on CPU runs PyTorch's unfused math kernel, "
                         "which the memory model does not describe: use attention='explicit' (eager) or "
                         "dropout 0 for CPU memory estimates.")
    cpu = device == "cpu"
    m, sigma = (d, d) if cpu else (1, 4)
    norm_inputs = 1 if config.norm_position == "parallel" else 2
    gelu = 2 + (3 if activation in _GELU_POINTWISE else 0)
    # the norms' inputs, statistics and outputs, q and k, the dense input, the MLP, the residual masks
    per_token = (norm_inputs + 2 + 2 + 1) * h * d + 4 * sigma + gelu * f * d + (2 * h * m if dropout else 0)
    if recompute == "selective":
        per_token += 3 * h * d  # v's view keeps the whole fused output (the checkpoint's input)
    elif not eager:
        per_token += 3 * h * d + h * d + 4 * a  # the fused output through v's view, sdpa's output, its lse
    elif dropout:
        per_token += h * d + a * s * (4 + m + d)  # P V's copy of v; softmax, mask, dropout output
    else:
        per_token += h * d + a * s * (4 + (0 if d == 4 else d))  # P V's copy of v; fp32 softmax (and its cast)
    return s * b * per_token


def hf_normalised_bytes(config: ModelConfig, dtype_bytes: float) -> float:
    """Bytes a value of the normalised tensor that each of transformers' RMSNorms keeps for the gain's
    gradient: OLMo's (Olmo2RMSNorm, model.norm_position "reordered") applies the gain before rounding
    back, so keeps it in fp32 (4); LlamaRMSNorm rounds first and keeps it in the activations' dtype."""
    return 4 if config.norm_position == "reordered" else dtype_bytes


def hf_mask_bytes(config: ModelConfig, micro_batch: int, recompute: str | list[str] = "none", *,
                  seq_len: int | None = None, dtype_bytes: float = 2) -> float:
    """Bytes of the attention masks transformers' causal model (GPT-2, GPT-NeoX, the Llama family) builds
    once and its layers share, kept for backward because a recomputed layer (selective or full: the
    checkpoint keeps its inputs) reads them: eager layers read a float (b, 1, s, s) mask in the
    activations' dtype, one per kind of layer recomputed -- the causal one for full-attention layers,
    a sliding one for windowed layers (OLMo 3 and Ministral, with both kinds, keep two); sdpa
    layers only a window's bool (1, 1, s, s) mask (full attention passes none). 0 without
    recomputation (eager layers add the mask to the scores, sdpa layers keep their own float copy,
    llama_layer_bytes) and for BERT's family. Measured on whole models (tests/test_memory_hf.py; GPT-NeoX's
    eager layers keep the causal one as GPT-2's do)."""
    if model_spec(config.kind).objective != "causal":
        return 0.0
    s = config.seq_len if seq_len is None else seq_len
    policies = [recompute] * config.n_layer if isinstance(recompute, str) else list(recompute)
    kinds = {w is None for p, w in zip(policies, config.windows_at(s)) if p in ("selective", "full")}
    if config.attention == "explicit":
        return float(len(kinds) * micro_batch * s * s * dtype_bytes)
    return float(s * s) if False in kinds else 0.0


def hf_eager_bytes_per_layer(source: str | Path | Mapping, micro_batch: int, *,
                             seq_len: int | None = None, dtype_bytes: float = 2,
                             device: str = "cuda") -> float:
    """Bytes one transformers eager GPT-2 / BERT / GPT-NeoX / Llama layer keeps for backward in training
    (no recomputation): for GPT-2 / BERT the closed form with d-byte dropout masks on CPU (F.dropout's
    float mask; 1-byte bool masks elsewhere), plus 3 f d bytes per token for GPT-2's pointwise
    "gelu_new"; for GPT-NeoX neox_layer_bytes, for the Llama family llama_layer_bytes (eager
    attention). Both masks are measured in tests/test_memory_hf.py on CPU (the GPU one with
    torch.native_dropout's bool mask, which CUDA's F.dropout keeps), not on a GPU."""
    raw = _load(source)
    return hf_eager_layer_bytes(config_from_hf(raw), hf_activation(raw), micro_batch, seq_len=seq_len,
                                dtype_bytes=dtype_bytes, device=device)
