"""What the trainer's step costs over a hand-written PyTorch loop on the same model, interleaved.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_overhead.py                 # quick arm's model
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --optim lans --batch 16

The peer is the loop a user writes by hand: forward with the loss, ``backward``, ``step``,
``zero_grad``, on a copy of the trainer's model with the same optimizer, the same batches
(prepared before the clock starts) and the same thread count. The trainer's step does more, and
this measures what that costs: the LR schedule, the batch cut into micro-batches and prefetched,
the loss summed in float64 over the step's targets, the gradient norm (clipping and the log), the
non-finite check kept on the device. Small models show the per-step overhead most: the quick
experiments' 1x arms take 4,096 steps of 128 tokens each.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.optimizer import build_optimizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=96)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    overrides = {"model.n_layer": args.layers, "model.n_embd": args.embd, "model.n_head": args.heads,
                 "model.seq_len": args.seq, "data.vocab_size": args.vocab, "model.dropout": 0.0,
                 "optim.name": args.optim, "schedule.batch_policy": "constant",
                 "schedule.batch_size": args.batch, "run.micro_batch": args.batch,
                 "run.total_tokens": 10**9, "run.device": "cpu", "run.dtype": "fp32", "run.peak_flops": 1e12,
                 "run.progress": "off", "run.tensorboard": False, "run.sample_tokens": 0,
                 "run.log_every_steps": 10**6}
    times: dict[str, list[float]] = {"trainer": [], "hand-written loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config(resolve_config(None), {**overrides, "run.out_dir": tmp}), Path(tmp),
                          log=lambda *_: None)
        model = copy.deepcopy(trainer.raw_model)
        optimizer = build_optimizer(model, trainer.cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = 1e-4 * group.get("lr_mult", 1.0)
        batches = [trainer.data.train.get_batch(range(i * args.batch, (i + 1) * args.batch))
                   for i in range(args.steps)]

        def hand_written() -> None:
            for batch in batches:
                _, loss = model(batch["input_ids"], batch["targets"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        def trainer_steps() -> None:
            for _ in range(args.steps):
                trainer.train_step()
            trainer.settle()  # what the steps left on the device, read once

        runs = {"trainer": trainer_steps, "hand-written loop": hand_written}
        for run in runs.values():  # warm up: optimizer state, allocator
            run()
        for _ in range(args.rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - t0) / args.steps)
        trainer._close()
    print(f"{args.optim}, {args.layers} layers x {args.embd}, batch {args.batch} x {args.seq}, vocabulary "
          f"{args.vocab}, {type(optimizer).__name__}, torch threads {torch.get_num_threads()}")
    for name, values in times.items():
        print(f"  {name:<18} {1e3 * statistics.median(values):7.3f} ms/step (median of {args.rounds} "
              f"rounds of {args.steps})")
    print(f"  ratio trainer / hand-written: "
          f"{statistics.median(times['trainer']) / statistics.median(times['hand-written loop']):.3f}")


if __name__ == "__main__":
    sys.exit(main())
