"""Seesaw in a plain PyTorch loop: LAMB, TokenLR, and a batch that grows by micro-batches.

    .venv/bin/python examples/schedule_plain_loop.py            # ~30 s on 2 CPU cores
    .venv/bin/python examples/schedule_plain_loop.py --tokens 60000   # shorter

A byte-level GPT (largebatch.models, 2 layers x 64) learns Hamlet. The joint schedule is Seesaw
(Meterez et al. 2025) on a warmup + cosine base: at each milestone the LR is multiplied by sqrt(r)
and the batch by 1/r, here 8 -> 16 -> 32 -> 64 sequences in micro-batches of 8, so the loop
accumulates 1, 2, 4, then 8 micro-batches per optimizer step. ``schedule.steps(seq_len)`` says,
at the tokens seen, how big each step is; ``TokenLR`` (a torch LRScheduler) keeps the optimizer's
LR on the same token clock. Prints each phase, the optimizer steps against the base schedule's, and
the held-out loss on Macbeth.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.data.corpus import shakespeare_documents  # noqa: E402
from largebatch.models import GPT, ModelConfig  # noqa: E402
from largebatch.optim import LAMB, param_groups  # noqa: E402
from largebatch.schedules import ConstantBatch, Cosine, Seesaw, TokenLR, count_optimizer_steps  # noqa: E402

SEQ_LEN, MICRO_BATCH, START_BATCH, PEAK_LR = 64, 8, 8, 2e-2


def play_bytes(name: str) -> torch.Tensor:
    """One play from the bundled Shakespeare corpus as a stream of byte ids (0..255)."""
    text = next(d.text for d in shakespeare_documents() if d.name == f"shakespeare/{name}")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def windows(data: torch.Tensor, n: int, generator: torch.Generator):
    """n random (input, target) windows of SEQ_LEN tokens: (n, T) each."""
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (n,), generator=generator).tolist()
    chunk = torch.stack([data[s:s + SEQ_LEN + 1] for s in starts])  # (n, T + 1)
    return chunk[:, :-1], chunk[:, 1:]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300_000, help="token budget")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: more threads only spin on shared cores
    torch.manual_seed(0)
    train_data, held_out = play_bytes("hamlet"), play_bytes("macbeth")

    # final_lr is a fraction of the peak: the base cosine ends at 0.1 x 2e-2
    base = Cosine(PEAK_LR, args.tokens, warmup_tokens=args.tokens // 10, final_lr=0.1)
    schedule = Seesaw(base, batch_size=START_BATCH, ratio=0.5, micro_batch=MICRO_BATCH)
    base_steps = count_optimizer_steps(ConstantBatch(base, START_BATCH), SEQ_LEN)
    print(f"Seesaw over {args.tokens:,} tokens: {count_optimizer_steps(schedule, SEQ_LEN)} "
          f"optimizer steps vs {base_steps} for the cosine base at batch {START_BATCH}")

    model = GPT(ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=SEQ_LEN, vocab_size=256))
    optimizer = LAMB(param_groups(model, weight_decay=0.01), lr=PEAK_LR)  # groups at the peak
    scheduler = TokenLR(optimizer, schedule)  # no fixed tokens_per_step: the batch grows
    generator, start, batch = torch.Generator().manual_seed(1), time.perf_counter(), None
    for k, step in enumerate(schedule.steps(SEQ_LEN)):
        if step.batch_size != batch:  # a new phase (or the last step, trimmed to the budget)
            batch = step.batch_size
            print(f"step {k:4d}  tokens {step.tokens_seen:8,}  batch {step.batch_size:3d} = "
                  f"{step.micro_batches} micro-batch{'es' if step.micro_batches > 1 else ''} of "
                  f"{min(step.micro_batch, step.batch_size)}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}")
        for i in range(step.micro_batches):  # accumulate: the loss is a mean over the step's sequences
            size = min(step.micro_batch, step.batch_size - i * step.micro_batch)  # the last may be short
            x, y = windows(train_data, size, generator)
            loss = model(x, y)[1] * size / step.batch_size
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step(tokens=step.tokens)  # the token clock advances by this step's tokens
    with torch.no_grad():
        model.eval()
        evaluation = [model(*windows(held_out, 32, generator))[1].item() for _ in range(8)]
    held_out_loss = sum(evaluation) / len(evaluation)
    print(f"done: {k + 1} optimizer steps, {scheduler.tokens_seen:,} tokens in "
          f"{time.perf_counter() - start:.1f} s; held-out loss (Macbeth) {held_out_loss:.3f} "
          f"(uniform guess ln 256 = {math.log(256):.3f})")
    return held_out_loss


if __name__ == "__main__":
    main()
