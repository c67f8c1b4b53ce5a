"""The peak memory of a training step (forward and backward) against the memory model: the stored
activations (largebatch.memory.model_activation_bytes, Korthikanti et al. 2022 Table 2) alone and
with what backward needs on top (backward_working_bytes). On CUDA the peak is
torch.cuda.max_memory_allocated() over what was allocated before the step; on CPU it is
largebatch.memory.measure_peak_bytes (every storage the step creates, after every op).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_peak_memory.py [--device cuda] [--dtype bf16]

On a GPU (benchmarks/gpu_check.sh) this measures what the CPU tests cannot: the loss's fp32 logits
gradients (three copies on CPU) and the fused kernels' workspaces, in bf16.
"""

from __future__ import annotations

import argparse

import torch

from largebatch.memory import apply_recompute, backward_working_bytes, measure_peak_bytes, model_activation_bytes
from largebatch.models import ModelConfig, build_model

# (kind, s, b, h, a, v, dropout, attention, recompute): s^2-bound, MLP-bound, logits-bound, BERT
CASES = [
    ("gpt", 512, 4, 128, 8, 512, 0.1, "explicit", "none"),
    ("gpt", 512, 4, 128, 8, 512, 0.1, "explicit", "selective"),
    ("gpt", 512, 4, 128, 8, 512, 0.1, "explicit", "full"),
    ("gpt", 512, 4, 128, 8, 512, 0.0, "sdpa", "none"),
    ("gpt", 512, 4, 128, 8, 512, 0.0, "sdpa", "full"),
    ("gpt", 128, 8, 256, 4, 4096, 0.1, "explicit", "none"),
    ("gpt", 128, 8, 256, 4, 4096, 0.1, "explicit", "full"),
    ("bert", 256, 4, 128, 8, 2048, 0.1, "explicit", "full"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast, 2-byte activations in the model")
    parser.add_argument("--scale", type=int, default=1, help="multiply each case's micro-batch by this")
    args = parser.parse_args()
    device = torch.device(args.device)
    d = 2 if args.dtype == "bf16" else 4
    print(f"device {device}, {args.dtype}; bytes in MiB; ratios over the measured peak")
    print(f"{'case':<50} {'peak':>9} {'stored':>9} {'backward':>9} {'stored/peak':>12} {'model/peak':>11}")
    for kind, s, b, h, a, v, dropout, attention, policy in CASES:
        b *= args.scale
        torch.manual_seed(0)
        config = ModelConfig(kind=kind, n_layer=2, n_embd=h, n_head=a, seq_len=s, vocab_size=v, dropout=dropout,
                             attention=attention)
        model = build_model(config).to(device).train()
        if policy != "none":
            apply_recompute(model, policy)
        idx = torch.randint(0, v, (b, s), device=device)
        targets = idx.clone()
        if kind == "bert":
            targets[torch.rand(b, s, device=device) > 0.15] = -100

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = model(idx, targets)[1]  # the logits dropped, as the trainer does
            loss.backward()

        step()  # lazy initialisations; the parameters' gradients then exist
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            peak = measure_peak_bytes(step)
        kw = dict(dtype_bytes=d, device=device.type)
        stored = model_activation_bytes(config, b, policy, **kw)
        working = backward_working_bytes(config, b, policy, **kw)
        name = f"{kind} s{s} b{b} h{h} a{a} v{v} drop{dropout} {attention} {policy}"
        print(f"{name:<50} {peak / 2**20:>9.2f} {stored / 2**20:>9.2f} {working / 2**20:>9.2f} "
              f"{stored / peak:>12.3f} {(stored + working) / peak:>11.3f}")


if __name__ == "__main__":
    main()
