"""ModelConfig: the one description of a GPT or BERT that the model, the FLOP counter and the
memory model (Korthikanti et al. 2022, docs/papers.md: memory) all read.

Notation follows the paper: L = n_layer, h = n_embd, a = n_head, s = seq_len, v = vocab_size,
f = ffn_hidden (4h in the paper).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from largebatch.models.registry import MODELS, model_spec
from largebatch.typed_config import check_fields

Attention = Literal["explicit", "sdpa"]
NormPosition = Literal["pre", "post", "reordered", "parallel"]
QkNormScope = Literal["head", "projection"]
Activation = Literal["gelu", "gelu_tanh", "swiglu"]
Position = Literal["learned", "rope"]
Norm = Literal["layernorm", "rmsnorm"]
RopeScaling = Literal["none", "linear", "llama3"]
HfModelType = Literal["gpt2", "llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "olmo3", "gpt_neox", "bert",
                      "roberta", "xlm-roberta", "camembert"]
# model kind -> the transformers model types it exports as (largebatch export --format hf)
HF_MODEL_TYPES = {"gpt": ("gpt2", "llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "olmo3", "gpt_neox"),
                  "bert": ("bert", "roberta", "xlm-roberta", "camembert")}
# transformers model type -> the ModelConfig values its blocks compute (every type: as many key/value
# heads as query heads, but the Llama family's, GROUPED_TYPES): GPT-2 (Radford et al. 2019) and BERT's
# family (Devlin et al. 2019): LayerNorm, learned positions, a GeLU MLP; Llama (Touvron et al. 2023):
# RMSNorm, rotary positions, the SwiGLU MLP, grouped-query attention (Ainslie et al. 2023; Llama 2 70B,
# Llama 3), biases on every Linear or none (attention_bias = mlp_bias); Qwen2 (Yang et al. 2024): Llama's
# blocks with biases on q, k and v only; Qwen3 (Yang et al. 2025): Llama's blocks without biases, each
# query and key head normalised; Mistral (Jiang et al. 2023): Llama's blocks without biases, every layer
# attending within a sliding window; Ministral: the same with the window on the layers its layer_types
# name; OLMo 2 (OLMo et al. 2024): Llama's blocks without biases, each sub-layer's output normalised
# before the residual add and the whole q and k projections normalised; OLMo 3: the same with sliding
# windows on any layers. GPT-2's and the Llama family's but OLMo's are pre-LN. Llama's family may have
# heads of any size (head_dim), GPT-2's and BERT's n_embd / n_head; only Mistral, Ministral, Qwen2,
# Qwen3 and OLMo 3 have sliding windows ("window_layout" below: on no layer, every layer, or some
# layers); "qk_norm_layout": no query/key norm, one over each head (Qwen3), or over each projection.
# GPT-NeoX (Black et al. 2022; Pythia): LayerNorm, rotary positions on a share of each head
# (rope_fraction, PARTIAL_ROPE_TYPES: the only type with one below 1), a GeLU MLP, biases everywhere, the
# attention and the MLP in parallel (use_parallel_residual, its default) or in sequence.
# (GPT-2's and BERT's always have biases: a missing one exports as zeros.)
_PRE, _LLAMA = {"norm_position": ("pre",)}, {"norm": ("rmsnorm",), "position": ("rope",), "activation": ("swiglu",)}
_OLMO = {"norm_position": ("reordered",), **_LLAMA, "biases": ("none",), "qk_norm_layout": ("projection",)}
HF_TYPE_FIELDS = {"gpt2": {**_PRE, "norm": ("layernorm",), "position": ("learned",),
                           "activation": ("gelu", "gelu_tanh")},
                  "llama": {**_PRE, **_LLAMA, "biases": ("all", "none")},
                  "mistral": {**_PRE, **_LLAMA, "biases": ("none",), "window_layout": ("none", "all")},
                  "ministral": {**_PRE, **_LLAMA, "biases": ("none",), "window_layout": ("none", "all", "some")},
                  "qwen2": {**_PRE, **_LLAMA, "biases": ("qkv",), "window_layout": ("none", "all", "some")},
                  "qwen3": {**_PRE, **_LLAMA, "biases": ("none",), "qk_norm_layout": ("head",),
                            "window_layout": ("none", "all", "some")},
                  "olmo2": _OLMO, "olmo3": {**_OLMO, "window_layout": ("none", "all", "some")},
                  "gpt_neox": {"norm_position": ("parallel", "pre"), "norm": ("layernorm",), "position": ("rope",),
                               "activation": ("gelu", "gelu_tanh"), "biases": ("all",)},
                  **dict.fromkeys(HF_MODEL_TYPES["bert"], {"norm": ("layernorm",), "position": ("learned",)})}
# the architecture each type exports as, and what its blocks compute (for the messages)
HF_TYPE_WORDS = {"gpt2": ("GPT2LMHeadModel", "LayerNorm, learned positions, a GeLU MLP and as many key/value "
                                             "heads as query heads, each n_embd / n_head values wide"),
                 "llama": ("LlamaForCausalLM", "RMSNorm, rotary positions and the SwiGLU MLP, with biases on "
                                               "every Linear layer or none"),
                 "mistral": ("MistralForCausalLM", "RMSNorm, rotary positions and the SwiGLU MLP without biases, "
                                                   "every layer within the same sliding window or none"),
                 "ministral": ("MinistralForCausalLM", "RMSNorm, rotary positions and the SwiGLU MLP without "
                                                       "biases, a sliding window on any of its layers"),
                 "qwen2": ("Qwen2ForCausalLM", "RMSNorm, rotary positions and the SwiGLU MLP, with biases on q, "
                                               "k and v only"),
                 "qwen3": ("Qwen3ForCausalLM", "RMSNorm, rotary positions, the SwiGLU MLP and each query and key "
                                               "head normalised, without biases"),
                 "olmo2": ("Olmo2ForCausalLM", "RMSNorm on each sub-layer's output (norm_position 'reordered'), "
                                               "rotary positions, the SwiGLU MLP and the whole query and key "
                                               "projections normalised, without biases or sliding windows"),
                 "olmo3": ("Olmo3ForCausalLM", "RMSNorm on each sub-layer's output (norm_position 'reordered'), "
                                               "rotary positions, the SwiGLU MLP and the whole query and key "
                                               "projections normalised, without biases, a sliding window on any "
                                               "of its layers"),
                 "gpt_neox": ("GPTNeoXForCausalLM", "LayerNorm, rotary positions on any share of each head, a "
                                                    "GeLU MLP, biases on every layer, the attention and the MLP in "
                                                    "parallel (norm_position 'parallel') or in sequence ('pre'), "
                                                    "and as many key/value heads as query heads, each n_embd / "
                                                    "n_head values wide"),
                 **{t: (f"{name}ForMaskedLM", "LayerNorm, learned positions and as many key/value heads as query "
                                              "heads, each n_embd / n_head values wide")
                    for t, name in (("bert", "Bert"), ("roberta", "Roberta"), ("xlm-roberta", "XLMRoberta"),
                                    ("camembert", "Camembert"))}}
# sdpa's memory-efficient kernel (CUDA) copies a float mask whose rows are not 8-element aligned, in
# every call: the document mask's rows are laid out so (a view of a row-padded tensor), and its bytes
# counted so (largebatch.models.layers.AttentionMask, largebatch.memory.activations.attention_mask_bytes)
MASK_ROW_ALIGNMENT = 8
ATTENTION_KINDS = get_args(Attention)
NORM_POSITIONS, ACTIVATIONS = get_args(NormPosition), get_args(Activation)
POSITIONS, NORMS = get_args(Position), get_args(Norm)


# the rotary scaling's factors and their defaults (ModelConfig: read only by the scalings that use them)
ROPE_SCALING_DEFAULTS = {"rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                         "rope_original_seq_len": 8192}


def unread_rope_fields(cfg: ModelConfig) -> list[str]:
    """The rope scaling factors ``cfg`` sets to other than their defaults where its rope_scaling does
    not read them (rope_factor without a scaling; a llama3 band under "linear"): they change nothing."""
    read = {"none": (), "linear": ("rope_factor",)}.get(cfg.rope_scaling, tuple(ROPE_SCALING_DEFAULTS))
    return [name for name, default in ROPE_SCALING_DEFAULTS.items()
            if name not in read and getattr(cfg, name) != default]


@dataclass(frozen=True)
class ModelConfig:
    kind: str = field(default="gpt", metadata={"choices": MODELS})
    """"gpt" (causal language model), "bert" (masked language model, bidirectional), or a kind added
    with largebatch.models.register_model."""
    n_layer: int = 4
    """L: number of transformer blocks."""
    n_embd: int = 256
    """h: hidden size (width of the residual stream)."""
    n_head: int = 4
    """a: attention heads; must divide n_embd unless head_size is set (head size = n_embd // n_head)."""
    n_kv_head: int | None = field(default=None, metadata={"none": "n_head"})
    """Key/value heads; None means n_head (multi-head attention). Fewer, dividing n_head, is grouped-
    query attention (Llama 2 70B, Llama 3, Mistral): each key/value head serves n_head / n_kv_head
    query heads, shrinking the k and v projections and their stored activations by that factor."""
    head_size: int | None = field(default=None, metadata={"none": "n_embd // n_head"})
    """d_h: the size of one attention head (transformers' head_dim); None means n_embd // n_head. Set,
    the query and output projections are n_embd x n_head * head_size and the key and value ones
    n_embd x n_kv_head * head_size, whatever n_embd / n_head is (Qwen3 0.6B: 1024 wide, 16 heads of
    128)."""
    ffn_hidden: int | None = field(default=None, metadata={"none": "4 * n_embd"})
    """f: width of the MLP's inner layer; None means 4 * n_embd (the paper's choice)."""
    seq_len: int = 128
    """s: context length; also the number of learned position embeddings (or rotary table rows)."""
    vocab_size: int = 4096
    """v: vocabulary size (rows of the token embedding and of the output layer). The trainer sizes it
    to the tokenizer while it keeps this built-in default; any other value is kept when it holds
    every token id (padding the embedding, e.g. to a multiple of 64 or of parallel.tp) and refused
    when it is smaller than the tokenizer."""
    dropout: float = 0.0
    """Dropout probability used everywhere dropout sits in the paper's layer: embedding output,
    attention probabilities, attention output and MLP output. 0 disables all of it."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection (GPT-2 and BERT do)."""
    bias: bool = True
    """Biases in the Linear layers and LayerNorms (GPT-2/BERT: True; Cramming, Llama: False)."""
    qkv_bias: bool | None = field(default=None, metadata={"none": "as bias"})
    """Biases on the q, k and v projections alone; None follows ``bias``. Qwen2: true with bias false
    (its other Linear layers and its RMSNorms have none)."""
    qk_norm: bool = False
    """Normalise each query and key head over its d_h values before the rotary positions, with a gain
    of d_h values shared by the heads (Qwen3; Dehghani et al. 2023): the model's
    norm (RMSNorm, or LayerNorm with a bias when bias; k_norm's bias, as a key bias, changes no
    attention weight). Its backward keeps the q and k projections' outputs, (n_head + n_kv_head) * d_h
    values a token, and a statistic per head (docs/papers.md: Llama-style layers)."""
    qk_norm_scope: QkNormScope = "head"
    """What qk_norm normalises over ("projection" needs qk_norm): "head", each query and key head over its
    d_h values with one d_h-wide gain shared by the heads (Qwen3); "projection", the whole query
    projection over its n_head * d_h values and the whole key projection over its n_kv_head * d_h,
    with a gain per value (OLMo 2 and 3; norm="rmsnorm" only). Under tensor parallel a projection's
    values are split by heads over the ranks, so its statistic is summed over them (one all-reduce
    of a value per token each way, for q and for k)."""
    sliding_window: int | None = None
    """W: each position attends to the W latest positions, itself included -- position j is visible from
    i when i - W < j <= i (Child et al. 2019; Beltagy et al. 2020; Mistral 7B: 4096; transformers'
    sliding_window) -- on every layer but full_attention_layers; None: every earlier position. Causal
    kinds only. Information still travels W - 1 positions a layer, so the top of an L-layer stack reads
    about L (W - 1) back. The masked-out scores are still computed (explicit attention and sdpa
    alike, as transformers' eager and sdpa layers do); FLOPs and MFU count only the W columns a query
    reads (docs/models.md: sliding windows). W >= seq_len changes nothing in training."""
    full_attention_layers: tuple[int, ...] = ()
    """With sliding_window: the layers (0-based) that attend to every earlier position anyway -- Qwen2's
    first max_window_layers, or one layer in every few as Gemma 3 and OLMo 3 interleave them (e.g.
    [3, 7, 11] for every fourth of 12). Empty: the window on every layer."""
    attention: Attention = "explicit"
    """"explicit": Q K^T, softmax, dropout, then V as separate ops -- the layout whose stored
    activations docs/papers.md: memory counts (5 a s^2 b bytes per layer). "sdpa":
    torch.nn.functional.scaled_dot_product_attention, which on a fused kernel stores no s^2 term."""
    norm_position: NormPosition = "pre"
    """"pre": x + f(LN(x)) (GPT-2, Cramming). "post": LN(x + f(x)) (original BERT, BERT only; lets the
    BERT here match transformers' BertForMaskedLM exactly). "reordered": x + LN(f(x)), each
    sub-layer's output normalised before the residual add (OLMo 2 and 3, GPT only; Swin V2's
    res-post-norm), with a final norm as pre-LN has. "parallel": x + attn(LN1(x)) + mlp(LN2(x)), the
    attention and the MLP both reading the layer's input (GPT-J, GPT-NeoX and Pythia, PaLM; GPT only),
    with a final norm. The memory model counts the first three the same: two norm inputs a layer, and
    the sub-layers' inputs; the parallel layer keeps its input once for both norms (docs/papers.md:
    memory)."""
    norm_eps: float = 1e-5
    """LayerNorm or RMSNorm epsilon (GPT-2: 1e-5, BERT: 1e-12, Llama: 1e-5 or 1e-6)."""
    norm: Norm = "layernorm"
    """"layernorm" (GPT-2, BERT), or "rmsnorm": x / sqrt(mean(x^2) + eps) times a gain, no mean
    and never a bias (Llama). Its backward keeps its input only, as LayerNorm's, recomputing the
    normalised tensor (transformers' LlamaRMSNorm, written out op by op, keeps an fp32 copy of a
    16-bit input and the normalised tensor besides: docs/memory.md)."""
    position: Position = "learned"
    """"learned": a learned position embedding added to the token embedding (GPT-2, BERT). "rope":
    rotary position embeddings applied to queries and keys in every layer, no position weights
    (Llama; transformers' half-split layout)."""
    rope_theta: float = 10000.0
    """The rotary base: pair i of a head rotates by position * rope_theta^(-2i/head_size) (Llama 1
    and 2: 10000; Llama 3: 500000). Used with position="rope" only."""
    rope_fraction: float = 1.0
    """The share of each head's values the rotation turns (position="rope" only): the first
    r = int(head_size * rope_fraction) of a query's and a key's d_h values are rotated as above, with
    r in place of head_size in the frequencies, and the other d_h - r pass unchanged (GPT-NeoX and
    Pythia: 0.25; transformers' partial_rotary_factor, rotary_pct). r must be even and at least 2."""
    rope_scaling: RopeScaling = "none"
    """How the rotary frequencies are rescaled (position="rope" only), as models extended past the
    context they were first trained on were (a model trained so keeps it at every length: it changes
    every position's angle): "none"; "linear" (every frequency divided by rope_factor: the
    positions interpolated); "llama3" (Llama 3.1 and 3.2: a frequency whose wavelength 2 pi / w is
    longer than rope_original_seq_len / rope_low_freq_factor is divided by rope_factor, one shorter
    than rope_original_seq_len / rope_high_freq_factor is kept, and those between are interpolated
    between the two). model.init_from reads it from a transformers config.json (rope_scaling or
    rope_parameters) and the export writes it back (docs/papers.md: Llama-style layers)."""
    rope_factor: float = ROPE_SCALING_DEFAULTS["rope_factor"]
    """rope_scaling's factor (Llama 3.1: 8, Llama 3.2: 32); read with rope_scaling "linear" or "llama3" only."""
    rope_low_freq_factor: float = ROPE_SCALING_DEFAULTS["rope_low_freq_factor"]
    """rope_scaling="llama3": wavelengths past rope_original_seq_len / this are divided by rope_factor."""
    rope_high_freq_factor: float = ROPE_SCALING_DEFAULTS["rope_high_freq_factor"]
    """rope_scaling="llama3": wavelengths under rope_original_seq_len / this are kept as they are."""
    rope_original_seq_len: int = ROPE_SCALING_DEFAULTS["rope_original_seq_len"]
    """rope_scaling="llama3": the context the model was first trained on (transformers'
    original_max_position_embeddings; Llama 3: 8192)."""
    activation: Activation = "gelu"
    """The MLP's (and BERT head's) activation: "gelu" is the exact erf form (BERT, transformers'
    "gelu"); "gelu_tanh" the tanh approximation GPT-2 was trained with (transformers' "gelu_new").
    Both keep only their input for backward, so the memory model counts them the same. "swiglu"
    (Llama; GPT only): fc2(SiLU(gate(x)) * fc1(x)), a third h x f matrix; Llama's f is about
    8/3 h (set ffn_hidden), which keeps the parameters of the 4 h GeLU MLP."""
    document_mask: bool = False
    """Attention within documents only: a token attends to the tokens of its own document -- which
    starts at a separator_id token and runs to the next -- never to the document before it in the
    same packed sequence (Llama 3 trained so; Megatron-LM's reset_attention_mask). With
    position="learned" the positions restart at 0 at each separator too, so a document inside a
    packed sequence is computed exactly as it would be alone; rotary positions are relative and
    need no restart. Costs one s x s mask per sequence, shared by every layer (docs/models.md)."""
    separator_id: int | None = field(default=None, metadata={"none": "the tokenizer's separator"})
    """The token id that starts each document, for document_mask. None: the trainer takes its
    tokenizer's separator (<|endoftext|>, the token its streams put before every document). Give
    it for token arrays (.npy/.bin) without a tokenizer: the id their writer put between documents
    (GPT-2's <|endoftext|> is 50256)."""
    init_from: str | None = None
    """Start a fresh run from pretrained weights: "hf:PATH", a transformers GPT2LMHeadModel /
    GPT2Model, LlamaForCausalLM, MistralForCausalLM, MinistralForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM, Olmo2ForCausalLM or Olmo3ForCausalLM (their sliding windows too), post-LN
    BertForMaskedLM or RobertaForMaskedLM / XLMRobertaForMaskedLM / CamembertForMaskedLM directory
    (config.json + model.safetensors, pytorch_model.bin, or a sharded checkpoint's index and
    shards). The shape fields above and data.tokenizer_file then come from it
    (largebatch.train.hf_import); a resumed run loads its checkpoint instead."""
    hf_model_type: HfModelType | None = None
    """The transformers model_type `largebatch export --format hf` writes (None: for GPT "llama"
    when norm="rmsnorm", position="rope" and activation="swiglu" (LlamaForCausalLM), "mistral" for
    that layout without biases and with a sliding window on every layer, "ministral" for one on some
    layers, "qwen2" for that layout with biases on q, k and v alone (bias=False, qkv_bias=True),
    "qwen3" for it without biases and with qk_norm, "olmo2" for it without biases, with the reordered
    norms and qk_norm over the projections ("olmo3" with a sliding window), else "gpt2"; "bert" for
    BERT). Set, it is checked before training against the blocks it computes (GPT-2 and BERT:
    LayerNorm, learned positions, GeLU, n_kv_head = n_head, heads of n_embd / n_head, no qk_norm, no
    sliding window; GPT-2 and the Llama family but OLMo: pre-LN; Llama: RMSNorm, rope, SwiGLU, biases on
    every Linear layer or none, no qk_norm, no sliding window; Mistral and Ministral: the same without
    biases, a window on every layer or none (Mistral), on any (Ministral); Qwen2: biases on q, k and v
    alone; Qwen3: no biases, qk_norm over each head; both with windows on any layers; OLMo 2: no
    biases, norm_position "reordered", qk_norm over the projections, no window; OLMo 3: the same with
    windows on any layers);
    unset, a layout neither computes (rope with LayerNorm, ...) trains and its export is refused.
    "roberta" / "xlm-roberta" / "camembert" write a post-LN BERT as that family's *ForMaskedLM:
    positions counted from pad_token_id + 1, no segment embedding, the head under
    lm_head. init_from sets it to its directory's model_type, so a run continued from RoBERTa
    exports as RoBERTa; set it to export another family (or give export --hf-model-type). It
    changes nothing in training, and may differ when a run continues."""

    def __post_init__(self) -> None:
        model_spec(self.kind, key="ModelConfig.kind=")  # a registered kind (largebatch.models.MODELS), named
        check_fields(self, "ModelConfig")  # with register_model, before check_fields' generic message
        for name in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}: must be a positive integer.")
        for name, unset in (("ffn_hidden", "4 * n_embd"), ("n_kv_head", "n_head"), ("head_size", "n_embd // n_head")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ModelConfig.{name}={value!r}: must be a positive integer, or None for {unset}.")
        if self.head_size is None and self.n_embd % self.n_head:
            raise ValueError(f"ModelConfig.n_head={self.n_head} does not divide n_embd={self.n_embd}: "
                             f"choose n_head among the divisors of n_embd (e.g. "
                             f"{_nearest_divisor(self.n_embd, self.n_head)}), or set head_size.")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig.n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: "
                             f"each key/value head serves a whole group of query heads; choose a divisor "
                             f"of n_head (e.g. {_nearest_divisor(self.n_head, self.n_kv_head)}), or none.")
        if self.position == "rope":
            if self.head_dim % 2:
                size = (f"head_size={self.head_size}" if self.head_size is not None
                        else f"head size n_embd / n_head = {self.head_dim}")
                raise ValueError(f"ModelConfig.position='rope' with {size}: rotary embeddings rotate pairs "
                                 "of dimensions, so the head size must be even; change "
                                 + ("head_size." if self.head_size is not None else "n_embd or n_head."))
        self._check_rope_fraction()
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta!r}: must be a finite number > 1 "
                             "(10000 in Llama 1 and 2, 500000 in Llama 3).")
        if self.rope_scaling != "none":
            if self.position != "rope" and self.init_from is None:  # (init_from's directory decides position)
                raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r} with position={self.position!r}: "
                                 "it rescales rotary frequencies; set position='rope', or rope_scaling='none'.")
            read = ("rope_factor",) + (("rope_low_freq_factor", "rope_high_freq_factor")
                                       if self.rope_scaling == "llama3" else ())
            for name in read:
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                           and value > 0):
                    raise ValueError(f"ModelConfig.{name}={value!r}: must be a finite number > 0 (Llama 3.1: "
                                     "rope_factor 8, rope_low_freq_factor 1, rope_high_freq_factor 4).")
            if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
                raise ValueError(f"ModelConfig.rope_high_freq_factor={self.rope_high_freq_factor!r} must exceed "
                                 f"rope_low_freq_factor={self.rope_low_freq_factor!r}: the frequencies between "
                                 "them are interpolated (Llama 3.1: 4 and 1).")
            if self.rope_scaling == "llama3" and (not isinstance(self.rope_original_seq_len, int)
                                                  or isinstance(self.rope_original_seq_len, bool)
                                                  or self.rope_original_seq_len < 1):
                raise ValueError(f"ModelConfig.rope_original_seq_len={self.rope_original_seq_len!r}: must be a "
                                 "positive integer (Llama 3: 8192).")
        if self.activation == "swiglu" and model_spec(self.kind).objective == "masked":
            raise ValueError(f"ModelConfig.activation='swiglu' with kind={self.kind!r}: the gated MLP is for "
                             "causal models here (the masked-LM head has one activation and no gate); use "
                             "'gelu' or 'gelu_tanh'.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout={self.dropout!r}: must be in [0, 1).")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps={self.norm_eps!r}: must be > 0.")
        if self.separator_id is not None:
            if not isinstance(self.separator_id, int) or isinstance(self.separator_id, bool) or self.separator_id < 0:
                raise ValueError(f"ModelConfig.separator_id={self.separator_id!r}: must be a token id (an integer "
                                 ">= 0), or None for the tokenizer's document separator.")
            if not self.document_mask:
                raise ValueError(f"ModelConfig.separator_id={self.separator_id!r} without document_mask: the id "
                                 "is read only to mask attention between documents; set document_mask=True "
                                 "too, or leave separator_id out.")
        self._check_window()
        self._check_norms()
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError(f"ModelConfig.init_from={self.init_from!r}: give hf:PATH (a transformers directory), "
                             "or none to start from random weights")

    def _check_window(self) -> None:
        W, full = self.sliding_window, self.full_attention_layers
        if W is not None:
            if not isinstance(W, int) or isinstance(W, bool) or W < 1:
                raise ValueError(f"ModelConfig.sliding_window={W!r}: must be a positive number of positions (each "
                                 "position attends to that many, itself included), or None for every earlier one.")
            if model_spec(self.kind).objective != "causal":
                raise ValueError(f"ModelConfig.sliding_window={W!r} with kind={self.kind!r}: the window is the "
                                 "causal one (the W latest positions); a bidirectional model attends both ways. "
                                 "Leave sliding_window unset for this kind.")
        if full:
            if W is None:
                raise ValueError(f"ModelConfig.full_attention_layers={list(full)!r} without sliding_window: every "
                                 "layer already attends to every earlier position; set sliding_window, or leave "
                                 "full_attention_layers empty.")
            bad = [i for i in full if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layer]
            if bad:
                raise ValueError(f"ModelConfig.full_attention_layers={list(full)!r}: {bad[0]!r} is not a layer "
                                 f"index; give 0-based indices below n_layer={self.n_layer}.")
            if len(set(full)) != len(full):
                twice = next(i for i in full if full.count(i) > 1)
                raise ValueError(f"ModelConfig.full_attention_layers={list(full)!r} names layer {twice} twice: "
                                 "name each full-attention layer once.")
            if len(full) == self.n_layer:
                raise ValueError(f"ModelConfig.full_attention_layers={list(full)!r} names every one of the "
                                 f"{self.n_layer} layers, so sliding_window={W} applies nowhere: leave "
                                 "sliding_window unset, or list fewer layers.")

    def _check_rope_fraction(self) -> None:
        f = self.rope_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"ModelConfig.rope_fraction={f!r}: must be a number in (0, 1], the share of each "
                             "head's values the rotation turns (1: all of them; GPT-NeoX and Pythia: 0.25).")
        if f != 1 and self.position != "rope" and self.init_from is None:  # (init_from's directory decides)
            raise ValueError(f"ModelConfig.rope_fraction={f!r} with position={self.position!r}: it says how much of "
                             "each head the rotary positions turn; set position='rope', or rope_fraction=1.")
        r = self.rotary_dim
        if self.position == "rope" and f != 1 and (r < 2 or r % 2):
            raise ValueError(f"ModelConfig.rope_fraction={f!r} with head size {self.head_dim}: it rotates "
                             f"int({self.head_dim} x {f!r}) = {r} values, and the rotation turns pairs, so that "
                             "must be even and at least 2; choose a fraction that gives an even count (e.g. "
                             f"{2 * max(1, round(self.head_dim * f / 2)) / self.head_dim:g}).")

    @property
    def rotary_dim(self) -> int:
        """r: the values of each query and key head the rotary positions turn, int(head_dim x
        rope_fraction) (transformers' rotary_ndims); the rest pass unchanged."""
        return int(self.head_dim * self.rope_fraction)

    def _check_norms(self) -> None:
        objective = model_spec(self.kind).objective
        for position, words in (("reordered", "reordered norms (x + LN(f(x)), OLMo 2)"),
                                ("parallel", "parallel layer (x + attn(LN(x)) + mlp(LN(x)), GPT-NeoX)")):
            if self.norm_position == position and objective != "causal":
                raise ValueError(f"ModelConfig.norm_position={position!r} with kind={self.kind!r}: the {words} "
                                 "is built for causal models here; use 'post' (original BERT) or 'pre'.")
        if self.norm_position == "post" and objective == "causal":
            raise ValueError(f"ModelConfig.norm_position='post' with kind={self.kind!r}: a causal model here is "
                             "pre-LN (GPT-2, Llama), reordered (OLMo 2: x + LN(f(x))) or parallel (GPT-NeoX: "
                             "x + attn(LN(x)) + mlp(LN(x))); use 'pre', 'reordered' or 'parallel'.")
        if self.qk_norm_scope == "projection" and not self.qk_norm:
            raise ValueError("ModelConfig.qk_norm_scope='projection' without qk_norm: the scope says what the query "
                             "and key norms normalise over; set qk_norm=True too (OLMo 2), or leave "
                             "qk_norm_scope 'head'.")
        if self.qk_norm_scope == "projection" and self.norm != "rmsnorm":
            raise ValueError(f"ModelConfig.qk_norm_scope='projection' with norm={self.norm!r}: the projection-wide "
                             "query and key norm is an RMSNorm (OLMo 2); set norm='rmsnorm', or "
                             "qk_norm_scope='head' (each head over its values).")

    @property
    def qk_norm_layout(self) -> str:
        """How queries and keys are normalised: "none", "head" (each head, Qwen3) or "projection"
        (the whole projection, OLMo 2)."""
        return self.qk_norm_scope if self.qk_norm else "none"

    @property
    def qk_norm_width(self) -> tuple[int, int]:
        """The widths the query and key norms normalise over (and their gains' lengths): d_h each,
        or the whole projections', n_head * d_h and n_kv_head * d_h ((0, 0) without qk_norm)."""
        if not self.qk_norm:
            return 0, 0
        if self.qk_norm_scope == "head":
            return self.head_dim, self.head_dim
        return self.attention_width, self.kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (0-based): sliding_window, or None (every earlier
        position) for one of full_attention_layers or without a window."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), in layer order."""
        return tuple(self.layer_window(i) for i in range(self.n_layer))

    def windows_at(self, seq_len: int | None = None) -> tuple[int | None, ...]:
        """Each layer's sliding window at context ``seq_len`` (seq_len when None), None where the layer
        attends to every earlier position -- a window of seq_len or more included (the same attention)."""
        s = self.seq_len if seq_len is None else seq_len
        return tuple(None if w is None or w >= s else w for w in self.windows)

    def layer_options(self) -> list[str]:
        """The layer options the model uses besides the GPT-2 layout (LayerNorm, learned positions, exact
        GeLU, a 4 h MLP, biases, tied embeddings), in words ([] for that layout)."""
        scaled = "" if self.rope_scaling == "none" else f", {self.rope_scaling} scaling x{self.rope_factor:g}" + (
            f" from {self.rope_original_seq_len} (bands {self.rope_low_freq_factor:g}-{self.rope_high_freq_factor:g})"
            if self.rope_scaling == "llama3" else "")
        parts = [name for name, on in (("RMSNorm", self.norm == "rmsnorm"),
                                       (f"rope (theta {self.rope_theta:g}{scaled})", self.position == "rope"),
                                       ("SwiGLU", self.activation == "swiglu"),
                                       ("tanh GeLU", self.activation == "gelu_tanh"),
                                       (f"MLP {self.ffn} wide", self.ffn != 4 * self.n_embd),
                                       ("post-LN", self.norm_position == "post"),
                                       ("reordered norms", self.norm_position == "reordered"),
                                       ("attention within documents", self.document_mask)) if on]
        if self.kv_heads != self.n_head:
            parts.append(f"{self.kv_heads} key/value head{'s' if self.kv_heads > 1 else ''} for {self.n_head}")
        if self.attention_width != self.n_embd:
            parts.append(f"heads of {self.head_dim}")
        if self.qk_norm:
            parts.append("q/k norms" if self.qk_norm_layout == "head" else "q/k projection norms")
        if self.window_layout != "none":
            parts.append(self.window_words())
        if self.qkv_biased != self.bias:
            parts.append("biases on q, k, v only" if self.qkv_biased else "no biases on q, k, v")
        elif not self.bias:
            parts.append("no biases")
        if not self.tie_embeddings:
            parts.append("untied output layer")
        return parts

    def layout_words(self) -> str:
        """The model's shape and layers in words, for the run's header and `largebatch train --check`
        ("4 layers x 256 hidden, seq 128, sdpa attention, RMSNorm, rope (theta 10000), SwiGLU")."""
        return ", ".join([f"{self.n_layer} layers x {self.n_embd} hidden", f"seq {self.seq_len}",
                          f"{self.attention} attention", *self.layer_options()])

    def window_words(self) -> str:
        """The windows in words, for logs and reports ("sliding window 32 on 3 of 4 layers"); "" without."""
        if self.window_layout == "none":
            return ""
        where = "" if self.window_layout == "all" else f" on {self.windowed_layers} of {self.n_layer} layers"
        return f"sliding window {self.sliding_window}{where}"

    @property
    def windowed_layers(self) -> int:
        """How many layers have a sliding window."""
        return sum(w is not None for w in self.windows)

    @property
    def window_layout(self) -> str:
        """Which layers have a sliding window: "none", "all" or "some"."""
        sliding = self.windowed_layers
        return "none" if not sliding else "all" if sliding == self.n_layer else "some"

    @property
    def masks_attention(self) -> bool:
        """Whether the layers read a mask beyond the plain causal (or full) one: document_mask, or a
        sliding window on some layer."""
        return self.document_mask or self.window_layout != "none"

    @property
    def head_dim(self) -> int:
        """The size of one attention head actually used: head_size, or n_embd // n_head."""
        return self.n_embd // self.n_head if self.head_size is None else self.head_size

    @property
    def attention_width(self) -> int:
        """n_head * head_dim: the width of Q and of the output projection's input (n_embd unless
        head_size makes it another)."""
        return self.n_head * self.head_dim

    @property
    def qkv_biased(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when that is None."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def biases(self) -> str:
        """Which Linear layers have biases: "all", "none", "qkv" (q, k and v only: Qwen2) or
        "all-but-qkv"."""
        return {(True, True): "all", (False, False): "none", (False, True): "qkv",
                (True, False): "all-but-qkv"}[(self.bias, self.qkv_biased)]

    @property
    def kv_heads(self) -> int:
        """The key/value heads actually used: n_kv_head, or n_head when that is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn(self) -> int:
        """The MLP width actually used: ffn_hidden, or 4 * n_embd when that is None."""
        return 4 * self.n_embd if self.ffn_hidden is None else self.ffn_hidden

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# the types whose attention may have fewer key/value heads than query heads, and heads of any size
GROUPED_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "olmo3")
# the settings giving each "biases" a type computes
# the types whose rotary positions may turn a share of each head only (model.rope_fraction < 1)
PARTIAL_ROPE_TYPES = ("gpt_neox",)
BIAS_SETTINGS = {("all", "none"): "model.qkv_bias=None (biases on every Linear layer, or none)",
                 ("all",): "model.bias=True, model.qkv_bias=None",
                 ("qkv",): "model.bias=False, model.qkv_bias=True",
                 ("none",): "model.bias=False, model.qkv_bias=None"}


def hf_layout_mismatch(cfg: ModelConfig, model_type: str) -> list[str]:
    """The settings of ``cfg`` (as "model.name=value") that transformers' ``model_type`` does not
    compute (HF_TYPE_FIELDS); [] when its blocks are ``cfg``'s."""
    fields = HF_TYPE_FIELDS.get(model_type, {})
    off = [f"model.bias={cfg.bias!r}, model.qkv_bias={cfg.qkv_bias!r}" if name == "biases"
           else _window_settings(cfg) if name == "window_layout"
           else _qk_settings(cfg) if name == "qk_norm_layout"
           else f"model.{name}={getattr(cfg, name)!r}" for name, values in fields.items()
           if getattr(cfg, name) not in values]
    if model_type not in GROUPED_TYPES and cfg.kv_heads != cfg.n_head:  # one h x h matrix each for q, k and v
        off.append(f"model.n_kv_head={cfg.n_kv_head!r}")
    if model_type not in GROUPED_TYPES and cfg.attention_width != cfg.n_embd:  # heads of n_embd / n_head
        off.append(f"model.head_size={cfg.head_size!r}")
    if "qk_norm_layout" not in fields and cfg.qk_norm:
        off.append(_qk_settings(cfg))
    if "window_layout" not in fields and cfg.window_layout != "none":
        off.append(_window_settings(cfg))
    if model_type not in PARTIAL_ROPE_TYPES and cfg.rope_fraction != 1:
        off.append(f"model.rope_fraction={cfg.rope_fraction!r}")
    return off


def _qk_settings(cfg: ModelConfig) -> str:
    """``cfg``'s query/key norm fields, as "model.name=value"."""
    return (f"model.qk_norm=True, model.qk_norm_scope={cfg.qk_norm_scope!r}" if cfg.qk_norm
            else "model.qk_norm=False")


# what makes a layout's query/key norms one of a type's qk_norm_layout values
QK_SETTINGS = {("head",): "model.qk_norm=True, model.qk_norm_scope='head'",
               ("projection",): "model.qk_norm=True, model.qk_norm_scope='projection'"}


def _window_settings(cfg: ModelConfig) -> str:
    """``cfg``'s sliding-window fields, as "model.name=value"."""
    full = f", model.full_attention_layers={list(cfg.full_attention_layers)!r}" if cfg.full_attention_layers else ""
    return f"model.sliding_window={cfg.sliding_window!r}{full}"


# what makes a layout's sliding windows one of a type's window_layout values
WINDOW_SETTINGS = {("none",): "model.sliding_window=None",
                   ("none", "all"): "model.full_attention_layers=[] (the window on every layer) or "
                                    "model.sliding_window=None"}


def _layout_settings(cfg: ModelConfig, model_type: str) -> str:
    """The settings that make ``cfg`` a ``model_type`` layout ("model.norm='rmsnorm', ...")."""
    want = [BIAS_SETTINGS[values] if name == "biases" else WINDOW_SETTINGS[values] if name == "window_layout"
            else QK_SETTINGS[values] if name == "qk_norm_layout"
            else f"model.{name}=" + " or ".join(map(repr, values))
            for name, values in HF_TYPE_FIELDS[model_type].items() if getattr(cfg, name) not in values]
    if model_type not in GROUPED_TYPES and cfg.kv_heads != cfg.n_head:
        want.append("model.n_kv_head=None")
    if model_type not in GROUPED_TYPES and cfg.attention_width != cfg.n_embd:
        want.append("model.head_size=None" if cfg.n_embd % cfg.n_head == 0 else
                    f"model.head_size=None with a model.n_head that divides model.n_embd={cfg.n_embd}")
    if "qk_norm_layout" not in HF_TYPE_FIELDS[model_type] and cfg.qk_norm:
        want.append("model.qk_norm=False")
    if "window_layout" not in HF_TYPE_FIELDS[model_type] and cfg.window_layout != "none":
        want.append(WINDOW_SETTINGS[("none",)])
    if model_type not in PARTIAL_ROPE_TYPES and cfg.rope_fraction != 1:
        want.append("model.rope_fraction=1")
    return ", ".join(want)


def fitting_hf_model_types(cfg: ModelConfig) -> tuple[str, ...]:
    """The transformers model types of ``cfg``'s kind whose blocks compute ``cfg``'s (none for a
    mixed layout, e.g. rope with LayerNorm)."""
    return tuple(t for t in HF_MODEL_TYPES.get(cfg.kind, ()) if not hf_layout_mismatch(cfg, t))


def default_hf_model_type(cfg: ModelConfig) -> str | None:
    """The model_type ``cfg`` exports as: model.hf_model_type; else its kind's first type whose blocks
    are ``cfg``'s (a GPT: "llama" for RMSNorm, rope and SwiGLU, "mistral" for those without biases with
    a sliding window on every layer, "ministral" with one on some, "qwen2" for those with biases on q, k
    and v alone, "qwen3" for those without biases and with qk_norm, "olmo2" / "olmo3" for those with
    the reordered norms and qk_norm over the projections, "gpt2" for LayerNorm, learned
    positions and GeLU), else its kind's first (a mixed
    layout, refused by ``hf_layout_problem``); None for a kind without any."""
    if cfg.hf_model_type is not None:
        return cfg.hf_model_type
    return (fitting_hf_model_types(cfg) or HF_MODEL_TYPES.get(cfg.kind, (None,)))[0]


def hf_layout_problem(cfg: ModelConfig) -> str | None:
    """Why no transformers architecture computes ``cfg``'s blocks (e.g. rope with LayerNorm, learned
    positions with RMSNorm, GeLU with rope), None when one of its kind's types does. The export's
    check where model.hf_model_type is unset: training such a model is fine, exporting it is not."""
    types = HF_MODEL_TYPES.get(cfg.kind, ())
    if not types or fitting_hf_model_types(cfg):
        return None
    families = {}  # one line per distinct layout: BERT's family shares one
    for t in types:
        families.setdefault((tuple(hf_layout_mismatch(cfg, t)), _layout_settings(cfg, t)), []).append(t)
    differs = "; ".join(f"{'/'.join(HF_TYPE_WORDS[t][0] for t in ts)} comput{'e' if len(ts) > 1 else 'es'} "
                        f"{HF_TYPE_WORDS[ts[0]][1]} "
                        f"(train with {_layout_settings(cfg, ts[0])})" for ts in families.values())
    biases = (f", model.bias={cfg.bias!r}, model.qkv_bias={cfg.qkv_bias!r}"
              if any("biases" in HF_TYPE_FIELDS.get(t, {}) and cfg.biases not in HF_TYPE_FIELDS[t]["biases"]
                     for t in types) else "")
    extra = (", " + _qk_settings(cfg) if cfg.qk_norm else "") + (
        f", model.norm_position={cfg.norm_position!r}" if cfg.norm_position != "pre" else "") + (
        f", model.head_size={cfg.head_size!r}" if cfg.attention_width != cfg.n_embd else "") + (
        ", " + _window_settings(cfg) if cfg.window_layout != "none" else "") + (
        f", model.rope_fraction={cfg.rope_fraction!r}" if cfg.rope_fraction != 1 else "")
    return (f"model.norm={cfg.norm!r}, model.position={cfg.position!r}, model.activation={cfg.activation!r}, "
            f"model.n_kv_head={cfg.n_kv_head!r}{biases}{extra}: no transformers architecture computes these {cfg.kind} "
            f"blocks, so the model cannot be exported; {differs}")


def hf_model_type_problem(cfg: ModelConfig, field: str = "model.hf_model_type", fixed: bool = False) -> str | None:
    """What makes ``cfg.hf_model_type`` unexportable (another kind's type, a type whose blocks are
    not the model's -- HF_TYPE_FIELDS: rope with "gpt2", LayerNorm or GeLU with "llama" --, or a
    RoBERTa-family type with the tanh GeLU, which that family's head does not compute), None when it
    is fine. Checked
    once the model is whole (after init_from has set the kind), by the trainer and the export.
    ``field``: how the type was set (the export's ``--hf-model-type``); ``fixed``: the model's other
    fields cannot change (trained weights being exported, or model.init_from's), so only the type's
    own fix is named."""
    if cfg.hf_model_type is None:
        return None
    flag = field.startswith("--")
    value = f"{field} {cfg.hf_model_type!r}" if flag else f"{field}={cfg.hf_model_type!r}"
    unset = f"leave {field} out" if flag else "leave it unset"

    def as_type(name: str) -> str:
        return f"{field} {name}" if flag else f"{field}={name!r}"

    refused = "is refused" if fixed else "would be refused after training"
    types = HF_MODEL_TYPES.get(cfg.kind, ())
    if cfg.hf_model_type not in types:
        types = fitting_hf_model_types(cfg) or types  # (those whose blocks are the model's)
        fix = ((f"one of {', '.join(types)}" if len(types) > 1 else types[0]) + f" (or {unset})"
               if types else f"nothing (no transformers architecture): {unset}")
        return f"{value}: a {cfg.kind!r} model exports as {fix}"
    if off := hf_layout_mismatch(cfg, cfg.hf_model_type):
        fits = fitting_hf_model_types(cfg)
        arch, computes = HF_TYPE_WORDS[cfg.hf_model_type]
        other = f"use {as_type(fits[0])}" if fits else None
        if fixed:  # (trained weights: only the type can change)
            fix = (f"{other}, or {unset}" if other else
                   f"no transformers architecture computes these {cfg.kind} blocks, so the model does not export")
        else:
            fix = f"set {_layout_settings(cfg, cfg.hf_model_type)}" + (f", or {other}" if other else "")
        return (f"{value} with {', '.join(off)}: transformers' {arch} computes {computes}, so the export "
                f"{refused}; {fix}")
    if cfg.kind == "bert" and cfg.norm_position != "post":
        fix = ("only a post-LN BERT (model.norm_position='post') exports" if fixed else
               f"set model.norm_position='post', or {unset}")
        return (f"{value} with model.norm_position={cfg.norm_position!r}: a pre-LN BERT ends in a LayerNorm "
                f"that transformers' masked-LM models have no place for, so the export {refused}; {fix}")
    if cfg.hf_model_type in HF_MODEL_TYPES["bert"][1:] and cfg.activation != "gelu":
        fix = (f"use {as_type('bert')} (its head computes {cfg.activation!r}), or {unset}" if fixed else
               f"use model.activation='gelu', or {as_type('bert')}")
        return (f"{value} with model.activation={cfg.activation!r}: the {cfg.hf_model_type} head computes the "
                f"exact GeLU, so the export would compute other logits; {fix}")
    return None


NEAREST_DIVISOR_STEPS = 100_000


def _nearest_divisor(n: int, near: int) -> int:
    """The divisor of ``n`` nearest ``near`` (the smaller on a tie), searched outward from ``near``
    for at most NEAREST_DIVISOR_STEPS steps each way, else the nearer of 1 and n (both divide n):
    a hint in a refusal, found at once for any width (listing divisors up to sqrt(n) took minutes
    for a fuzzed n_embd near 10^18, and trying every number up to n for one of 10^8)."""
    near = min(max(near, 1), n)  # every divisor lies in [1, n]
    for k in range(NEAREST_DIVISOR_STEPS):
        for d in (near - k, near + k):  # the smaller first: the smaller on a tie
            if 1 <= d <= n and n % d == 0:
                return d
    return 1 if near - 1 <= n - near else n

