"""Memory and time of every activation-recomputation policy, next to the memory model.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(docs/papers.md: memory): selective recomputation (core attention only) removes the 5as^2b term for a few
percent of step time; full recomputation keeps only each layer's input (2sbh) for ~36-39%.
Everything here comes from largebatch.memory -- the policies (``apply_recompute``), the
measurement of what a forward leaves for backward (``measure_forward_bytes``) and the closed-form
prediction (``model_activation_bytes``) -- the same pieces benchmarks/recompute.py uses.
Times are interleaved (each round runs every policy once, rotating the order) and reported as the
median over rounds of the per-round ratio to "none", so a shared machine hits all policies alike.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from matplotlib.figure import Figure

from largebatch.experiments.report import Report, finish_figure, markdown_table
from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.memory import apply_recompute, measure_forward_bytes, model_activation_bytes
from largebatch.models import GPT, RECOMPUTE_POLICIES, ModelConfig, preset

MIB = 2 ** 20
# Per size: model, micro-batch, timed rounds.
SETTINGS = {
    "smoke": (ModelConfig(n_layer=2, n_embd=32, n_head=2, seq_len=32, vocab_size=256), 2, 2),
    "quick": (preset("demo"), 8, 5),
    "full": (preset("demo"), 8, 20),
}


def train_step(model: GPT, policy: str, idx: torch.Tensor) -> None:
    """Forward and backward of the model under one recompute policy (idx: (b, s) token ids)."""
    apply_recompute(model, policy)
    _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure_policies(config: ModelConfig, micro_batch: int, rounds: int) -> list[dict]:
    """One row per policy: measured and predicted activation bytes, step times (interleaved)."""
    torch.manual_seed(0)
    model = GPT(config).train()
    idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))  # (b, s)
    rows = {}
    for policy in RECOMPUTE_POLICIES:
        apply_recompute(model, policy)
        for _ in range(2):  # the first measurement also counts one-time dispatch caches
            (_, loss), memory = measure_forward_bytes(lambda: model(idx, idx))
            loss.backward()
        model.zero_grad(set_to_none=True)
        predicted = model_activation_bytes(config, micro_batch, policy, dtype_bytes=4, device="cpu")
        rows[policy] = {"policy": policy, "measured": memory.tensor_bytes, "predicted": predicted}
    times = time_interleaved({p: functools.partial(train_step, model, p, idx)
                              for p in RECOMPUTE_POLICIES}, rounds)
    ratios = median_ratios(times, "none")
    for policy, row in rows.items():
        row["time_ratio"], row["min_ms"] = ratios[policy], 1e3 * min(times[policy])
    return list(rows.values())


def run(size: str, out_dir: Path, command: str, log=print, execution=None) -> Report:
    """``execution`` is accepted for a uniform interface: this experiment times policies in-process."""
    config, micro_batch, rounds = SETTINGS[size]
    report = Report("recompute", "Recomputation policies: measured memory and time vs the "
                    "memory model (Korthikanti et al. 2022)", command, arms=False)
    report.add(f"""GPT {config.n_layer} layers x {config.n_embd} hidden, {config.n_head} heads, seq
{config.seq_len}, vocab {config.vocab_size}, micro-batch {micro_batch}, fp32 on CPU, {rounds}
interleaved timing rounds. "measured" = bytes of tensors the forward leaves alive for backward
(largebatch.memory.measure_forward_bytes); "predicted" = largebatch.memory.model_activation_bytes
with 4-byte activations.""")
    by_attention = {}
    for attention in ("explicit", "sdpa"):
        rows = measure_policies(config.replace(attention=attention), micro_batch, rounds)
        by_attention[attention] = rows
        log(f"  recompute {attention}: " + ", ".join(
            f"{r['policy']} {r['measured'] / MIB:.1f} MiB {r['time_ratio']:.2f}x" for r in rows))
        report.add(f"## {attention} attention\n\n" + markdown_table(
            ["policy", "measured MiB", "predicted MiB", "measured / predicted", "min step ms",
             "time / none"],
            [[r["policy"], f"{r['measured'] / MIB:.2f}", f"{r['predicted'] / MIB:.2f}",
              f"{r['measured'] / r['predicted']:.3f}", f"{r['min_ms']:.1f}",
              f"{r['time_ratio']:.3f}x"] for r in rows]))
    full = {a: next(r for r in rows if r["policy"] == "full") for a, rows in by_attention.items()}
    selective = by_attention["explicit"][RECOMPUTE_POLICIES.index("selective")]
    none = by_attention["explicit"][0]
    report.add(f"""## What this shows

- explicit attention: selective recompute keeps {100 * selective['measured'] / none['measured']:.0f}%
  of the activation bytes of "none" at {selective['time_ratio']:.2f}x its step time; full keeps
  {100 * full['explicit']['measured'] / none['measured']:.0f}% at {full['explicit']['time_ratio']:.2f}x
  (paper, GPU at scale: selective +2-7%, full +36-39% of step time).
- CPU timings are a proxy only: the ratio of recompute cost to step time depends on the kernels.""")
    report.plots.append(plot_policies(by_attention, out_dir / "recompute.png").name)
    return report


def plot_policies(by_attention: dict[str, list[dict]], path: Path) -> Path:
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    width = 0.2
    for i, (attention, rows) in enumerate(by_attention.items()):
        x = range(len(rows))
        axes[0].bar([p + (2 * i - 1) * width for p in x], [r["measured"] / MIB for r in rows],
                    width, color=f"C{i}", label=f"{attention} measured")
        axes[0].plot([p + (2 * i - 1) * width for p in x], [r["predicted"] / MIB for r in rows],
                     "k_", markersize=18, label="predicted" if i == 0 else None)
        axes[1].bar([p + (2 * i - 1) * width for p in x], [r["time_ratio"] for r in rows], width,
                    color=f"C{i}", label=attention)
    for ax in axes:
        ax.set_xticks(range(len(RECOMPUTE_POLICIES)), RECOMPUTE_POLICIES)
    axes[0].set(ylabel="activation MiB (forward -> backward)", title="memory: measured vs model")
    axes[1].set(ylabel="step time / none", title="step time (median per-round ratio)")
    return finish_figure(fig, axes, path, legend_axes=axes)
