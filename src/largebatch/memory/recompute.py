"""Activation recomputation applied from outside the model: Korthikanti et al. 2022 §4.2 (selective
recomputation) and the usual full-layer checkpointing, per layer (docs/papers.md: memory).

    apply_recompute(model, "selective")                       # every layer
    apply_recompute(model, ["full", "full", "selective", "none"])  # one entry per layer

Policies (what the backward pass keeps; the rest is recomputed during backward):
* none      -- everything (34 s b h + 5 a s^2 b bytes per layer at 16 bits);
* selective -- all but the core attention (Q K^T, softmax, dropout, @V): its inputs q, k, v are
  kept and the s^2 tensors recomputed (34 s b h);
* op        -- the outputs of matmuls (mm / addmm / bmm / fused attention) via a selective
  checkpoint context; pointwise ops (LayerNorm, GeLU, softmax, dropout) are recomputed;
* full      -- only each layer's input (2 s b h).

Built on torch.utils.checkpoint (non-reentrant, RNG state preserved: with dropout on, gradients are
bit-identical to no recomputation) and create_selective_checkpoint_contexts. Wrapping sets the
module's instance `forward` to a picklable functools.partial, so parameter names, state_dict keys
and tensor-parallel plans that address `blocks.N.attn.q` are unchanged. Works on largebatch's
GPT/BERT and on transformers' GPT-2 / BERT layers (selective there goes through transformers'
AttentionInterface, and ``"none"`` gives the config its ``_attn_implementation`` back). A
transformers model with its own gradient checkpointing on is refused: it would recompute whole
layers whatever the policy. Apply after tensor parallelism and before torch.compile / FSDP
(torchtitan's order).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from largebatch.models.flops import per_layer_policies
from largebatch.models.layers import Block

_aten = torch.ops.aten
MATMUL_OPS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm,
              _aten._scaled_dot_product_flash_attention,
              _aten._scaled_dot_product_efficient_attention,
              _aten._scaled_dot_product_cudnn_attention,
              _aten._scaled_dot_product_flash_attention_for_cpu}
"""Ops whose outputs the "op" policy saves (compared by overload packet)."""


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep matmul outputs, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_context():
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def _without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """transformers layers in train mode may get a KV cache, which recompute would append to again:
    drop it, with a warning, as transformers' own gradient checkpointing does."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return args, kwargs
    dropped = (any(isinstance(a, cache_utils.Cache) for a in (*args, *kwargs.values()))
               or kwargs.get("use_cache") is True)
    if dropped:
        warnings.warn("apply_recompute: a KV cache (use_cache=True) does not go with recomputation in "
                      "training mode; it is dropped for this layer (pass use_cache=False, or call "
                      "model.eval() to generate)", stacklevel=3)
    args = tuple(None if isinstance(a, cache_utils.Cache) else a for a in args)
    kwargs = {k: (None if isinstance(v, cache_utils.Cache) else False if k == "use_cache" else v)
              for k, v in kwargs.items()}
    return args, kwargs


def _checkpointed_forward(module: nn.Module, context_fn, *args, **kwargs):
    forward = type(module).forward
    if not (torch.is_grad_enabled() and module.training):  # inference or eval (generation with its KV
        return forward(module, *args, **kwargs)  # cache, as transformers' checkpointing): run as is
    args, kwargs = _without_kv_cache(args, kwargs)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(forward, module, *args, use_reentrant=False, **extra, **kwargs)


def _wrap(module: nn.Module, context_fn=None) -> None:
    module.forward = functools.partial(_checkpointed_forward, module, context_fn)
    module._largebatch_recompute = True


def _unwrap(module: nn.Module) -> None:
    for sub in module.modules():
        if sub.__dict__.pop("_largebatch_recompute", False):
            sub.__dict__.pop("forward", None)
        sub.__dict__.pop("_largebatch_selective", None)


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """model.blocks, or else THE nn.ModuleList of same-type modules that no other such list holds
    (transformers: transformer.h for GPT-2, bert.encoder.layer for BERT, model.layers for Llama);
    lists inside one of its layers (a mixture of experts' experts) do not count. Several such lists
    (an encoder and a decoder, layers in an nn.Sequential each holding a list) are refused, naming
    them: picking one silently left the others unrecomputed."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    names = {id(m): name for name, m in model.named_modules()}
    lists = [m for m in model.modules()
             if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no `blocks` and no nn.ModuleList of layers: "
                         "pass a model whose transformer layers sit in an nn.ModuleList.")
    inner = {id(sub) for m in lists for layer in m for sub in layer.modules()}
    top = [m for m in lists if id(m) not in inner]
    if len(top) > 1:
        found = ", ".join(f"{names[id(m)]} ({len(m)} x {type(m[0]).__name__})" for m in top)
        raise ValueError(f"{type(model).__name__} holds several lists of layers ({found}): it is not clear "
                         "which to recompute; call apply_recompute on the module that holds the layers "
                         f"(e.g. model.{names[id(top[0])].rsplit('.', 1)[0] or names[id(top[0])]}), once per "
                         "such module")
    return top[0]


def _hf_checkpointing_on(model: nn.Module) -> bool:
    """transformers' own gradient checkpointing (``model.is_gradient_checkpointing``, read without
    the deprecated property): a layer whose ``gradient_checkpointing`` flag is set."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def apply_recompute(model: nn.Module, policy: str | Sequence[str]) -> list[str]:
    """Set each transformer layer's recomputation policy; returns the per-layer list applied.

    policy: "none" | "selective" | "op" | "full", or one of those per layer. Calling it again
    replaces the previous policy, and "none" restores everything an earlier call changed (wrapped
    forwards, and a transformers config's ``_attn_implementation``).

    A transformers model with its own gradient checkpointing on is refused for any policy but
    "none": that recomputes every whole layer on top of the policy, so "selective" would silently
    be full recomputation. Turn it off first (``model.gradient_checkpointing_disable()``) and leave
    ``TrainingArguments(gradient_checkpointing=...)`` False.
    """
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module  # (the wrapper's forward calls the module's; a config sits on the module)
    layers = transformer_layers(model)
    policies = per_layer_policies(policy, len(layers))
    if any(name != "none" for name in policies) and _hf_checkpointing_on(model):
        fix = "activation_checkpointing_disable"  # transformers >= 5.23; the old name before
        fix = fix if hasattr(model, fix) else "gradient_checkpointing_disable"
        raise ValueError(
            f"apply_recompute(model, {policy!r}): the model has transformers' gradient "
            "checkpointing on, which recomputes whole layers on top of any policy; call "
            f"model.{fix}() first (and keep TrainingArguments.gradient_checkpointing=False)")
    for layer, name in zip(layers, policies):  # everything checked before any layer changes
        if name == "selective" and layer is not None and not isinstance(layer, Block):
            _check_foreign_attention(model, layer)
    for layer, name in zip(layers, policies):
        if layer is None:  # a block another pipeline stage holds
            continue
        _unwrap(layer)
        if name == "full":
            _wrap(layer)
        elif name == "op":
            _wrap(layer, save_matmuls_context)
        elif name == "selective" and isinstance(layer, Block):
            _wrap(layer.attn.core)
        elif name == "selective":
            _select_foreign_attention(model, layer)
    if not any(getattr(m, "_largebatch_selective", False) for m in model.modules()):
        _restore_foreign_attention(model)
    return policies


# --- selective recomputation inside transformers' layers ------------------------------------------
# Their core attention is a function looked up by config._attn_implementation, not a submodule. We
# register a wrapper implementation that checkpoints the original function for the attention
# modules marked _largebatch_selective and calls it straight through for all others.

_HF_PREFIX = "largebatch_selective_"


def _hf_core_attention(base: str, module: nn.Module, *args, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":  # each model file defines its own eager_attention_forward
        core = sys.modules[type(module).__module__].eager_attention_forward
    else:
        core = ALL_ATTENTION_FUNCTIONS[base]
    if getattr(module, "_largebatch_selective", False) and torch.is_grad_enabled() and module.training:
        return checkpoint(core, module, *args, use_reentrant=False, **kwargs)
    return core(module, *args, **kwargs)


def _check_foreign_attention(model: nn.Module, layer: nn.Module) -> str:
    """The transformers attention implementation that selective recompute wraps (ValueError where it
    cannot)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is None:
        raise ValueError(f"selective recompute needs a core-attention region: {type(layer).__name__} "
                         "is neither a largebatch Block nor a transformers layer; use 'full' or 'op'.")
    if not current.startswith(_HF_PREFIX) and current not in ("eager", "sdpa"):
        raise ValueError(f"selective recompute supports transformers attn_implementation 'eager' "
                         f"or 'sdpa', not {current!r}: load the model with one of those.")
    return current


def _select_foreign_attention(model: nn.Module, layer: nn.Module) -> None:
    current = _check_foreign_attention(model, layer)
    if not current.startswith(_HF_PREFIX):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        name = _HF_PREFIX + current
        AttentionInterface.register(name, functools.partial(_hf_core_attention, current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
        for sub in model.modules():  # the config object is shared, sub-configs may not be
            sub_config = getattr(sub, "config", None)
            if getattr(sub_config, "_attn_implementation", None) == current:
                sub_config._attn_implementation = name
    for sub in layer.modules():
        sub._largebatch_selective = True


def _restore_foreign_attention(model: nn.Module) -> None:
    """Give every transformers config back the attention implementation it had before selective
    recomputation registered its wrapper (the wrapper's name is the prefix + the original)."""
    for sub in model.modules():
        config = getattr(sub, "config", None)
        current = getattr(config, "_attn_implementation", None)
        if isinstance(current, str) and current.startswith(_HF_PREFIX):
            config._attn_implementation = current[len(_HF_PREFIX):]
