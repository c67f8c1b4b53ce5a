"""The gradient noise scale over training, and Seesaw capped by it.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (docs/papers.md: schedules): the simple
noise scale B_simple = tr(Sigma) / |G|^2 predicts the critical batch size and grows as the loss
falls. The trainer estimates it every step from the first micro-batch's gradient and the
accumulated step's gradient (App. A; two batch sizes, EMA-smoothed numerator and denominator).
Arms (AdamW, warmup + cosine, equal tokens):
  constant     -- a constant batch B0: B_simple and the loss over training
  seesaw       -- Seesaw r = 1/2 from B0 (Meterez et al. 2025), uncapped
  seesaw-capped -- the same, with the batch capped at NOISE_MULTIPLE x the measured B_simple
                   (schedule.noise_scale_multiple: adaptive Seesaw)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from largebatch.experiments.report import Report, finish_figure, fmt_loss, markdown_table, plot_schedules
from largebatch.experiments.runner import Arm, ArmResult, Execution, base_overrides, run_arms

SETTINGS = {"smoke": (8, 2), "quick": (16, 4), "full": (16, 4)}  # start batch, micro-batch
NOISE_MULTIPLE = 1.0
PEAK_LR = 3e-3


def arms(size: str) -> list[Arm]:
    batch, micro = SETTINGS[size]
    shared = {"optim.name": "adamw", "optim.weight_decay": 0.1, "schedule.peak_lr": PEAK_LR,
              "schedule.batch_size": batch, "run.micro_batch": micro, "schedule.ratio": 0.5}
    return [Arm("constant", {**shared, "schedule.batch_policy": "constant"},
                label=f"constant batch {batch}"),
            Arm("seesaw", {**shared, "schedule.batch_policy": "seesaw"}, label="Seesaw r=1/2"),
            Arm("seesaw-capped", {**shared, "schedule.batch_policy": "seesaw",
                                  "schedule.noise_scale_multiple": NOISE_MULTIPLE},
                label=f"Seesaw r=1/2, batch <= {NOISE_MULTIPLE:g} x B_simple")]


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (ties broken by order; fine for continuous values)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var = sum((a - mean) ** 2 for a in rx)
    return cov / var if var else float("nan")


def noise_over_training(result: ArmResult) -> list[list[object]]:
    """B_simple and the training loss at 10%, 25%, 50%, 75% and 100% of the steps."""
    records = [t for t in result.train if t.get("noise_scale") is not None]
    rows = []
    for fraction in (0.1, 0.25, 0.5, 0.75, 1.0):
        t = records[max(0, round(fraction * len(records)) - 1)]
        rows.append([f"{100 * fraction:.0f}%", t["step"], t["tokens"], f"{t['loss']:.4f}",
                     f"{t['noise_scale']:.1f}"])
    return rows


def run(size: str, out_dir: Path, command: str, log=print, execution: Execution = Execution()) -> Report:
    base = base_overrides(size)
    results = run_arms(arms(size), base, out_dir, log, execution)
    constant = results[0]
    report = Report("noise-scale", "Gradient noise scale over training, and Seesaw capped by it "
                    "(McCandlish et al. 2018)", command)
    report.add(f"""AdamW, peak LR {PEAK_LR:g}, warmup + cosine; {base['model.n_layer']} layers x
{base['model.n_embd']} hidden, seq {base['model.seq_len']}, {base['run.total_tokens']:,} tokens of
Shakespeare per arm. B_simple is in sequences, EMA 0.95, from micro-batch {SETTINGS[size][1]} vs
the whole step.""")
    report.add("## B_simple over training (constant batch)\n\n" + markdown_table(
        ["point", "step", "tokens", "train loss", "B_simple"], noise_over_training(constant)))
    records = [t for t in constant.train if t.get("noise_scale") is not None]
    rho = rank_correlation([t["loss"] for t in records], [t["noise_scale"] for t in records])
    report.add("## Arms\n\n" + markdown_table(
        ["arm", "final val loss", "optimizer steps", "final batch", "final B_simple"],
        [[r.arm.name, fmt_loss(r.final_val_loss), r.steps, r.final_batch,
          "n/a" if r.summary.get("noise_scale") is None else f"{r.summary['noise_scale']:.1f}"]
         for r in results]))
    grows = "grows" if rho < 0 else "does NOT grow"
    report.add(f"""## What this shows

- Spearman rank correlation between training loss and B_simple over the constant-batch run:
  {rho:+.2f} (negative: B_simple {grows} as the loss falls; McCandlish et al. predict it grows).
- Capped Seesaw ends at batch {results[2].final_batch} vs {results[1].final_batch} uncapped, after
  {results[2].steps} vs {results[1].steps} steps; final val loss {fmt_loss(results[2].final_val_loss)}
  vs {fmt_loss(results[1].final_val_loss)}.""")
    report.plots.append(plot_noise(results, out_dir / "noise_scale.png").name)
    report.plots.append(plot_schedules(results, out_dir / "schedules.png",
                                       "Realised LR and batch schedules").name)
    return report


def plot_noise(results: list[ArmResult], path: Path) -> Path:
    fig, (ax_noise, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(results):
        records = [t for t in r.train if t.get("noise_scale") is not None]
        tokens = [t["tokens"] for t in records]
        ax_noise.plot(tokens, [t["noise_scale"] for t in records], color=f"C{i}", label=r.arm.legend)
        ax_noise.step([t["tokens"] for t in r.train], [t["batch_size"] for t in r.train], ":",
                      where="post", color=f"C{i}")
        ax_loss.plot([v["tokens"] for v in r.val], [v["val_loss"] for v in r.val], marker=".",
                     color=f"C{i}", label=r.arm.legend)
    ax_noise.set(xlabel="tokens", ylabel="sequences", yscale="log",
                 title="B_simple (solid) and batch size (dotted)")
    ax_loss.set(xlabel="tokens", ylabel="validation loss", title="validation loss")
    return finish_figure(fig, (ax_noise, ax_loss), path, legend_axes=(ax_noise, ax_loss))
