"""Seesaw vs cosine at equal tokens (Meterez et al. 2025; docs/papers.md: schedules).

Arms, each from the same starting batch B0 and the same token budget, AdamW:
  cosine        -- warmup + cosine to 0.1 x peak at constant batch B0 (the base)
  seesaw-r0.5   -- Seesaw, r = 1/2: at each milestone LR x sqrt(r), batch x 1/r
  seesaw-r0.91  -- Seesaw, r = 1/1.1 (the paper's main runs)
  seesaw-r0.91-mb1 -- the same at micro-batch 1. A batch is a multiple of the micro-batch: at
                  micro-batch 4 the batch 16 grows only every few milestones (16, 16, 16, 20, 20,
                  24, ...); at micro-batch 1 it grows by 1.1 at every milestone, in whole sequences
                  (16, 17, 19, 21, ...). The pair separates the schedule from the batch granularity.
                  At smoke size, and at any size with ``--granularity`` (its runs take 2-3x the
                  others': see SETTINGS).
  smith-r0.5    -- Smith et al. 2017: batch x 1/r at constant LR (the alpha = 1 corner)
Every arm runs at each of ``seeds`` seeds (init and data order; ``*-seed7`` etc.; the first seed is
the config default, 1337). A seed's arms share init and data order, so the gap "arm minus cosine"
is paired per seed; the report gives each seed's table and the mean, standard deviation and range
of the paired gaps over seeds; with two or more seeds, each group's first-seed arms are re-run
under the noise floor's perturbations (with one seed there is no interval, and no floor is run).
The paper's claim: below the critical batch size Seesaw matches cosine's validation loss with ~38%
fewer optimizer steps (r = 1/1.1: 61.55% of cosine's steps); starting above it, Seesaw loses.

The critical batch is measured, not assumed: the first seed's cosine arm at B0 logs the gradient
noise scale B_simple (McCandlish et al. 2018); its median over the second half of training is the
estimate. The second group then starts at a batch above it (the larger of the size's default and
the next power of two >= 2 x B_simple, at most 4x the default). Its token budget is the larger of
the first group's and what gives cosine the size's minimum number of steps at that batch: at equal
tokens a start batch 8-16x larger leaves cosine so few steps that every arm is still near the
unigram loss, which says nothing about the claim (measured: full size, batch 256, 48 steps).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from largebatch.experiments import floor as noise_floor
from largebatch.experiments.report import (
    ESCAPE_HEADER,
    Report,
    fmt_escape,
    fmt_loss,
    markdown_table,
    plot_schedules,
    plot_validation,
)
from largebatch.experiments.runner import (
    Arm,
    ArmResult,
    Execution,
    arm_threads,
    base_overrides,
    run_arms,
    steps_to_reach,
)


@dataclass(frozen=True)
class Setting:
    below: int
    """Start batch (sequences) of the first group, below the critical batch."""
    micro_below: int
    above: int
    """Default start batch of the second group (raised if the measured critical batch needs it)."""
    peak_lr: float
    above_steps: int
    """The second group's budget gives cosine at least this many optimizer steps."""
    seeds: int
    """Seeds per arm by default (``--seeds N`` changes it)."""
    floor: tuple[str, ...] = noise_floor.PERTURBATIONS
    """Perturbations that measure each group's noise floor (experiments/floor.py)."""
    eval_tokens: int | None = None
    """Tokens per evaluation (None: the size's, runner.SIZE_OVERRIDES), as in the optimizers' Setting."""
    evaluations: int = 20
    """Evaluations per arm after the first (every total_tokens / evaluations tokens, the last at the
    end): they give the validation curves and each arm's plateau-escape step. The final loss is the
    same at any number (evaluation does not change training)."""
    granularity: bool = False
    """Also run seesaw-r0.91-mb1, the micro-batch-1 twin of Seesaw r=1/1.1 (GRANULARITY_PAIR; at any
    size with ``--granularity``). Its runs take 2-3x the others' time (the batch in forwards of one
    sequence)."""


# quick: the second group gets >= 96 cosine steps; arms leave the unigram plateau after ~25-40 steps at
# any batch (measured: batch 128, 48 steps: 1 of 4 runs left it; 96 steps at batch 64 or 128: all did).
# The micro-batch-1 pair runs by default at smoke size only (what the tests run), elsewhere with
# --granularity: at quick size its 10 runs took 35% of the arms' time (740 of 2,110 s on 2026-12-01)
# and kept the quick run over 10 minutes; at full size they run at ~1,350 tokens/s against ~4,400.
# quick evaluates 10 times an arm, not 20: its 21 evaluations of 16,384 tokens were ~30% of an arm's
# time (measured on quiet cores, 2026-12-02: 294 s for the 2-seed run with 20, 249 s with 10).
# full: 96 too (192 until 2026-12-02: 3,145,728 tokens an arm from batch 128, twice the first group's,
# which put the 50 runs of 2 seeds and the floor at ~4 hours; at 96 steps both groups get 1,572,864),
# with 16,384 evaluation tokens (65,536 until 2026-12-02; 21 evaluations of 65,536 tokens cost about
# a quarter of an arm). Tried on 2026-12-02 and dropped: 786,432 tokens from batch 16 at 2% warmup
# (the quick size's): cosine left the unigram plateau only at step ~100-250 of 384 and ended 0.2 nats
# apart at two seeds, the late, chaotic escape the quick setup avoids.
SETTINGS = {"smoke": Setting(8, 2, 64, 3e-3, 8, 2, ("data",), granularity=True),
            "quick": Setting(16, 4, 64, 3e-3, 96, 2, evaluations=10),
            "full": Setting(16, 4, 128, 2e-3, 96, 2, eval_tokens=16_384)}
SEEDS = noise_floor.SEEDS  # None: the config's defaults (run.seed 1337)
seed_name = noise_floor.seed_name
ARMS = (("cosine", "constant", 0.5), ("seesaw-r0.5", "seesaw", 0.5),
        ("seesaw-r0.91", "seesaw", 1 / 1.1), ("seesaw-r0.91-mb1", "seesaw", 1 / 1.1),
        ("smith-r0.5", "smith", 0.5))
LABELS = {"cosine": "AdamW + cosine", "seesaw-r0.5": "Seesaw r=1/2",
          "seesaw-r0.91": "Seesaw r=1/1.1",
          "seesaw-r0.91-mb1": "Seesaw r=1/1.1, micro-batch 1 (batch x1.1 per milestone)",
          "smith-r0.5": "constant LR, batch x2 (Smith)"}
MICRO_BATCH = {"seesaw-r0.91-mb1": 1}  # arms whose micro-batch is not the group's
GRANULARITY_PAIR = ("seesaw-r0.91", "seesaw-r0.91-mb1")  # the same schedule, two batch granularities


def arm_kinds(setting: Setting) -> tuple[str, ...]:
    """The arms a setting runs, in ARMS order (cosine first)."""
    return tuple(name for name, _, _ in ARMS if setting.granularity or name != GRANULARITY_PAIR[1])


check_seeds = noise_floor.check_seeds


def arms_from(start_batch: int, micro_batch: int, peak_lr: float, group: str, seeds: int = 1,
              extra: dict | None = None, kinds: tuple[str, ...] | None = None) -> list[list[Arm]]:
    """The arms of one group, one list per seed (cosine first in each); ``kinds``: which of ARMS
    (None: all)."""
    per_seed = []
    for seed in SEEDS[:check_seeds(seeds)]:
        arms = []
        for name, policy, ratio in ARMS:
            if kinds is not None and name not in kinds:
                continue
            overrides = {"optim.name": "adamw", "optim.weight_decay": 0.1,
                         "schedule.peak_lr": peak_lr, "schedule.batch_size": start_batch,
                         "schedule.batch_policy": policy, "schedule.ratio": ratio,
                         "run.micro_batch": MICRO_BATCH.get(name, micro_batch), **(extra or {})}
            label = LABELS[name]
            arm_name = f"{group}-{name}"
            if seed is not None:
                overrides.update({"run.seed": seed, "data.seed": seed})
                label, arm_name = f"{label}, seed {seed}", f"{arm_name}-seed{seed}"
            arms.append(Arm(arm_name, overrides, group=group, label=label))
        per_seed.append(arms)
    return per_seed


def critical_batch(result: ArmResult) -> float | None:
    """Median B_simple (sequences) over the second half of a run's steps."""
    values = [t["noise_scale"] for t in result.train[len(result.train) // 2:]
              if t.get("noise_scale") is not None]
    return statistics.median(values) if values else None


def above_batch(default: int, b_crit: float | None) -> int:
    """The second group's start batch: the default, or the next power of two >= 2 x B_simple if
    that is larger, at most 4x the default (each doubling doubles that group's budget)."""
    batch = default
    if b_crit is not None:
        batch = max(batch, 2 ** math.ceil(math.log2(max(2.0, 2 * b_crit))))
    return min(batch, 4 * default)


def above_budget(total_tokens: int, batch: int, seq_len: int, min_steps: int) -> int:
    """Tokens per arm of the second group: cosine gets >= min_steps steps, and never fewer tokens
    than the first group."""
    return max(total_tokens, min_steps * batch * seq_len)


def group_table(results: list[ArmResult]) -> str:
    """One row per arm: final loss, steps, steps saved vs the cosine arm of the group. Tokens are
    what the run consumed: the trainer finishes the step that crosses the budget, so an arm whose
    last batch is large overshoots it (shown, not hidden)."""
    cosine = results[0]
    rows = []
    for r in results:
        reached = steps_to_reach(r, cosine.final_val_loss)
        rows.append([r.arm.name, fmt_loss(r.final_val_loss),
                     f"{r.final_val_loss - cosine.final_val_loss:+.4f}", r.tokens, r.steps,
                     f"{100 * (1 - r.steps / cosine.steps):.1f}%", r.final_batch,
                     "not reached" if reached is None else reached, fmt_escape(r), f"{r.wall_seconds:.1f}"])
    headers = ["arm", "final val loss", "vs cosine", "tokens", "optimizer steps", "steps saved",
               "final batch", f"steps to cosine's {fmt_loss(cosine.final_val_loss)}", ESCAPE_HEADER, "wall s"]
    return markdown_table(headers, rows)


@dataclass(frozen=True)
class PairedGaps(noise_floor.Gaps):
    """One arm's final validation loss minus cosine's at the same seed, over seeds (mean, sd and
    95% interval: floor.Gaps), and its share of cosine's steps saved."""

    steps_saved: list[float]

    @property
    def arm(self) -> str:
        return self.name

    @property
    def ahead(self) -> int:
        """Seeds at which the arm ends at or below cosine's loss."""
        return sum(g <= 0 for g in self.gaps)


def paired_gaps(per_seed: list[list[ArmResult]]) -> list[PairedGaps]:
    """Per non-cosine arm: its gap to the same seed's cosine arm (index 0), for every seed."""
    out = []
    kinds = _kinds(per_seed)
    for i in range(1, len(per_seed[0])):
        out.append(PairedGaps(LABELS[kinds[i]],
                              [s[i].final_val_loss - s[0].final_val_loss for s in per_seed],
                              [100 * (1 - s[i].steps / s[0].steps) for s in per_seed]))
    return out


_signed, _interval = noise_floor.signed, noise_floor.interval


def _verdict(p: PairedGaps, floor: noise_floor.Floor | None, on_plateau: int = 0, runs: int = 0) -> str:
    """The gap's interval, floor and verdict; ``on_plateau`` of the pair's ``runs`` never left the
    unigram plateau: then not resolvable, as the claims table judges it (``Claim.verdict``)."""
    if p.ci95 is None:
        return ""
    judged = (f"not resolvable at this scale ({on_plateau} of {runs} runs on the plateau)" if on_plateau else
              noise_floor.verdict(p.mean, p.ci95, None if floor is None else floor.floor,
                                  "worse than cosine", "better than cosine", values=p.finite, nonfinite=p.nonfinite))
    return f"; 95% CI {_interval(p.ci95)}, noise floor {'n/a' if floor is None else f'{floor.floor:.4f}'}: {judged}"


def floor_table(floors: list[noise_floor.Floor], threads: int) -> str:
    """Each arm's gap to cosine (seed 1337) unperturbed and under each perturbation, and the floor."""
    return noise_floor.floor_table(floors, threads, "gap vs cosine")


def seed_table(per_seed: list[list[ArmResult]]) -> str:
    """Mean, sample sd and range over seeds of each arm's paired gap to cosine; cosine's own spread."""
    cosine = [s[0].final_val_loss for s in per_seed]
    finite = [c for c in cosine if math.isfinite(c)]
    rows = [[LABELS["cosine"] + " (final loss itself)", len(cosine),
             fmt_loss(statistics.fmean(finite)) if finite else "n/a",
             f"{statistics.stdev(finite):.4f}" if len(finite) >= 2 else "n/a", "",
             fmt_loss(min(cosine)), fmt_loss(max(cosine)), "", ""]]
    for p in paired_gaps(per_seed):
        diverged = len(p.gaps) - len(p.finite)
        rows.append([p.arm, len(p.gaps), _signed(p.mean), "n/a" if p.sd is None else f"{p.sd:.4f}",
                     _interval(p.ci95), _signed(min(p.finite)) if p.finite else "n/a",
                     _signed(max(p.finite)) if p.finite else "n/a",
                     f"{p.ahead} of {len(p.gaps)}" + (f" ({diverged} diverged)" if diverged else ""),
                     f"{statistics.fmean(p.steps_saved):.1f}%"])
    headers = ["arm", "seeds", "mean gap vs cosine", "sd", "95% CI of the mean", "min", "max",
               "seeds at or below cosine", "steps saved (mean)"]
    return markdown_table(headers, rows)


def run(size: str, out_dir: Path, command: str, log=print, execution: Execution = Execution(),
        seeds: int | None = None, granularity: bool | None = None) -> Report:
    """``granularity``: run the micro-batch-1 pair (None: the size's default, Setting.granularity)."""
    setting = SETTINGS[size]
    base = base_overrides(size)
    base["run.eval_every_tokens"] = base["run.total_tokens"] // setting.evaluations
    if setting.eval_tokens is not None:
        base["run.eval_tokens"] = setting.eval_tokens
    if granularity is not None:
        setting = replace(setting, granularity=granularity)
    seeds = check_seeds(setting.seeds if seeds is None else seeds)
    report = Report("seesaw", "Seesaw vs cosine at equal tokens (Meterez et al. 2025)", command)
    seq_len, total = base["model.seq_len"], base["run.total_tokens"]
    log(f"seesaw ({size}): start batch {setting.below} (below), {seeds} seed(s)")
    kinds = arm_kinds(setting)
    low_arms = arms_from(setting.below, setting.micro_below, setting.peak_lr, "below", seeds, kinds=kinds)
    low = _by_seed(run_arms([a for arms in low_arms for a in arms], base, out_dir, log, execution),
                   len(kinds))
    threads = report.threads = arm_threads(execution)
    # one seed gives no interval, so no verdict can use a floor: not measured (as the other experiments)
    floor_kinds = setting.floor if seeds > 1 else ()
    low_floor, low_perturbed = noise_floor.measure(low_arms[0], low[0], floor_kinds, threads, base, out_dir, log,
                                                   execution)
    b_crit = critical_batch(low[0][0])
    above = above_batch(setting.above, b_crit)
    above_total = above_budget(total, above, seq_len, setting.above_steps)
    measured = "n/a" if b_crit is None else f"{b_crit:.1f}"
    log(f"seesaw ({size}): measured B_simple {measured}; start batch {above} (above), "
        f"{above_total:,} tokens per arm")
    budget = {"run.total_tokens": above_total, "run.eval_every_tokens": above_total // setting.evaluations}
    high_arms = arms_from(above, max(setting.micro_below, above // 8), setting.peak_lr, "above", seeds,
                          extra=budget if above_total != total else None, kinds=kinds)
    high = _by_seed(run_arms([a for arms in high_arms for a in arms], base, out_dir, log, execution),
                    len(kinds))
    high_floor, high_perturbed = noise_floor.measure(high_arms[0], high[0], floor_kinds, threads, base, out_dir,
                                                     log, execution)
    report.add(f"""AdamW (weight decay 0.1), peak LR {setting.peak_lr:g} for every arm,
{100 * base['schedule.warmup']:g}% warmup,
cosine to 0.1 x peak; {base['model.n_layer']} layers x {base['model.n_embd']} hidden, seq {seq_len},
vocab {base['data.vocab_size']}, Shakespeare; {seeds} seed(s) per arm ({', '.join(
        seed_name(s) for s in SEEDS[:seeds])}: init and data order). Tokens per arm: {total:,} from
batch {setting.below}, {above_total:,} from batch {above} (at least {setting.above_steps} cosine steps).
Measured critical batch (median B_simple of the seed-1337 cosine arm at batch {setting.below},
second half of training): **{'n/a' if b_crit is None else f'{b_crit:.1f}'} sequences**.
{noise_floor.threads_sentence(threads, floor_kinds)}""")
    for per_seed, floors in ((low, low_floor), (high, high_floor)):
        start = per_seed[0][0].arm.overrides["schedule.batch_size"]
        side = "n/a" if b_crit is None else ("below" if start < b_crit else "above")
        section = f"## Start batch {start} ({side} the measured critical batch)"
        for seed, results in zip(SEEDS, per_seed):
            section += f"\n\nSeed {seed_name(seed)}:\n\n" + group_table(results)
        if seeds > 1:
            section += (f"\n\nOver {seeds} seeds, each arm's final loss minus the same seed's cosine "
                        f"(paired):\n\n" + seed_table(per_seed))
        if floors:
            section += ("\n\nNoise floor (seed 1337, every arm re-run with one harmless change; the floor "
                        "is the largest move of its gap to cosine; a difference must exceed it):\n\n"
                        + floor_table(floors, threads))
        report.add(section)
    report.add(claims_section(claims(low, high, low_perturbed, high_perturbed, b_crit)))
    report.add(findings(low, high, low_floor, high_floor))
    shown = low[0] + high[0]
    report.plots.append(plot_validation(shown, out_dir / "val_loss.png",
                                        "Seesaw vs cosine: validation loss (seed 1337)").name)
    report.plots.append(plot_schedules(shown, out_dir / "schedules.png",
                                       "Realised LR and batch schedules").name)
    return report



# ---------------------------------------------------------------------------------- the paper's claims
@dataclass(frozen=True)
class Claim:
    """One claim of the paper, tested as the paired gap "arm minus reference" (final validation loss,
    per seed): its interval over seeds and its noise floor (floor.compare: seed 1337's gap moved by
    each harmless perturbation)."""

    text: str
    arm: str
    reference: str
    expect: str
    """"same": the paper finds equal loss; "worse": it finds the arm's loss higher."""
    comparison: noise_floor.Comparison
    on_plateau: tuple[str, ...] = ()
    """Runs of the two arms (any seed) whose validation loss never left the unigram plateau
    (ArmResult.plateau_escape is None): a gap between such runs measures when each escaped, not the
    schedules, so the claim is then not resolvable whatever the interval says."""
    wrong_side: str = ""
    """Why the group's start batch is not on the side of the measured critical batch the claim is
    about (e.g. "start batch 8 is not below the measured critical batch 7.7"): the claim is then not
    tested by these arms; empty when it is (or when no critical batch was measured)."""

    @property
    def verdict(self) -> str:
        if self.on_plateau:
            runs = 2 * len(self.comparison.gaps.gaps)
            return f"not resolvable at this scale ({len(self.on_plateau)} of {runs} runs on the plateau)"
        if self.wrong_side:
            return f"not resolvable at this scale ({self.wrong_side})"
        gaps = self.comparison.gaps
        return noise_floor.claim_verdict(gaps.mean, gaps.ci95, self.comparison.floor_value, self.expect,
                                         values=gaps.finite, nonfinite=gaps.nonfinite)


CLAIMS = (  # (group, arm, reference, expect, the paper's claim)
    ("below", "seesaw-r0.5", "cosine", "same",
     "below the critical batch, Seesaw r=1/2 reaches cosine's loss with fewer steps"),
    ("below", "seesaw-r0.91", "cosine", "same",
     "below the critical batch, Seesaw r=1/1.1 (the paper's main runs) reaches cosine's loss"),
    ("above", "seesaw-r0.5", "cosine", "worse", "started above the critical batch, Seesaw r=1/2 loses to cosine"),
    ("above", "seesaw-r0.91", "cosine", "worse", "started above the critical batch, Seesaw r=1/1.1 loses to cosine"),
    ("below", "smith-r0.5", "seesaw-r0.5", "worse",
     "for Adam, Smith's batch ramp at constant LR is worse than Seesaw (below the critical batch)"),
)


def wrong_side(group: str, start: int, b_crit: float | None) -> str:
    """Why a group's start batch is not ``group`` ("below"/"above") the measured critical batch, or ""."""
    if b_crit is None or (start < b_crit if group == "below" else start > b_crit):
        return ""
    return f"start batch {start} is not {group} the measured critical batch {b_crit:.1f}"


def claims(low: list[list[ArmResult]], high: list[list[ArmResult]], low_perturbed: dict[str, list[ArmResult]],
           high_perturbed: dict[str, list[ArmResult]], b_crit: float | None = None) -> list[Claim]:
    out = []
    for group, arm, reference, expect, text in CLAIMS:
        per_seed, perturbed = (low, low_perturbed) if group == "below" else (high, high_perturbed)
        start = per_seed[0][0].arm.overrides["schedule.batch_size"]
        names = _kinds(per_seed)
        i, j = names.index(arm), names.index(reference)
        comparison = noise_floor.compare(f"{group}-{arm} minus {group}-{reference}",
                                         lambda rs, i=i, j=j: rs[i].final_val_loss - rs[j].final_val_loss,
                                         per_seed, perturbed, "worse", "better")
        stuck = tuple(r.arm.name for s in per_seed for r in (s[i], s[j]) if r.plateau_escape is None)
        out.append(Claim(text, f"{group}-{arm}", f"{group}-{reference}", expect, comparison, stuck,
                         wrong_side(group, start, b_crit)))
    return out


def claims_section(found: list[Claim]) -> str:
    """The paper's claims, one row each: the paired gap over seeds, its interval, the floor, the verdict."""
    rows = [[c.text, c.comparison.gaps.name, len(c.comparison.gaps.gaps), _signed(c.comparison.gaps.mean),
             _interval(c.comparison.gaps.ci95),
             "n/a" if c.comparison.floor is None else f"{c.comparison.floor_value:.4f}", c.verdict] for c in found]
    return ("## The paper's claims, judged\n\nEach claim as a paired gap in final validation loss (per seed; "
            "positive: the first arm ends higher), its 95% interval over seeds and the noise floor of that gap. "
            "Established: the interval excludes 0 and the mean exceeds the floor. Equivalent: the whole "
            f"interval lies within +-{noise_floor.EQUIVALENCE_NATS:g} nats and the floor is no larger. "
            "Otherwise, or when a run of either arm never left the unigram "
            "plateau (see the tables' plateau column), or when the group's start batch is not on the side "
            "of the measured critical batch the claim is about, the claim is not resolvable at this scale.\n\n"
            + markdown_table(["claim (Meterez et al. 2025)", "gap", "seeds", "mean", "95% CI", "noise floor",
                              "verdict"], rows))


def _by_seed(results: list[ArmResult], per_seed: int) -> list[list[ArmResult]]:
    return [results[i:i + per_seed] for i in range(0, len(results), per_seed)]


def _kinds(per_seed: list[list[ArmResult]]) -> list[str]:
    """The arm kinds (names in ARMS) of a group's per-seed lists, in their order."""
    return [r.arm.name.split("-", 1)[1] for r in per_seed[0]]  # the first seed's names carry no suffix


def findings(low: list[list[ArmResult]], high: list[list[ArmResult]],
             low_floor: list[noise_floor.Floor] = (), high_floor: list[noise_floor.Floor] = ()) -> str:
    lines = ["## What this shows\n"]
    for label, per_seed, floors in (("below", low, low_floor), ("above", high, high_floor)):
        n = len(per_seed)
        for i, p in enumerate(paired_gaps(per_seed)):
            floor = floors[i] if floors else None
            spread = "" if p.sd is None else f" ± {p.sd:.4f} (sd)"
            where = f" over {n} seeds, at or below cosine at {p.ahead} of {n}" if n > 1 else ""
            stuck = sum(r.plateau_escape is None for s in per_seed for r in (s[i + 1], s[0]))  # arm, cosine
            lines.append(f"- {label}: {p.arm} ends {_signed(p.mean)}{spread} nats vs cosine{where}, with "
                         f"{statistics.fmean(p.steps_saved):.1f}% fewer optimizer steps"
                         f"{_verdict(p, floor, stuck, 2 * n)}.")
        if n > 1:
            cosine = [s[0].final_val_loss for s in per_seed if math.isfinite(s[0].final_val_loss)]
            if len(cosine) >= 2:
                lines.append(f"- {label}: cosine's own final loss over the seeds spans "
                             f"{max(cosine) - min(cosine):.4f} nats (sd {statistics.stdev(cosine):.4f}): "
                             f"the unpaired seed spread the paired gaps are measured against.")
    if GRANULARITY_PAIR[1] in _kinds(low):
        lines += [granularity_line(label, per_seed) for label, per_seed in (("below", low), ("above", high))]
    else:
        lines.append(f"- Batch granularity ({LABELS[GRANULARITY_PAIR[1]]}): not run (add --granularity).")
    lines.append("- Paper (150M-600M OLMo on C4): equal loss with 38.4% fewer steps below the critical "
                 "batch; a loss gap starting above it. A gap is established only when its 95% interval "
                 "excludes 0 and it exceeds the noise floor.")
    return "\n".join(lines)


def granularity_line(label: str, per_seed: list[list[ArmResult]]) -> str:
    """Seesaw r=1/1.1 at micro-batch 1 minus at the group's micro-batch, paired per seed: what the
    batch granularity alone changes (the schedule, LR and tokens are the same)."""
    names = _kinds(per_seed)
    coarse, fine = (names.index(n) for n in GRANULARITY_PAIR)
    diffs = [s[fine].final_val_loss - s[coarse].final_val_loss for s in per_seed]
    finite = [d for d in diffs if math.isfinite(d)]
    spread = f" ± {statistics.stdev(finite):.4f} (sd)" if len(finite) >= 2 else ""
    first = per_seed[0]
    micro = first[coarse].arm.overrides["run.micro_batch"]
    return (f"- {label}: batch granularity, {LABELS[GRANULARITY_PAIR[1]]} minus the same schedule at "
            f"micro-batch {micro}: {_signed(statistics.fmean(finite) if finite else None)}{spread} nats"
            f"{f' over {len(per_seed)} seeds' if len(per_seed) > 1 else ''}; final batch "
            f"{first[fine].final_batch} vs {first[coarse].final_batch}, {first[fine].steps} vs "
            f"{first[coarse].steps} optimizer steps (seed {seed_name(SEEDS[0])}).")
