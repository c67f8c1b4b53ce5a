"""Hugging Face configs for the memory model: `config_from_hf` maps a GPT-2 or BERT `config.json`
(a path, a directory holding one, or the dict) to a ModelConfig, without importing transformers, and
`hf_eager_bytes_per_layer` counts what transformers' own eager layers keep, which is more than the
closed form of Korthikanti et al. 2022 (docs/papers.md: memory) counts for largebatch's layers.

What transformers' eager GPT-2 / BERT layers keep beyond the closed form (found by walking the
autograd graph of GPT2LMHeadModel and BertForMaskedLM, docs/memory.md):
* activation "gelu_new" (GPT-2's default) is written as pointwise ops, 0.5 x (1 + tanh(...)), and
  keeps three more f-wide tensors per token than a fused GeLU: the tanh output, 0.5 x and 1 + tanh.
  BERT's "gelu" is torch's GeLU, which keeps only its input.
* nn.Dropout calls F.dropout, which on CPU keeps a mask in the activation dtype (d bytes), not a
  1-byte bool mask: three masks per layer (attention probabilities, two residual branches).
No attention mask or bias is kept (transformers 5 adds the causal/padding mask), and the softmax
runs in the activation dtype (GPT-2's `reorder_and_upcast_attn` is refused below).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from largebatch.memory.activations import activation_bytes_per_layer
from largebatch.models.config import HF_MODEL_TYPES, ModelConfig

# Families that are not GPT-2 / BERT layouts, and what in them the closed form does not describe.
_LLAMA_EAGER = ("; largebatch's own layers of that kind are counted (--model.norm rmsnorm --model.position rope "
                "--model.activation swiglu --model.n_kv_head N), but transformers' eager attention keeps more "
                "(K and V repeated to every query head, an fp32 softmax), not measured here")
UNSUPPORTED = {
    "llama": "gated MLP (SwiGLU: three f-wide projections), RMSNorm, rotary embeddings and "
             "grouped-query attention (fewer K/V heads than Q heads)" + _LLAMA_EAGER,
    "mistral": "gated MLP (SwiGLU), RMSNorm, rotary embeddings, grouped-query and sliding-window "
               "attention" + _LLAMA_EAGER,
    "mixtral": "mixture-of-experts gated MLPs, RMSNorm, rotary embeddings, grouped-query attention",
    "qwen2": "gated MLP (SwiGLU), RMSNorm, rotary embeddings and grouped-query attention" + _LLAMA_EAGER,
    "gemma": "gated MLP (GeGLU), RMSNorm, rotary embeddings and multi-query attention",
    "phi": "parallel attention and MLP branches, partial rotary embeddings",
    "gpt_neox": "parallel attention and MLP branches and rotary embeddings",
    "gptj": "parallel attention and MLP branches and rotary embeddings",
    "falcon": "parallel attention and MLP branches, rotary embeddings and multi-query attention",
    "t5": "an encoder-decoder with cross-attention, relative position biases and RMSNorm",
    "bart": "an encoder-decoder with cross-attention",
}

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


HF_ACTIVATIONS = _GELU_EXACT + _GELU_POINTWISE
"""transformers' activation names whose eager layers the memory model counts."""
# each as largebatch's model.activation: the same function ("gelu_new" is the tanh formula written
# out, "gelu_pytorch_tanh" torch's tanh kernel)
_ACTIVATION = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def check_activation(activation, name: str = "activation") -> str:
    """``activation`` if it is one of HF_ACTIVATIONS, else ValueError naming ``name`` (a misspelt
    "gelu-new" would otherwise be counted as a fused GeLU: ~10% fewer bytes for GPT-2)."""
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"{name}={activation!r}: not a transformers activation the memory model counts; "
                         f"choose one of {', '.join(HF_ACTIVATIONS)} (GPT-2's default is gelu_new, BERT's gelu)")
    return activation


def _load(source) -> dict:
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
        model_type = "gpt2" if arch.startswith("GPT2") else "bert" if arch.startswith("Bert") else None
    if model_type == "gpt2" or model_type in BERT_LAYOUTS:
        return model_type
    why = UNSUPPORTED.get(model_type)
    what = f"model_type={model_type!r}" if model_type else \
        f"architectures={raw.get('architectures')!r} (no model_type)"
    raise ValueError(f"hf config {what}: not supported; the closed form describes GPT-2 and BERT "
                     "(RoBERTa, XLM-R, CamemBERT) layouts as transformers' eager layers keep them (LayerNorm, "
                     "one GeLU MLP, as many K/V heads as Q heads)"
                     + (f", and this model has {why}" if why else "")
                     + ". Describe the model with --layers/--hidden/--heads/--ffn (and --model.norm, "
                       "--model.position, --model.activation, --model.n_kv_head) only if its layers are "
                       "largebatch's.")


def _field(raw: dict, name: str, default=None):
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"hf config field {name!r} is missing: a {raw.get('model_type')} "
                         "config.json needs it.")
    return value


# transformers' dropout fields per model type (each defaults to 0.1 in its config class)
HF_DROPOUTS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
               **dict.fromkeys(BERT_LAYOUTS, ("hidden_dropout_prob", "attention_probs_dropout_prob"))}


def _dropout(raw: dict, names: tuple[str, ...]) -> float:
    """One dropout probability for the model: the memory model only needs to know whether the masks
    exist, so equal-or-not probabilities are fine, but some on and some off is not describable."""
    probs = {}
    for name in names:
        value = raw.get(name, 0.1)
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


def config_from_hf(source: str | Path | Mapping) -> ModelConfig:
    """A ModelConfig for a Hugging Face GPT-2 or BERT (RoBERTa, XLM-R, CamemBERT) config: a config.json path, a
    directory holding one, its dict, or the transformers config object (`GPT2Config(...)`). The
    activation is largebatch's name for transformers' (gelu_new -> gelu_tanh, as `hf:` imports it).
    Refuses other architectures, naming what in them the closed form does not describe. Attention is
    "explicit" (transformers' eager layout); pass the result through `.replace(attention="sdpa")` for
    a fused kernel."""
    raw = _load(source)
    model_type = _model_type(raw)
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
    """transformers' activation name of a GPT-2 / BERT config ("gelu_new" is GPT-2's default)."""
    raw = _load(source)
    if _model_type(raw) == "gpt2":
        return _activation(raw, "activation_function", "gelu_new")
    return _activation(raw, "hidden_act", "gelu")


def hf_eager_layer_bytes(config: ModelConfig, activation: str, micro_batch: int,
                         recompute: str = "none", *, seq_len: int | None = None,
                         dtype_bytes: float = 2, device: str = "cuda") -> float:
    """Bytes one transformers eager layer of ``config`` keeps under a recompute policy:
    "none" the measured terms below (hf_eager_bytes_per_layer); "selective" those minus the core
    attention (softmax output, its dropout mask and output, recomputed as in the closed form);
    "full" the layer input, s b h d. ``activation``: transformers' name ("gelu" or "gelu_new")."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: transformers' eager layers are counted for "
                         "none, selective and full only.")
    check_activation(activation)
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


def hf_eager_bytes_per_layer(source: str | Path | Mapping, micro_batch: int, *,
                             seq_len: int | None = None, dtype_bytes: float = 2,
                             device: str = "cuda") -> float:
    """Bytes one transformers eager GPT-2 / BERT layer keeps for backward in training (no
    recomputation): the closed form with d-byte dropout masks on CPU (F.dropout's float mask; 1-byte
    bool masks elsewhere), plus 3 f d bytes per token for GPT-2's pointwise "gelu_new". Both cases
    are measured in tests/test_memory_hf.py on CPU (the GPU one with torch.native_dropout's bool
    mask, which CUDA's F.dropout keeps), not on a GPU."""
    raw = _load(source)
    return hf_eager_layer_bytes(config_from_hf(raw), hf_activation(raw), micro_batch, seq_len=seq_len,
                                dtype_bytes=dtype_bytes, device=device)
