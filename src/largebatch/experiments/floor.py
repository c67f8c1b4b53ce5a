"""The noise floor of a comparison: how far a gap between two arms moves under changes that should
not matter, so a report states a difference only when it exceeds both its seed interval and that floor.

At a fixed seed, training here is deterministic for a given torch thread count. Changing only the
summation order (another thread count), only the data order (data.seed, same init) or only the
initialisation (run.seed, same data order) are harmless perturbations: none changes what is
compared. Near the unigram plateau each arm escapes at a chaotic moment, so such a change can move a
gap more than the paired seed interval suggests (the seed interval pairs arms at one thread count
and one code path; it does not see rounding).

For a group of arms whose first is the baseline, ``perturbed_arms`` re-runs every arm of the group
once per perturbation; ``gap_floors`` gives, per non-baseline arm, its gap to the baseline under
each perturbation (both arms perturbed alike) and the floor: the largest change of that gap from the
unperturbed one. ``verdict`` calls a paired difference established only when its 95% interval
excludes 0 and its mean exceeds the floor; ``claim`` turns a verdict into what it says about a
paper's claim (agrees / contradicts / not resolvable at this scale).

Shared by the seeded experiments (seesaw, optimizers, noise-scale): ``SEEDS`` and ``seeded`` (a
seed's arms share init and data order), ``Gaps`` (paired gaps over seeds with their interval),
``measure`` (run a group's perturbed arms and return its floors), ``check_seeds``
and ``never_left_plateau``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from largebatch.experiments.report import markdown_table
from largebatch.experiments.runner import (
    THREADS,
    Arm,
    ArmResult,
    Execution,
    check_seed_count,
    run_arms,
)
from largebatch.stats import all_same, ci95

PERTURBATIONS = ("threads", "data", "init")
SEEDS = (None, 7, 11, 23, 42, 101, 211, 307)  # None: the config's defaults (run.seed 1337)
AGREES, CONTRADICTS, UNRESOLVED = "agrees", "contradicts", "not resolvable at this scale"


def seed_name(seed: int | None) -> str:
    return "1337" if seed is None else str(seed)


def check_seeds(seeds: int) -> int:
    """``seeds`` if it is an integer from 1 to len(SEEDS) (``--seeds N`` of a seeded experiment)."""
    return check_seed_count(seeds, len(SEEDS))


def never_left_plateau(per_seed: list[list[ArmResult]]) -> list[str]:
    """The names of the runs that ended on the unigram plateau (ArmResult.plateau_escape is None)."""
    return [r.arm.name for rs in per_seed for r in rs if r.plateau_escape is None]


def both_on_plateau(per_seed: list[list[ArmResult]], a: int, b: int) -> int:
    """Seeds at which the compared runs ``a`` and ``b`` (indices into each seed's results) both ended
    on the unigram plateau: their gap measures when each would have escaped (claim_line's ``on_plateau``)."""
    return sum(rs[a].plateau_escape is None and rs[b].plateau_escape is None for rs in per_seed)


def seeded(arm: Arm, seed: int | None) -> Arm:
    """The arm at another seed (init and data order): ``NAME-seedS``; the first seed is the arm itself."""
    if seed is None:
        return arm
    return Arm(f"{arm.name}-seed{seed}", {**arm.overrides, "run.seed": seed, "data.seed": seed},
               group=arm.group, label=f"{arm.legend}, seed {seed}")


def other_threads(threads: int) -> int:
    """The thread count of the "threads" perturbation: 2 when the arms run on 1, else 1."""
    return 2 if threads == 1 else 1


def threads_sentence(threads: int, kinds: tuple[str, ...]) -> str:
    """A report's statement of the arms' thread count, naming the "threads" floor arms' other count."""
    other = (f", except the thread-count floor arms, which ran with {other_threads(threads)}"
             if "threads" in kinds else "")
    return f"Every arm ran with {threads} torch thread(s){other}."


def _changes(kind: str, arm: Arm, threads: int) -> dict:
    if kind == "threads":
        return {THREADS: other_threads(threads)}
    if kind == "data":  # another data order (and BERT masks), the same initialisation
        return {"data.seed": int(arm.overrides.get("data.seed", 0)) + 1}
    if kind == "init":  # another initialisation (and dropout), the same data order
        return {"run.seed": int(arm.overrides.get("run.seed", 1337)) + 1}
    raise ValueError(f"perturbation {kind!r}: choose from {', '.join(PERTURBATIONS)}")


def perturbed_arms(arms: list[Arm], kinds: tuple[str, ...], threads: int) -> dict[str, list[Arm]]:
    """{kind: the group's arms re-run under that perturbation}, names suffixed with the kind."""
    out = {}
    for kind in kinds:
        out[kind] = [Arm(f"{arm.name}-{kind}", {**arm.overrides, **_changes(kind, arm, threads)},
                         group=f"{arm.group}-{kind}", label=f"{arm.legend} ({kind} perturbed)")
                     for arm in arms]
    return out


@dataclass(frozen=True)
class Floor:
    arm: str
    gap: float
    """The unperturbed gap: this arm's final validation loss minus the baseline's."""
    perturbed: dict[str, float]
    """The gap with both arms under each perturbation."""

    @property
    def floor(self) -> float:
        """The largest |perturbed gap - gap|; inf when a gap is not finite (an arm diverged)."""
        moves = [abs(g - self.gap) for g in self.perturbed.values()]
        return math.inf if not all(math.isfinite(m) for m in moves) else max(moves, default=0.0)


def measure(arms: list[Arm], results: list[ArmResult], kinds: tuple[str, ...], threads: int,
            base: dict, out_dir: Path, log, execution: Execution) -> tuple[list[Floor], dict[str, list[ArmResult]]]:
    """A group's noise floors (``gap_floors``) and its perturbed results {kind: results in arm order}:
    the group's arms (baseline first, one seed) re-run once per perturbation. No kinds: no floors."""
    if not kinds:
        return [], {}
    perturbed = perturbed_arms(arms, kinds, threads)
    ran = run_arms([a for group in perturbed.values() for a in group], base, out_dir, log, execution)
    by_kind = {kind: ran[i * len(arms):(i + 1) * len(arms)] for i, kind in enumerate(perturbed)}
    return gap_floors(results, by_kind), by_kind


def gap_floors(base: list[ArmResult], perturbed: dict[str, list[ArmResult]]) -> list[Floor]:
    """Per non-baseline arm of ``base`` (index 0 is the baseline), its gap and the noise floor."""
    floors = []
    for i in range(1, len(base)):
        gaps = {kind: rs[i].final_val_loss - rs[0].final_val_loss for kind, rs in perturbed.items()}
        floors.append(Floor(base[i].arm.name, base[i].final_val_loss - base[0].final_val_loss, gaps))
    return floors


@dataclass(frozen=True)
class Gaps:
    """One comparison's paired differences over seeds (e.g. an arm's final loss minus the same seed's
    baseline): mean, sample sd and the 95% t interval of the finite ones. ``bounds``: the range the
    values cannot leave (a correlation's [-1, 1]); the t interval, symmetric about the mean, is cut
    to it (which never moves it across 0, since the mean lies inside)."""

    name: str
    gaps: list[float]
    bounds: tuple[float, float] | None = field(default=None, kw_only=True)

    @property
    def finite(self) -> list[float]:
        return [g for g in self.gaps if math.isfinite(g)]

    @property
    def nonfinite(self) -> int:
        """Seeds whose gap is inf or nan (a run diverged): the mean and interval leave them out, so no
        difference is established from the others (``verdict``, ``claim_verdict``)."""
        return len(self.gaps) - len(self.finite)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.finite) if self.finite else None

    @property
    def sd(self) -> float | None:
        """Sample standard deviation (n - 1); None below two finite gaps."""
        return statistics.stdev(self.finite) if len(self.finite) >= 2 else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        """95% confidence interval of the mean paired gap (Student t, n - 1 degrees of freedom)."""
        ci = ci95(self.finite)
        if ci is None or self.bounds is None:
            return ci
        low, high = self.bounds
        return max(ci[0], low), min(ci[1], high)


def diverged_note(nonfinite: int) -> str:
    return f"a non-finite value at {nonfinite} seed(s) (a run diverged, or the statistic is undefined)"


def verdict(mean: float | None, ci: tuple[float, float] | None, floor: float | None,
            worse: str, better: str, *, values: list[float] | None = None, nonfinite: int = 0) -> str:
    """'worse' / 'better' only when the 95% interval excludes 0 and |mean| exceeds the floor; never
    on the same gap at every seed (``values``, the finite gaps; without them, a zero-width interval),
    nor when ``nonfinite`` seeds' gaps were left out of the interval (a run diverged there)."""
    if mean is None:
        return "no finite gap"
    if nonfinite:
        return f"{diverged_note(nonfinite)}: no difference established"
    if ci is None:
        return "one seed: no interval"
    if all_same(values if values is not None else list(ci)):
        return "the same gap at every seed (sd 0): no interval, no difference established"
    if ci[0] <= 0 <= ci[1]:
        return "interval contains 0: no difference established"
    if floor is not None and abs(mean) <= floor:
        return f"within the noise floor {floor:.4f}: no difference established"
    return worse if ci[0] > 0 else better


def claim(verdict_text: str, agrees: str, contradicts: str) -> str:
    """What a verdict says about a claim: AGREES when it is ``agrees`` (e.g. "better than AdamW"),
    CONTRADICTS when it is ``contradicts``, else UNRESOLVED (no interval, interval contains 0,
    within the floor, no finite gap)."""
    if verdict_text == agrees:
        return AGREES
    if verdict_text == contradicts:
        return CONTRADICTS
    return UNRESOLVED


def signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.4f}"


def interval(ci: tuple[float, float] | None) -> str:
    return "n/a" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def floor_table(floors: list[Floor], threads: int, gap: str = "gap vs cosine", first: str = "arm") -> str:
    """Each comparison's gap (first seed) unperturbed and under each perturbation, and its floor."""
    kinds = list(floors[0].perturbed) if floors else []
    names = {"threads": f"gap at {other_threads(threads)} thread(s) (not {threads})",
             "data": "gap, other data order", "init": "gap, other initialisation"}
    rows = [[f.arm, signed(f.gap)] + [signed(f.perturbed[k]) for k in kinds] + [f"{f.floor:.4f}"]
            for f in floors]
    return markdown_table([first, gap] + [names[k] for k in kinds] + ["noise floor"], rows)


@dataclass(frozen=True)
class Comparison:
    """A paired comparison over seeds, its noise floor (None: not measured) and its verdict."""

    gaps: Gaps
    floor: Floor | None
    worse: str
    better: str

    @property
    def floor_value(self) -> float | None:
        return None if self.floor is None else self.floor.floor

    @property
    def floor_text(self) -> str:
        return "n/a" if self.floor is None else f"{self.floor.floor:.4f}"

    @property
    def verdict(self) -> str:
        return verdict(self.gaps.mean, self.gaps.ci95, self.floor_value, self.worse, self.better,
                       values=self.gaps.finite, nonfinite=self.gaps.nonfinite)

    def row(self) -> list[object]:
        """The cells under COMPARISON_HEADERS."""
        g = self.gaps
        return [len(g.gaps), signed(g.mean), "n/a" if g.sd is None else f"{g.sd:.4f}", interval(g.ci95),
                self.floor_text, self.verdict]


COMPARISON_HEADERS = ["seeds", "mean", "sd", "95% CI of the mean", "noise floor", "verdict"]


def compare(name: str, diff, per_seed: list, perturbed: dict[str, list], worse: str, better: str,
            bounds: tuple[float, float] | None = None) -> Comparison:
    """``diff(results)`` at every seed (``per_seed``: one list of results per seed, paired) and, for
    the floor, under every perturbation of the first seed (``perturbed``: {kind: results in the same
    layout}; empty: no floor). ``bounds``: see ``Gaps``."""
    gaps = Gaps(name, [diff(s) for s in per_seed], bounds=bounds)
    floor = Floor(name, gaps.gaps[0], {k: diff(rs) for k, rs in perturbed.items()}) if perturbed else None
    return Comparison(gaps, floor, worse, better)


def claim_line(claim_text: str, c: Comparison, agrees: str, contradicts: str, unit: str = " nats",
               on_plateau: int = 0) -> str:
    """A report's bullet: the claim, what the comparison's verdict says about it, and the numbers.
    ``on_plateau``: seeds whose compared runs both ended on the unigram plateau (then the gap
    measures when each would have escaped, and the claim is not resolvable whatever the numbers)."""
    status, note = claim(c.verdict, agrees, contradicts), ""
    if on_plateau:
        status, note = UNRESOLVED, f" ({on_plateau} seed(s) with both compared runs on the plateau)"
    return (f"- {claim_text}: **{status}**{note} ({c.gaps.name}: {signed(c.gaps.mean)}{unit} over "
            f"{len(c.gaps.gaps)} seed(s), 95% CI {interval(c.gaps.ci95)}, noise floor {c.floor_text}: "
            f"{c.verdict}).")


EQUIVALENCE_NATS = 0.05
"""Two arms are called equivalent only within this many nats of final validation loss (and only when
the setup can see that much: its noise floor no larger). The papers' own effects are of this order:
Seesaw's "same loss" is 0.001 nats, its loss above the critical batch 0.09."""


def claim_verdict(mean: float | None, ci: tuple[float, float] | None, floor: float | None, expect: str,
                  *, values: list[float] | None = None, nonfinite: int = 0) -> str:
    """agrees / contradicts / not resolvable at this scale, from a paired gap's mean, 95% interval and
    noise floor. A gap is established when the interval excludes 0 and |mean| exceeds the floor. Two
    arms are equivalent when the whole interval lies within +-EQUIVALENCE_NATS and the floor is no
    larger: a setup whose harmless perturbations move the gap by more cannot call two arms equal.
    ``values`` and ``nonfinite``: as ``verdict``'s."""
    if expect not in ("same", "worse"):
        raise ValueError(f"expect={expect!r}: must be 'same' or 'worse'")
    if nonfinite:
        return f"not resolvable at this scale ({diverged_note(nonfinite)})"
    if mean is None or ci is None:
        return "not resolvable at this scale (fewer than 2 finite seeds)"
    if all_same(values if values is not None else list(ci)):
        return "not resolvable at this scale (the same gap at every seed: sd 0, no interval)"
    margin = 0.0 if floor is None else floor
    established = (ci[0] > 0 or ci[1] < 0) and abs(mean) > margin
    equivalent = (floor is not None and margin <= EQUIVALENCE_NATS
                  and -EQUIVALENCE_NATS <= ci[0] and ci[1] <= EQUIVALENCE_NATS)
    if expect == "same":
        if established:
            return "contradicts (ends higher)" if mean > 0 else "agrees (ends lower)"
        return f"agrees (equivalent within {EQUIVALENCE_NATS:g})" if equivalent else "not resolvable at this scale"
    if established:
        return "agrees" if mean > 0 else "contradicts (ends lower)"
    return (f"contradicts (equivalent within {EQUIVALENCE_NATS:g})" if equivalent
            else "not resolvable at this scale")
