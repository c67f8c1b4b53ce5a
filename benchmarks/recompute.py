"""Step time and activation memory of each recomputation policy on the demo GPT, explicit and SDPA
attention, in one run (Korthikanti et al. 2022, docs/papers.md: memory: selective recompute costs a
few percent of step time, full recompute about 35%).

Timings are interleaved (each round runs every policy once, in rotating order) and reported as
ratios to "none" measured in the same rounds (median over rounds of the per-round ratio, and the
ratio of the fastest steps), so a shared, noisy machine affects all policies alike. Memory is
what the forward pass leaves for backward (largebatch.memory.measure), next to the closed-form
prediction.

    PYTHONPATH=src python benchmarks/recompute.py [--rounds 10] [--micro-batch 8] [--threads 1]
    PYTHONPATH=src python benchmarks/recompute.py --autocast --rounds 1   # what run.dtype = "bf16" keeps

``--autocast`` runs the forward under torch.autocast(bfloat16) with fp32 parameters, as the trainer's
bf16 runs do, against the model's 2-byte prediction (the paper's pure 16-bit layout); the measured
bytes then include autocast's bf16 copies of the weights (12 h^2 x 2 bytes a layer).
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.memory import apply_recompute, measure_forward_bytes, model_activation_bytes
from largebatch.models import GPT, preset

POLICIES = ("none", "selective", "op", "full")


def step(model: GPT, idx: torch.Tensor, precision=contextlib.nullcontext) -> None:
    with precision():
        _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def run(attention: str, dropout: float, micro_batch: int, rounds: int, autocast: bool = False) -> None:
    precision = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext)
    config = preset("demo", attention=attention, dropout=dropout)
    torch.manual_seed(0)
    base = GPT(config).train()
    idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))
    models, memory = {}, {}
    for policy in POLICIES:  # one copy per policy: the same weights, recompute applied once
        model = models[policy] = copy.deepcopy(base)
        apply_recompute(model, policy)
        for _ in range(2):  # the first measurement warms up dispatch caches
            with precision():
                (_, loss), memory[policy] = measure_forward_bytes(lambda: model(idx, idx))
            loss.backward()
        model.zero_grad(set_to_none=True)
    times = time_interleaved({p: (lambda m=models[p]: step(m, idx, precision)) for p in POLICIES}, rounds)
    ratios = median_ratios(times, "none")
    base_m = memory["none"].tensor_bytes
    print(f"\n{attention} attention, dropout {dropout}, micro-batch {micro_batch} x {config.seq_len} "
          f"tokens, {rounds} interleaved rounds{', bf16 autocast' if autocast else ''}")
    print(f"  {'policy':<10} {'min ms':>8} {'time/none':>10} {'(fastest)':>10} {'act MiB':>9} "
          f"{'predicted':>10} {'malloc MiB':>11} {'mem/none':>9} {'act/pred':>9}")
    for policy in POLICIES:
        per_round = ratios[policy]
        fastest = min(times[policy]) / min(times["none"])
        m = memory[policy]
        predicted = model_activation_bytes(config, micro_batch, policy, dtype_bytes=2 if autocast else 4,
                                           device="cpu")
        malloc = "n/a" if m.allocator_bytes is None else f"{m.allocator_bytes / 2**20:.2f}"
        print(f"  {policy:<10} {1e3 * min(times[policy]):>8.1f} {per_round:>9.3f}x {fastest:>9.3f}x "
              f"{m.tensor_bytes / 2**20:>9.2f} "
              f"{predicted / 2**20:>10.2f} {malloc:>11} {m.tensor_bytes / base_m:>8.3f}x "
              f"{m.tensor_bytes / predicted:>8.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier when shared)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="for explicit attention; SDPA runs without (CPU's flash kernel has none)")
    parser.add_argument("--autocast", action="store_true",
                        help="forward under bf16 autocast with fp32 parameters (the trainer's run.dtype = 'bf16')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'bf16 autocast' if args.autocast else 'fp32'} on CPU")
    run("explicit", args.dropout, args.micro_batch, args.rounds, args.autocast)
    run("sdpa", 0.0, args.micro_batch, args.rounds, args.autocast)


if __name__ == "__main__":
    main()
