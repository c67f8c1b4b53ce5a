"""Matmul FLOPs per token: model FLOPs (for MFU) and hardware FLOPs (counting recomputation).

Korthikanti et al. 2022, §6 / Appendix: a GPT layer's forward pass costs 24 B s h^2 + 4 B s^2 h
matmul FLOPs (QKV 6, projection 2, MLP 16 in units of B s h^2; Q K^T and attention over V 4 B s^2 h),
the output layer 2 B s h v; backward costs twice the forward. Model FLOPs per iteration are
    72 B s L h^2 (1 + s/(6h) + v/(12 h L))          (= 6N + 12 L h s per token, PaLM's form)
and hardware FLOPs add one more forward of whatever is recomputed: the whole layer under full
recomputation (-> 96 B s L h^2 (1 + s/(6h) + v/(16 h L))), only the two attention matmuls
(4 B s^2 h) under selective recomputation, nothing under the op-level policy (it recomputes
pointwise ops only). Pointwise ops, softmax and LayerNorm are not counted, as in the paper.
That extra forward is the paper's (and Megatron's) recomputation, and an upper bound on what
``largebatch.memory.apply_recompute`` runs: torch's checkpoint stops once the tensors backward
needs are rebuilt, so a region's last matmul does not run again when nothing after it saves its
output -- probs @ V under selective (2 s w per token and layer, w = a d_h: h unless model.head_size
says otherwise; unless one fused attention kernel reruns whole), fc2 under full in a pre-norm layer
without dropout (2 h f).

The denominator of MFU is the device's peak: declared by the user, or measured by
:func:`measure_peak_flops` with a large matmul in the run's dtype (Chowdhery et al. 2022, PaLM
App. B: MFU = model FLOPs per token x tokens/s / peak FLOP/s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

from largebatch.models.config import ModelConfig
from largebatch.models.registry import model_spec

if TYPE_CHECKING:
    import torch

RecomputePolicy = Literal["none", "selective", "op", "full"]
RECOMPUTE_POLICIES = get_args(RecomputePolicy)
"""none: keep everything; selective: recompute core attention (Korthikanti et al. 2022 §4.2);
op: save matmul outputs, recompute pointwise ops; full: keep only each layer's input."""


def per_layer_policies(policy: str | Sequence[str], n_layer: int) -> list[str]:
    """One policy name per layer, from a single name or a per-layer list (validated)."""
    if not isinstance(policy, (str, list, tuple)):
        raise ValueError(f"recompute policy {policy!r}: give one of {', '.join(RECOMPUTE_POLICIES)}, or a "
                         "list of those, one per layer.")
    names = [policy] * n_layer if isinstance(policy, str) else list(policy)
    if len(names) != n_layer:
        raise ValueError(f"recompute policy list has {len(names)} entries but the model has "
                         f"{n_layer} layers: give one entry per layer, or a single name.")
    for i, name in enumerate(names):
        if name not in RECOMPUTE_POLICIES:
            where = "" if isinstance(policy, str) else f" (layer {i})"
            raise ValueError(f"recompute policy {name!r}{where}: must be one of "
                             f"{', '.join(RECOMPUTE_POLICIES)}.")
    return names


def layer_forward_flops(config: ModelConfig, seq_len: int | None = None) -> tuple[float, float]:
    """Forward matmul FLOPs per token of one layer: (dense part, core-attention part); the model
    kind's ``layer_flops`` where it declares one, else the shared block's."""
    s = config.seq_len if seq_len is None else seq_len
    hook = model_spec(config.kind).layer_flops
    return shared_layer_flops(config, s) if hook is None else hook(config, s)


def shared_layer_flops(config: ModelConfig, s: int) -> tuple[float, float]:
    """The shared block's (largebatch.models.layers.Block) forward FLOPs per token at context s."""
    h, f, w = config.n_embd, config.ffn, config.attention_width  # w = a d_h: h unless head_size says otherwise
    kv = config.kv_heads * config.head_dim  # the k and v projections' width (w unless grouped)
    mlp = 3 if config.activation == "swiglu" else 2  # gate, fc1, fc2 or fc1, fc2
    dense = 2.0 * (2 * h * w + 2 * h * kv + mlp * h * f)  # q, proj, k, v, the MLP
    core = 4.0 * s * w  # Q K^T and probs @ V over the full context (no causal halving, as the paper)
    return dense, core


def head_forward_flops(config: ModelConfig, mask_fraction: float = 0.15) -> float:
    """Forward matmul FLOPs per input token of the output layer, as the model kind declares it
    (``head_flops``): GPT 2 h v; BERT's head (dense h x h, then the vocabulary projection) runs on
    the masked fraction of positions only."""
    return model_spec(config.kind).head_flops(config, mask_fraction)


def flops_per_token(config: ModelConfig, recompute: str | Sequence[str] = "none",
                    seq_len: int | None = None, mask_fraction: float = 0.15) -> float:
    """Training FLOPs per token (forward + backward = 3x forward, plus recomputed forwards).
    A layer with a sliding window W < s (ModelConfig.sliding_window) counts its core attention at
    context W: the W columns each query reads (the masked-out ones are computed, not counted).

    recompute="none" gives model FLOPs (use for MFU); any other policy, or a per-layer list, gives
    hardware FLOPs for that policy (use for HFU), counted as the paper counts them (an upper bound
    on what torch's checkpoint runs: module docstring). mask_fraction (the share of positions the
    masked-LM head runs on) only matters for BERT.
    """
    s = config.seq_len if seq_len is None else seq_len
    dense, core = layer_forward_flops(config, s)
    cores = [core if w is None else layer_forward_flops(config, w)[1] for w in config.windows_at(s)]
    model = 3.0 * (config.n_layer * dense + sum(cores) + head_forward_flops(config, mask_fraction))
    policies = per_layer_policies(recompute, config.n_layer)
    return model + sum({"none": 0.0, "op": 0.0, "selective": c, "full": dense + c}[p] for p, c in zip(policies, cores))


def utilization(config: ModelConfig, tokens_per_second: float, peak_flops_per_second: float,
                recompute: str | Sequence[str] = "none", seq_len: int | None = None) -> float:
    """Model FLOPs utilization (recompute="none") or hardware FLOPs utilization (the policy in use):
    achieved FLOPs per second over the devices' peak (Korthikanti et al. 2022 §6; PaLM App. B)."""
    if not peak_flops_per_second > 0:
        raise ValueError(f"peak_flops_per_second={peak_flops_per_second!r}: must be > 0 (e.g. "
                         "989e12 for one H100 in bf16, times the number of devices).")
    return tokens_per_second * flops_per_token(config, recompute, seq_len) / peak_flops_per_second


def matmul_size(seconds_at_256: float, budget: float, n: int = 2048, smallest: int = 256) -> int:
    """The largest size n, n/2, ... (down to ``smallest``) whose n x n x n product takes at most
    ``budget`` / 4 seconds, judged from one at 256 (a cube in n): a slow kernel (bf16 ``torch.mm``
    on a CPU without bf16 units: ~1.4 GFLOP/s, 12 s at 2048) is measured at a size it finishes."""
    while n > smallest and seconds_at_256 * (n / 256) ** 3 > budget / 4:
        n //= 2
    return n


def measure_peak_flops(device: torch.device, dtype: torch.dtype | None = None, n: int = 2048,
                       seconds: float = 1.5) -> float:
    """Best achieved FLOP/s of an n x n x n product on ``device`` (``dtype``: float32 when None) --
    an honest MFU denominator.

    Both ``torch.mm`` and ``F.linear`` (the model's dense layers): they can run different kernels,
    and on a CPU in bf16 linear ran ~6x mm's rate (9 against 1.4 GFLOP/s), so a peak from mm alone
    gave MFU above 1000%. The best of many repetitions, so a busy moment on a shared machine lowers
    it little; on a machine shared with other jobs it can still be low (and MFU then high): declare
    the peak with ``run.peak_flops`` for numbers to compare across machines. Takes about
    ``seconds`` (the size shrinks for a slow kernel; it took 5 minutes in bf16 on a CPU).
    """
    import torch  # here: the FLOP counts above need no torch
    import torch.nn.functional as F

    dtype = torch.float32 if dtype is None else dtype

    def timed(op, a, b) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        op(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    # drawn from a generator of its own: the global one is a run's (dropout) stream, restored from a
    # checkpoint just before the trainer measures; drawing from it made every resume with dropout
    # inexact (and a fresh run's masks depend on whether run.peak_flops was declared)
    own = torch.Generator(device=device).manual_seed(0)
    rate = 0.0
    for op in (torch.mm, F.linear):
        small = [torch.randn(256, 256, device=device, dtype=dtype, generator=own) for _ in range(2)]
        timed(op, *small)  # warm up kernels and caches
        size = matmul_size(min(timed(op, *small) for _ in range(2)), seconds / 2, n)
        a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=own) for _ in range(2))
        op(a, b)
        best = math.inf
        deadline = time.perf_counter() + seconds / 2
        reps = 0
        while reps < 3 or time.perf_counter() < deadline:
            best = min(best, timed(op, a, b))
            reps += 1
        rate = max(rate, 2.0 * size**3 / best)
    return rate


def mfu_over_peak(mfu: float, peak_flops: float, source: str) -> str:
    """Why an MFU above 100% is not a result: the peak it divides by is too low."""
    return (f"MFU {100 * mfu:.0f}% is above 100%: the peak of {peak_flops / 1e12:.3g} TFLOP/s it "
            f"divides by was {source}, so it is too low (a matmul measured under load, or a wrong "
            f"declaration); declare the device's peak with --run.peak_flops")
