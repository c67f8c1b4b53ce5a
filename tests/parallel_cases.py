"""Worker code for tests/test_parallel.py: runs INSIDE 2 spawned gloo ranks (1 thread each).

Each case compares a sharded run with the single-process run of the same model, seed and batch,
computed in the same process; rank 0 writes the measured differences to results.json and the
test functions assert on them. Independent float64 references (from docs/papers.md) live here too.
"""

from __future__ import annotations

import atexit
import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from largebatch.checkpoint.distributed import load_distributed, save_distributed
from largebatch.models import ModelConfig, build_model
from largebatch.optim import LAMB, LANS, LARS, param_groups
from largebatch.parallel import (
    ParallelConfig,
    apply_tensor_parallel,
    clip_grad_norm_,
    global_grad_norm,
    gradient_sync,
    init_distributed,
    parallelize,
    rank_guard,
    seed_ranks,
    shard_optimizer,
    unwrap,
)
from largebatch.parallel.batch import (
    LocalGradNorm,
    global_sum,
    micro_batches_per_rank,
    noise_scale_inputs,
    rank_samples,
)

B, T = 4, 16  # global batch (sequences) and sequence length of every case
SEPARATOR = 0  # the document separator of the "-docs" cases
MODES = ("ddp", "fsdp", "tp", "sp", "tp_loss", "sp_loss")
# the document mask under the layouts that touch it: FSDP2's wrapped blocks take it as an argument,
# sequence parallel gives the layers sequence shards and split heads beside the whole mask
DOCS_MODES = ("fsdp", "sp")
# the sliding window (ModelConfig.sliding_window, WINDOW of the T positions) on layer 0 of the Llama-style
# GPT, layer 1 attending to every position: the one mask beside split heads, sequence shards and the
# vocabulary-parallel loss
WINDOW = 5
WINDOW_MODES = ("ddp", "fsdp", "tp", "sp", "tp_loss")


# the Llama-style layers (Touvron et al. 2023): RMSNorm, rotary positions, the SwiGLU MLP (f ~ 8/3 h,
# even: tp = 2 splits it) and grouped-query attention, 2 K/V heads for the 4 query heads (one per tp rank)
LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", n_kv_head=2, ffn_hidden=88)
# Qwen3's (Yang et al. 2025): Llama's layers with each query and key head normalised, heads of 12 values
# on the 32-wide stream (so q is 48 wide): the norms' gains see only their own heads on a tp rank
QWEN3 = dict(LLAMA, head_size=12, qk_norm=True)
# OLMo 2's (OLMo et al. 2024): Llama's layers with each sub-layer's output normalised before the residual add
# and the whole q (48 values) and k (24) projections normalised: on a tp rank each norm sees half the values,
# its gain split with them, the statistic summed over the ranks
OLMO = dict(LLAMA, head_size=12, qk_norm=True, qk_norm_scope="projection", norm_position="reordered")
# GPT-NeoX's (Black et al. 2022; Pythia): the attention and the MLP in parallel on the layer input (their two
# row-split outputs reduced and added), a quarter of each head of 8 rotated, LayerNorm, biases
NEOX = dict(position="rope", rope_fraction=0.25, norm_position="parallel")


def tiny(kind: str = "gpt", dropout: float = 0.0, bias: bool | None = None) -> ModelConfig:
    """The tiny model of every case: "gpt", "bert", or "llama" (a GPT with the LLAMA layers; no
    biases unless ``bias``, as Llama). ``bias`` None: the kind's own (True for gpt and bert).
    "gpt-docs" and "bert-docs": attention within documents (ModelConfig.document_mask), the GPT's
    through sdpa's float mask, BERT's through the explicit attention's bool one. "qwen3", "olmo" and "neox":
    the GPT with the QWEN3, OLMO or NEOX layers. "llama-window": "llama" with a sliding window of WINDOW on
    layer 0 (sdpa)."""
    if kind == "llama-window":
        return replace(tiny("llama", dropout, bias), sliding_window=WINDOW, full_attention_layers=(1,),
                       attention="sdpa")
    if kind.endswith("-docs"):
        base = tiny(kind.removesuffix("-docs"), dropout, bias)
        return replace(base, document_mask=True, separator_id=SEPARATOR,
                       attention="sdpa" if base.kind == "gpt" else "explicit")
    if kind in ("llama", "qwen3", "olmo"):
        return ModelConfig(kind="gpt", n_layer=2, n_embd=32, n_head=4, seq_len=T, vocab_size=64, dropout=dropout,
                           bias=bool(bias), **{"llama": LLAMA, "qwen3": QWEN3, "olmo": OLMO}[kind])
    if kind == "neox":
        return replace(tiny("gpt", dropout, bias), **NEOX)
    return ModelConfig(kind=kind, n_layer=2, n_embd=32, n_head=4, seq_len=T, vocab_size=64, dropout=dropout,
                       bias=True if bias is None else bias)


def batch(kind: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (B, T), generator=gen)
    targets = torch.randint(0, 64, (B, T), generator=gen)
    if kind.endswith("-docs"):  # packed documents: a separator at about one position in four
        idx[torch.rand(B, T, generator=gen) < 0.25] = SEPARATOR
    kind = kind.removesuffix("-docs")
    if kind == "bert":  # ~30% of positions predicted, unevenly spread over the two dp halves
        targets[torch.rand(B, T, generator=gen) > 0.3] = -100
    return idx, targets


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_batch(state, idx, targets):
    rows = rank_samples(list(range(B)), state)
    return idx[rows], targets[rows]


def loss_and_backward(model, state, idx, targets) -> torch.Tensor:
    """The trainer's convention: summed loss / (global targets / dp), then backward."""
    mine_idx, mine_targets = local_batch(state, idx, targets)
    n_targets = global_sum(int((mine_targets != -100).sum()), state)
    with state.loss_context():  # the vocabulary-parallel loss needs forward and backward inside
        _, loss_sum = model(mine_idx, mine_targets, reduction="sum")
        (loss_sum * state.dp_size / n_targets).backward()
    return loss_sum.detach()


def max_grad_diff(model, reference) -> float:
    ref = dict(reference.named_parameters())
    return max(float((full(p.grad) - ref[n].grad).abs().max()) for n, p in unwrap(model).named_parameters())


def max_param_diff(model, reference) -> float:
    ref = dict(reference.named_parameters())
    return max(float((full(p.detach()) - ref[n].detach()).abs().max())
               for n, p in unwrap(model).named_parameters())


_JOINED: dict[str, object] = {}


def joined(config: ParallelConfig):
    """``init_distributed(config)``, once per distinct config in this process. Each call builds a
    new device mesh, whose gloo groups (worker threads and sockets each) nothing frees: called per
    case, a rank held over 500 threads and 700 file descriptors by the end of a file."""
    key = repr(config)
    if key not in _JOINED:
        _JOINED[key] = init_distributed(config)
    return _JOINED[key]


def states(kind: str):
    """The meshes of the cases: tp = 2 (optionally with SP), and dp = 2 (DDP: 2 replicas, or FSDP: 2 shards)."""
    if kind == "fsdp":  # the mode decides the layout (dp_replicate x dp_shard)
        return joined(ParallelConfig(dp=2, dp_mode="fsdp"))
    tp = joined(ParallelConfig(tp=2))
    dp = joined(ParallelConfig(dp=2))
    return {"tp": tp, "sp": replace(tp, sequence_parallel=True), "ddp": dp,
            "tp_loss": replace(tp, loss_parallel=True),
            "sp_loss": replace(tp, sequence_parallel=True, loss_parallel=True)}[kind]


def recompute_cases(results: dict) -> None:
    """parallelize's order: TP/SP, THEN recomputation (then FSDP); gradients must not change."""
    for kind in ("gpt", "gpt-docs"):  # (the mask is an argument of the recomputed regions)
        idx, targets = batch(kind)
        torch.manual_seed(0)
        reference = build_model(tiny(kind))
        model0 = copy.deepcopy(reference)
        _, ref_loss = reference(idx, targets)
        ref_loss.backward()
        for mode in ("sp", "fsdp"):
            for policy in ("selective", "full"):
                state = states(mode)
                model = parallelize(copy.deepcopy(model0), state, recompute=policy)
                loss_and_backward(model, state, idx, targets)
                results[f"recompute/{kind}/{mode}/{policy}"] = max_grad_diff(model, reference)


def relative_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


NORM_GAINS = ("ln1.weight", "ln2.weight", "ln_f.weight")
QK_GAINS = ("attn.q_norm.weight", "attn.k_norm.weight")


def forward_backward_cases(results: dict) -> None:
    for kind in ("gpt", "bert", "llama", "qwen3", "olmo", "neox", "gpt-docs", "bert-docs", "llama-window"):
        modes = DOCS_MODES if kind.endswith("-docs") else WINDOW_MODES if kind == "llama-window" else MODES
        idx, targets = batch(kind)
        torch.manual_seed(0)
        # the Llama-style case with Qwen2's biases, on q, k and v alone: split with their columns
        reference = build_model(replace(tiny(kind), qkv_bias=True) if kind == "llama" else tiny(kind))
        model0 = copy.deepcopy(reference)
        _, ref_loss = reference(idx, targets, reduction="sum")
        (ref_loss / (targets != -100).sum()).backward()
        for mode in modes:
            state = states(mode)
            model = parallelize(copy.deepcopy(model0), state)
            loss_sum = loss_and_backward(model, state, idx, targets)
            results[f"fwd_bwd/{kind}/{mode}"] = max_grad_diff(model, reference)
            if kind == "llama" and state.tp_size > 1:
                norm_gain_grads(results, mode, model, reference)
            if kind == "qwen3" and state.tp_size > 1:  # the heads' norms: each rank sums over its own heads
                norm_gain_grads(results, mode, model, reference, QK_GAINS, "qk_gains")
            if kind == "olmo" and state.tp_size > 1:  # the projections' norms: gains split as q and k are
                gains = [p for n, p in unwrap(model).named_parameters() if n.endswith(QK_GAINS)]
                results[f"olmo_qk_gains/{mode}"] = sorted({(str(p.placements), str(p.grad.placements),
                                                            tuple(p.to_local().shape)) for p in gains})
            if state.dp_size == 1:  # the whole batch on every rank: the loss itself must match
                results[f"loss/{kind}/{mode}"] = abs(float(loss_sum) - float(ref_loss)) / float(ref_loss)
                with torch.no_grad(), state.loss_context():
                    logits, _ = model(idx, targets)
                results[f"logits_vocab_per_rank/{kind}/{mode}"] = (
                    logits.to_local() if isinstance(logits, DTensor) else logits).shape[-1]


def norm_gain_grads(results: dict, mode: str, model, reference, names: tuple[str, ...] = NORM_GAINS,
                    prefix: str = "norm_gains") -> None:
    """The RMSNorm gains' gradients as backward leaves them (placements; this rank's local value)
    and as the optimizers read them (largebatch.optim.core.local_grad), against one process. Under
    sequence parallel each rank's gain gradient sums over its own half of the tokens: a partial sum
    that must be all-reduced first, as a LayerNorm's. ``names``: QK_GAINS for the query and key
    heads' norms (qk_norm), whose gains sum over each rank's own heads under any tensor parallel."""
    from largebatch.optim.core import local_grad

    ref = dict(reference.named_parameters())
    gains = [(n, p) for n, p in unwrap(model).named_parameters() if n.endswith(names)]
    results[f"{prefix}/{mode}/names"] = [n for n, _ in gains]
    results[f"{prefix}/{mode}/grad_placements"] = sorted({str(p.grad.placements) for _, p in gains})
    results[f"{prefix}/{mode}/local_before_reduce"] = max(relative_diff(p.grad.to_local(), ref[n].grad)
                                                          for n, p in gains)
    results[f"{prefix}/{mode}/optimizer_reads"] = max(relative_diff(local_grad(p), ref[n].grad) for n, p in gains)


def ddp_buffer_cases(results: dict) -> None:
    """Bytes DDP broadcasts before each of 2 forwards (torch.distributed._broadcast_coalesced, what its
    buffer sync calls): none for the built-in kinds, whose buffers (the causal mask, the rotary
    tables) are non-persistent and rebuilt by init_buffers, equal on every rank; a persistent buffer
    of one's own still is, and so is a non-persistent one no init_buffers rebuilds (torch's default)."""
    import torch.distributed as dist

    idx, targets = batch("gpt")
    state = states("ddp")
    for name in ("gpt", "llama", "persistent", "users"):
        torch.manual_seed(0)
        model = build_model(tiny(name if name in ("gpt", "llama") else "gpt"))
        if name == "persistent":
            model.register_buffer("seen", torch.zeros(3))  # state a model keeps: rank 0's is sent
        if name == "users":  # a non-persistent buffer no init_buffers rebuilds (a running scale): sent too
            model.register_buffer("seen", torch.zeros(3), persistent=False)
        model = parallelize(model, state)
        sent, real = [], dist._broadcast_coalesced
        dist._broadcast_coalesced = lambda group, tensors, *a, **k: (
            sent.append(sum(t.nbytes for t in tensors)), real(group, tensors, *a, **k))[1]
        try:
            for _ in range(2):
                loss_and_backward(model, state, idx, targets)
        finally:
            dist._broadcast_coalesced = real
        results[f"ddp_buffers/{name}/broadcast_bytes"] = sent
        results[f"ddp_buffers/{name}/buffer_bytes"] = sum(b.nbytes for b in unwrap(model).buffers())


# ------------------------------------------------------------------------------------ optimizers
def lamb_float64(x, g, wd, adapt, lr, b1=0.9, b2=0.999, eps=1e-6):
    """One LAMB step from a zero state, docs/papers.md: optimizers, float64 (independent of largebatch.optim)."""
    x, g = x.double(), g.double()
    m, v = (1 - b1) * g, (1 - b2) * g * g
    r = (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps) + wd * x
    xn, rn = x.norm(), r.norm()
    ratio = 1.0 if not adapt or xn == 0 or rn == 0 else float(xn / rn)
    return x - lr * ratio * r


def optimizer_cases(results: dict) -> None:
    idx, targets = batch("gpt")
    torch.manual_seed(0)
    # no biases: attn.k.bias has an exactly-zero true gradient (softmax is shift-invariant), so its
    # computed gradient is rounding noise, which Adam-type normalisation blows up to O(1) steps
    model0 = build_model(tiny("gpt", bias=False))
    makers = {"lamb": lambda groups: LAMB(groups, lr=0.02),
              "lans": lambda groups: LANS(groups, lr=0.02),
              "lars": lambda groups: LARS(groups, lr=0.5, momentum=0.9),
              "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01)}  # the peer: element-wise
    for name, make in makers.items():
        reference = copy.deepcopy(model0)
        ref_opt = make(param_groups(reference, weight_decay=0.01))
        for step in range(2):
            ref_opt.zero_grad()
            _, loss = reference(idx, targets)
            loss.backward()
            ref_opt.step()
        for mode in ("tp", "fsdp"):
            state = states(mode)
            model = parallelize(copy.deepcopy(model0), state)
            opt = shard_optimizer(make(param_groups(unwrap(model), weight_decay=0.01)), state)
            for step in range(2):
                opt.zero_grad()
                loss_and_backward(model, state, idx, targets)
                opt.step()
            results[f"optim/{name}/{mode}"] = max_param_diff(model, reference)
    # the float64 paper formula vs one sharded LAMB step: with the mesh's reduction, with the default
    # (None: the DTensors' own meshes), and WITHOUT any reduction (per-shard norms, the old default)
    for mode in ("tp", "fsdp"):
        state = states(mode)
        for reduce in ("reduced", "default", "unreduced"):
            model = parallelize(copy.deepcopy(model0), state)
            opt = shard_optimizer(LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=0.02), state)
            if reduce != "reduced":
                opt.reduce_norms = None if reduce == "default" else (lambda squared, params: squared)
            loss_and_backward(model, state, idx, targets)
            grads = {n: full(p.grad).clone() for n, p in unwrap(model).named_parameters()}
            hyper = {id(p): (g["weight_decay"], g["adapt"]) for g in opt.param_groups for p in g["params"]}
            hyper = {n: hyper[id(p)] for n, p in unwrap(model).named_parameters()}
            before = {n: full(p.detach()).clone() for n, p in unwrap(model).named_parameters()}
            opt.step()
            worst = max(float((full(p.detach()).double() - lamb_float64(before[n], grads[n], *hyper[n], 0.02))
                              .abs().max()) for n, p in unwrap(model).named_parameters())
            results[f"optim/lamb_float64/{mode}/{reduce}"] = worst


def collective_count_cases(results: dict) -> None:
    """How many all-reduces one optimizer step issues (counted at torch.distributed.all_reduce)."""
    import torch.distributed as dist

    idx, targets = batch("gpt")
    torch.manual_seed(0)
    for name, make in (("lamb", LAMB), ("lans", LANS)):
        state = states("fsdp")
        model = parallelize(build_model(tiny("gpt")), state)
        opt = shard_optimizer(make(param_groups(unwrap(model), weight_decay=0.01), lr=0.01), state)
        loss_and_backward(model, state, idx, targets)
        calls, real = [], dist.all_reduce
        dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            opt.step()
        finally:
            dist.all_reduce = real
        adapted = sum(bool(g["adapt"]) for g in opt.param_groups)
        results[f"all_reduces/{name}"] = [len(calls), len(opt.param_groups), adapted]


def float64_grad_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


def grad_norm_cases(results: dict) -> None:
    idx, targets = batch("gpt")
    torch.manual_seed(0)
    reference = build_model(tiny("gpt"))
    _, loss = reference(idx, targets)
    loss.backward()
    ref_norm = float64_grad_norm(reference)
    for mode in ("tp", "sp", "fsdp", "ddp"):
        torch.manual_seed(0)
        state = states(mode)
        model = parallelize(build_model(tiny("gpt")), state)
        loss_and_backward(model, state, idx, targets)
        params = list(unwrap(model).parameters())
        norm = float(clip_grad_norm_(params, 0.5, state))
        clipped = float(global_grad_norm(params, state))
        results[f"grad_norm/{mode}"] = abs(norm - ref_norm) / ref_norm
        results[f"grad_norm_clipped/{mode}"] = abs(clipped - 0.5)
        # a fault on one rank only: an inf in rank 1's copy of a replicated gradient (which the sum
        # leaves to rank 0's copy), or in rank 1's own loss, makes the norm non-finite on every rank
        # (rank 1 alone skipped or stopped, or none did, and the ranks went apart)
        same = float(global_grad_norm(params, state, local_value=torch.tensor(3.0)))
        bad_loss = torch.tensor(math.inf if torch.distributed.get_rank() == 1 else 3.0)
        on_all = [same == clipped]
        if mode != "ddp":  # (DDP: no reduction here; its gradients are already alike, its loss summed by the caller)
            on_all.append(not math.isfinite(float(global_grad_norm(params, state, local_value=bad_loss))))
        if mode in ("tp", "sp"):
            replica = next(p for p in params if isinstance(p, DTensor) and p.grad is not None
                           and all(placement.is_replicate() for placement in p.placements))
            if torch.distributed.get_rank() == 1:
                replica.grad.to_local().fill_(math.nan)
            on_all.append(not math.isfinite(float(global_grad_norm(params, state))))
        results[f"grad_norm_nonfinite_anywhere/{mode}"] = on_all


# ----------------------------------------------------------------------- sequence-parallel memory
REGIONS = ("ln1", "ln2", "attn.drop", "mlp.drop")  # the norm / dropout / residual regions
OUTPUT_REGIONS = ("ln_f", "lm_head")  # the final norm and the output layer (GPT)


def saved_region_bytes(model, state, idx, targets) -> dict[str, int]:
    """Bytes autograd saves for backward in block 0, per rank: in each norm/dropout module, and in
    the whole block ("block"); and in the final norm and the output layer (OUTPUT_REGIONS).
    Parameters are not activations and are not counted."""
    params = {full_or_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    block = unwrap(model).blocks[0]
    active, in_block = [None], [False]
    seen: dict[str, set] = {"region": set(), "block": set()}
    sizes = {r: 0 for r in (*REGIONS, *OUTPUT_REGIONS, "block")}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in params:
            return t
        if active[0] is not None and key not in seen["region"]:
            seen["region"].add(key)
            sizes[active[0]] += storage.nbytes()
        if in_block[0] and key not in seen["block"]:
            seen["block"].add(key)
            sizes["block"] += storage.nbytes()
        return t

    for region in (*REGIONS, *OUTPUT_REGIONS):
        module = (block if region in REGIONS else unwrap(model)).get_submodule(region)
        module.register_forward_pre_hook(lambda m, a, r=region: active.__setitem__(0, r))
        module.register_forward_hook(lambda m, a, o: active.__setitem__(0, None))
    block.register_forward_pre_hook(lambda m, a: in_block.__setitem__(0, True))
    block.register_forward_hook(lambda m, a, o: in_block.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mine_idx, mine_targets = local_batch(state, idx, targets)
        model(mine_idx, mine_targets)
    return sizes


def full_or_local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def memory_cases(results: dict) -> None:
    idx, targets = batch("gpt")
    torch.manual_seed(0)
    model0 = build_model(tiny("gpt", dropout=0.1))
    for mode in ("tp", "sp"):
        state = states(mode)
        torch.manual_seed(1)
        sizes = saved_region_bytes(parallelize(copy.deepcopy(model0), state), state, idx, targets)
        for region, n in sizes.items():
            results[f"memory/{mode}/{region}"] = n
    # the whole block under sequence parallel, with and without the shard kept for backward (torch's
    # own), in fp32 and under bf16 autocast (which hands each linear its own bf16 copy of the input)
    state = states("sp")
    for autocast in (False, True):
        for regather in (True, False):
            model = apply_tensor_parallel(copy.deepcopy(model0), state.tp_mesh, True, regather=regather)
            torch.manual_seed(1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                sizes = saved_region_bytes(model, state, idx, targets)
            results[f"memory/sp_regather={regather}/autocast={autocast}/block"] = sizes["block"]
    # the gathers again: started when backward reaches each sub-layer (prefetch) or where the first
    # linear needs them; the same gradients as torch's own, bit for bit (under autocast the bf16
    # copies are rebuilt from the shard). Counted: the gathers backward waits on where it needs them
    from largebatch.parallel import tensor_parallel

    real_gathered = tensor_parallel._gathered
    for autocast in (False, True):
        grads = {}
        for kind in ("prefetch", "on_demand", "torch"):
            model = apply_tensor_parallel(copy.deepcopy(model0), state.tp_mesh, True, regather=kind != "torch",
                                          prefetch=kind == "prefetch")
            in_backward = []
            tensor_parallel._gathered = lambda *a, **k: (in_backward.append(not torch.is_grad_enabled()),
                                                         real_gathered(*a, **k))[1]
            try:
                torch.manual_seed(1)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss_and_backward(model, state, idx, targets)
            finally:
                tensor_parallel._gathered = real_gathered
            grads[kind] = [full(p.grad) for p in model.parameters()]
            results[f"memory/sp_regather/{kind}/autocast={autocast}/waited_gathers"] = sum(in_backward)
        for kind in ("prefetch", "on_demand"):
            results[f"memory/sp_regather/{kind}/autocast={autocast}/grad_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(grads[kind], grads["torch"]))


# ------------------------------------------------------------------------------ noise scale (DDP)
def noise_scale_cases(results: dict) -> None:
    """The DDP inputs of the noise scale against each dp half's own mean gradient, computed in one
    process: GPT (every half has the same target count) and BERT (masked positions unevenly spread
    over the halves, so the trainer's loss scale dp / N_step is not the half's own 1 / N_half)."""
    state = states("ddp")
    for kind in ("gpt", "bert"):
        idx, targets = batch(kind)
        torch.manual_seed(0)
        model0 = build_model(tiny(kind))
        micro = micro_batches_per_rank(B, 1, state.dp_size)  # 2 micro-batches of 1 sequence per rank
        model = parallelize(copy.deepcopy(model0), state)
        recorder = LocalGradNorm.install(model, state)
        mine_idx, mine_targets = local_batch(state, idx, targets)
        n_local = int((mine_targets != -100).sum())
        n_targets = global_sum(n_local, state)
        for i in range(micro):
            with gradient_sync(model, enabled=i == micro - 1):
                _, loss_sum = model(mine_idx[i:i + 1], mine_targets[i:i + 1], reduction="sum")
                (loss_sum * state.dp_size / n_targets).backward()
        local_sq = recorder.take()
        big_sq = global_grad_norm(list(unwrap(model).parameters()), state) ** 2
        # the same gradients again, in DDP's rebuilt buckets (the layout every step after a process's
        # first has; a resumed process's first step had the first one): the same local norm, to the bit
        grads = [p.grad.clone() for p in unwrap(model).parameters()]
        model.zero_grad(set_to_none=True)
        for i in range(micro):
            with gradient_sync(model, enabled=i == micro - 1):
                _, loss_sum = model(mine_idx[i:i + 1], mine_targets[i:i + 1], reduction="sum")
                (loss_sum * state.dp_size / n_targets).backward()
        same_grads = all(torch.equal(g, p.grad) for g, p in zip(grads, unwrap(model).parameters()))
        results[f"noise/{kind}/local_norm_bits_after_rebuild"] = [float(local_sq), float(recorder.take()),
                                                                   same_grads]
        small, b_small, big, b_big = noise_scale_inputs(local_sq, big_sq, B // state.dp_size, state,
                                                        n_local, n_targets)
        refs, counts = [], []  # each half's own mean gradient, in float64, in one process
        for half in range(state.dp_size):
            reference = copy.deepcopy(model0).double()
            rows = slice(half * B // 2, (half + 1) * B // 2)
            _, loss_sum = reference(idx[rows], targets[rows], reduction="sum")
            counts.append(int((targets[rows] != -100).sum()))
            (loss_sum / counts[-1]).backward()
            refs.append(sum(float(p.grad.square().sum()) for p in reference.parameters()))
        key = f"noise/{kind}"
        results[f"{key}/target_counts"] = counts
        small = float(small)  # a device tensor: the trainer reads it only when it logs
        results[f"{key}/mean_small_rel_err"] = abs(small - sum(refs) / len(refs)) / small
        uncorrected = float(noise_scale_inputs(local_sq, big_sq, B // state.dp_size, state)[0])
        results[f"{key}/uncorrected_rel_err"] = abs(uncorrected - sum(refs) / len(refs)) / small
        results[f"{key}/batches"] = [b_small, b_big]


# ------------------------------------------------------------------------------------ checkpoints
def checkpoint_cases(results: dict, out_dir: Path) -> None:
    idx, targets = batch("gpt")
    torch.manual_seed(0)
    model0 = build_model(tiny("gpt"))
    for mode in ("fsdp", "sp"):
        state = states(mode)

        def fresh():
            model = parallelize(copy.deepcopy(model0), state)
            opt = LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=0.02)
            return model, shard_optimizer(opt, state)

        def step(model, opt):
            opt.zero_grad()
            loss_and_backward(model, state, idx, targets)
            opt.step()

        model, opt = fresh()
        step(model, opt)
        path = save_distributed(out_dir / mode, 1, model, opt, {"step": 1, "mode": mode}, state)
        expected = {"model": {n: full(p.detach()).clone() for n, p in unwrap(model).named_parameters()},
                    "optim": {n: {k: full(v).clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                              for n, p in unwrap(model).named_parameters()}}
        step(model, opt)  # the uninterrupted run's step 2
        after_two = {n: full(p.detach()).clone() for n, p in unwrap(model).named_parameters()}
        resumed, resumed_opt = fresh()  # a "killed" run restarted: new processes' state, then load
        extra = load_distributed(path, resumed, resumed_opt, state)
        step(resumed, resumed_opt)
        results[f"resume/{mode}/extra_ok"] = extra == {"step": 1, "mode": mode}
        results[f"resume/{mode}/max_diff"] = max(float((full(p.detach()) - after_two[n]).abs().max())
                                                 for n, p in unwrap(resumed).named_parameters())
        if state.is_main:
            torch.save({"expected": expected, "after_two": after_two, "path": str(path)},
                       out_dir / f"{mode}_expected.pt")


def llama_cases(results: dict, out_dir: Path) -> None:
    """The Llama-style GPT (tiny("llama"), untied as pipeline stages need) beyond one step's
    gradients: pp = 2 stages' gradients and loss (1F1B, 2 micro-batches); two LAMB steps under
    tensor + sequence parallel (the gains' partial gradients reduced before the trust ratios); a DCP
    checkpoint written under tp = 2 + SP after one step, loaded under FSDP2 (dp = 2) and under pp =
    2 (exactly), and the next step from it (the one-process load: test_parallel)."""
    from largebatch.parallel.pipeline import pipeline_parallelize

    idx, targets = batch("llama")
    cfg = replace(tiny("llama"), tie_embeddings=False)
    torch.manual_seed(0)
    model0 = build_model(cfg)
    n_targets = int((targets != -100).sum())
    reference = copy.deepcopy(model0)
    _, ref_loss = reference(idx, targets, reduction="sum")
    (ref_loss / n_targets).backward()
    ref = dict(reference.named_parameters())

    pp = joined(ParallelConfig(pp=2))
    pipe = pipeline_parallelize(copy.deepcopy(model0), pp)
    loss_sum = pipe.step(idx, targets, 2, 1.0 / n_targets)  # the trainer's scale: 1 / the step's targets
    held = dict(pipe.model.named_parameters())
    results["llama/pp/held"] = sorted(held)
    results["llama/pp/loss"] = abs(float(loss_sum) - float(ref_loss)) / float(ref_loss)
    results["llama/pp/grad"] = max(float((p.grad - ref[n].grad).abs().max()) for n, p in held.items())

    sp = states("sp")

    def lamb(model, state):
        return shard_optimizer(LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=0.02), state)

    def step(model, opt, state):
        opt.zero_grad()
        loss_and_backward(model, state, idx, targets)
        opt.step()

    reference = copy.deepcopy(model0)
    ref_opt = LAMB(param_groups(reference, weight_decay=0.01), lr=0.02)
    model = parallelize(copy.deepcopy(model0), sp)
    opt = lamb(model, sp)
    for i in range(2):
        ref_opt.zero_grad()
        _, loss = reference(idx, targets)
        loss.backward()
        ref_opt.step()
        step(model, opt, sp)
        if i == 0:
            path = save_distributed(out_dir / "llama_sp", 1, model, opt, {"step": 1}, sp)
            saved = {n: full(p.detach()).clone() for n, p in unwrap(model).named_parameters()}
            saved_state = {n: {k: full(v).clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                           for n, p in unwrap(model).named_parameters()}
    results["llama/optim/lamb/sp"] = max_param_diff(model, reference)
    after_two = {n: full(p.detach()).clone() for n, p in unwrap(model).named_parameters()}

    def exact(model, opt) -> float:
        """The largest difference of the loaded parameters and optimizer state from the saved."""
        worst = 0.0
        for n, p in unwrap(model).named_parameters():
            worst = max(worst, float((full(p.detach()) - saved[n]).abs().max()))
            for k, v in saved_state[n].items():
                worst = max(worst, float((full(opt.state[p][k]) - v).abs().max()))
        return worst

    torch.manual_seed(123)  # another init: every value must come from the checkpoint
    other = build_model(cfg)
    fsdp = states("fsdp")
    model = parallelize(copy.deepcopy(other), fsdp)
    opt = lamb(model, fsdp)
    results["llama/dcp/sp_to_fsdp/extra"] = load_distributed(path, model, opt, fsdp) == {"step": 1}
    results["llama/dcp/sp_to_fsdp/max_diff"] = exact(model, opt)
    step(model, opt, fsdp)
    results["llama/dcp/sp_to_fsdp/next_step"] = max(float((full(p.detach()) - after_two[n]).abs().max())
                                                   for n, p in unwrap(model).named_parameters())
    pipe = pipeline_parallelize(copy.deepcopy(other), pp)
    opt = lamb(pipe.model, pp)
    load_distributed(path, pipe.model, opt, pp)
    results["llama/dcp/sp_to_pp/max_diff"] = exact(pipe.model, opt)
    if sp.is_main:
        torch.save({"expected": {"model": saved, "optim": saved_state}, "after_two": after_two, "path": str(path)},
                   out_dir / "llama_sp_expected.pt")
    llama_regather_cases(results)


def llama_regather_cases(results: dict) -> None:
    """Sequence parallel's kept shard (SequenceGather) with the gated MLP: gate and fc1 share the
    MLP's one gathered input, as q, k and v share attention's. Block 0's saved bytes with the shard
    kept and with torch's own (the gathered input saved), in fp32 and under bf16 autocast (one bf16
    copy per linear: q, k, v, gate, fc1), and the gradients of both, which must be equal."""
    idx, targets = batch("llama")
    torch.manual_seed(0)
    model0 = build_model(tiny("llama"))
    state = states("sp")
    for autocast in (False, True):
        grads = {}
        for regather in (True, False):
            model = apply_tensor_parallel(copy.deepcopy(model0), state.tp_mesh, True, regather=regather)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                results[f"llama/sp_regather={regather}/autocast={autocast}/block"] = saved_region_bytes(
                    model, state, idx, targets)["block"]
                loss_and_backward(model, state, idx, targets)
            grads[regather] = [full(p.grad) for p in model.parameters()]
        results[f"llama/sp_regather/autocast={autocast}/grad_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(grads[True], grads[False]))


def seed_cases(results: dict) -> None:
    import torch.distributed as dist

    for mode in ("tp", "ddp"):
        state = states(mode)
        seed_ranks(7, state)
        draws = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(draws, torch.rand(1))
        results[f"seed/{mode}/same_draw_on_both_ranks"] = bool(draws[0] == draws[1])


def argmax_cases(results: dict) -> None:
    """vocab_parallel_argmax on logits split over the vocabulary equals torch.argmax of the whole
    logits, ties included (values drawn from {0, 1, 2}: most rows hold the maximum several times, on
    both ranks' slices), for GPT-shaped (B, T, v) and BERT-shaped (n, v) logits."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from largebatch.parallel.tensor_parallel import vocab_parallel_argmax

    state = states("tp")
    generator = torch.Generator().manual_seed(3)
    for shape in ((2, 5, 64), (7, 64)):
        whole = torch.randint(0, 3, shape, generator=generator).float()  # the same on both ranks
        split = distribute_tensor(whole, state.tp_mesh, [Shard(-1)])
        best = vocab_parallel_argmax(split)
        results[f"argmax/{len(shape)}d/equal"] = bool(torch.equal(best, whole.argmax(-1)))
        results[f"argmax/{len(shape)}d/ties_across_ranks"] = int(
            ((whole[..., :32].amax(-1) == whole.amax(-1)) & (whole[..., 32:].amax(-1) == whole.amax(-1))).sum())


def generate_cases(results: dict) -> None:
    """Decoding with a KV cache on a sharded model (the trainer's end-of-run sample): under tensor
    parallel (each rank caches its own heads; with the vocabulary-parallel loss the logits are
    gathered) and FSDP2 (decode goes through forward, whose hooks gather the root's parameters), each
    cached step's logits are one process's whole-context logits, and the greedy tokens are its own."""
    for kind in ("gpt", "llama", "olmo", "gpt-docs", "llama-window"):
        idx, _ = batch(kind)
        prompt = idx[:, :5]
        torch.manual_seed(0)
        reference = build_model(tiny(kind)).eval()
        with torch.no_grad():
            expected = reference.generate(prompt, T - 5 + 3, temperature=0)  # (past seq_len by 3)
            whole = reference(expected[:, :T])[0]
        for mode in ("tp", "tp_loss", "fsdp"):
            state = states(mode)
            model = unwrap(parallelize(copy.deepcopy(reference), state)).eval()
            cache = model.cache()
            with torch.no_grad():  # (as the trainer's sample: outside the loss context)
                steps = [model.decode(expected[:, :5], cache)]
                steps += [model.decode(expected[:, t:t + 1], cache) for t in range(5, T)]
                tokens = model.generate(prompt, T - 5 + 3, temperature=0)
            results[f"generate/{kind}/{mode}/logits"] = max(
                float((step - whole[:, t]).abs().max()) for t, step in zip(range(4, T), steps))
            results[f"generate/{kind}/{mode}/same_tokens"] = bool(torch.equal(tokens, expected))
            results[f"generate/{kind}/{mode}/cached"] = model.decodes()  # (not the cache-less fallback)


def mixed_precision_cases(results: dict) -> None:
    """FSDP2 with param_dtype=bf16 (what run.dtype='bf16' selects): the forward computes with bf16
    parameters, the reduce-scatter carries fp32 gradients, the sharded parameters and gradients stay
    fp32, and the loss is the one-process loss of the bf16-cast model."""
    import torch.distributed as dist

    idx, targets = batch("gpt")
    torch.manual_seed(0)
    model0 = build_model(tiny("gpt"))
    state = states("fsdp")
    model = parallelize(copy.deepcopy(model0), state, param_dtype=torch.bfloat16)
    seen = []
    hook = unwrap(model).blocks[0].attn.q.register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.dtype))
    reduced, real = [], dist.reduce_scatter_single  # what FSDP2's reduce-scatter calls

    def recording(*args, **kwargs):
        reduced.append(str(kwargs["input"].dtype if "input" in kwargs else args[1].dtype))
        return real(*args, **kwargs)

    dist.reduce_scatter_single = recording
    try:
        loss_sum = loss_and_backward(model, state, idx, targets)
    finally:
        dist.reduce_scatter_single = real
        hook.remove()
    total = loss_sum.double().clone()
    dist.all_reduce(total)
    reference = copy.deepcopy(model0).to(torch.bfloat16)
    _, ref_loss = reference(idx, targets, reduction="sum")
    results["mp/forward_param_dtype"] = str(seen[0])
    results["mp/reduce_dtypes"] = sorted(set(reduced))
    results["mp/sharded_dtypes"] = sorted({str(p.dtype) for p in unwrap(model).parameters()}
                                          | {str(p.grad.dtype) for p in unwrap(model).parameters()})
    results["mp/loss_rel_err"] = abs(float(total) - float(ref_loss)) / float(ref_loss)


def run_all(out_dir: str, compile_too: bool = True) -> None:
    out = Path(out_dir)
    state = init_distributed(ParallelConfig(tp=2))
    results: dict = {}
    with rank_guard(state):
        forward_backward_cases(results)
        ddp_buffer_cases(results)
        recompute_cases(results)
        optimizer_cases(results)
        grad_norm_cases(results)
        collective_count_cases(results)
        memory_cases(results)
        noise_scale_cases(results)
        mixed_precision_cases(results)
        checkpoint_cases(results, out)
        llama_cases(results, out)
        seed_cases(results)
        argmax_cases(results)
        generate_cases(results)
        if compile_too:
            compile_cases(results)
    (out / f"results_rank{state.rank}.json").write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------------------- failures
def fail_on_rank_one() -> None:
    """Rank 1 raises; rank 0 is already waiting in a collective on it."""
    import torch.distributed as dist

    state = init_distributed(ParallelConfig(dp=2, timeout_s=60))
    with rank_guard(state):
        if state.rank == 1:
            raise ValueError("injected failure while loading a batch")
        for _ in range(3):
            dist.all_reduce(torch.ones(1))


def abort_on_rank_one() -> None:
    """Rank 1 dies of a native abort (SIGABRT, as glibc ends a process whose heap it finds
    corrupted) after joining, in a function whose name its Python stack shows; rank 0 then fails in a
    collective. faulthandler is
    switched off first: joining through init_distributed switches it on, as under torchrun. Rank 0
    joins with a stderr that has no file descriptor (a notebook's): joining must not fail there."""
    import faulthandler
    import io
    import os
    import sys

    faulthandler.disable()
    if int(os.environ["RANK"]) == 0:
        sys.stderr = io.StringIO()
    state = init_distributed(ParallelConfig(dp=2, timeout_s=60))
    if state.rank == 1:
        os.abort()
    # rank 0, as a trainer would: the clean-up's SIGTERM asks for a stop, and the collective it is in
    # fails on the lost peer ("Connection reset by peer"), a Python error written after the crash
    import signal

    signal.signal(signal.SIGTERM, lambda *_: None)
    torch.distributed.all_reduce(torch.ones(1))


def stuck_rank_one() -> None:
    """Rank 1 is alive but never joins the collective; rank 0 must give up after timeout_s."""
    import time

    import torch.distributed as dist

    state = init_distributed(ParallelConfig(dp=2, timeout_s=3))
    with rank_guard(state):
        if state.rank == 1:
            time.sleep(60)
            return
        dist.all_reduce(torch.ones(1))


class TeardownMark:
    """Writes "teardown" to ``path`` when destroyed: as a module global, during the interpreter's
    teardown at exit (the file is opened now; at teardown only the saved os.write is called)."""

    def __init__(self, path: Path):
        import os

        self._fd, self._write = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), os.write

    def __del__(self):
        self._write(self._fd, b"teardown")


def finish_after_ddp(out_dir: str) -> None:
    """A rank that trains a DDP step (DDP keeps the default group alive past destroy_process_group)
    and returns: spawn() ends it through end_process. Records whether the atexit handlers ran (and
    if the group was still alive then) and whether the interpreter's teardown ran."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    global _MARK
    state = init_distributed(ParallelConfig(dp=2))
    out = Path(out_dir)
    _MARK = TeardownMark(out / f"teardown_rank{state.rank}.txt")
    atexit.register(lambda: (out / f"atexit_rank{state.rank}.txt").write_text(str(dist.is_initialized())))
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    dist.barrier()


def peer_lost_during_save(out_dir: str) -> None:
    """Rank 1 leaves the job in the middle of a distributed save (its group destroyed where its
    shard would be written: its peer's collectives fail), then waits for rank 0's record. Rank 0
    records how its save ended and which temporaries are left in the checkpoint directory."""
    import os
    import time

    import torch.distributed as dist

    import largebatch.checkpoint.distributed as distributed_checkpoint

    state = init_distributed(ParallelConfig(dp=2, timeout_s=5))
    out = Path(out_dir)
    model = parallelize(build_model(tiny("gpt")), state)
    optimizer = shard_optimizer(LAMB(param_groups(unwrap(model)), lr=0.01), state)
    record = out / "save_rank0.json"
    if state.rank == 1:
        def leave(*args, **kwargs):
            dist.destroy_process_group()
            deadline = time.monotonic() + 60
            while not record.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)

        distributed_checkpoint.dcp.save = leave  # (this process only)
    try:
        save_distributed(out / "run", 1, model, optimizer, {"step": 1}, state)
        outcome = "saved"
    except BaseException as exc:  # noqa: BLE001 -- whatever the lost peer makes the collectives raise
        outcome = type(exc).__name__
    left = sorted(p.name for p in (out / "run" / "checkpoints").iterdir())
    record.write_text(json.dumps({"outcome": outcome, "left": left}))
    os._exit(0)  # (the group cannot be left: the peer is gone)


if __name__ == "__main__":  # PYTHONPATH=src python tests/parallel_cases.py: print what the ranks measured
    import sys
    import tempfile

    from largebatch.parallel import spawn

    sys.path.insert(0, str(Path(__file__).parent))
    import parallel_cases  # the importable twin of __main__, for the spawned ranks

    with tempfile.TemporaryDirectory() as out:
        spawn(parallel_cases.run_all, 2, out, False)
        print((Path(out) / "results_rank0.json").read_text())


def run_2d(out_dir: str) -> None:
    """4 ranks: FSDP over dp = 2 of a model tensor+sequence parallel over tp = 2 (a 2-D mesh)."""
    out = Path(out_dir)
    state = init_distributed(ParallelConfig(tp=2, sequence_parallel=True, dp_mode="fsdp"))
    exit_file = out / f"group_alive_at_exit_rank{state.rank}.txt"
    # spawn() must leave the group before the interpreter exits (an alive gloo group can SIGABRT)
    atexit.register(lambda: exit_file.write_text(str(torch.distributed.is_initialized())))
    results: dict = {}
    with rank_guard(state):
        idx, targets = batch("gpt")
        torch.manual_seed(0)
        model0 = build_model(tiny("gpt", bias=False))
        reference = copy.deepcopy(model0)
        ref_opt = LAMB(param_groups(reference, weight_decay=0.01), lr=0.02)
        model = parallelize(copy.deepcopy(model0), state)
        opt = shard_optimizer(LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=0.02), state)
        for step in range(2):
            ref_opt.zero_grad()
            _, loss = reference(idx, targets)
            loss.backward()
            opt.zero_grad()
            loss_and_backward(model, state, idx, targets)
            if step == 0:
                results["fwd_bwd"] = max_grad_diff(model, reference)
                ref_norm = float64_grad_norm(reference)
                norm = float(global_grad_norm(list(unwrap(model).parameters()), state))
                results["grad_norm"] = abs(norm - ref_norm) / ref_norm
            ref_opt.step()
            opt.step()
        results["lamb"] = max_param_diff(model, reference)
        results["placements"] = str(next(unwrap(model).blocks[0].attn.q.parameters()).placements)
        path = save_distributed(out / "run2d", 2, model, opt, {"step": 2}, state)
        if state.is_main:
            torch.save({"model": {n: full(p.detach()) for n, p in unwrap(model).named_parameters()},
                        "path": str(path)}, out / "2d_expected.pt")
        else:
            {n: full(p.detach()) for n, p in unwrap(model).named_parameters()}  # collective on every rank
    (out / f"results2d_rank{state.rank}.json").write_text(json.dumps(results))


def compile_cases(results: dict) -> None:
    """parallelize(compile=True) after TP + SP: each block compiled in place (the one compile test);
    "olmo": OLMo 2's projection norms, whose statistic is all-reduced over the ranks, run eagerly
    inside the compiled blocks."""
    state = states("sp")
    for kind in ("gpt", "olmo"):
        idx, targets = batch(kind)
        torch.manual_seed(0)
        reference = build_model(tiny(kind))
        model = parallelize(copy.deepcopy(reference), state, compile=True)
        _, ref_loss = reference(idx, targets)
        ref_loss.backward()
        loss_and_backward(model, state, idx, targets)
        suffix = "" if kind == "gpt" else f"/{kind}"
        results[f"compile/all_blocks_compiled{suffix}"] = all(getattr(block, "_compiled_call_impl", None) is not None
                                                              for block in unwrap(model).blocks)
        results[f"compile/grad_diff{suffix}"] = max_grad_diff(model, reference)


def abort_the_first_time_on_rank_one(marks: str) -> None:
    """Rank 1 dies of a native abort the first time it runs (a mark file says it has); every rank
    writes a mark each time it gets to the end. No process group: nothing to lose but the process."""
    import faulthandler
    import os

    faulthandler.disable()
    rank, marks_dir = int(os.environ["RANK"]), Path(marks)
    if rank == 1 and not (marks_dir / "aborted").exists():
        (marks_dir / "aborted").write_text("")
        os.abort()
    with open(marks_dir / f"finished_rank{rank}", "a") as f:
        f.write("x")


def raise_then_abort_on_rank_one(marks: str) -> None:
    """Rank 1 raises a Python error (no process group), counting its tries in a mark file, and then
    aborts in its exit (as gloo's threads can abort an interpreter teardown): a Python failure."""
    import atexit
    import faulthandler
    import os

    if int(os.environ["RANK"]) == 1:
        faulthandler.disable()
        atexit.register(os.abort)
        with open(Path(marks) / "tries", "a") as f:
            f.write("x")
        raise ValueError("a Python error, not a crash")


def sigkill_on_rank_one() -> None:
    """Rank 1 is killed outright (SIGKILL, as the out-of-memory killer does): no stack, no error."""
    import os
    import signal

    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
