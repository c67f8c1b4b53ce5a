"""Sequence parallel with the shard kept for backward (gathered again there, started early or when
needed) against torch's own (the gathered input saved): step time and saved bytes, interleaved, as
ratios.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/sp_regather.py [--preset demo] [--rounds 21]

Two gloo ranks on CPU (tp = 2, sequence parallel), the preset in fp32 with dropout 0.1. The
models are the same build sharded by largebatch.parallel.apply_tensor_parallel: ``regather=True``
with the gather again started when backward reaches each sub-layer (``prefetch=True``, what the
trainer does) or where the first linear needs it (``prefetch=False``), and ``regather=False``;
each round times one forward + backward of each in turn, so a busy machine slows all alike.
Printed: the median step time of each and its ratio to torch's own, the bytes autograd saves for
backward (largebatch.parallel.measure) and their ratio. The cost is the extra all-gather per
sub-layer in backward. Started early it overlaps the sub-layer's backward over NCCL; over gloo
(these CPU ranks) an early gather is waited for at once (gloo's ranks crash with a collective left
in flight, see largebatch.parallel.tensor_parallel.SequenceGather), so here it shows only the cost
of gathering sooner.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from largebatch.models import build_model, preset
from largebatch.parallel import ParallelConfig, apply_tensor_parallel, init_distributed, spawn
from largebatch.parallel.measure import saved_activation_bytes

KINDS = {  # name: (regather, prefetch)
    "shard kept, gathered early": (True, True),
    "shard kept, gathered when needed": (True, False),
    "torch's own (gathered saved)": (False, False),
}


def ranks(config, micro_batch: int, rounds: int, out: str) -> None:
    import dataclasses

    state = dataclasses.replace(init_distributed(ParallelConfig(tp=2)), sequence_parallel=True)
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))
    torch.manual_seed(0)
    reference = build_model(config)
    models = {}
    for name, (regather, prefetch) in KINDS.items():
        torch.manual_seed(0)
        model = build_model(config)
        model.load_state_dict(reference.state_dict())
        models[name] = apply_tensor_parallel(model, state.tp_mesh, True, regather=regather,
                                              prefetch=prefetch)
    # (every tp rank feeds the whole batch: the model splits the sequence itself)

    def step(model):
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()

    saved, times = {}, {name: [] for name in KINDS}
    for name, model in models.items():
        loss, saved[name] = saved_activation_bytes(lambda m=model: m(idx, targets)[1], model)
        loss.backward()
        step(model)  # warm-up
    for _ in range(rounds):
        for name, model in models.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - start)
    if state.is_main:
        Path(out).write_text(json.dumps({"saved": saved, "times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    config = preset(args.preset, dropout=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(ranks, 2, config, args.micro_batch, args.rounds, f"{tmp}/out.json")
        result = json.loads(Path(f"{tmp}/out.json").read_text())
    peer = "torch's own (gathered saved)"
    print(f"{args.preset}: L={config.n_layer} h={config.n_embd} s={config.seq_len} b={args.micro_batch}, "
          f"fp32, dropout 0.1, tp = 2 + sequence parallel, 2 gloo ranks, median of {args.rounds} rounds")
    print(f"{'':34s}{'step ms':>10s}{'x peer':>9s}{'saved bytes':>14s}{'x peer':>9s}")
    for name in KINDS:
        ms = statistics.median(result["times"][name]) * 1e3
        peer_ms = statistics.median(result["times"][peer]) * 1e3
        saved, peer_saved = result["saved"][name], result["saved"][peer]
        print(f"{name:34s}{ms:10.1f}{ms / peer_ms:9.3f}{saved:14,d}{saved / peer_saved:9.3f}")


if __name__ == "__main__":
    main()
