"""The Llama-style layers against GPT-2's, on one device: a training step's time (forward and backward,
interleaved rounds, the GPT-2 layout the peer measured in the same run) and what one layer keeps for
backward, measured and as the memory model counts it on that device. Then the RMSNorm alone against
its peers, forward and backward of a (micro-batch, seq, 256) input: torch's nn.RMSNorm (fused on a
GPU, composite on the CPU) and transformers' LlamaRMSNorm (written out op by op; skipped where
transformers is not installed): time per call and the bytes per token each keeps for backward.

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


def norm_peers(width: int, device, dtype) -> dict[str, torch.nn.Module]:
    """largebatch's RMSNorm, torch's, and transformers' LlamaRMSNorm where it is installed."""
    from largebatch.models.layers import RMSNorm

    peers = {"largebatch": RMSNorm(width, eps=1e-6), "torch": torch.nn.RMSNorm(width, eps=1e-6)}
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        pass
    else:
        peers["transformers"] = LlamaRMSNorm(width, eps=1e-6)
    return {name: norm.to(device=device, dtype=dtype) for name, norm in peers.items()}


def norm_table(x: torch.Tensor, rounds: int, repeat: int) -> list[str]:
    """Time of forward + backward per call (median of interleaved rounds) and saved bytes per token."""
    norms = norm_peers(x.shape[-1], x.device, x.dtype)
    x = x.detach().requires_grad_()
    grad = torch.randn_like(x)
    times = {name: [] for name in norms}

    def call(norm) -> None:
        norm(x).backward(grad)
        x.grad = None
        norm.zero_grad(set_to_none=True)

    for _ in range(rounds):
        for name, norm in norms.items():
            call(norm)  # warm
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            start = time.perf_counter()
            for _ in range(repeat):
                call(norm)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            times[name].append((time.perf_counter() - start) / repeat)
    base = statistics.median(times["largebatch"])
    tokens = x.numel() // x.shape[-1]
    lines = [f"RMSNorm alone, input {tuple(x.shape)} {str(x.dtype)[6:]}:",
             f"{'norm':<14}{'fwd+bwd us':>12}{'/ largebatch':>14}{'kept beyond x, B/token':>24}"]
    for name, norm in norms.items():
        kept = measure_forward_bytes(lambda: norm(x), device=x.device.type)[1].tensor_bytes
        lines.append(f"{name:<14}{statistics.median(times[name]) * 1e6:>12.1f}"
                     f"{statistics.median(times[name]) / base:>14.3f}{kept / tokens:>24.1f}")
    return lines


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
    x = torch.randn(b, s, configs["llama-demo"].n_embd, device=device, dtype=dtype)
    print("\n".join(["", *norm_table(x, args.rounds, args.repeat * 10)]))


if __name__ == "__main__":
    main()
