"""Recomputation planner: the per-layer mix of none / selective / full recomputation with the least
recompute FLOPs whose memory fits a per-device budget (Korthikanti et al. 2022 §4.2 and §6: selective
recomputation first, then full recomputation on only as many layers as needed).

Memory comes from estimate() (activations of the first pipeline stage + model state), or for a
transformers eager model, or an unsharded sdpa Llama-family one (``Setup.hf_activation``), with its
layers counted by the measured transformers terms (largebatch.memory.hf, docs/memory.md); the cost of a
mix is its hardware FLOPs minus model FLOPs (largebatch.models.flops). Layers are interchangeable,
so a mix is just (n_full, n_selective, n_none) per pipeline stage. The op-level policy is left out:
it recomputes no matmuls, so FLOPs cannot rank it -- measure it (benchmarks/recompute.py).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, replace

from largebatch.memory.activations import (
    activation_bytes_per_layer,
    attention_mask_bytes,
    config_layer_kwargs,
    stages_per_rank,
)
from largebatch.memory.estimate import MemoryEstimate, estimate
from largebatch.memory.hf import (
    LLAMA_ACTIVATIONS,
    check_activation,
    hf_eager_layer_bytes,
    hf_mask_bytes,
    hf_normalised_bytes,
)
from largebatch.models.config import ModelConfig
from largebatch.models.flops import flops_per_token, per_layer_policies


def counts_hf_terms(config: ModelConfig, hf_activation: str | None, *, tp: int = 1, pp: int = 1,
                    sequence_parallel: bool = False) -> bool:
    """Whether transformers' measured layer terms count ``config``'s layers under this layout: eager
    (explicit) layers always (they are planned unsharded), a Llama family's sdpa layers unsharded
    only -- sharded, and a GPT-2 / BERT's sdpa layers, are counted by the closed form."""
    if hf_activation is None:
        return False
    if config.attention == "explicit":
        return True
    return hf_activation in LLAMA_ACTIVATIONS and tp == 1 and pp == 1 and not sequence_parallel


@dataclass(frozen=True)
class Setup:
    """Everything but the recompute mix that determines memory per device."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1
    seq_len: int | None = None
    optimizer: str = "adamw"
    dtype_bytes: float = 2
    zero_stage: int = 0
    pp_schedule: str = "1f1b"
    """The pipeline schedule (with pp > 1): how many layers' worth the first stage keeps."""
    pp_virtual_stages: int = 1
    """V, stages per rank of the interleaved schedules (ZBV: always 2)."""
    pp_micro_batches: int | None = None
    """m, micro-batches per step (GPipe and the zero-bubble schedules); None: 2 pp."""
    loss_parallel: bool = True
    """The logits stay split over the vocabulary across tp (the paper's layout); False: gathered on
    every rank, as the trainer does unless parallel.loss_parallel."""
    mask_fraction: float = 0.15
    """The share of positions a BERT head runs on: largebatch's masked ones; transformers'
    BertForMaskedLM computes its head and logits on every position (1)."""
    weight_average: bool = False
    """The trainer's run.ema_decay: one more fp32 copy of the parameters, with the optimizer state."""
    hf_activation: str | None = None
    """A transformers eager GPT-2 / BERT / GPT-NeoX model, by its activation name ("gelu_new", "gelu"), or a
    Llama-family one ("silu", eager or sdpa): its layers are counted with the measured transformers
    terms (largebatch.memory.hf_eager_layer_bytes), not the closed form. None: largebatch's own
    layers, the closed form."""

    def __post_init__(self) -> None:
        if self.hf_activation is not None:
            check_activation(self.hf_activation, "Setup.hf_activation")

    @property
    def formula(self) -> str:
        """Which per-layer count the estimates use, in words."""
        if self.hf_activation is None:
            return "closed form (Korthikanti et al. 2022, Table 2)"
        kind = "Llama layers, eager or sdpa" if self.hf_activation in LLAMA_ACTIVATIONS else "eager layers"
        return (f"transformers {kind} ({self.hf_activation}; the closed form plus the measured "
                "terms of largebatch.memory.hf_eager_layer_bytes, 1-byte GPU dropout masks)")

    def estimate(self, config: ModelConfig, policies: list[str] | str) -> MemoryEstimate:
        est = estimate(config, self.micro_batch, tp=self.tp, pp=self.pp, dp=self.dp,
                       sequence_parallel=self.sequence_parallel, recompute=policies,
                       optimizer=self.optimizer, seq_len=self.seq_len,
                       dtype_bytes=self.dtype_bytes, zero_stage=self.zero_stage,
                       pp_schedule=self.pp_schedule, virtual_stages=self.pp_virtual_stages,
                       micro_batches=self.pp_micro_batches, loss_parallel=self.loss_parallel,
                       mask_fraction=self.mask_fraction, weight_average=self.weight_average)
        if self.hf_activation is None:
            return est
        sdpa_ok = self.hf_activation in LLAMA_ACTIVATIONS  # a Llama's sdpa layers are measured too
        if self.tp > 1 or self.pp > 1 or self.sequence_parallel or not (config.attention == "explicit" or sdpa_ok):
            raise ValueError(f"tp={self.tp}, pp={self.pp}, sequence_parallel={self.sequence_parallel}, "
                             f"attention={config.attention!r}: transformers' layers are counted unsharded, "
                             "with explicit attention (or sdpa for the Llama family) only; plan them with "
                             "tp=1, pp=1")
        # swap each layer's closed-form bytes for the transformers terms (first stage = all layers)
        kw = config_layer_kwargs(config, dtype_bytes=self.dtype_bytes)
        s = config.seq_len if self.seq_len is None else self.seq_len
        layers = per_layer_policies(policies, config.n_layer)
        delta = sum(hf_eager_layer_bytes(config, self.hf_activation, self.micro_batch, p, seq_len=s,
                                         dtype_bytes=self.dtype_bytes, layer=i)
                    - activation_bytes_per_layer(s, self.micro_batch, recompute=p, **kw) for i, p in enumerate(layers))
        # the masks: transformers' own (a sliding window's bool mask, kept by a recomputed sdpa layer) in
        # place of largebatch's shared one (attention_mask_bytes)
        delta += (hf_mask_bytes(config, self.micro_batch, layers, seq_len=s, dtype_bytes=self.dtype_bytes)
                  - attention_mask_bytes(config, self.micro_batch, s, self.dtype_bytes))
        if config.norm == "rmsnorm":  # the final LlamaRMSNorm, written out: (4 + n) h + 4 bytes a token, not d h
            normalised = hf_normalised_bytes(config, self.dtype_bytes)  # (n: d, or fp32's 4 for OLMo's)
            delta += s * self.micro_batch * ((4 + normalised - self.dtype_bytes) * config.n_embd + 4)
        return replace(est, activations=est.activations + delta)


@dataclass(frozen=True)
class Plan:
    setup: Setup
    policies: list[str]
    """Per layer of a pipeline stage (every stage runs the same mix)."""
    memory: MemoryEstimate
    recompute_overhead: float
    """Extra FLOPs of recomputation as a fraction of model FLOPs (0.33 = full recompute of a
    large GPT, Korthikanti et al. 2022 §6)."""

    def describe(self) -> str:
        counts = {p: self.policies.count(p) for p in ("full", "selective", "none")}
        mix = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        return (f"micro-batch {self.setup.micro_batch}: layers per stage {mix}; "
                f"+{100 * self.recompute_overhead:.1f}% FLOPs; {self.memory}")


def mixes(n_layers: int) -> Iterator[list[str]]:
    """Every (n_full, n_selective, n_none) mix, full recomputation on the first layers."""
    for n_full in range(n_layers + 1):
        for n_sel in range(n_layers - n_full + 1):
            yield ["full"] * n_full + ["selective"] * n_sel + ["none"] * (n_layers - n_full - n_sel)


# the search below visits every (full, selective, none) mix of a stage: O(L^2) mixes of L layers
# each; 400 layers take ~10 s on one CPU core (docs/memory.md), real models have <= ~200 per stage
MAX_STAGE_LAYERS = 512


def check_plannable(config: ModelConfig, setup: Setup) -> None:
    """ValueError naming the layers per stage when the exhaustive search would not end in minutes."""
    stage = config.n_layer // setup.pp
    if stage > MAX_STAGE_LAYERS:
        raise ValueError(f"n_layer={config.n_layer} with pp={setup.pp}: {stage} layers per pipeline "
                         f"stage; the recomputation planner searches at most {MAX_STAGE_LAYERS} "
                         f"(raise pp, or drop the budget for the table only)")


def cheapest_plan(config: ModelConfig, setup: Setup, budget_bytes: float) -> Plan | None:
    """The fitting mix with the least recompute FLOPs (ties: least memory), or None."""
    if not (isinstance(budget_bytes, numbers.Real) and not isinstance(budget_bytes, bool)
            and math.isfinite(budget_bytes) and budget_bytes > 0):
        raise ValueError(f"budget_bytes={budget_bytes!r}: must be a positive finite number of bytes per device")
    check_plannable(config, setup)
    stage = config.n_layer // setup.pp
    base = flops_per_token(config, seq_len=setup.seq_len)
    best = None
    for policies in mixes(stage):
        memory = setup.estimate(config, policies)
        if memory.total > budget_bytes:
            continue
        # FLOPs of a stage's mix, scaled to the whole model (every stage runs the same mix)
        extra = (flops_per_token(config, policies * setup.pp, seq_len=setup.seq_len) - base) / base
        key = (round(extra, 12), memory.total)
        if best is None or key < best[0]:
            best = (key, Plan(setup, policies, memory, extra))
    return None if best is None else best[1]


def micro_batch_sweep(config: ModelConfig, setup: Setup, budget_bytes: float,
                      largest: int = 1024) -> list[Plan]:
    """cheapest_plan for micro-batch 1, 2, 4, ... while something fits."""
    plans = []
    b = 1
    while b <= largest:
        plan = cheapest_plan(config, replace(setup, micro_batch=b), budget_bytes)
        if plan is None:
            break
        plans.append(plan)
        b *= 2
    return plans


def what_would_fit(config: ModelConfig, setup: Setup, budget_bytes: float, *,
                   micro_batches_asked: bool = True) -> list[str]:
    """Up to three larger (tp, pp, ZeRO stage) settings, fewest devices per replica first, under
    which micro-batch 1 with full recomputation fits. A larger tp comes with sequence parallelism
    where the sequence splits over it (and without, unless ``setup`` asked for it, where it does
    not). ``micro_batches_asked``: ``setup.pp_micro_batches`` was given by the user (it carries over
    to another pp), rather than the command's default 2 pp (which follows the pp)."""
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t >= setup.tp and config.kv_heads % t == 0]  # (| n_head too)
    pps = [p for p in range(setup.pp, config.n_layer + 1) if config.n_layer % p == 0]
    if setup.hf_activation is not None and config.attention == "explicit":  # transformers' eager layers: ZeRO only
        tps, pps = [1], [1]
    zeros = range(setup.zero_stage, 4 if setup.dp > 1 else setup.zero_stage + 1)
    grid = sorted(((tp * pp, tp, pp, z) for tp in tps for pp in pps for z in zeros))
    seq_len = config.seq_len if setup.seq_len is None else setup.seq_len
    found = []
    for _, tp, pp, zero in grid:
        if (tp, pp, zero) == (setup.tp, setup.pp, setup.zero_stage):
            continue
        if pp > 1 and (config.n_layer // pp) % stages_per_rank(setup.pp_schedule, setup.pp_virtual_stages):
            continue  # a schedule of V stages per rank needs V to divide the layers per rank
        # the asked m carries over (it is the global batch / micro-batch), named in the command, where
        # the schedule can run it at this pp (all but GPipe need m >= pp); else the command's default 2 pp
        m = setup.pp_micro_batches if micro_batches_asked else None
        if m is None or (setup.pp_schedule != "gpipe" and m < pp):
            m = 2 * pp
        splits = tp > 1 and seq_len % tp == 0  # sequence parallelism needs tp | seq_len (the trainer's check)
        if setup.sequence_parallel and not splits:
            continue
        changed = replace(setup, micro_batch=1, tp=tp, pp=pp, zero_stage=zero, pp_micro_batches=m,
                          sequence_parallel=setup.sequence_parallel or splits)
        if not counts_hf_terms(config, changed.hf_activation, tp=tp, pp=pp,
                               sequence_parallel=changed.sequence_parallel):  # (sharded sdpa: closed form)
            changed = replace(changed, hf_activation=None)
        try:
            fits = changed.estimate(config, "full").total <= budget_bytes
        except ValueError:  # the schedule cannot run at this pp
            continue
        if fits:
            flags = f"--tp {tp}{' --sequence-parallel' if changed.sequence_parallel else ''} --pp {pp}"
            if pp > 1 and m != 2 * pp:  # (the command's m is 2 pp unless given)
                flags += f" --pp-micro-batches {m}"
            found.append(flags + (f" --zero-stage {zero}" if zero else ""))
            if len(found) == 3:
                break
    return found
