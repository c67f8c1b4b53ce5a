"""The Llama-style layers against GPT-2's, on one device: a training step's time (forward and backward,
interleaved rounds, the GPT-2 layout the peer measured in the same run) and what one layer keeps for
backward, measured and as the memory model counts it on that device (on a GPU torch's fused RMSNorm
kernel keeps only its input in fp32, which the CPU cannot show: docs/memory.md).

Configs: gpt-demo's and llama-demo's models (4 layers, 256 wide; llama-demo: RMSNorm, rope, SwiGLU
f = 704, 2 key/value heads for 4, no biases), micro-batch 8 at seq 128.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/llama_layers.py [--rounds 5]
    PYTHONPATH=src python benchmarks/llama_layers.py --device cuda --dtype bf16 --attention sdpa
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from largebatch.memory import activation_bytes_per_layer, measure_forward_bytes
from largebatch.memory.activations import config_layer_kwargs
from largebatch.models import build_model
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config


def per_layer_bytes(config, idx, dtype, device) -> int:
    """Saved bytes of one layer: (3-layer model - 1-layer model) / 2, the rest cancelling."""
    held = {}
    for n_layer in (1, 3):
        torch.manual_seed(0)
        model = build_model(config.replace(n_layer=n_layer)).to(device=device, dtype=dtype)
        measure_forward_bytes(lambda: model(idx, idx), device=device.type)  # warm-up
        held[n_layer] = measure_forward_bytes(lambda: model(idx, idx), device=device.type)[1].tensor_bytes
    return (held[3] - held[1]) // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), (torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    configs = {name: load_config(resolve_config(name), {}).model.replace(attention=args.attention, vocab_size=4096)
               for name in ("gpt-demo", "llama-demo")}
    b, s = args.micro_batch, configs["gpt-demo"].seq_len
    idx = torch.randint(0, 4096, (b, s), device=device)
    models, times = {}, {name: [] for name in configs}
    for name, config in configs.items():
        torch.manual_seed(0)
        models[name] = build_model(config).to(device=device, dtype=dtype)

    def step(model) -> None:
        model(idx, idx)[1].backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.rounds):
        for name, model in models.items():
            step(model)  # warm
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(args.repeat):
                step(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) / args.repeat)
    base = statistics.median(times["gpt-demo"])
    d = 4 if dtype == torch.float32 else 2
    print(f"device {device}, {args.dtype}, {args.attention} attention, micro-batch {b} x seq {s}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    print(f"{'model':<12}{'params':>10}{'step ms':>10}{'/ gpt-demo':>12}{'layer MiB measured':>20}{'model':>10}")
    for name, config in configs.items():
        ms = statistics.median(times[name]) * 1e3
        measured = per_layer_bytes(config, idx, dtype, device)
        counted = activation_bytes_per_layer(s, b, **config_layer_kwargs(config, dtype_bytes=d, device=device.type))
        params = sum(p.numel() for p in models[name].parameters())
        print(f"{name:<12}{params / 1e6:>9.2f}M{ms:>10.1f}{ms / 1e3 / base:>12.3f}"
              f"{measured / 2**20:>20.2f}{counted / 2**20:>10.2f}")


if __name__ == "__main__":
    main()
