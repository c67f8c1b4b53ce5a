"""Pipeline parallel step time and first-stage activation memory, pp = 2 against one process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline.py                 # 8 layers, m = 8
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline.py --micro-batches 4 --rounds 3   # quick

One process (1 thread) runs a step of m micro-batches through the whole GPT (gradient accumulation);
2 gloo ranks (1 thread each, one spawn) run the same step through a 2-stage pipeline with each
schedule the trainer offers (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZBV); the
one-process step is timed on rank 0 of that spawn, in the same rounds as the schedules. Per
schedule: the median step time, its speed-up over one process (T_one / T_pp), and the measured bubble fraction
1 - T_one / (p T_pp) (the share of a rank's step not spent on its 1/p of the work, p2p communication
included) beside the walk's (largebatch.memory.pipeline_schedule: idle slots of torch's action lists,
a forward, input- and weight-gradient one slot each) and the closed form (p - 1) / (V m + p - 1)
(Narayanan et al. 2021; none for zero bubble). And the first stage's peak saved activations against
the walk's bytes (Korthikanti et al. 2022 §4.2.3 where the closed form holds), in fp32 without
dropout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.memory.pipeline_schedule import schedule_activation_bytes, theoretical_bubble, walk  # noqa: E402
from largebatch.models import ModelConfig, build_model  # noqa: E402
from largebatch.models.gpt import token_loss  # noqa: E402
from largebatch.parallel import ParallelConfig, init_distributed, spawn  # noqa: E402
from largebatch.parallel.measure import peak_saved_activation_bytes  # noqa: E402
from largebatch.parallel.pipeline import pipeline_parallelize  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)]


def model_config(args) -> ModelConfig:
    return ModelConfig(kind="gpt", n_layer=args.layers, n_embd=args.width, n_head=args.heads, seq_len=args.seq_len,
                       vocab_size=args.vocab, tie_embeddings=False)


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batches * args.micro_batch, args.seq_len)
    return torch.randint(0, args.vocab, shape, generator=gen), torch.randint(0, args.vocab, shape, generator=gen)


def one_process_step(args, model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> None:
    """One step of m micro-batches through the whole GPT (gradient accumulation)."""
    for i in range(0, len(idx), args.micro_batch):
        logits, _ = model(idx[i:i + args.micro_batch])
        token_loss(logits, targets[i:i + args.micro_batch], "sum").backward()
    model.zero_grad(set_to_none=True)


def pipeline_worker(args, out_dir: str) -> None:
    """Every schedule's pipeline, and on rank 0 the whole model; then rounds that time, in turn, the
    one-process step (rank 0 alone, rank 1 waiting at a barrier) and each schedule's step (the order
    of the schedules turns each round), so that the peer and the pipelines see the same machine."""
    import torch.distributed as dist

    idx, targets = batch(args)
    pipes = {}
    for schedule, virtual in SCHEDULES:
        state = init_distributed(ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=virtual))
        torch.manual_seed(0)
        model = build_model(model_config(args))
        pipe = pipeline_parallelize(model, state)

        def step(pipe=pipe, model=model):
            pipe.step(idx, targets, args.micro_batches, 1.0)
            for p in model.parameters():
                p.grad = None

        step()  # the first step infers the stages' shapes
        pipes[schedule] = (virtual, model, step)
    rank0 = dist.get_rank() == 0
    torch.manual_seed(0)
    whole = build_model(model_config(args)) if rank0 else None
    if rank0:
        one_process_step(args, whole, idx, targets)  # warm-up
    one: list[float] = []
    times: dict[str, list[float]] = {schedule: [] for schedule in pipes}
    order = list(pipes)
    for r in range(args.rounds):
        dist.barrier()
        if rank0:
            t0 = time.perf_counter()
            one_process_step(args, whole, idx, targets)
            one.append(time.perf_counter() - t0)
        for schedule in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier()
            t0 = time.perf_counter()
            pipes[schedule][2]()
            dist.barrier()  # the step ends when the last rank is done
            times[schedule].append(time.perf_counter() - t0)
    results = {"one": one, "schedules": {}}
    for schedule, (virtual, model, step) in pipes.items():
        _, peak = peak_saved_activation_bytes(step, model)
        results["schedules"][schedule] = {"times": times[schedule], "peak": peak, "virtual": virtual}
    if rank0:
        Path(out_dir, "pipeline.json").write_text(json.dumps(results))


def model_arguments(description: str, micro_batch: int = 4, micro_batches: int = 8) -> argparse.ArgumentParser:
    """The GPT and step shape flags of the pipeline benchmarks (``model_config`` reads them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=micro_batch)
    parser.add_argument("--micro-batches", type=int, default=micro_batches, help="m, micro-batches per step")
    parser.add_argument("--rounds", type=int, default=5)
    return parser


def main() -> None:
    args = model_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(1)
    p, m = 2, args.micro_batches
    with tempfile.TemporaryDirectory() as out:
        spawn(pipeline_worker, p, args, out)
        measured = json.loads(Path(out, "pipeline.json").read_text())
    one, results = statistics.median(measured["one"]), measured["schedules"]
    cfg = model_config(args)
    print(f"GPT {args.layers} layers x {args.width}, seq {args.seq_len}, micro-batch {args.micro_batch}, "
          f"m = {m} micro-batches, p = {p}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"one process: {one * 1e3:.0f} ms per step (median of {args.rounds}, rounds interleaved with the "
          f"pipelines'; speed-up = one-process time / pipeline time)")
    print(f"{'schedule':<17} {'step ms':>8} {'speed-up':>8} {'bubble':>7} {'walk':>6} {'formula':>7} "
          f"{'1st-stage MiB':>13} {'walk MiB':>8} {'ratio':>6}")
    for schedule, r in results.items():
        t = statistics.median(r["times"])
        v = r["virtual"]
        formula = theoretical_bubble(schedule, p, v, m)
        walked = schedule_activation_bytes(cfg, args.micro_batch, schedule, p, v, m, dtype_bytes=4, device="cpu")
        print(f"{schedule:<17} {t * 1e3:>8.0f} {one / t:>7.2f}x {1 - one / (p * t):>7.3f} "
              f"{walk(schedule, p, v, m).bubble:>6.3f} {'-' if formula is None else f'{formula:.3f}':>7} "
              f"{r['peak'] / 2**20:>13.1f} {walked / 2**20:>8.1f} {r['peak'] / walked:>6.3f}")


if __name__ == "__main__":
    main()
