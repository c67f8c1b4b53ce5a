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
excludes 0 and its mean exceeds the floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from largebatch.experiments.runner import THREADS, Arm, ArmResult

PERTURBATIONS = ("threads", "data", "init")


def other_threads(threads: int) -> int:
    """The thread count of the "threads" perturbation: 2 when the arms run on 1, else 1."""
    return 2 if threads == 1 else 1


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
        return max((abs(g - self.gap) for g in self.perturbed.values()), default=0.0)


def gap_floors(base: list[ArmResult], perturbed: dict[str, list[ArmResult]]) -> list[Floor]:
    """Per non-baseline arm of ``base`` (index 0 is the baseline), its gap and the noise floor."""
    floors = []
    for i in range(1, len(base)):
        gaps = {kind: rs[i].final_val_loss - rs[0].final_val_loss for kind, rs in perturbed.items()}
        floors.append(Floor(base[i].arm.name, base[i].final_val_loss - base[0].final_val_loss, gaps))
    return floors


def verdict(mean: float | None, ci: tuple[float, float] | None, floor: float | None,
            worse: str, better: str) -> str:
    """'worse' / 'better' only when the 95% interval excludes 0 and |mean| exceeds the floor."""
    if mean is None:
        return "no finite gap"
    if ci is None:
        return "one seed: no interval"
    if ci[0] <= 0 <= ci[1]:
        return "interval contains 0: no difference established"
    if floor is not None and abs(mean) <= floor:
        return f"within the noise floor {floor:.4f}: no difference established"
    return worse if ci[0] > 0 else better
