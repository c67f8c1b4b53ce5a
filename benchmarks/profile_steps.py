"""What run.profile_steps costs the steps it records (largebatch.train.profile), in one real run.

Trains a config (gpt-demo by default) with a window of profiled steps in its middle and compares
the tokens/s of the profiled steps' records with the median of the unprofiled steps after the first
few (the peer, in the same run, on the same model and data): the profiler's own cost, which the
records of those steps carry ("profiled": true). Then lists what the window wrote and, on CUDA,
how many device kernels the trace holds and whether the allocator's history was written.

    PYTHONPATH=src python benchmarks/profile_steps.py [--config gpt-demo] [--steps 20-24] [--memory]
    PYTHONPATH=src python benchmarks/profile_steps.py --device cuda --memory   # kernels, memory history
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
from pathlib import Path

from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from largebatch.train.profile import profile_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-demo")
    parser.add_argument("--steps", default="20-24", help="the profiled window (run.profile_steps)")
    parser.add_argument("--last-step", type=int, default=40, help="steps the run takes (run.max_steps)")
    parser.add_argument("--memory", action="store_true", help="run.profile_memory too")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    (first, last), = profile_windows(args.steps)
    out = Path(tempfile.mkdtemp(prefix="profile-bench-"))
    cfg = load_config(resolve_config(args.config), {
        "run.out_dir": str(out), "run.device": args.device, "run.profile_steps": args.steps,
        "run.profile_memory": args.memory, "run.max_steps": args.last_step, "run.eval_every_tokens": None,
        "run.progress": "off", "run.sample_tokens": 0, "run.plots": False, "run.tensorboard": False})
    Trainer(cfg, out, log=lambda line: print(line) if line.startswith(("profile of", "warning")) else None).fit()
    records = [r for r in read_metrics(out) if r["kind"] == "train"]
    profiled = [r["tokens_per_s"] for r in records if r.get("profiled")]
    others = [r["tokens_per_s"] for r in records if not r.get("profiled") and r["step"] > 5]
    peer = statistics.median(others)
    print(f"{args.config} on {args.device}: profiled steps {first}-{last}: "
          f"{statistics.median(profiled):,.0f} tokens/s (median of {len(profiled)}) against "
          f"{peer:,.0f} tokens/s (median of the {len(others)} unprofiled steps after step 5): "
          f"{statistics.median(profiled) / peer:.2f}x")
    folder = out / "profile" / f"steps_{first}-{last}"
    for path in sorted(folder.iterdir()):
        print(f"  {path.name}  {path.stat().st_size:,} bytes")
    with gzip.open(folder / "rank0.pt.trace.json.gz", "rt") as file:
        events = json.load(file)["traceEvents"]
    kernels = sum(e.get("cat") == "kernel" for e in events)
    print(f"  trace: {len(events):,} events, {kernels:,} device kernels")
    row = next(line.split() for line in (folder / "rank0.txt").read_text().splitlines()
               if line.split()[:1] == ["ProfilerStep*"])
    print(f"  table: {row[-1]} steps (the window has {last - first + 1})")
    assert int(row[-1]) == last - first + 1, "the operators table does not count the window's steps"
    if args.device.startswith("cuda"):
        assert kernels > 0, "no device kernel in a CUDA run's trace"
        assert not args.memory or (folder / "rank0.memory.pickle").is_file(), "no allocator history"


if __name__ == "__main__":
    main()
