"""Generation speed: largebatch's GPT.generate with its KV cache against the same model reading its
whole context for every token (no cache, as generate did before the cache), and against transformers'
own generate (its KV cache) on the same weights (largebatch.integrations.hf_export.hf_model), in
interleaved rounds; tokens per second and ratios to transformers measured in the same rounds.

Greedy decoding (temperature 0; transformers: do_sample=False, no end token), a prompt of
--prompt tokens, --new tokens per sample, batch 1 and 8. Models: gpt-demo's GPT-2 layout and
llama-demo's Llama layout (RMSNorm, rope, SwiGLU, 2 key/value heads for 4), both at seq_len
--seq-len (the demo models' 128 by default; the prompt and the new tokens must fit it, as
transformers' GPT-2 has no positions beyond). Every candidate's tokens are checked equal first.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/generate.py [--rounds 5]
    PYTHONPATH=src python benchmarks/generate.py --device cuda --seq-len 1024 --prompt 512 --new 256
"""

from __future__ import annotations

import argparse

import torch

from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.integrations.hf_export import hf_model
from largebatch.models import build_model
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config

SPECIAL = {"bos": 0, "eos": 0, "pad": 1}


def model_of(recipe: str, seq_len: int, device: torch.device):
    cfg = load_config(resolve_config(recipe), {"model.seq_len": seq_len, "model.dropout": 0.0}).model
    torch.manual_seed(0)
    model = build_model(cfg.replace(vocab_size=4096))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights away from the init, so greedy decoding does not repeat one token
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval().to(device)


def run(recipe: str, batch: int, args, device: torch.device) -> None:
    ours = model_of(recipe, args.seq_len, device)
    theirs = hf_model(ours.cpu(), SPECIAL).to(device)
    ours.to(device)
    theirs.generation_config.eos_token_id = None
    prompt = torch.randint(2, 4096, (batch, args.prompt), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(prompt)
    candidates = {
        "transformers": lambda: theirs.generate(prompt, attention_mask=mask, max_new_tokens=args.new,
                                                do_sample=False, pad_token_id=1),
        "cached": lambda: ours.generate(prompt, args.new, temperature=0),
        "no cache": lambda: ours.generate(prompt, args.new, temperature=0, use_cache=False),
    }
    with torch.no_grad():
        outputs = {name: fn() for name, fn in candidates.items()}
    agree = {name: bool(torch.equal(out, outputs["transformers"])) for name, out in outputs.items()}
    times = time_interleaved(candidates, args.rounds, device)
    ratios = median_ratios(times, "transformers")
    print(f"\n{recipe} ({ours.num_params() / 1e6:.2f}M parameters), batch {batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, {args.rounds} interleaved rounds")
    print(f"  {'generate':<14} {'min s':>8} {'tokens/s':>10} {'time/transformers':>18} {'same tokens':>12}")
    for name in candidates:
        best = min(times[name])
        print(f"  {name:<14} {best:>8.3f} {batch * args.new / best:>10,.0f} {ratios[name]:>17.3f}x "
              f"{str(agree[name]):>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.prompt + args.new > args.seq_len:
        parser.error(f"--prompt {args.prompt} + --new {args.new} exceed --seq-len {args.seq_len}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 on {device}")
    for recipe in ("gpt-demo", "llama-demo"):
        for batch in (1, 8):
            run(recipe, batch, args, device)


if __name__ == "__main__":
    main()
