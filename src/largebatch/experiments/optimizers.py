"""AdamW vs the layer-wise adaptive optimizers as the batch grows, at equal tokens.

LAMB (You et al. 2019, Alg. 2), LANS (Zheng et al. 2020, Alg. 1), LARS (You, Gitman, Ginsburg 2017,
Alg. 1) and torch.optim.AdamW (docs/papers.md: optimizers), each at a small batch B and at 8B and 32B, with the
same token budget (so 8x / 32x fewer optimizer steps), warmup + cosine. The LR is tuned per
optimizer and batch on a small grid (quick mode: 2 points, full mode: 4) centred by the square-root
rule: at m x the small batch the grid is multiplied by sqrt(m). Each cell reports its best LR, marked
"(edge)" when that LR is at an end of a grid of 3+ points (the optimum may lie beyond it).
The papers' claim: LAMB and LANS hold their loss at batch sizes where AdamW degrades.
"The batch beyond which an optimizer degrades" is read off as the first batch whose best loss is
more than DEGRADE_NATS above that optimizer's small-batch loss.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from largebatch.experiments.report import Report, finish_figure, fmt_loss, markdown_table, plot_validation
from largebatch.experiments.runner import Arm, ArmResult, Execution, base_overrides, run_arms
from largebatch.train.optimizer import OPTIMIZERS as REGISTERED

MULTIPLES = (1, 8, 32)
DEGRADE_NATS = 0.05
# LR grid per optimizer, by its name in the optimizer registry (largebatch.train.optimizer)
LR_GRID = {"adamw": (1e-3, 3e-3, 1e-2, 3e-2), "lamb": (3e-3, 1e-2, 3e-2, 1e-1),
           "lans": (3e-3, 1e-2, 3e-2, 1e-1), "lars": (1.0, 3.0, 10.0, 30.0)}
if set(LR_GRID) - set(REGISTERED):  # a renamed or removed optimizer fails here, not mid-experiment
    raise ImportError(f"experiments.optimizers: LR_GRID names {sorted(set(LR_GRID) - set(REGISTERED))}, "
                      f"not registered optimizers ({', '.join(REGISTERED)})")
OPTIMIZERS = tuple(LR_GRID)  # the registered optimizers this experiment has an LR grid for
# Per size: small batch, token budget, LR grid per optimizer.
SETTINGS = {"smoke": (2, 12_288, {k: v[2:3] for k, v in LR_GRID.items()}),
            "quick": (4, 98_304, {k: v[1:3] for k, v in LR_GRID.items()}),
            "full": (8, 1_048_576, LR_GRID)}


def grid_arms(size: str) -> list[Arm]:
    small, _, grid = SETTINGS[size]
    arms = []
    for multiple in MULTIPLES:
        batch = small * multiple
        for name in OPTIMIZERS:
            for lr in (float(f"{base_lr * multiple ** 0.5:.3g}") for base_lr in grid[name]):
                overrides = {"optim.name": name, "optim.weight_decay": 0.01,
                             "schedule.peak_lr": lr, "schedule.batch_size": batch,
                             "schedule.batch_policy": "constant",
                             "run.micro_batch": min(batch, 32)}
                arms.append(Arm(f"{name}-b{batch}-lr{lr:g}", overrides, group=f"batch {batch}",
                                label=f"{name} lr {lr:g}"))
    return arms


def best_per_cell(results: list[ArmResult]) -> dict[tuple[str, int], ArmResult]:
    """(optimizer, batch) -> the arm with the lowest final validation loss over the LR grid."""
    best: dict[tuple[str, int], ArmResult] = {}
    for r in results:
        key = (r.arm.overrides["optim.name"], r.arm.overrides["schedule.batch_size"])
        if key not in best or r.final_val_loss < best[key].final_val_loss:
            best[key] = r
    return best


def degrades_beyond(best: dict[tuple[str, int], ArmResult], name: str, batches: list[int]) -> str:
    reference = best[(name, batches[0])].final_val_loss
    for previous, batch in zip(batches, batches[1:]):
        if best[(name, batch)].final_val_loss > reference + DEGRADE_NATS:
            return f"{previous} (at {batch}: +{best[(name, batch)].final_val_loss - reference:.3f})"
    return f"holds to {batches[-1]}"


def run(size: str, out_dir: Path, command: str, log=print, execution: Execution = Execution()) -> Report:
    small, tokens, grid = SETTINGS[size]
    base = {**base_overrides(size), "run.total_tokens": tokens,
            "run.eval_every_tokens": tokens // 16}
    results = run_arms(grid_arms(size), base, out_dir, log, execution)
    best = best_per_cell(results)
    batches = [small * m for m in MULTIPLES]
    report = Report("optimizers", "AdamW vs LAMB / LANS / LARS as the batch grows, equal tokens",
                    command)
    report.add(f"""{base['model.n_layer']} layers x {base['model.n_embd']} hidden, seq
{base['model.seq_len']}, vocab {base['data.vocab_size']}, {tokens:,} tokens of Shakespeare per run,
10% warmup + cosine to 0.1 x peak, weight decay 0.01, no gradient clipping. LR grid per optimizer
at batch {small} (x sqrt(batch / {small}) at larger batches):
{'; '.join(f'{k} {list(v)}' for k, v in grid.items())}.""")
    rows = []
    for name in OPTIMIZERS:
        row: list[object] = [name]
        for batch in batches:
            r = best[(name, batch)]
            lr = r.arm.overrides["schedule.peak_lr"]
            lrs = [a.arm.overrides["schedule.peak_lr"] for a in results
                   if a.arm.overrides["optim.name"] == name
                   and a.arm.overrides["schedule.batch_size"] == batch]
            edge = " (edge)" if len(lrs) > 2 and lr in (min(lrs), max(lrs)) else ""
            row.append(f"{fmt_loss(r.final_val_loss)} (lr {lr:g}{edge}, {r.steps} steps)")
        row.append(degrades_beyond(best, name, batches))
        rows.append(row)
    headers = ["optimizer"] + [f"batch {b}" for b in batches] + [
        f"largest batch within {DEGRADE_NATS} nats of batch {batches[0]}"]
    report.add("## Best final validation loss per optimizer and batch\n\n"
               + markdown_table(headers, rows))
    report.add("## Every run\n\n" + markdown_table(
        ["arm", "optimizer", "batch", "peak lr", "final val loss", "optimizer steps"],
        [[r.arm.name, r.arm.overrides["optim.name"], r.arm.overrides["schedule.batch_size"],
          f"{r.arm.overrides['schedule.peak_lr']:g}", fmt_loss(r.final_val_loss), r.steps]
         for r in results]))
    winners = [min(OPTIMIZERS, key=lambda n: best[(n, b)].final_val_loss) for b in batches]
    report.add("## What this shows\n\n" + "\n".join(
        f"- batch {b}: lowest loss {winner} ({fmt_loss(best[(winner, b)].final_val_loss)})"
        for b, winner in zip(batches, winners)) + "\n- Papers: LAMB/LANS hold the loss where "
        "AdamW degrades (BERT at batch 32K-96K). A tiny model at a few hundred thousand tokens is "
        "far from that regime; read the table as what happens here, not as a verdict on the paper.")
    report.plots.append(plot_loss_vs_batch(best, batches, out_dir / "loss_vs_batch.png").name)
    report.plots.append(plot_validation(list(best.values()), out_dir / "val_loss.png",
                                        "Best LR per optimizer and batch: validation loss").name)
    return report


def plot_loss_vs_batch(best: dict[tuple[str, int], ArmResult], batches: list[int], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(OPTIMIZERS):
        losses = [best[(name, b)].final_val_loss for b in batches]
        ax.plot(batches, losses, marker="o", color=f"C{i}", label=name)
    ax.set(xscale="log", xlabel="batch size (sequences), equal tokens",
           ylabel="best final validation loss", title="Loss vs batch size (LR tuned per cell)")
    ax.set_xticks(batches, [str(b) for b in batches])
    return finish_figure(fig, (ax,), path, legend_axes=(ax,))
