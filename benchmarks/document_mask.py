"""What attention within documents (model.document_mask) and a sliding window (model.sliding_window)
cost: the step time and the activation memory of a GPT with each against the same GPT without them,
explicit and SDPA attention, in one run.

The mask changes which scores count, not how many are computed (dense attention either way), so the
step costs what building one s x s mask per micro-batch and applying it in every layer add; memory
grows by the one mask the layers share (largebatch.memory.activations.attention_mask_bytes), measured
here next to the closed form. A sliding window (``--window``, default a quarter of the context, on
every layer) is dense too: the whole scores are computed and masked, with one mask for every sequence.
Timings are interleaved (each round runs every model once, in rotating order) and reported as ratios
to the unmasked model in the same rounds, so a shared machine affects all alike.
On a GPU, SDPA with a mask cannot use the FlashAttention kernel (torch takes the memory-efficient
one, which reads the mask): the ratio there is the one to look at.

    PYTHONPATH=src python benchmarks/document_mask.py [--rounds 10] [--micro-batch 8] [--threads 1] [--window 32]
    PYTHONPATH=src python benchmarks/document_mask.py --device cuda --dtype bf16 --seq-len 1024
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

from largebatch.experiments.timing import median_ratios, time_interleaved
from largebatch.memory import measure_forward_bytes, model_activation_bytes
from largebatch.models import GPT, preset

SEPARATOR = 0
DOCUMENT_TOKENS = 20  # a separator every ~20 tokens: speeches, short web documents


def step(model: GPT, idx: torch.Tensor, precision) -> None:
    with precision():
        _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def run(attention: str, micro_batch: int, seq_len: int, rounds: int, device: torch.device, dtype: str,
        window: int) -> None:
    bf16 = dtype == "bf16"
    precision = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    plain_config = preset("demo", attention=attention, seq_len=seq_len)
    masked_config = plain_config.replace(document_mask=True, separator_id=SEPARATOR)
    torch.manual_seed(0)
    plain = GPT(plain_config).to(device).train()
    masked = GPT(masked_config).to(device).train()
    masked.load_state_dict(copy.deepcopy(plain.state_dict()))
    windowed = GPT(plain_config.replace(sliding_window=window)).to(device).train()
    windowed.load_state_dict(copy.deepcopy(plain.state_dict()))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(1, plain_config.vocab_size, (micro_batch, seq_len), generator=gen)
    idx[torch.rand(micro_batch, seq_len, generator=gen) < 1 / DOCUMENT_TOKENS] = SEPARATOR
    idx = idx.to(device)
    models = {"plain": plain, "document_mask": masked, f"window {window}": windowed}
    memory = {}
    for name, model in models.items():
        for _ in range(2):  # the first measurement warms up dispatch caches
            with precision():
                (_, loss), memory[name] = measure_forward_bytes(lambda: model(idx, idx), device=device.type)
            loss.backward()
        model.zero_grad(set_to_none=True)
    times = time_interleaved({n: (lambda m=m: step(m, idx, precision)) for n, m in models.items()}, rounds, device)
    ratios = median_ratios(times, "plain")
    print(f"\n{attention} attention, micro-batch {micro_batch} x {seq_len} tokens, a separator every "
          f"~{DOCUMENT_TOKENS} tokens, {rounds} interleaved rounds, {dtype}")
    print(f"  {'model':<14} {'min ms':>8} {'time/plain':>11} {'(fastest)':>10} {'act MiB':>9} {'predicted':>10} "
          f"{'grown MiB':>10} {'mask MiB':>9}")
    predicted = {name: model_activation_bytes(model.config, micro_batch, dtype_bytes=2 if bf16 else 4,
                                              device=device.type) for name, model in models.items()}
    for name in models:
        grown = memory[name].tensor_bytes - memory["plain"].tensor_bytes
        mask = predicted[name] - predicted["plain"]
        print(f"  {name:<14} {1e3 * min(times[name]):>8.1f} {ratios[name]:>10.3f}x "
              f"{min(times[name]) / min(times['plain']):>9.3f}x {memory[name].tensor_bytes / 2**20:>9.2f} "
              f"{predicted[name] / 2**20:>10.2f} {grown / 2**20:>10.3f} {mask / 2**20:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier when shared)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128, help="the demo GPT's context (default its 128)")
    parser.add_argument("--window", type=int, help="the sliding window (default a quarter of --seq-len)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the forward under autocast with fp32 parameters, as run.dtype = 'bf16'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype} on {device}")
    for attention in ("explicit", "sdpa"):
        run(attention, args.micro_batch, args.seq_len, args.rounds, device, args.dtype,
            args.window or max(1, args.seq_len // 4))


if __name__ == "__main__":
    main()
