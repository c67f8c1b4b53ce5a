"""One evaluation of a trainer at several ``run.eval_micro_batch`` values, in one interleaved run.

The same validation tokens are evaluated in forwards of 2 (the training micro-batch here), 8 and
64 sequences; the script prints each evaluation's median time, its ratio to micro-batch 2 measured
in the same rounds, and the loss (the same mean over the same tokens: equal to about 6 decimals).
The default is the experiments' smoke GPT (1 layer x 32, seq 32, 2,048 evaluation tokens).

    PYTHONPATH=src python benchmarks/eval_batch.py [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from largebatch.experiments.runner import base_overrides
from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

MICRO_BATCHES = (2, 8, 64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = {k: v for k, v in base_overrides("smoke").items() if k != "run.eval_micro_batch"}
    trainers, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mb in MICRO_BATCHES:
            overrides = {**base, "run.micro_batch": 2, "schedule.batch_size": 8,
                         "run.eval_micro_batch": mb, "run.out_dir": f"{tmp}/mb{mb}"}
            trainer = Trainer(load_config(resolve_config(None), overrides), overrides["run.out_dir"],
                              log=lambda *_: None)
            trainers[f"eval micro-batch {mb}"] = trainer
            losses[f"eval micro-batch {mb}"] = trainer.evaluate()
        times = time_interleaved({name: t.evaluate for name, t in trainers.items()}, args.rounds)
    ratios = median_ratios(times, f"eval micro-batch {MICRO_BATCHES[0]}")
    print(f"one evaluation, {base['run.eval_tokens']:,} tokens, {args.threads} torch thread(s), "
          f"median of {args.rounds} interleaved rounds; the ratio is the median of each round's ratio to "
          f"micro-batch {MICRO_BATCHES[0]} in that round (not the ratio of the medians: on a busy "
          f"machine the two can differ)")
    for name, series in times.items():
        print(f"{name:<20} {1e3 * statistics.median(series):7.1f} ms  {ratios[name]:5.2f}x  loss {losses[name]:.8f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
