"""Activation memory: the closed-form model of Korthikanti et al. 2022 (docs/papers.md: memory),
recomputation policies applied from outside the model, a measurement helper and the planner.

    from largebatch.memory import apply_recompute, activation_bytes_per_layer, estimate
    apply_recompute(model, ["full", "full", "selective", "selective"])
    activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True, recompute="selective")
    estimate(preset("gpt3-175b"), micro_batch=1, tp=8, pp=16, sequence_parallel=True)
    estimate(config_from_hf("path/to/gpt2-medium/config.json"), micro_batch=4)

Nothing here imports largebatch.train: it drops into any PyTorch loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from largebatch.memory.activations import (
    activation_bytes_per_layer,
    backward_working_bytes,
    config_layer_kwargs,
    first_stage_layers,
    model_activation_bytes,
    stage_activation_bytes,
)
from largebatch.memory.estimate import OPTIMIZER_STATE_BYTES, MemoryEstimate, estimate
from largebatch.memory.hf import config_from_hf, hf_eager_bytes_per_layer, hf_eager_layer_bytes
from largebatch.memory.pipeline_schedule import schedule_activation_bytes, walk
from largebatch.memory.planner import Setup, cheapest_plan, micro_batch_sweep

__all__ = ["OPTIMIZER_STATE_BYTES", "MemoryEstimate", "Setup", "activation_bytes_per_layer", "apply_recompute",
           "backward_working_bytes", "cheapest_plan", "config_from_hf", "config_layer_kwargs", "estimate",
           "first_stage_layers", "hf_eager_bytes_per_layer", "hf_eager_layer_bytes", "measure_forward_bytes",
           "measure_peak_bytes", "micro_batch_sweep", "model_activation_bytes", "schedule_activation_bytes",
           "stage_activation_bytes", "transformer_layers", "walk"]


if TYPE_CHECKING:  # what __getattr__ serves, for type checkers (imported on first use at run time)
    from largebatch.memory.measure import measure_forward_bytes, measure_peak_bytes
    from largebatch.memory.recompute import apply_recompute, transformer_layers

_TORCH = {"measure_forward_bytes": "largebatch.memory.measure", "measure_peak_bytes": "largebatch.memory.measure",
          "apply_recompute": "largebatch.memory.recompute", "transformer_layers": "largebatch.memory.recompute"}


def __getattr__(name: str):
    """What acts on modules (recomputation, measurement) on first use: it needs torch, which the
    closed form and the planner do not (``largebatch memory`` starts without it)."""
    if name in _TORCH:
        import importlib

        return getattr(importlib.import_module(_TORCH[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
