"""Total memory per device at the peak of a training step: the stored activations (Korthikanti et
al. 2022 §4, see activations.py), what backward allocates on top of them
(activations.backward_working_bytes), plus model
state -- parameters, gradients, fp32 master weights and optimizer state -- counted as in ZeRO
(Rajbhandari et al. 2020 §3.1: 2 + 2 + K bytes per parameter in mixed precision, K = 12 for Adam).

Optimizer state per parameter, fp32 (docs/papers.md: optimizers): AdamW, LAMB and LANS keep m and v
(8 bytes); LARS and SGD-momentum keep one buffer (4 bytes). Mixed precision (dtype_bytes < 4) adds a
4-byte fp32 master copy. ZeRO stage 1 shards master + optimizer state over data parallel ranks,
stage 2 also the gradients, stage 3 also the parameters.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from largebatch.memory.activations import (
    backward_working_bytes,
    last_rank_activation_bytes,
    last_stage_rank,
    model_activation_bytes,
)
from largebatch.models.config import ModelConfig
from largebatch.models.flops import per_layer_policies
from largebatch.models.kinds import norm_parameters
from largebatch.models.registry import model_spec

# fp32 state bytes per parameter by optimizer name; largebatch.train.optimizer.register_optimizer adds
# each optimizer it declares, so `largebatch memory --optim.name` takes every registered one
OPTIMIZER_STATE_BYTES = {"adamw": 8, "lamb": 8, "lans": 8, "lars": 4, "sgd": 4}
GIB = 1024 ** 3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (under pipeline parallel: on the rank that needs the most, the first or the
    one holding the last stage)."""

    activations: float
    parameters: float
    gradients: float
    optimizer: float
    """fp32 master weights (mixed precision) plus the optimizer's state (plus a weight average)."""
    backward: float = 0.0
    """What the backward pass allocates on top of the stored activations at its peak
    (activations.backward_working_bytes)."""

    @property
    def total(self) -> float:
        return self.activations + self.backward + self.parameters + self.gradients + self.optimizer

    def __str__(self) -> str:
        parts = ("activations", "backward", "parameters", "gradients", "optimizer")
        body = ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)
        return f"{self.total / GIB:.2f} GiB ({body})"


def stage_parameters(config: ModelConfig, tp: int = 1, pp: int = 1, *, first: bool = True,
                     last: bool | None = None) -> float:
    """Parameters held by one device of a pipeline rank: its L / pp blocks, the embeddings if it
    holds the ``first`` stage, the final norm and output layer if it holds the ``last`` (default:
    only when pp = 1). Matrices and embeddings are split by tp (vocabulary-parallel embedding);
    LayerNorms, position embeddings and the biases of row-parallel linears are replicated. With
    tp = pp = 1 this is the model's exact parameter count. The Llama-style options: k and v map h to
    a_kv h / a (grouped-query attention), the SwiGLU MLP adds the gate (h x f, split by columns as
    fc1), rotary positions have no weights, an RMSNorm a gain and no bias; with head_size q and
    the projection are h x a d_h, k and v h x a_kv d_h, and qk_norm adds two norms of d_h values
    (replicated: every rank's heads share them), or with qk_norm_scope="projection" gains of a d_h and
    a_kv d_h values (split by heads as q and k are)."""
    h, f, v, s, w = config.n_embd, config.ffn, config.vocab_size, config.seq_len, config.attention_width
    kv = config.kv_heads * config.head_dim  # the k and v projections' width (w unless grouped)
    mlp_in = 2 if config.activation == "swiglu" else 1  # h -> f matrices: fc1 (and the gate)
    spec = model_spec(config.kind)
    bias, qkv_bias = (1 if config.bias else 0), (1 if config.qkv_biased else 0)
    # q, k, v, proj, the MLP's h x f matrices and fc2 (+ the column-parallel biases)
    split = 2 * h * w + 2 * h * kv + (mlp_in + 1) * h * f + qkv_bias * (w + 2 * kv) + bias * mlp_in * f
    # proj and fc2 biases, the norms (and the query and key heads' norms)
    replicated = bias * 2 * h + spec.layer_norms * norm_parameters(config)
    qk_norms = sum(norm_parameters(config, width) for width in config.qk_norm_width)
    if config.qk_norm_layout == "head":
        replicated += qk_norms
    elif config.qk_norm_layout == "projection":  # split by heads, as q and k are
        split += qk_norms
    n = config.n_layer // pp * (split / tp + replicated)
    if first:  # token embeddings, and learned position embeddings
        n += v * h / tp + (s * h if config.position == "learned" else 0)
    # the kind's other modules: norms, heads (the output layer sits on the last stage)
    return n + spec.stage_parameters(config, tp, first, pp == 1 if last is None else last)


def rank_policies(recompute: str | Sequence[str], n_layer: int, pp: int = 1) -> list[list[str]]:
    """Each pipeline rank's slice of a run's recomputation: one policy for every layer, or a list of
    one per layer over the whole model (ValueError naming what is wrong, as per_layer_policies)."""
    layers = per_layer_policies(recompute, n_layer)
    per_rank = n_layer // pp
    return [layers[r * per_rank:(r + 1) * per_rank] for r in range(pp)]


def estimate(config: ModelConfig, micro_batch: int = 1, *, tp: int = 1, pp: int = 1, dp: int = 1,
             sequence_parallel: bool = False, recompute: str | Sequence[str] = "none",
             optimizer: str = "adamw", seq_len: int | None = None, dtype_bytes: float = 2,
             zero_stage: int = 0, device: str = "cuda", pp_schedule: str = "1f1b", virtual_stages: int = 1,
             micro_batches: int | None = None, loss_parallel: bool = True,
             mask_fraction: float = 0.15, weight_average: bool = False) -> MemoryEstimate:
    """Bytes per device for training `config` (under pipeline parallel the larger of the first rank's
    and the last stage's rank's, untied: stages cannot share the embedding with the output layer).
    recompute: one policy or a per-layer list for the L / pp layers of a stage.
    pp_schedule, virtual_stages, micro_batches (default 2 pp): the pipeline schedule, which sets how
    many layers' worth the first stage keeps (activations.first_stage_layers). mask_fraction: the
    share of positions a BERT head runs on (largebatch's: the masked ones; transformers': all, 1).
    weight_average: the trainer's run.ema_decay, one more fp32 copy of the parameters, counted with
    the optimizer state (and sharded as it is)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r}: must be one of {', '.join(OPTIMIZER_STATE_BYTES)}.")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3.")
    if not isinstance(dp, numbers.Integral) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp={dp!r}: must be a positive integer.")
    if not (isinstance(dtype_bytes, numbers.Real) and not isinstance(dtype_bytes, bool) and 0 < dtype_bytes <= 8):
        raise ValueError(f"dtype_bytes={dtype_bytes!r}: bytes per stored value, from 1 (fp8) to 8 (fp64).")
    if not (isinstance(mask_fraction, numbers.Real) and not isinstance(mask_fraction, bool)
            and 0 < mask_fraction <= 1):
        raise ValueError(f"mask_fraction={mask_fraction!r}: the share of positions a BERT head runs on, in (0, 1] "
                         "(largebatch's masked ones: 0.15; transformers' BertForMaskedLM: 1)")
    if pp > 1 and config.tie_embeddings:  # (the trainer refuses tied embeddings under pp: the first
        config = config.replace(tie_embeddings=False)  # stage's embedding and the last's output layer)
    acts = model_activation_bytes(config, micro_batch, recompute, tp=tp, pp=pp,
                                  sequence_parallel=sequence_parallel, seq_len=seq_len,
                                  dtype_bytes=dtype_bytes, device=device, schedule=pp_schedule,
                                  virtual_stages=virtual_stages, micro_batches=micro_batches or 2 * pp,
                                  loss_parallel=loss_parallel, mask_fraction=mask_fraction)

    last_rank = last_stage_rank(pp_schedule, pp)

    def on_device(acts: float, n: float, output_layer: bool) -> MemoryEstimate:
        state = n * (OPTIMIZER_STATE_BYTES[optimizer] + (4 if dtype_bytes < 4 else 0) + (4 if weight_average else 0))
        working = backward_working_bytes(config, micro_batch, recompute, layers=config.n_layer // pp,
                                         output_layer=output_layer, tp=tp, sequence_parallel=sequence_parallel,
                                         seq_len=seq_len, dtype_bytes=dtype_bytes, device=device,
                                         mask_fraction=mask_fraction, loss_parallel=loss_parallel)
        return MemoryEstimate(activations=acts,
                              parameters=n * dtype_bytes / (dp if zero_stage >= 3 else 1),
                              gradients=n * dtype_bytes / (dp if zero_stage >= 2 else 1),
                              optimizer=state / (dp if zero_stage >= 1 else 1), backward=working)

    first = on_device(acts, stage_parameters(config, tp, pp), pp == 1 or last_rank == 0)
    if pp == 1:
        return first
    # The rank with the last stage keeps fewer micro-batches in flight but the output layer's inputs
    # and fp32 logits (4 s b v bytes, / tp only under loss_parallel), which the paper leaves out
    # (§4.3: the first stage dominates) and which can dominate (a large vocabulary, gathered logits,
    # recomputed layers): the larger of the two is what must fit. Under ZBV rank 0 holds both.
    last_acts = last_rank_activation_bytes(config, micro_batch, recompute, tp=tp, pp=pp,
                                           sequence_parallel=sequence_parallel, seq_len=seq_len,
                                           dtype_bytes=dtype_bytes, device=device, schedule=pp_schedule,
                                           virtual_stages=virtual_stages,
                                           micro_batches=micro_batches or 2 * pp, loss_parallel=loss_parallel,
                                           mask_fraction=mask_fraction)
    last = on_device(last_acts, stage_parameters(config, tp, pp, first=last_rank == 0, last=True), True)
    return last if last.total > first.total else first
