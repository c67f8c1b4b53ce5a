"""Parameter groups for the layer-wise optimizers: who gets weight decay, who gets a trust ratio.

Every parameter falls in one category, decided by its module type and tensor rank:

* ``norm``       -- any parameter of a normalisation module (LayerNorm, RMSNorm, BatchNorm, GroupNorm,
                    or a class whose name ends in "Norm", e.g. transformers' LlamaRMSNorm);
* ``embedding``  -- the table of an nn.Embedding / nn.EmbeddingBag;
* ``weight``     -- any other parameter of rank >= 2 (Linear, Conv, attention projections);
* ``bias``       -- any other parameter of rank <= 1 (biases, scales, gates).

Decay and adaptation are chosen separately per category. The defaults follow the LAMB authors'
BERT recipe (You et al. 2019, §4; their reference code excludes LayerNorm and bias from both weight
decay and layer adaptation): decay and adapt ``weight`` and ``embedding``; neither for ``bias`` and
``norm``. A tied tensor (e.g. GPT-2's wte / lm_head) is optimized once, classified by the first
module that owns it; the report lists its aliases.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

CATEGORIES = ("weight", "embedding", "bias", "norm")
ADAPT_DEFAULT = ("weight", "embedding")  # the LAMB authors' BERT recipe: no ratio for biases and norms
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm,
               *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def categorize(module: nn.Module, tensor_rank: int) -> str:
    """The category of a parameter directly owned by ``module``."""
    if isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm"):
        return "norm"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    return "weight" if tensor_rank >= 2 else "bias"


class ParamGroups(list):
    """A list of torch.optim parameter-group dicts (keys: params, names, weight_decay, adapt) that also
    prints which parameter got what: ``print(groups.report())``."""

    def __init__(self, groups: list[dict], rows: list[tuple[str, str, tuple, list[str]]], frozen: list[str]):
        super().__init__(groups)
        self._rows = {name: (category, shape, aliases) for name, category, shape, aliases in rows}
        self._frozen = frozen

    def report(self) -> str:
        n_tensors = sum(len(g["params"]) for g in self)
        n_elements = sum(p.numel() for g in self for p in g["params"])
        n_tied = sum(1 for _, _, aliases in self._rows.values() if aliases)
        lines = [f"param_groups: {len(self)} groups, {n_tensors} tensors, {n_elements:,} parameters "
                 f"({n_tied} tied tensors counted once, {len(self._frozen)} frozen skipped)"]
        for index, group in enumerate(self):
            size = sum(p.numel() for p in group["params"])
            lines.append(f"group {index}: weight_decay={group['weight_decay']} adapt={group['adapt']} "
                         f"-- {len(group['params'])} tensors, {size:,} parameters")
            for name in group["names"]:
                category, shape, aliases = self._rows[name]
                tied = f"  (tied: {', '.join(aliases)})" if aliases else ""
                lines.append(f"    {category:<9} {name} {tuple(shape)}{tied}")
        for name in self._frozen:
            lines.append(f"frozen (requires_grad=False, not optimized): {name}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def param_groups(model: nn.Module, weight_decay: float = 0.01, *, decay: tuple[str, ...] = ("weight", "embedding"),
                 adapt: tuple[str, ...] = ADAPT_DEFAULT) -> ParamGroups:
    """Group ``model``'s trainable parameters by (weight decay, adapt); see the module docstring.

    ``decay``: categories that get ``weight_decay`` (others 0.0). ``adapt``: categories whose step is
    scaled by a trust ratio (others take the plain step). Categories: weight, embedding, bias, norm.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: param_groups needs the nn.Module (each parameter's "
                        "category, weight / embedding / bias / norm, is read from the module that holds it); "
                        "pass the model, not model.parameters()")
    decay_value = weight_decay.item() if isinstance(weight_decay, torch.Tensor) and weight_decay.dim() == 0 \
        else weight_decay  # a 0-d tensor or numpy scalar, as the optimizers take it
    if isinstance(decay_value, bool) or not isinstance(decay_value, numbers.Real) or not decay_value >= 0:
        raise ValueError(f"weight_decay={weight_decay!r}: must be a number >= 0")
    weight_decay = float(decay_value)
    for arg_name, chosen in (("decay", decay), ("adapt", adapt)):
        unknown = [c for c in chosen if c not in CATEGORIES]
        if isinstance(chosen, str) or unknown:
            raise ValueError(f"{arg_name}={chosen!r}: expected a tuple of categories from {CATEGORIES}")
    first_name: dict[int, str] = {}
    rows: dict[str, list] = {}  # name -> [category, shape, aliases, param]
    frozen: list[str] = []
    for module_name, module in model.named_modules():
        for short_name, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{short_name}" if module_name else short_name
            if id(p) in first_name:  # a tied alias: listed with its first owner (not at all if frozen)
                if first_name[id(p)] in rows:
                    rows[first_name[id(p)]][2].append(name)
                continue
            first_name[id(p)] = name
            if not p.requires_grad:
                frozen.append(name)
                continue
            rows[name] = [categorize(module, p.dim()), tuple(p.shape), [], p]
    buckets: dict[tuple[float, bool], dict] = {}
    for name, (category, _, _, p) in rows.items():
        key = (float(weight_decay) if category in decay else 0.0, category in adapt)
        group = buckets.setdefault(key, {"params": [], "names": [], "weight_decay": key[0], "adapt": key[1]})
        group["params"].append(p)
        group["names"].append(name)
    ordered = sorted(buckets.values(), key=lambda g: (-g["weight_decay"], not g["adapt"]))
    return ParamGroups(ordered, [(n, c, s, a) for n, (c, s, a, _) in rows.items()], frozen)
