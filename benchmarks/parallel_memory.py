"""Activation memory per rank under tensor / sequence / vocabulary parallel, measured vs the model.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/parallel_memory.py [--preset demo] [--micro-batch 4]

Two gloo ranks on CPU (tp = 2) run one training forward of the preset (fp32, dropout 0.1,
explicit attention) and measure the bytes autograd saves for backward
(largebatch.parallel.measure); the same on one process for the baseline. Printed next to
largebatch.memory.model_activation_bytes (Korthikanti et al. 2022, docs/papers.md: memory) and as ratios to
tensor parallel alone. Memory is counted in bytes, not timed, so a shared machine does not matter.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from largebatch.memory.activations import model_activation_bytes
from largebatch.models import build_model, preset
from largebatch.parallel import ParallelConfig, init_distributed, parallelize, spawn
from largebatch.parallel.measure import saved_activation_bytes

MODES = {"tp": dict(tp=2), "tp+sp": dict(tp=2, sequence_parallel=True),
         "tp+sp+loss": dict(tp=2, sequence_parallel=True, loss_parallel=True)}


def measure(model, state, idx, targets) -> int:
    model.train()
    with state.loss_context():
        _, saved = saved_activation_bytes(lambda: model(idx, targets), model)
    return saved


def ranks(config, micro_batch: int, out: str) -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))
    measured = {}
    for name, fields in MODES.items():
        state = init_distributed(ParallelConfig(**fields))
        torch.manual_seed(0)
        measured[name] = measure(parallelize(build_model(config), state), state, idx, targets)
    if state.is_main:
        Path(out).write_text(json.dumps(measured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    config = preset(args.preset, dropout=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(ranks, 2, config, args.micro_batch, f"{tmp}/out.json")
        measured = json.loads(Path(f"{tmp}/out.json").read_text())
    single = init_distributed(ParallelConfig())
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len))
    measured = {"single": measure(build_model(config), single, idx, idx), **measured}
    kw = dict(dtype_bytes=4, device="cpu")
    predicted = {"single": model_activation_bytes(config, args.micro_batch, **kw),
                 "tp": model_activation_bytes(config, args.micro_batch, tp=2, **kw)}
    predicted["tp+sp"] = model_activation_bytes(config, args.micro_batch, tp=2, sequence_parallel=True, **kw)
    predicted["tp+sp+loss"] = predicted["tp+sp"]  # the model always splits the logits over tp
    print(f"{args.preset}: L={config.n_layer} h={config.n_embd} a={config.n_head} s={config.seq_len} "
          f"v={config.vocab_size} b={args.micro_batch}, fp32, dropout 0.1; bytes per rank (tp = 2)")
    print(f"{'mode':<12}{'measured':>12}{'model':>12}{'measured/model':>16}{'vs tp (measured)':>18}")
    for name, value in measured.items():
        print(f"{name:<12}{value:>12,}{predicted[name]:>12,.0f}{value / predicted[name]:>16.3f}"
              f"{value / measured['tp']:>18.3f}")


if __name__ == "__main__":
    main()
