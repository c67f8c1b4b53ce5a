"""Peak host memory per rank of the two starts: the whole model built on every rank then sharded,
vs built on the meta device and materialised per rank (largebatch.parallel.materialize).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/meta_init.py [--preset gpt2-small] [--mode pp]

Two gloo ranks on CPU, the vocabulary padded to 50304 (tensor parallel splits it); each start
runs in fresh processes so the peak resident set (ru_maxrss) is its own. Printed per mode (FSDP over
2 replicas, tensor + sequence parallel over 2, pipeline stages pp = 2 with untied embeddings, which
pipeline stages need): the rank's parameter bytes after the start, the whole model's, the rise of
its peak resident set during the start (the larger of the two ranks'), and the seconds it took.
Bytes are counted, not timed, so a shared machine changes only the seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from largebatch.models import build_model, preset
from largebatch.parallel import ParallelConfig, init_distributed, parallelize, spawn, unwrap
from largebatch.parallel.materialize import build_on_meta, materialize
from largebatch.parallel.pipeline import pipeline_parallelize

MODES = {"fsdp": dict(dp=2, dp_mode="fsdp"), "tp+sp": dict(tp=2, sequence_parallel=True), "pp": dict(pp=2)}


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def start(preset_name: str, mode: str, meta: bool, out: str) -> None:
    state = init_distributed(ParallelConfig(**MODES[mode]))
    cfg = replace(preset(preset_name), dropout=0.0, vocab_size=50304)  # tp = 2 divides 50304
    if mode == "pp":
        cfg = replace(cfg, tie_embeddings=False)  # pipeline stages refuse tied embeddings
    torch.manual_seed(0)
    before, t0 = _peak_bytes(), time.perf_counter()
    if mode == "pp" and meta:
        model, log = build_on_meta(lambda: build_model(cfg))
        model = pipeline_parallelize(model, state, init_log=log).model
    elif mode == "pp":
        model = pipeline_parallelize(build_model(cfg), state).model
    elif meta:
        model, log = build_on_meta(lambda: build_model(cfg))
        model = parallelize(model, state)
        materialize(unwrap(model), log, state.device)
    else:
        model = parallelize(build_model(cfg), state)
    seconds = time.perf_counter() - t0
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in unwrap(model).parameters())
    with torch.device("meta"):  # the whole model's bytes (a pipeline stage holds only its own)
        total = sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
    Path(out, f"rank{state.rank}.json").write_text(json.dumps(
        {"local": local, "total": total, "peak_rise": _peak_bytes() - before, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all")
    args = parser.parse_args()
    print(f"{'mode':7} {'start':6} {'params/rank MB':>14} {'whole MB':>9} {'peak rise MB':>13} {'s':>6}")
    for mode in MODES if args.mode == "all" else [args.mode]:
        for meta in (False, True):
            with tempfile.TemporaryDirectory() as out:
                spawn(start, 2, args.preset, mode, meta, out)
                r = max((json.loads(Path(out, f"rank{i}.json").read_text()) for i in range(2)),
                        key=lambda x: x["peak_rise"])
            print(f"{mode:7} {'meta' if meta else 'whole':6} {r['local'] / 1e6:14.1f} {r['total'] / 1e6:9.1f} "
                  f"{r['peak_rise'] / 1e6:13.1f} {r['seconds']:6.1f}")


if __name__ == "__main__":
    main()
