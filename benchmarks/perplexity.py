"""Scoring speed: largebatch.perplexity.document_losses on largebatch's GPT (the output layer applied to
the scored positions only) against the same windows and batches scored by transformers' model on the
same weights (largebatch.integrations.hf_export.hf_model; its forward makes every position's logits),
in interleaved rounds; tokens scored per second and ratios to transformers measured in the same rounds.
Both candidates' summed -ln p are checked equal first (relative 1e-4, fp32).

Documents: --documents of --tokens random ids each (the speed does not depend on the text), read at
--stride seq_len and seq_len / 2, --batch windows to a forward. Model: gpt-demo's GPT-2 layout at
seq_len --seq-len, a 4,096-token vocabulary.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/perplexity.py [--rounds 5]
    PYTHONPATH=src python benchmarks/perplexity.py --device cuda --seq-len 1024 --tokens 65536
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import numpy as np
import torch

from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.integrations.hf_export import hf_model
from largebatch.models import build_model
from largebatch.perplexity import document_losses
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config

SPECIAL = {"bos": 0, "eos": 0, "pad": 1}


class Transformers(torch.nn.Module):
    """transformers' model behind the registry's ``forward(idx) -> (logits, ...)``."""

    def __init__(self, model, seq_len: int):
        super().__init__()
        self.model, self.config = model, SimpleNamespace(seq_len=seq_len)

    def forward(self, idx):
        return (self.model(idx).logits,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = load_config(resolve_config("gpt-demo"), {"model.seq_len": args.seq_len, "model.dropout": 0.0}).model
    torch.manual_seed(0)
    ours = build_model(cfg.replace(vocab_size=4096)).eval()
    theirs = Transformers(hf_model(ours, SPECIAL).eval(), args.seq_len).to(device)
    ours.to(device)
    g = np.random.default_rng(1)
    documents = [np.concatenate([[0], g.integers(2, 4096, args.tokens)]) for _ in range(args.documents)]
    scored = args.documents * args.tokens
    print(f"gpt-demo layout ({ours.num_params() / 1e6:.2f}M parameters), seq_len {args.seq_len}, {args.documents} "
          f"documents of {args.tokens:,} tokens, batch {args.batch}, {args.device}, {torch.get_num_threads()} "
          "thread(s)")
    print("| stride | transformers | largebatch (ratio of times) |")
    print("|---|---|---|")
    for stride in (args.seq_len, args.seq_len // 2):
        candidates = {name: (lambda m=model: document_losses(m, documents, stride, args.batch))
                      for name, model in (("transformers", theirs), ("largebatch", ours))}
        with torch.no_grad():
            sums = {name: math.fsum(n for n, _ in fn()) for name, fn in candidates.items()}
        assert math.isclose(sums["largebatch"], sums["transformers"], rel_tol=1e-4), sums
        times = time_interleaved(candidates, args.rounds, device)
        ratios = median_ratios(times, "transformers")
        rate = {name: scored / min(t) for name, t in times.items()}
        print(f"| {stride} | {rate['transformers']:,.0f}/s | {rate['largebatch']:,.0f}/s "
              f"({ratios['largebatch']:.2f}x) |")


if __name__ == "__main__":
    main()
