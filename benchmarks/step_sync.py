"""Host reads per training step and step time of the real trainer, reading the device every step
(``run.log_every_steps = 1``) vs never between logs (``= 1000``), interleaved.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_sync.py --device cpu          # quick
    PYTHONPATH=src python benchmarks/step_sync.py --device cuda --layers 12 --embd 768     # GPU

A read of a device value (``.item()``, ``float(t)``) makes the host wait for every queued kernel,
so the next step's kernels are queued only after the device drains: on a GPU the deferred reads
show as a shorter step; on CPU (no queue) the two match and only the read count differs.
Reads are counted by largebatch.train.deferred.HostReads: aten._local_scalar_dense calls (every
scalar read lands there) plus .tolist() calls (one read of several values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.deferred import HostReads
from largebatch.train.loop import Trainer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optim", default="lamb")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    overrides = {"model.n_layer": args.layers, "model.n_embd": args.embd, "model.n_head": 4,
                 "model.seq_len": 128, "data.vocab_size": 2048, "optim.name": args.optim,
                 "schedule.batch_policy": "constant", "schedule.batch_size": 8, "run.micro_batch": 4,
                 "run.total_tokens": 10**9, "run.device": args.device, "run.peak_flops": 1e12,
                 "run.progress": "off", "run.tensorboard": False, "run.sample_tokens": 0}
    times: dict[int, list[float]] = {1: [], 1000: []}
    reads: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for every in times:
            o = {**overrides, "run.log_every_steps": every, "run.out_dir": f"{tmp}/every{every}"}
            trainers[every] = Trainer(load_config(resolve_config(None), o), Path(tmp) / f"every{every}",
                                      log=lambda *_: None)
            trainers[every].train_step()  # warm up: optimizer state, allocator
        for r in range(args.rounds):  # the order alternates between rounds (the first of a pair runs colder)
            for every, trainer in (list(trainers.items()) if r % 2 == 0 else list(trainers.items())[::-1]):
                with HostReads() as host_reads:
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        record = trainer.train_step()
                        if every == 1:
                            trainer.log_record(record)
                    trainer.log_record(record)  # the same final read for both
                    if trainer.device.type == "cuda":
                        torch.cuda.synchronize()
                    times[every].append((time.perf_counter() - t0) / args.steps)
                reads[every] = host_reads.total / args.steps
        for trainer in trainers.values():
            trainer._close()
    print(f"{args.optim}, {args.layers} layers x {args.embd}, batch 8 x 128 (2 micro-batches), "
          f"{args.device}, torch threads {torch.get_num_threads()}")
    for every in times:
        print(f"  log_every_steps {every:>4}: {1e3 * statistics.median(times[every]):8.2f} ms/step "
              f"(median of {args.rounds}), {reads[every]:.1f} host reads/step")
    print(f"  ratio (reads deferred / every step): "
          f"{statistics.median(times[1000]) / statistics.median(times[1]):.2f} (median of {args.rounds} rounds "
          f"each; a CPU run's rounds spread by several percent)")


if __name__ == "__main__":
    sys.exit(main())
