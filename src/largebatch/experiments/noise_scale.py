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
Every arm runs at each of ``--seeds N`` seeds (default 2; init and data order, ``*-seed7`` etc.; the
first seed is the config's, 1337). A seed's arms share init and data order, so "seesaw minus
constant", "seesaw-capped minus constant" and "seesaw-capped minus seesaw" are paired per seed, each
with its 95% t interval over the seeds, a noise floor (experiments/floor.py: the first seed's arms
re-run under harmless perturbations; smoke size: another data order only) and floor.verdict. The
Spearman correlation between the constant arm's training loss and B_simple is given per seed, with
its own floor (its move under the same perturbations); the B_simple checkpoints are the first seed's.
With one seed there is no interval and no floor is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from largebatch.experiments import floor as noise_floor
from largebatch.experiments.report import (
    ESCAPE_HEADER,
    Report,
    finish_figure,
    fmt_escape,
    fmt_loss,
    markdown_table,
    plot_schedules,
)
from largebatch.experiments.runner import Arm, ArmResult, Execution, arm_threads, base_overrides, run_arms


@dataclass(frozen=True)
class Setting:
    batch: int
    """Start batch (sequences) of every arm."""
    micro: int
    seeds: int = 2
    """Seeds per arm by default (``--seeds N`` changes it)."""
    floor: tuple[str, ...] = noise_floor.PERTURBATIONS
    """Perturbations that measure the noise floor (experiments/floor.py)."""


SETTINGS = {"smoke": Setting(8, 2, 2, ("data",)), "quick": Setting(16, 4), "full": Setting(16, 4)}
NOISE_MULTIPLE = 1.0
PEAK_LR = 3e-3
RHO = "Spearman rho(train loss, B_simple), constant batch"
# (name, arm index minus arm index) of the paired comparisons, arms in the order of ``arms``
COMPARISONS = (("seesaw - constant", 1, 0), ("seesaw-capped - constant", 2, 0),
               ("seesaw-capped - seesaw", 2, 1))


check_seeds = noise_floor.check_seeds


def arms(size: str) -> list[Arm]:
    batch, micro = SETTINGS[size].batch, SETTINGS[size].micro
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


def loss_noise_rho(result: ArmResult) -> float:
    """Spearman's rho between the training loss and B_simple over a run's steps."""
    records = [t for t in result.train if t.get("noise_scale") is not None]
    return rank_correlation([t["loss"] for t in records], [t["noise_scale"] for t in records])


def run(size: str, out_dir: Path, command: str, log=print, execution: Execution = Execution(),
        seeds: int | None = None) -> Report:
    setting = SETTINGS[size]
    seeds = check_seeds(setting.seeds if seeds is None else seeds)
    base = base_overrides(size)
    first_arms = arms(size)
    every = [noise_floor.seeded(a, seed) for seed in noise_floor.SEEDS[:seeds] for a in first_arms]
    ran = run_arms(every, base, out_dir, log, execution)
    n = len(first_arms)
    per_seed = [ran[i * n:(i + 1) * n] for i in range(seeds)]
    results = per_seed[0]
    threads = arm_threads(execution)
    kinds = setting.floor if seeds > 1 else ()
    perturbed = noise_floor.measure(first_arms, results, kinds, threads, base, out_dir, log, execution)[1]
    constant = results[0]
    comparisons = [noise_floor.compare(name, lambda rs, i=i, j=j: rs[i].final_val_loss - rs[j].final_val_loss,
                                       per_seed, perturbed, "worse", "better") for name, i, j in COMPARISONS]
    rho = noise_floor.compare(RHO, lambda rs: loss_noise_rho(rs[0]), per_seed, perturbed,
                              "positive: B_simple falls with the loss", "negative: B_simple grows as the loss falls",
                              bounds=(-1.0, 1.0))  # a rank correlation: the t interval cut to [-1, 1]
    report = Report("noise-scale", "Gradient noise scale over training, and Seesaw capped by it "
                    "(McCandlish et al. 2018)", command, threads=threads)
    report.add(f"""AdamW, peak LR {PEAK_LR:g}, warmup + cosine; {base['model.n_layer']} layers x
{base['model.n_embd']} hidden, seq {base['model.seq_len']}, {base['run.total_tokens']:,} tokens of
Shakespeare per arm. B_simple is in sequences, EMA 0.95, from micro-batch {setting.micro} vs
the whole step. {seeds} seed(s) per arm ({', '.join(noise_floor.seed_name(s) for s in noise_floor.SEEDS[:seeds])}:
init and data order). {noise_floor.threads_sentence(threads, kinds)}""")
    report.add("## B_simple over training (constant batch, seed 1337)\n\n" + markdown_table(
        ["point", "step", "tokens", "train loss", "B_simple"], noise_over_training(constant)))
    report.add("## Loss vs B_simple per seed (constant batch)\n\n" + markdown_table(
        ["seed", "Spearman rho(train loss, B_simple)", "final B_simple", "final val loss"],
        [[noise_floor.seed_name(seed), f"{loss_noise_rho(rs[0]):+.4f}",
          "n/a" if rs[0].summary.get("noise_scale") is None else f"{rs[0].summary['noise_scale']:.1f}",
          fmt_loss(rs[0].final_val_loss)] for seed, rs in zip(noise_floor.SEEDS, per_seed)]))
    report.add("## Arms\n\n" + markdown_table(
        ["arm", "seed", "final val loss", "optimizer steps", "final batch", "final B_simple", ESCAPE_HEADER],
        [[r.arm.name, noise_floor.seed_name(seed), fmt_loss(r.final_val_loss), r.steps, r.final_batch,
          "n/a" if r.summary.get("noise_scale") is None else f"{r.summary['noise_scale']:.1f}", fmt_escape(r)]
         for seed, rs in zip(noise_floor.SEEDS, per_seed) for r in rs]))
    report.add(f"## Paired comparisons over seeds\n\nFinal validation loss of one arm minus another at "
               f"the same seed; Spearman rho per seed. The noise floor is the largest move of the seed-1337 "
               f"value when every arm is re-run with one harmless change "
               f"({', '.join(kinds) or 'not measured: one seed'}).\n\n" + markdown_table(
                   ["comparison"] + noise_floor.COMPARISON_HEADERS,
                   [[c.gaps.name] + c.row() for c in (*comparisons, rho)]))
    if perturbed:
        report.add("## Noise floor\n\n" + noise_floor.floor_table(
            [c.floor for c in (*comparisons, rho)], threads, "value", "comparison"))
    report.add(findings(comparisons, rho, per_seed))
    report.plots.append(plot_noise(results, out_dir / "noise_scale.png").name)
    report.plots.append(plot_schedules(results, out_dir / "schedules.png",
                                       "Realised LR and batch schedules").name)
    return report


def findings(comparisons: list[noise_floor.Comparison], rho: noise_floor.Comparison,
             per_seed: list[list[ArmResult]]) -> str:
    """Each claim with the verdict of its comparison: agrees / contradicts / not resolvable."""
    seesaw, capped, capped_vs_seesaw = comparisons
    first = per_seed[0]
    stuck = noise_floor.never_left_plateau(per_seed)
    lines = ["## What this shows\n",
             noise_floor.claim_line("B_simple grows as the training loss falls (McCandlish et al. 2018)", rho,
                                    rho.better, rho.worse, unit=""),
             *(noise_floor.claim_line(text, c, "better", "worse",
                                      on_plateau=noise_floor.both_on_plateau(per_seed, i, j))
               for text, c, (_, i, j) in zip(
                   ("Seesaw r=1/2 ends below constant batch at equal tokens, with fewer steps",
                    "Seesaw capped at B_simple ends below constant batch",
                    "capping Seesaw's batch at B_simple ends below uncapped Seesaw"),
                   (seesaw, capped, capped_vs_seesaw), COMPARISONS)),
             f"- Capped Seesaw ends at batch {first[2].final_batch} vs {first[1].final_batch} uncapped, after "
             f"{first[2].steps} vs {first[1].steps} steps (constant: {first[0].steps}; seed 1337).",
             f"- Arms that never leave the unigram plateau: {len(stuck)} of {sum(len(rs) for rs in per_seed)}"
             + (f" ({', '.join(stuck)})." if stuck else "."),
             "- A difference is established only when its 95% interval excludes 0 and it exceeds the noise floor."]
    return "\n".join(lines)


def plot_noise(results: list[ArmResult], path: Path) -> Path:
    fig = Figure(figsize=(12, 4.5))
    ax_noise, ax_loss = fig.subplots(1, 2)
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
