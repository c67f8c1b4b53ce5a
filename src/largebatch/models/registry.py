"""Model kinds by name: what the rest of the library asks of a kind, declared once where it is built.

    register_model("gpt", build=GPT, objective="causal", help="...", head_flops=...,
                   output_activations=..., stage_parameters=..., tp_plan=..., pipeline_first=...,
                   pipeline_last=...)

``model.kind`` takes any registered name (``MODELS``; ``--help-config`` lists them with their help
line). GPT and BERT are declared in ``models/kinds.py`` (without torch: their ``build`` imports
``models/gpt.py`` / ``models/bert.py`` on first use), which this module imports; a module that
registers another kind must be imported before the config is loaded. The consumers look a kind up
with :func:`model_spec` instead of testing its name:

* ``objective`` -- "causal" (next-token targets, causal attention) or "masked" (masked-LM targets,
  bidirectional attention, the logits of the predicted positions only): the data pipeline, the
  attention mask and the evaluation's accuracy read it;
* FLOPs per token (``largebatch.models.flops``): the shared per-layer formula (or ``layer_flops``)
  plus ``head_flops``, the forward matmul FLOPs per input token of what runs after the blocks;
* activation memory (``largebatch.memory``, Korthikanti et al. 2022 §4): the shared per-layer count,
  with ``layer_replicated`` h-wide values per token outside the tensor-parallel regions (4 for the
  sequential block: two LayerNorm inputs, the Q/K/V input, the fc1 input), plus what the first
  stage's modules keep besides the embedding dropout mask (``embedding_activations``) and what the
  output layer keeps (``output_activations``);
* parameters of a pipeline stage (``largebatch.memory.estimate.stage_parameters``): ``layer_norms``
  LayerNorms per block, and ``stage_parameters(config, tp, first, last)`` for the modules before
  and after the blocks;
* tensor parallel: ``tp_plan(model)`` -> {module name: role}, module names relative to the model
  with ``blocks.*.`` for every block; ``largebatch.parallel.tensor_parallel`` turns each role into
  torch's ``ParallelStyle`` (see :data:`TP_ROLES`), so this layer needs no torch.distributed;
* pipeline parallel: the modules the first stage runs before the blocks (``pipeline_first``, run by
  the model's ``embed_input``) and those the last runs after them (``pipeline_last``, run by its
  ``output_logits``); the blocks are ``model.blocks``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from largebatch.typed_config import check_registration

if TYPE_CHECKING:
    import torch.nn as nn

    from largebatch.models.config import ModelConfig

Objective = Literal["causal", "masked"]
OBJECTIVES = get_args(Objective)

TP_ROLES = {
    "vocab_embedding": "the token embedding, split over the vocabulary (partial lookups all-reduced)",
    "sequence_start": "where the residual stream starts: split along the sequence (sequence parallel only)",
    "enter": "a sub-layer's input: all-gathered from the sequence-parallel region once for its linears",
    "colwise": "a linear split by output columns (q, k, v, fc1)",
    "rowwise": "a linear split by input rows, its output back to the residual stream's layout",
    "norm": "a LayerNorm in the residual stream: split along the sequence (sequence parallel only)",
    "gather": "a module run on the whole sequence: its sequence-split input all-gathered (sequence parallel only)",
    "head_norm": "a norm over each attention head's values (qk_norm): run on the rank's own heads, its gain "
                 "replicated and its gradient summed over the ranks",
    "projection_norm": "an RMSNorm over a whole column-parallel projection (qk_norm_scope='projection'): its gain "
                       "split as the projection is, its mean of squares summed over the ranks",
    "output": "the output projection reading the residual stream: split over the vocabulary",
    "output_whole": "the output projection reading a whole-sequence tensor: split over the vocabulary",
}
"""What a tensor-parallel plan may say of a module (the roles of Megatron's layout, Korthikanti et al.
2022 §2-§4); modules no role names run whole on every rank."""


def _no_bytes(config: ModelConfig, dtype_bytes: float) -> float:
    return 0.0


@dataclass(frozen=True)
class ModelSpec:
    """A model kind, declared by :func:`register_model`."""

    name: str
    build: Callable[[ModelConfig], nn.Module]
    """config -> the model: ``forward(idx, targets, reduction)`` -> (logits, loss), ``blocks``,
    ``embed_input`` and ``output_logits`` (pipeline stages), ``hidden_states``; a causal kind's model
    also ``generate`` (the run's sample)."""
    objective: Objective
    help: str
    """One line for --help-config."""
    head_flops: Callable[[ModelConfig, float], float]
    """(config, mask_fraction) -> forward matmul FLOPs per input token after the blocks."""
    output_activations: Callable[[ModelConfig, float, int, int, float], float]
    """(config, dtype_bytes, tp, sequence-parallel divisor, mask_fraction) -> bytes per token the
    modules after the blocks keep for backward (on the last pipeline stage)."""
    stage_parameters: Callable[[ModelConfig, int, bool, bool], float]
    """(config, tp, first, last) -> parameters per device of the modules outside the blocks and the
    two embeddings on a stage that is first and/or last (norms, heads, an untied output layer)."""
    tp_plan: Callable[[nn.Module], dict[str, str]]
    """model -> {module name: role of TP_ROLES}; ``blocks.*.`` names every block's modules."""
    pipeline_first: tuple[str, ...]
    pipeline_last: tuple[str, ...]
    embedding_activations: Callable[[ModelConfig, float], float] = _no_bytes
    """(config, dtype_bytes) -> bytes per token the first stage's modules keep besides the
    embedding dropout mask (split by t under sequence parallel)."""
    layer_flops: Callable[[ModelConfig, int], tuple[float, float]] | None = None
    """(config, seq_len) -> forward (dense, core-attention) FLOPs per token of one block; None: the
    shared formula of largebatch.models.flops."""
    layer_replicated: int = 4
    """h-wide activation values per token a block keeps outside the tensor-parallel regions."""
    layer_norms: int = 2
    """LayerNorms per block."""


MODELS: dict[str, ModelSpec] = {}
"""Every model kind ``model.kind`` accepts, by name (add one with :func:`register_model`)."""


def register_model(name: str, *, build: Callable[[ModelConfig], nn.Module], objective: Objective,
                   help: str, **fields) -> ModelSpec:
    """Declare ``model.kind = name`` (replacing one of that name); ``fields`` are the other fields
    of :class:`ModelSpec`."""
    check_registration("register_model", name, MODELS, {"build": build}, {"help": help})
    if objective not in OBJECTIVES:
        raise ValueError(f"register_model({name!r}): objective={objective!r} must be one of "
                         f"{', '.join(OBJECTIVES)}")
    unknown = sorted(set(fields) - set(ModelSpec.__dataclass_fields__))
    if unknown:
        raise ValueError(f"register_model({name!r}): unknown field(s) {', '.join(unknown)}")
    MODELS[name] = ModelSpec(name, build, objective, help, **fields)
    return MODELS[name]


def model_spec(kind: str, key: str = "model.kind = ") -> ModelSpec:
    """The registered kind ``kind``; ValueError naming ``key``, the registered kinds and the fix otherwise."""
    if not isinstance(kind, str) or kind not in MODELS:
        raise ValueError(f"{key}{kind!r}: must be one of {', '.join(map(repr, MODELS))} "
                         "(register another with largebatch.models.register_model, from a module "
                         "imported before the config is loaded)")
    return MODELS[kind]


from largebatch.models import kinds as _kinds  # noqa: E402, F401 -- declares "gpt" and "bert"
