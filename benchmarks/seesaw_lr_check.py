"""Re-run arms of a finished `largebatch experiment seesaw` at other peak LRs (same everything else).

    .venv/bin/python benchmarks/seesaw_lr_check.py runs/experiments/seesaw-full \
        --arms above-cosine above-seesaw-r0.5 --lrs 5.66e-3 --jobs 2
    .venv/bin/python benchmarks/seesaw_lr_check.py runs/experiments/seesaw-full --arms above-cosine --lrs 1e-3

Asks whether a Seesaw-vs-cosine gap is an artefact of the one peak LR the experiment uses for every
arm: each chosen arm's recorded config (runs/<arm>/arm.json) is trained again with only
schedule.peak_lr changed, into OUT/runs/<arm>-lr<LR>/ (default OUT: EXPERIMENT/lr-check), and the
final validation losses are printed next to the experiment's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.experiments.runner import Arm, Execution, read_metrics, run_arms  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", type=Path, help="a seesaw experiment's report directory")
    parser.add_argument("--arms", nargs="+", required=True, help="arm names, e.g. above-cosine")
    parser.add_argument("--lrs", nargs="+", type=float, required=True, help="peak LRs to try")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    out = args.out or args.experiment / "lr-check"
    arms, recorded_lr = [], {}
    for name in args.arms:
        record = args.experiment / "runs" / name / "arm.json"
        if not record.exists():
            parser.error(f"--arms {name}: no {record} (a finished arm of this experiment)")
        overrides = {k: v for k, v in json.loads(record.read_text())["overrides"].items()
                     if k != "run.peak_flops"}
        recorded_lr[name] = overrides["schedule.peak_lr"]
        for lr in args.lrs:
            if not lr > 0:
                parser.error(f"--lrs {lr}: must be > 0")
            arms.append(Arm(f"{name}-lr{lr:g}", {**overrides, "schedule.peak_lr": lr}, group=name))
    results = run_arms(arms, {}, out, print, Execution(jobs=args.jobs))
    print(f"\n{'arm':<32} {'peak lr':>9} {'final val loss':>15}")
    for name in args.arms:
        _, val = read_metrics(args.experiment / "runs" / name)
        print(f"{name:<32} {recorded_lr[name]:>9g} {val[-1]['val_loss']:>15.4f}  (the experiment's)")
        for r in results:
            if r.arm.group == name:
                print(f"{name:<32} {r.arm.overrides['schedule.peak_lr']:>9g} {r.final_val_loss:>15.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
