"""``model.init_from = "hf:PATH"``: continued pretraining from a transformers directory.

    largebatch train my.toml --model.init_from=hf:path/to/gpt2      # config.json + weights

The reverse of ``largebatch export --format hf`` (largebatch.integrations.hf_export), the same
renaming and reshapes run backwards:

* GPT2LMHeadModel / GPT2Model (``model_type="gpt2"``) -> GPT: ``c_attn`` (a Conv1D, weight (in,
  out)) is cut into q, k, v and every Conv1D transposed. Tied or not (``tie_word_embeddings``;
  a stored output projection that differs from the embedding loads untied, as transformers loads
  it); GPT2Model has no ``lm_head`` and needs the tie. ``activation_function`` "gelu" -> exact GeLU,
  "gelu_new" / "gelu_pytorch_tanh" -> ``model.activation="gelu_tanh"`` (the same tanh formula).
* BertForMaskedLM (``model_type="bert"``) -> post-LN BERT. BERT's segment embedding has no place
  here: its row 0 (the segment every sequence gets without ``token_type_ids``) is added to the
  position embedding, which computes exactly what transformers computes for segment 0.
* RobertaForMaskedLM / XLMRobertaForMaskedLM / CamembertForMaskedLM (``model_type="roberta"`` /
  ``"xlm-roberta"`` / ``"camembert"``; Liu et al. 2019) -> post-LN BERT too: the same blocks, the
  head under ``lm_head``. RoBERTa counts positions from ``pad_token_id + 1`` (a sequence without
  padding takes rows pad+1, pad+2, ...), so the model's context is ``max_position_embeddings -
  pad_token_id - 1`` (512 of roberta-base's 514 rows) and those rows, in order, are the positions;
  the rows before them are never used. largebatch's samples carry no padding, so every position is
  the one RoBERTa computes.
* LlamaForCausalLM / LlamaModel (``model_type="llama"``; Touvron et al. 2023) -> the Llama-style GPT
  (model.norm="rmsnorm", position="rope", activation="swiglu"): a renaming, no reshape --
  ``embed_tokens`` -> tok_emb, ``q/k/v/o_proj`` -> attn.q/k/v/proj, ``gate_proj`` -> mlp.gate,
  ``up_proj`` -> mlp.fc1, ``down_proj`` -> mlp.fc2, ``input_layernorm`` / ``post_attention_layernorm``
  -> ln1 / ln2, ``norm`` -> ln_f. ``num_key_value_heads`` -> model.n_kv_head (grouped-query attention),
  ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (5) -> model.rope_theta,
  ``rms_norm_eps`` -> model.norm_eps, ``attention_bias`` (= ``mlp_bias``) -> model.bias,
  ``max_position_embeddings`` -> model.seq_len, a "linear" or "llama3" rope scaling (Llama 3.1 and 3.2;
  ``rope_scaling`` or ``rope_parameters``) -> model.rope_scaling and its factors. Refused, naming the
  field: another rope scaling (dynamic, YaRN, longrope), ``attention_bias`` != ``mlp_bias``, a
  ``hidden_act`` other than "silu"; a ``head_dim`` other than hidden_size / num_attention_heads
  is model.head_size.
  MistralForCausalLM (``"mistral"``; Jiang et al. 2023) is the same network without biases, every
  layer attending within its ``sliding_window`` (4096 where config.json has none; null: no window):
  model.sliding_window; MinistralForCausalLM (``"ministral"``) windows the layers its ``layer_types``
  name "sliding_attention" (the others are model.full_attention_layers). Qwen2ForCausalLM (``"qwen2"``; Yang et
  al. 2024) is Llama's network with biases on q_proj, k_proj and v_proj only: model.bias=False,
  model.qkv_bias=True, the same names (the three biases too); with ``use_sliding_window`` its layers
  from ``max_window_layers`` on (or those ``layer_types`` names) attend within ``sliding_window``.
  Each exports back as its own type (largebatch.memory.hf.sliding_windows reads the windows).
  Qwen3ForCausalLM (``"qwen3"``; Yang et al. 2025) is Llama's network without biases and with each
  query and key head normalised (``self_attn.q_norm`` / ``k_norm``, an RMSNorm over the head's
  ``head_dim`` values, 128 where config.json has none, as Qwen3Config): model.qk_norm=True,
  model.head_size = head_dim where it is not hidden_size / num_attention_heads (Qwen3 0.6B: 1024 /
  16 heads of 128); ``attention_bias`` true (biases on q, k, v and o_proj, none in the MLP) is
  refused; sliding windows as Qwen2; it exports back as Qwen3ForCausalLM.
  Olmo2ForCausalLM (``"olmo2"``; OLMo et al. 2024) is Llama's network without biases, each sub-layer's
  output normalised before the residual add and no input norm (model.norm_position="reordered":
  ``post_attention_layernorm`` / ``post_feedforward_layernorm`` -> ln1 / ln2), and the whole q and k
  projections normalised (``self_attn.q_norm`` / ``k_norm`` over n_head x head_dim and n_kv_head x
  head_dim values: model.qk_norm=True, model.qk_norm_scope="projection"); ``attention_bias`` true
  refused as Qwen3's. Olmo3ForCausalLM (``"olmo3"``) adds sliding windows on the layers its
  ``layer_types`` name (without it three of every four, Olmo3Config's default) and a rope table per
  layer type (``rope_parameters``): refused when the windowed and full layers' tables differ (OLMo
  3's long-context YaRN on the full layers), as one rotary embedding serves every layer here.
* BertForPreTraining (the original BERT checkpoints): its pooler and next-sentence head take no part
  in the masked-LM logits and are set aside with a warning, as AutoModelForMaskedLM leaves them.

Two steps, both before any training: ``resolve_init`` (from ``load_config``) reads config.json and
fills the model's shape fields and ``data.tokenizer_file`` (the directory's tokenizer.json), refusing
a field the config sets otherwise; ``check_init`` (preflight, ``--check`` too) reads the weights and
refuses missing, unexpected or misshapen tensors (of one weights file or of every shard a sharded
checkpoint's index names). ``init_from_pretrained`` (the trainer, fresh start
only) loads them into the full model before it is parallelized. Every refusal is one line naming
what and why. transformers itself is not needed: config.json is JSON, the weights safetensors or a
torch pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from largebatch.memory.hf import (
    BERT_LAYOUTS,
    HF_DROPOUTS,
    LLAMA_LAYOUTS,
    OLMO_TYPES,
    ROBERTA_LAYOUTS,
    UNSUPPORTED,
    as_transformers_reads,
    bert_positions,
    llama_fields,
    neox_fields,
    position_offset,
    rope_scaling,
    rope_theta,
)
from largebatch.models.config import ModelConfig, fitting_hf_model_types, hf_layout_mismatch
from largebatch.typed_config import ConfigError

PREFIX = "hf:"
# a whole checkpoint in one file, or the index of one sharded across files (save_pretrained's
# max_shard_size: transformers shards what is larger), in order of preference
# transformers' own order: a directory holding an older pytorch_model.bin beside newer safetensors
# shards (save_pretrained leaves other formats' files) loads the shards
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# the rotary scaling's fields (a Llama-family directory's rope_scaling or rope_parameters)
ROPE_FIELDS = ("rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len")
# fields init_from sets from config.json (the tensors' shapes and the function they compute)
SHAPE_FIELDS = ("kind", "n_layer", "n_embd", "n_head", "n_kv_head", "head_size", "ffn_hidden", "seq_len",
                "vocab_size", "bias", "qkv_bias", "qk_norm", "qk_norm_scope", "sliding_window", "full_attention_layers",
                "tie_embeddings", "norm_eps", "norm_position", "norm", "position", "rope_theta", "rope_fraction",
                *ROPE_FIELDS,
                "activation",
                "hf_model_type")
# fields init_from sets that the user may set otherwise: the export's family (hf_model_type)
YOURS_TO_CHOOSE = ("hf_model_type",)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# Llama's relatives, and what in them largebatch's Llama-style blocks do not compute (the other types:
# largebatch.memory.hf's UNSUPPORTED)
IMPORT_UNSUPPORTED = {
    "mixtral": "mixture-of-experts MLPs",
    "gemma": "a GeGLU MLP, RMSNorm gains stored as 1 + w, and an embedding scaled by sqrt(hidden_size)",
}
# buffers transformers builds itself (causal masks, position ids, rotary frequencies, which old Llama
# checkpoints stored): not weights, skipped
BUFFERS = re.compile(r"(^|\.)(h\.\d+\.attn\.(bias|masked_bias)|layers\.\d+\.attention\.(bias|masked_bias)"
                     r"|embeddings\.position_ids|rotary_emb\.inv_freq)$")


def hf_dir(init_from: str) -> Path:
    """The directory of ``model.init_from = "hf:PATH"``; ConfigError naming the fix otherwise."""
    if not init_from.startswith(PREFIX) or not init_from[len(PREFIX):]:
        hint = (f"; did you mean {PREFIX}{init_from}? (the prefix says where the weights come from)"
                if init_from and (Path(init_from).expanduser() / "config.json").is_file() else "")
        raise ConfigError(f"model.init_from={init_from!r}: give hf:PATH, a transformers directory "
                          "(config.json + model.safetensors, pytorch_model.bin or a sharded checkpoint), or "
                          f"none to start from random weights{hint}")
    path = Path(init_from[len(PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.init_from={init_from!r}: {path / 'config.json'} does not exist; "
                          "give a directory written by save_pretrained or `largebatch export`")
    return path


def _raw_config(path: Path) -> dict[str, Any]:
    try:  # (as transformers' AutoConfig reads it: a Mistral with layer_types is a Ministral)
        return as_transformers_reads(json.loads((path / "config.json").read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model.init_from: {path / 'config.json'} is not JSON ({exc}); give a "
                          "transformers config.json") from None


# GPT-NeoX's output layer: "embed_out" as its checkpoints store it (transformers 5 renames it lm_head on loading
# and back on saving), "lm_head" as a state_dict of the loaded model names it
NEOX_OUTPUT = ("embed_out.weight", "lm_head.weight")
# model types whose config classes leave the embeddings untied by default (tie_word_embeddings false)
UNTIED_BY_DEFAULT = (*LLAMA_LAYOUTS, "gpt_neox")
# (input embedding, output projection) as a tied model stores them, with and without the base prefix
TIED_PAIRS = {"gpt2": (("transformer.wte.weight", "wte.weight"), ("lm_head.weight",)),
              "bert": (("bert.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
                       ("cls.predictions.decoder.weight",)),
              "roberta": (("roberta.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
                          ("lm_head.decoder.weight",))}
TIED_PAIRS.update(dict.fromkeys(ROBERTA_LAYOUTS, TIED_PAIRS["roberta"]))
TIED_PAIRS.update(dict.fromkeys(LLAMA_LAYOUTS, (("model.embed_tokens.weight", "embed_tokens.weight"),
                                              ("lm_head.weight",))))
TIED_PAIRS["gpt_neox"] = (("gpt_neox.embed_in.weight", "embed_in.weight"), NEOX_OUTPUT)


def _stored_apart(path: Path, embedding: tuple[str, ...], output: tuple[str, ...]) -> bool:
    """Whether the weights hold both the input embedding and the output projection, with
    different values. transformers then loads them untied, whatever tie_word_embeddings says (with a
    warning), and so does init_from. Reads those two tensors only (lazily: safetensors' safe_open, a
    memory-mapped pickle; of a sharded checkpoint, the shards holding them), once per version of the
    file (a start asks for the model fields more than once)."""
    file = weights_file(path)
    if file is None:
        return False  # (refused, naming the directory, by read_weights)
    stat = file.stat()
    return _pair_differs(str(file), stat.st_mtime_ns, stat.st_size, embedding, output)


@functools.lru_cache(maxsize=8)
def _pair_differs(file: str, mtime_ns: int, size: int, embedding: tuple[str, ...], output: tuple[str, ...]) -> bool:
    """``_stored_apart`` for one version of ``file`` (its mtime and size are the cache key)."""
    try:
        a, b = (_one_tensor(Path(file), names) for names in (embedding, output))
    except Exception:  # noqa: BLE001 -- an unreadable file is refused, naming it, by read_weights
        return False
    apart = a is not None and b is not None and (a.shape != b.shape or not torch.equal(a, b))
    if apart:
        warnings.warn(f"model.init_from: {file} stores {output[0]} apart from {embedding[0]} with different "
                      "values although config.json ties them (tie_word_embeddings); loading them untied "
                      "(model.tie_embeddings = false), as transformers does", stacklevel=4)
    return apart


def _one_tensor(file: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """The first of ``names`` stored in ``file`` (a weights file, or a sharded checkpoint's index:
    the shard that holds it), read alone; None when none is stored."""
    if file.name.endswith(".index.json"):
        where = _shard_map(file)
        name = next((n for n in names if n in where), None)
        return None if name is None else _one_tensor(where[name], (name,))
    if file.name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            return next((f.get_tensor(k) for k in names if k in keys), None)
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return next((state[k] for k in names if k in state), None)


def _shard_map(index: Path) -> dict[str, Path]:
    """Tensor name -> the shard file holding it, from a sharded checkpoint's index (its
    ``weight_map``); ConfigError naming the index when it is not one, or a shard is missing."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {name: index.parent / shard for name, shard in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"model.init_from: {index} is not a sharded checkpoint's index ({type(exc).__name__}: "
                          f"{exc}): save the model again with save_pretrained") from None
    missing = sorted({p.name for p in where.values() if not p.is_file()})
    if missing:
        raise ConfigError(f"model.init_from: {index} names {', '.join(missing[:3])}, which "
                          f"{'does' if len(missing) == 1 else 'do'} not exist in {index.parent}: copy "
                          "every shard of the checkpoint")
    return where


def _need(raw: dict, name: str, where: Path):
    if raw.get(name) is None:
        raise ConfigError(f"model.init_from: {where / 'config.json'} has no {name!r}, which a "
                          f"{raw.get('model_type')} config needs: write it with save_pretrained")
    return raw[name]


def _activation(raw: dict, key: str, default: str, where: Path) -> str:
    act = raw.get(key, default)
    if act not in HF_ACTIVATIONS:
        raise ConfigError(f"model.init_from: {where / 'config.json'} has {key}={act!r}; largebatch "
                          f"computes {', '.join(HF_ACTIVATIONS)} only, so this model cannot continue "
                          "training here")
    return HF_ACTIVATIONS[act]


def _refuse(raw: dict, where: Path, flags: dict[str, Any]) -> None:
    """Settings under which transformers computes something largebatch's blocks do not."""
    for flag, ok in flags.items():
        if raw.get(flag, ok) != ok:
            raise ConfigError(f"model.init_from: {where / 'config.json'} has {flag}={raw[flag]!r}; "
                              f"largebatch's blocks compute {flag}={ok!r} only, so it cannot be mapped")


def model_fields(path: Path) -> dict[str, Any]:
    """The ModelConfig fields of the transformers model in ``path`` (SHAPE_FIELDS)."""
    raw = _raw_config(path)
    model_type = raw.get("model_type")
    if model_type not in HF_LAYOUTS:
        why = (IMPORT_UNSUPPORTED.get(model_type) or
               UNSUPPORTED.get(model_type, "an architecture largebatch has no blocks for"))
        raise ConfigError(f"model.init_from: {path / 'config.json'} is model_type={model_type!r} "
                          f"({why}); init_from maps gpt2 (GPT2LMHeadModel, GPT2Model), llama, mistral, "
                          "ministral, qwen2, qwen3, olmo2 and olmo3 (LlamaForCausalLM, MistralForCausalLM, "
                          "MinistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, "
                          "Olmo3ForCausalLM), gpt_neox (GPTNeoXForCausalLM, Pythia), bert (post-LN "
                          "BertForMaskedLM), roberta, "
                          "xlm-roberta and camembert (RobertaForMaskedLM, XLMRobertaForMaskedLM, "
                          "CamembertForMaskedLM) only")
    # (LlamaConfig's tie_word_embeddings defaults to false, GPT-2's and BERT's to true)
    tied = (bool(raw.get("tie_word_embeddings", model_type not in UNTIED_BY_DEFAULT))
            and not _stored_apart(path, *TIED_PAIRS[model_type]))
    common = {"bias": True, "qkv_bias": None, "tie_embeddings": tied, "vocab_size": _need(raw, "vocab_size", path),
              "hf_model_type": model_type, "norm": "layernorm", "position": "learned", "n_kv_head": None,
              "head_size": None, "qk_norm": False, "qk_norm_scope": "head", "sliding_window": None,
              "full_attention_layers": ()}
    if model_type in LLAMA_LAYOUTS:
        return _llama_fields(raw, path, common)
    if model_type == "gpt_neox":
        def refuse(what: str, why: str) -> ConfigError:
            return ConfigError(f"model.init_from: {path / 'config.json'} has {what}; {why}, so it cannot continue "
                               "training here")

        return {**common, **neox_fields(raw, lambda name: _need(raw, name, path), refuse), "tie_embeddings": tied}
    if model_type == "gpt2":
        _refuse(raw, path, {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                            "add_cross_attention": False})
        h = _need(raw, "n_embd", path)
        return {"kind": "gpt", "n_layer": _need(raw, "n_layer", path), "n_embd": h,
                "n_head": _need(raw, "n_head", path), "ffn_hidden": raw.get("n_inner") or 4 * h,
                "seq_len": _need(raw, "n_positions", path), "norm_position": "pre",
                "norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
                "activation": _activation(raw, "activation_function", "gelu_new", path), **common}
    _refuse(raw, path, {"position_embedding_type": "absolute", "is_decoder": False,
                        "add_cross_attention": False})
    activation = _activation(raw, "hidden_act", "gelu", path)
    if model_type in ROBERTA_LAYOUTS and activation != "gelu":
        raise ConfigError(f"model.init_from: {path / 'config.json'} has hidden_act={raw['hidden_act']!r}; "
                          f"{model_type}'s masked-LM head computes the exact GeLU whatever hidden_act says, "
                          "and largebatch's BERT computes one GeLU in the blocks and the head, so only "
                          "hidden_act='gelu' maps exactly")
    h = _need(raw, "hidden_size", path)
    return {"kind": "bert", "n_layer": _need(raw, "num_hidden_layers", path), "n_embd": h,
            "n_head": _need(raw, "num_attention_heads", path),
            "ffn_hidden": raw.get("intermediate_size") or 4 * h,
            "seq_len": _positions(raw, path), "norm_position": "post",
            "norm_eps": float(raw.get("layer_norm_eps", 1e-12)), "activation": activation, **common}


def _llama_fields(raw: dict, path: Path, common: dict[str, Any]) -> dict[str, Any]:
    """model_fields of a LlamaForCausalLM / MistralForCausalLM config.json (module docstring); every
    setting whose network largebatch's blocks do not compute refused, naming the field (the shapes
    and layer options read by largebatch.memory.hf.llama_fields, which the memory model shares)."""
    where = path / "config.json"

    def refuse(what: str, why: str) -> ConfigError:
        return ConfigError(f"model.init_from: {where} has {what}; {why}, so it cannot continue training here")

    fields = llama_fields(raw, lambda name: _need(raw, name, path), refuse)
    fields = {**fields, "rope_theta": rope_theta(raw, refuse), **rope_scaling(raw, refuse)}
    if raw.get("model_type") == "qwen2":  # biases on q, k and v, none elsewhere (Qwen2Config has no switch)
        return {**common, **fields, "bias": False, "qkv_bias": True, "hf_model_type": "qwen2"}
    if raw.get("model_type") == "qwen3":  # no MLP biases ever; attention_bias would put them on q, k, v and o
        if raw.get("attention_bias", False):
            raise refuse("attention_bias=True", "Qwen3 then has biases on q, k, v and o_proj but none in its MLP, "
                         "and largebatch's model.bias covers the MLP too")
        return {**common, **fields, "bias": False, "hf_model_type": "qwen3"}
    if raw.get("model_type") in OLMO_TYPES:  # no MLP biases ever; attention_bias would put them on q, k, v and o
        if raw.get("attention_bias", False):
            raise refuse("attention_bias=True", f"{raw['model_type']} then has biases on q, k, v and o_proj but "
                         "none in its MLP, and largebatch's model.bias covers the MLP too")
        return {**common, **fields, "bias": False, "hf_model_type": raw["model_type"]}
    if raw.get("model_type") in ("mistral", "ministral"):  # never a bias (their layers have no switch)
        return {**common, **fields, "bias": False, "hf_model_type": raw["model_type"]}
    attention_bias, mlp_bias = bool(raw.get("attention_bias", False)), bool(raw.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise refuse(f"attention_bias={attention_bias} and mlp_bias={mlp_bias}",
                     "largebatch has one model.bias for every Linear layer, so both must be equal")
    return {**common, **fields, "bias": attention_bias, "hf_model_type": "llama"}


def _positions(raw: dict, path: Path) -> int:
    """model.seq_len of a BERT-layout config: max_position_embeddings, less RoBERTa's offset."""
    _need(raw, "max_position_embeddings", path)
    try:
        return bert_positions(raw, f"model.init_from: {path / 'config.json'}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_kind(cfg: ModelConfig) -> None:
    """ConfigError naming a registered model kind that no transformers architecture maps to."""
    if cfg.kind not in HF_KINDS:
        known = ", ".join(f"{k!r} ({', '.join(HF_LAYOUTS[t][2] for t in types)})" for k, types in HF_KINDS.items())
        raise ConfigError(f"model.kind={cfg.kind!r}: model.init_from={cfg.init_from!r} reads transformers "
                          f"weights into {known} only, and {cfg.kind!r} maps to no transformers "
                          "architecture: drop model.init_from, or train one of those kinds")


def resolve_init(cfg, given: set[str]):
    """``cfg`` (a TrainConfig) with the model's shape fields and ``data.tokenizer_file`` taken from
    ``model.init_from``. ``given``: the dotted fields the user's config or command line set; one
    of them that disagrees with config.json is refused, naming both values and the fix."""
    if "model.kind" in given:
        _check_kind(cfg.model)
    path = hf_dir(cfg.model.init_from)
    fields = model_fields(path)
    for name, value in fields.items():
        mine, value = _compared(cfg.model, fields, name)
        if name == "tie_embeddings" and f"model.{name}" in given and value and not mine:
            fields[name] = False  # untied on request (pipeline parallel): the output layer a copy
            continue
        if name in YOURS_TO_CHOOSE and f"model.{name}" in given:
            fields[name] = mine  # (checked against the kind, activation and norms by config.check)
            continue
        if _rotary_context(fields, name) and f"model.{name}" in given:
            fields[name] = mine  # rotary positions: no table of max_position_embeddings rows to fit
            continue
        if name in WINDOW_FIELDS and f"model.{name}" in given:
            fields[name] = mine  # the windows: no weight depends on them (noted by window_note)
            continue
        if f"model.{name}" in given and mine != value:
            shorter = ("; to train shorter sequences, declare [[phases]] with a smaller seq_len in the "
                       "config file" if name == "seq_len" and mine < value else "")
            raise ConfigError(f"model.{name}={mine!r} but {cfg.model.init_from} has {value!r} "
                              f"(config.json): remove model.{name} (init_from sets it) or set it to "
                              f"{value!r}{shorter}")
    if fields["sliding_window"] is None and "model.full_attention_layers" not in given:
        fields["full_attention_layers"] = ()  # (no window given: no layer to exempt from it)
    fields["ffn_hidden"] = None if fields["ffn_hidden"] == 4 * fields["n_embd"] else fields["ffn_hidden"]
    if "model.n_kv_head" in given and fields["n_kv_head"] is None:
        fields["n_kv_head"] = cfg.model.n_kv_head  # (n_head given as n_kv_head: the same attention)
    try:
        model = dataclasses.replace(cfg.model, **fields)
    except ValueError as exc:  # (a value of config.json the model refuses, named as the model's field)
        raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {path / 'config.json'} gives a model "
                          f"largebatch refuses: {exc}") from None
    if ("model.hf_model_type" not in given and {f"model.{n}" for n in WINDOW_FIELDS} & given
            and hf_layout_mismatch(model, model.hf_model_type)):  # another window: the family that has it
        fits = fitting_hf_model_types(model)  # (a Llama with a window: Mistral's; none fits: the export says why)
        model = dataclasses.replace(model, hf_model_type=fits[0] if fits else None)
    if model.position != "rope" and model.rope_scaling != "none":
        raise ConfigError(f"model.rope_scaling={model.rope_scaling!r} but {cfg.model.init_from} has learned "
                          f"positions (model_type={fields.get('hf_model_type')!r}), which no rope scaling "
                          "applies to: remove model.rope_scaling")
    data = dataclasses.replace(cfg.data, tokenizer_file=_tokenizer_file(cfg, path, given, model))
    return dataclasses.replace(cfg, model=model, data=data)


WINDOW_FIELDS = ("sliding_window", "full_attention_layers")
"""The sliding-window fields a run may set otherwise than its init_from directory: no weight depends on
them, so they are the run's to choose (the model then attends otherwise than the checkpoint was trained
to: window_note says so)."""


def window_note(cfg, given: set[str]) -> str | None:
    """A note when the run's sliding windows differ from its init_from directory's (accepted: no
    weight depends on them, but the checkpoint was trained with its own)."""
    if not cfg.model.init_from or not {f"model.{n}" for n in WINDOW_FIELDS} & given:
        return None
    theirs = model_fields(hf_dir(cfg.model.init_from))
    mine = cfg.model
    theirs_windows = ModelConfig(n_layer=mine.n_layer, sliding_window=theirs["sliding_window"],
                                 full_attention_layers=theirs["full_attention_layers"]).windows
    if mine.windows == theirs_windows:
        return None
    return (f"note: model.sliding_window={mine.sliding_window!r}, model.full_attention_layers="
            f"{list(mine.full_attention_layers)!r} (config.json: {theirs['sliding_window']!r}, "
            f"{list(theirs['full_attention_layers'])!r}): the run's layers attend within other windows than "
            f"{cfg.model.init_from} was trained with; leave them out to keep its own")


def _rotary_context(fields: dict[str, Any], name: str) -> bool:
    """Whether ``name`` is the context length, the rotary base or a rope scaling field of a
    directory with rotary positions: no weight has the length's size (max_position_embeddings only
    bounds the rotary tables transformers builds) nor depends on the angles, so a run may train
    shorter or longer sequences from it at another model.rope_theta or scaling -- a context
    extension (noted by ``rope_note``)."""
    return name in ("seq_len", "rope_theta", *ROPE_FIELDS) and fields.get("position") == "rope"


def _compared(model: ModelConfig, fields: dict[str, Any], name: str) -> tuple[Any, Any]:
    """(the run's value, the directory's) of the shape field ``name``, as the network uses them:
    ffn_hidden None is 4 h, n_kv_head None is n_head, head_size None is h / a, qkv_bias None is bias;
    the run's n_kv_head or head_size given as None means the directory's n_head or h / a (not the
    run's own shape's, which the directory's replaces)."""
    if name == "ffn_hidden":
        return model.ffn, fields[name]
    if name in ("head_size", "n_kv_head"):  # (None: the directory's default, h / a or n_head, whatever it is)
        default = fields["n_embd"] // fields["n_head"] if name == "head_size" else fields["n_head"]
        theirs, mine = fields[name] or default, getattr(model, name)
        return (theirs if theirs == default else None) if mine is None else mine, theirs
    if name == "qkv_bias":
        return model.qkv_biased, fields["bias"] if fields[name] is None else fields[name]
    return getattr(model, name), fields[name]


def rope_note(cfg, given: set[str]) -> str | None:
    """A note when a given rotary setting (rope_theta, the rope scaling's fields) differs from the
    init_from directory's: accepted (a context change), but the model then computes other angles
    than the checkpoint was trained with."""
    if not cfg.model.init_from or cfg.model.position != "rope":
        return None
    theirs = model_fields(hf_dir(cfg.model.init_from))
    changed = [f"model.{name}={getattr(cfg.model, name)!r} (config.json: {theirs[name]!r})"
               for name in ("rope_theta", *ROPE_FIELDS) if f"model.{name}" in given and name in theirs
               and getattr(cfg.model, name) != theirs[name]]
    if theirs.get("rope_scaling", "none") == "none":  # (factors the directory does not read change nothing)
        changed = [c for c in changed if c.startswith(("model.rope_theta", "model.rope_scaling"))]
    if not changed:
        return None
    return (f"note: {'; '.join(changed)}: the run rotates queries and keys by other angles than "
            f"{cfg.model.init_from} was trained with (a context change); leave them out to keep its own")


LONG_CONTEXT = 8192
"""A rotary directory's max_position_embeddings past this (Qwen3's 40960, Mistral's 32768) is noted
as the run's sequence length (context_note)."""


def context_note(cfg, given: set[str]) -> str | None:
    """A note when model.seq_len came from a rotary init_from directory's max_position_embeddings and
    is longer than the context its rope scaling says it was first trained on (Llama 3.1 and 3.2: 131072
    against 8192), or than LONG_CONTEXT (Qwen3: 40960): every sequence of the run is that long unless
    --model.seq_len says otherwise (a rotary model takes any length)."""
    model = cfg.model
    if not model.init_from or "model.seq_len" in given or model.position != "rope":
        return None
    first = model.rope_original_seq_len if model.rope_scaling == "llama3" else None
    if model.seq_len <= (LONG_CONTEXT if first is None else first):
        return None
    example = (f"{first}, the context it was first trained on" if first is not None else
               "4096; the model's rotary positions take any length")
    return (f"note: model.seq_len={model.seq_len} is {model.init_from}'s max_position_embeddings (config.json): "
            f"every training sequence is {model.seq_len} tokens; set --model.seq_len (e.g. {example}) to train "
            "shorter ones")


def dropout_note(cfg, given: set[str]) -> str | None:
    """A note when the init_from model's config.json trains with other dropout rates than the run's
    ``model.dropout`` and the user did not set it (a recipe's value is a default): dropout is a
    training setting the run keeps, and an export writes the run's rate."""
    if not cfg.model.init_from or "model.dropout" in given:
        return None
    raw = _raw_config(hf_dir(cfg.model.init_from))
    model_type = raw.get("model_type")
    if model_type in LLAMA_LAYOUTS:  # attention dropout only, 0 by default (Llama, Mistral, Qwen2/3Config)
        rates = {"attention_dropout": float(raw.get("attention_dropout", 0.0))}
    elif model_type == "gpt_neox":  # (0 by default in GPTNeoXConfig)
        rates = {k: float(raw.get(k, 0.0)) for k in HF_DROPOUTS["gpt_neox"]}
    else:  # (0.1 by default in GPT2Config, BertConfig)
        rates = {k: float(raw.get(k, 0.1)) for k in HF_DROPOUTS.get(model_type, ())}
    if all(rate == cfg.model.dropout for rate in rates.values()):
        return None
    theirs = ", ".join(f"{k}={v:g}" for k, v in rates.items())
    keep = f"; set --model.dropout={max(rates.values()):g} to keep the model's" if len(set(rates.values())) == 1 \
        else f"; set --model.dropout to one rate for all ({theirs})"
    return (f"note: {cfg.model.init_from} was trained with {theirs} (config.json); this run trains with "
            f"model.dropout={cfg.model.dropout:g}, and an export writes that rate{keep}")


def _tokenizer_file(cfg, path: Path, given: set[str], model: ModelConfig) -> str:
    """The directory's tokenizer.json, or the user's data.tokenizer_file when it is the same
    vocabulary; every id of the vocabulary must be a row of the embedding (vocab_size entries or
    fewer: an embedding padded past the tokenizer, such as GPT-2's 50257 ids in 50304 rows, keeps
    its rows, and ids past the tokenizer are never inputs nor targets)."""
    from largebatch.data.build import tokenizer_path
    from largebatch.data.corpus import CorpusError

    theirs = path / "tokenizer.json"
    mine = cfg.data.tokenizer_file if "data.tokenizer_file" in given else None
    if not theirs.is_file() and not mine:
        raise ConfigError(f"model.init_from={cfg.model.init_from!r} has no tokenizer.json: set "
                          "data.tokenizer_file to the tokenizer.json the model was trained with "
                          f"(its ids index the embedding){_conversion_hint(path)}")
    try:  # a file, or the tokenizer.json inside a directory
        chosen = tokenizer_path(mine, "data.tokenizer_file") if mine else theirs
    except CorpusError as exc:
        raise ConfigError(f"{exc}{_conversion_hint(Path(mine).expanduser())}") from None
    tokenizer = _read_tokenizer(chosen)
    if mine and theirs.is_file() and chosen.resolve() != theirs.resolve():
        if tokenizer.get_vocab() != _read_tokenizer(theirs).get_vocab():
            raise ConfigError(f"data.tokenizer_file={mine!r} is not the vocabulary of "
                              f"{cfg.model.init_from} ({theirs}): leave data.tokenizer_file out to "
                              "use the model's own")
    from largebatch.data.tokenizer import id_space

    ids = id_space(tokenizer)
    if ids > model.vocab_size:
        raise ConfigError(f"the tokenizer {chosen} has ids up to {ids - 1} but "
                          f"{cfg.model.init_from} has vocab_size={model.vocab_size} embedding rows: give "
                          "data.tokenizer_file with the model's vocabulary (at most vocab_size ids)")
    return str(chosen)


# the vocabulary files transformers' slow tokenizers read, where a directory has no tokenizer.json
VOCABULARY_FILES = ("vocab.json", "merges.txt", "vocab.txt", "sentencepiece.bpe.model", "spiece.model",
                    "tokenizer.model")


def _conversion_hint(path: Path) -> str:
    """For a directory (or a file in one) holding a slow tokenizer's vocabulary files but no
    tokenizer.json: how to write one with transformers, which reads them; "" otherwise."""
    directory = path if path.is_dir() else path.parent
    found = [name for name in VOCABULARY_FILES if (directory / name).is_file()]
    if not found or (directory / "tokenizer.json").is_file():
        return ""
    return (f"; {directory} has {', '.join(found)}, a vocabulary without tokenizer.json: write one with "
            f"python -c \"from transformers import AutoTokenizer; d = {str(directory)!r}; "
            "AutoTokenizer.from_pretrained(d).save_pretrained(d)\"")


def _read_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
        raise ConfigError(f"{path} is not a tokenizer.json ({str(exc).splitlines()[0] if str(exc) else exc!r}): "
                          f"give one saved by HF tokenizers as data.tokenizer_file{_conversion_hint(path)}") from None


def weights_file(path: Path) -> Path | None:
    """The directory's first of WEIGHT_FILES (model.safetensors preferred; a sharded checkpoint's
    index); None without any."""
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The tensors of the directory's model.safetensors (preferred) or pytorch_model.bin, or of
    every shard a sharded checkpoint's index names."""
    file = weights_file(path)
    if file is None:
        raise ConfigError(f"model.init_from: {path} holds no {' or '.join(WEIGHT_FILES)}: save the "
                          "model with save_pretrained")
    if not file.name.endswith(".index.json"):
        return _read_file(file), file
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_shard_map(file).values())):
        state.update(_read_file(shard))
    return state, file


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors or torch pickle file; ConfigError naming it otherwise."""
    try:
        if file.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except ImportError as exc:  # (safetensors is part of the [train] extra)
        package = (exc.name or "safetensors").split(".")[0]
        raise ConfigError(f"model.init_from: reading {file} needs {package!r}, part of the [train] extra: "
                          "pip install 'largebatch[train]'") from None
    except Exception as exc:  # noqa: BLE001 -- safetensors, pickle and zip errors alike
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.init_from: {file} cannot be read ({first}): save the model "
                          "again with save_pretrained") from None


class _Taker:
    """Pops transformers tensors by name, recording missing names and wrong shapes."""

    def __init__(self, state: dict[str, torch.Tensor]):
        # old checkpoints: LayerNorm.gamma / beta; buffers are not weights
        self.left = {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v
                     for k, v in state.items() if not BUFFERS.search(k)}
        self.missing: list[str] = []
        self.misshapen: list[str] = []
        self.unused: list[str] = []  # stored, read by transformers' other heads only: not loaded

    def set_aside(self, name: str) -> None:
        self.left.pop(name)
        self.unused.append(name)

    def has(self, name: str) -> bool:
        return name in self.left

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        if name not in self.left:
            self.missing.append(name)
            return torch.zeros(shape)
        tensor = self.left.pop(name).float()
        if tuple(tensor.shape) != shape:
            self.misshapen.append(f"{name} {tuple(tensor.shape)} (expected {shape})")
            return torch.zeros(shape)
        return tensor


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


def _norm(out: dict, take: _Taker, ours: str, theirs: str, h: int) -> None:
    out[f"{ours}.weight"], out[f"{ours}.bias"] = take(f"{theirs}.weight", h), take(f"{theirs}.bias", h)


def _tied_in(raw: dict, take: _Taker, output: str) -> bool:
    """Whether the directory ties its output layer to the embedding (config.json's
    tie_word_embeddings, by default true, false for the Llama family as in LlamaConfig, and no stored
    output layer of its own): a model loaded untied from it (``model.tie_embeddings = false``, which
    pipeline parallel needs) starts with the output layer a copy of the embedding, so its logits are
    the tied model's. An untied directory without its output layer is missing a tensor (refused)."""
    return bool(raw.get("tie_word_embeddings", raw.get("model_type") not in UNTIED_BY_DEFAULT)) and not take.has(output)


def _output_layer(take: _Taker, cfg: ModelConfig, raw: dict, embedding: torch.Tensor, name: str) -> torch.Tensor:
    """The output projection stored as ``name``: the embedding itself when the model is tied (a stored
    copy shape-checked; one that differs loads untied, model_fields), a copy of it when the directory
    is tied and the model untied on request, else the stored tensor."""
    if cfg.tie_embeddings:
        if take.has(name):
            take(name, cfg.vocab_size, cfg.n_embd)  # the tied copy of the embedding
        return embedding
    if _tied_in(raw, take, name):  # untied on request: the output layer starts as a copy
        return embedding.clone()
    return take(name, cfg.vocab_size, cfg.n_embd)


def _gpt(take: _Taker, cfg: ModelConfig, raw: dict) -> dict[str, torch.Tensor]:
    h, f, v = cfg.n_embd, cfg.ffn, cfg.vocab_size
    out = {"tok_emb.weight": take("wte.weight", v, h), "pos_emb.weight": take("wpe.weight", cfg.seq_len, h),
           "ln_f.weight": take("ln_f.weight", h), "ln_f.bias": take("ln_f.bias", h)}
    out["lm_head.weight"] = _output_layer(take, cfg, raw, out["tok_emb.weight"], "lm_head.weight")
    for i in range(cfg.n_layer):
        o, b = f"h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            _norm(out, take, b + ours, o + theirs, h)
        qkv_w, qkv_b = take(o + "attn.c_attn.weight", h, 3 * h), take(o + "attn.c_attn.bias", 3 * h)
        for j, n in enumerate("qkv"):  # Conv1D (in, out) -> Linear (out, in)
            out[f"{b}attn.{n}.weight"] = qkv_w[:, j * h:(j + 1) * h].t().contiguous()
            out[f"{b}attn.{n}.bias"] = qkv_b[j * h:(j + 1) * h]
        for ours, theirs, n_in, n_out in (("attn.proj", "attn.c_proj", h, h), ("mlp.fc1", "mlp.c_fc", h, f),
                                          ("mlp.fc2", "mlp.c_proj", f, h)):
            out[f"{b}{ours}.weight"] = take(f"{o}{theirs}.weight", n_in, n_out).t().contiguous()
            out[f"{b}{ours}.bias"] = take(f"{o}{theirs}.bias", n_out)
    return out


# transformers' names of a Llama-family layer's two norms (largebatch's ln1, ln2), by model.norm_position:
# pre-LN, the sub-layers' input norms; reordered (OLMo 2 and 3), their output norms
LLAMA_NORMS = {"pre": ("input_layernorm", "post_attention_layernorm"),
               "reordered": ("post_attention_layernorm", "post_feedforward_layernorm")}


def _llama(take: _Taker, cfg: ModelConfig, raw: dict) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's (or MistralForCausalLM's, Qwen2's, Qwen3's) tensors, "model." stripped: nn.Linear
    weights (out, in) as largebatch's, so a renaming (module docstring); q is n_head x head size wide,
    k and v n_kv_head x head size; Qwen3's q_norm and k_norm are head size wide."""
    h, f, v, kv = cfg.n_embd, cfg.ffn, cfg.vocab_size, cfg.kv_heads * cfg.head_dim
    w = cfg.attention_width
    out = {"tok_emb.weight": take("embed_tokens.weight", v, h), "ln_f.weight": take("norm.weight", h)}
    out["lm_head.weight"] = _output_layer(take, cfg, raw, out["tok_emb.weight"], "lm_head.weight")
    norms = LLAMA_NORMS[cfg.norm_position]
    for i in range(cfg.n_layer):
        o, b = f"layers.{i}.", f"blocks.{i}."
        out[b + "ln1.weight"] = take(f"{o}{norms[0]}.weight", h)
        out[b + "ln2.weight"] = take(f"{o}{norms[1]}.weight", h)
        for ours, theirs, n_out, n_in in (
                ("attn.q", "self_attn.q_proj", w, h), ("attn.k", "self_attn.k_proj", kv, h),
                ("attn.v", "self_attn.v_proj", kv, h), ("attn.proj", "self_attn.o_proj", h, w),
                ("mlp.gate", "mlp.gate_proj", f, h), ("mlp.fc1", "mlp.up_proj", f, h),
                ("mlp.fc2", "mlp.down_proj", h, f)):
            out[f"{b}{ours}.weight"] = take(f"{o}{theirs}.weight", n_out, n_in)
            if cfg.qkv_biased if ours in ("attn.q", "attn.k", "attn.v") else cfg.bias:
                out[f"{b}{ours}.bias"] = take(f"{o}{theirs}.bias", n_out)
        for name, width in zip(("q_norm", "k_norm"), cfg.qk_norm_width):  # (each head's, or the projection's)
            if width:
                out[f"{b}attn.{name}.weight"] = take(f"{o}self_attn.{name}.weight", width)
    return out


def _neox(take: _Taker, cfg: ModelConfig, raw: dict) -> dict[str, torch.Tensor]:
    """GPTNeoXForCausalLM's tensors, "gpt_neox." stripped: nn.Linear on both sides, and one fused
    ``query_key_value`` whose 3h output rows run head by head, each head's q, k and v in turn ((heads,
    3, d) rows: transformers views the output so), cut into q, k and v; the output layer is
    ``embed_out`` (``lm_head`` in a loaded model's state_dict)."""
    h, f, v, a, d = cfg.n_embd, cfg.ffn, cfg.vocab_size, cfg.n_head, cfg.head_dim
    out = {"tok_emb.weight": take("embed_in.weight", v, h)}
    _norm(out, take, "ln_f", "final_layer_norm", h)
    output = next((n for n in NEOX_OUTPUT if take.has(n)), NEOX_OUTPUT[0])
    out["lm_head.weight"] = _output_layer(take, cfg, raw, out["tok_emb.weight"], output)
    for i in range(cfg.n_layer):
        o, b = f"layers.{i}.", f"blocks.{i}."
        _norm(out, take, b + "ln1", o + "input_layernorm", h)
        _norm(out, take, b + "ln2", o + "post_attention_layernorm", h)
        qkv_w = take(o + "attention.query_key_value.weight", 3 * h, h).view(a, 3, d, h)
        qkv_b = take(o + "attention.query_key_value.bias", 3 * h).view(a, 3, d)
        for j, n in enumerate("qkv"):
            out[f"{b}attn.{n}.weight"] = qkv_w[:, j].reshape(h, h).contiguous()
            out[f"{b}attn.{n}.bias"] = qkv_b[:, j].reshape(h).contiguous()
        pairs = (("attn.proj", "attention.dense", h, h), ("mlp.fc1", "mlp.dense_h_to_4h", f, h),
                 ("mlp.fc2", "mlp.dense_4h_to_h", h, f))
        for ours, theirs, n_out, n_in in pairs:
            out[f"{b}{ours}.weight"] = take(f"{o}{theirs}.weight", n_out, n_in)
            out[f"{b}{ours}.bias"] = take(f"{o}{theirs}.bias", n_out)
    return out


# the masked-LM head's names: (prefix, dense, LayerNorm), BertForMaskedLM's and RoBERTa's
BERT_HEADS = {"bert": ("cls.predictions.", "transform.dense", "transform.LayerNorm"),
              **dict.fromkeys(ROBERTA_LAYOUTS, ("lm_head.", "dense", "layer_norm"))}


def _bert(take: _Taker, cfg: ModelConfig, raw: dict) -> dict[str, torch.Tensor]:
    h, f, v = cfg.n_embd, cfg.ffn, cfg.vocab_size
    e, (c, dense, norm) = "embeddings.", BERT_HEADS[raw["model_type"]]
    offset = position_offset(raw)  # RoBERTa: positions from pad_token_id + 1
    types = take.left.get(e + "token_type_embeddings.weight", torch.zeros(1, h))
    segment = take(e + "token_type_embeddings.weight", max(1, types.shape[0]), h)
    positions = take(e + "position_embeddings.weight", offset + cfg.seq_len, h)[offset:]
    if segment.shape[0] > 1 and not torch.equal(segment[1:], segment[:1].expand_as(segment[1:])):
        warnings.warn(f"model.init_from={cfg.init_from!r}: its segment (token-type) embedding has "
                      f"{segment.shape[0]} rows; largebatch's BERT has none: row 0, what a sequence without "
                      "token_type_ids gets, is added to the positions and the other rows are dropped "
                      "(an export writes them as zeros, so fine-tuning on sentence pairs learns segment "
                      "B afresh)", stacklevel=2)
    out = {"tok_emb.weight": take(e + "word_embeddings.weight", v, h),
           # segment 0, the one every sequence gets without token_type_ids, folded into positions
           "pos_emb.weight": positions + segment[0],
           "emb_norm.weight": take(e + "LayerNorm.weight", h), "emb_norm.bias": take(e + "LayerNorm.bias", h)}
    for i in range(cfg.n_layer):
        o, b = f"encoder.layer.{i}.", f"blocks.{i}."
        pairs = [(f"attn.{n}", f"attention.self.{t}", h) for n, t in (("q", "query"), ("k", "key"), ("v", "value"))]
        pairs += [("attn.proj", "attention.output.dense", h), ("mlp.fc1", "intermediate.dense", f),
                  ("mlp.fc2", "output.dense", h)]
        for ours, theirs, n_out in pairs:
            n_in = f if ours == "mlp.fc2" else h
            out[f"{b}{ours}.weight"] = take(f"{o}{theirs}.weight", n_out, n_in)
            out[f"{b}{ours}.bias"] = take(f"{o}{theirs}.bias", n_out)
        for ours, theirs in (("ln1", "attention.output.LayerNorm"), ("ln2", "output.LayerNorm")):
            _norm(out, take, b + ours, o + theirs, h)
    out.update({"head.dense.weight": take(f"{c}{dense}.weight", h, h),
                "head.dense.bias": take(f"{c}{dense}.bias", h),
                "head.norm.weight": take(f"{c}{norm}.weight", h),
                "head.norm.bias": take(f"{c}{norm}.bias", h)})
    # the decoder bias may be stored twice: decoder.bias, the one transformers' forward adds (and
    # loads, tied or not, when both are stored: an untied model trained in transformers leaves
    # cls.predictions.bias behind), and cls.predictions.bias, all a tied save may hold
    names = [n for n in (c + "decoder.bias", c + "bias") if take.has(n)] or [c + "decoder.bias"]
    out["head.decoder.bias"] = take(names[0], v)
    for unused in names[1:]:
        take(unused, v)  # (shape-checked, then set aside)
    out["head.decoder.weight"] = _output_layer(take, cfg, raw, out["tok_emb.weight"], c + "decoder.weight")
    # BertForPreTraining's pooler and next-sentence head (the original BERT checkpoints store both):
    # no part of the masked-LM logits, set aside as AutoModelForMaskedLM leaves them
    for name in ("pooler.dense.weight", "pooler.dense.bias", "cls.seq_relationship.weight",
                 "cls.seq_relationship.bias"):
        if take.has(name):
            take.set_aside(name)
    return out


def largebatch_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of ``cfg.init_from`` under largebatch's names; ConfigError (one line) for
    missing, unexpected or misshapen tensors."""
    _check_kind(cfg)
    path = hf_dir(cfg.init_from)
    raw = _raw_config(path)
    if raw.get("model_type") not in HF_LAYOUTS:
        model_fields(path)  # refuses the model type, naming it
    kind_prefix, read, architecture = HF_LAYOUTS[raw["model_type"]]
    state, file = read_weights(path)
    take = _Taker(_strip(state, kind_prefix))
    out = read(take, cfg, raw)
    problems = []
    for what, names in (("missing", take.missing), ("wrong shape", take.misshapen),
                        ("unexpected", sorted(take.left))):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            problems.append(f"{what} {', '.join(names[:3])}{more}")
    if problems:
        raise ConfigError(f"model.init_from={cfg.init_from!r}: {file.name} does not fit the "
                          f"{cfg.kind} its config.json describes: {'; '.join(problems)}; give a "
                          f"directory saved from {architecture}")
    if take.unused:
        warnings.warn(f"model.init_from={cfg.init_from!r}: {', '.join(take.unused)} (the pooler and "
                      "next-sentence head of BertForPreTraining) take no part in a masked LM and are "
                      "not loaded, as transformers' AutoModelForMaskedLM leaves them", stacklevel=2)
    return out


# transformers model_type -> (its state's base-model prefix, the reader, the architecture it reads)
HF_LAYOUTS = {"gpt2": ("transformer.", _gpt, "GPT2LMHeadModel"), "llama": ("model.", _llama, "LlamaForCausalLM"),
              "mistral": ("model.", _llama, "MistralForCausalLM"),
              "ministral": ("model.", _llama, "MinistralForCausalLM"), "qwen2": ("model.", _llama, "Qwen2ForCausalLM"),
              "qwen3": ("model.", _llama, "Qwen3ForCausalLM"), "olmo2": ("model.", _llama, "Olmo2ForCausalLM"),
              "olmo3": ("model.", _llama, "Olmo3ForCausalLM"), "gpt_neox": ("gpt_neox.", _neox, "GPTNeoXForCausalLM"),
              "bert": ("bert.", _bert, "BertForMaskedLM"),
              "roberta": ("roberta.", _bert, "RobertaForMaskedLM"),
              "xlm-roberta": ("roberta.", _bert, "XLMRobertaForMaskedLM"),
              "camembert": ("roberta.", _bert, "CamembertForMaskedLM")}
# model kind -> the model types that load into it
HF_KINDS = {"gpt": ("gpt2", *LLAMA_LAYOUTS, "gpt_neox"), "bert": BERT_LAYOUTS}


def _check_fields(cfg: ModelConfig) -> None:
    """The shape fields of ``cfg`` are those of its init_from directory (a config built in Python,
    not through load_config, may disagree)."""
    fields = model_fields(hf_dir(cfg.init_from))
    for name in fields:
        mine, value = _compared(cfg, fields, name)
        if (name == "tie_embeddings" and value and not mine) or name in YOURS_TO_CHOOSE or name in WINDOW_FIELDS:
            continue  # a tied directory loads untied on request (the output layer a copy); windows: no weight
        if _rotary_context(fields, name):
            continue
        if mine != value:
            raise ConfigError(f"model.{name}={mine!r} but {cfg.init_from} has {value!r} (config.json): "
                              f"remove model.{name} (init_from sets it) or set it to {value!r}")


def check_init(cfg: ModelConfig) -> None:
    """Before training (preflight, ``--check``): the directory maps onto ``cfg``, fields and weights."""
    if cfg.init_from:
        _check_fields(cfg)
        largebatch_state(cfg)


@torch.no_grad()
def init_from_pretrained(model) -> None:
    """Load ``model.config.init_from`` into ``model`` (the full, not yet parallelized model); a
    no-op without it. The trainer calls it on a fresh start only: a resume loads its checkpoint."""
    cfg: ModelConfig = model.config
    if cfg.init_from:
        _check_fields(cfg)
        model.load_state_dict(largebatch_state(cfg), strict=True)
