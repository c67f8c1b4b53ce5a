"""Optimizer step time, interleaved, as ratios to a peer: on the parameter shapes of GPT-2 small (124M),
or on many small tensors of many distinct shapes (``--case small``).

    .venv/bin/python benchmarks/optim_step.py                  # GPT-2 small shapes, 5 rounds
    .venv/bin/python benchmarks/optim_step.py --layers 2 --vocab 8192 --rounds 3   # quick
    .venv/bin/python benchmarks/optim_step.py --case small     # 2000 x (4,) + 200 distinct shapes
    .venv/bin/python benchmarks/optim_step.py --no-fused      # skip torch.compile (~1 min cold on CPU)
    .venv/bin/python benchmarks/optim_step.py --capturable    # also capturable=True (device step counts)

Every optimizer steps the SAME parameters and gradients (values change a little each step; lr is
tiny); each round times one step of every optimizer in turn, so a busy machine slows all of them
alike, and the report is the median per optimizer and its ratio to the peer measured alongside:
default paths vs torch.optim.AdamW(foreach=True), fused paths vs torch.optim.AdamW(fused=True).
Targets: GPT-2 shapes: LAMB, LANS <= 1.3x AdamW(foreach); fused LAMB, LANS <= 2x AdamW(fused).
Small case: default paths <= 1.5x AdamW(foreach), fused <= 2x AdamW(fused), and the first fused
step (compilation, printed per optimizer) under 60 s.
The same LAMB/LANS/LARS instance is timed on its default and its fused path (they share the state).
``--capturable`` adds LAMB/LANS/LARS(capturable=True) instances on the default path (what
run.on_nonfinite='skip' builds) and reports each against its host-count twin.

CPU memory (--malloc): AdamW(foreach), torch_optimizer and timm allocate parameter-sized temporaries
every step. With glibc's defaults (``--malloc default``, what a user's process gets) large ones are
fresh mmap pages each step and page faults can double their step time; ``--malloc reuse`` raises
glibc's mmap and trim thresholds first (mallopt) so freed temporaries are recycled: the strongest
peers. LAMB/LANS/LARS keep their work buffers and barely notice. Quote both.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.optim import LAMB, LANS, LARS  # noqa: E402


def gpt2_shapes(layers: int, width: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 (HF layout; lm_head tied to wte, so counted once)."""
    shapes = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


def small_shapes() -> list[tuple[int, ...]]:
    """2000 tensors of 4 elements and 200 tensors of 200 distinct shapes (1-D and 2-D, 3 to 600 elements)."""
    distinct = [(i + 3,) if i % 2 else ((i + 3) // 2 + 1, 3) for i in range(200)]
    return [(4,)] * 2000 + distinct


def load_timm_lamb():
    """timm's Lamb without importing timm's package __init__ (which needs torchvision)."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        return None
    root = os.path.dirname(spec.origin)
    for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
        stub = types.ModuleType(name)
        stub.__path__ = [path]
        sys.modules.setdefault(name, stub)
    return importlib.import_module("timm.optim.lamb").Lamb


def build(params, fused: bool, peers: bool, capturable: bool = False):
    """name -> (optimizer, path setter or None); the first entry of each section is the peer."""
    lr = 1e-6
    entries = {
        "AdamW(foreach=True)": torch.optim.AdamW(params, lr=lr, foreach=True),
        "LAMB": LAMB(params, lr=lr),
        "LANS": LANS(params, lr=lr),
        "LARS": LARS(params, lr=lr),
    }
    if peers:
        import torch_optimizer

        entries["torch_optimizer.Lamb"] = torch_optimizer.Lamb(params, lr=lr)
        timm_lamb = load_timm_lamb()
        if timm_lamb is not None:
            entries["timm Lamb (default)"] = timm_lamb(params, lr=lr)
            entries["timm Lamb (foreach)"] = timm_lamb(params, lr=lr, foreach=True)
    if fused:
        entries["AdamW(fused=True)"] = torch.optim.AdamW(params, lr=lr, fused=True)
        for name in ("LAMB", "LANS", "LARS"):
            entries[f"{name}(fused=True)"] = entries[name]  # same instance, other path
    if capturable:
        for name, cls in (("LAMB", LAMB), ("LANS", LANS), ("LARS", LARS)):
            entries[f"{name}(capturable=True)"] = cls(params, lr=lr, capturable=True)
    return entries


def set_path(optimizer, name: str) -> None:
    if isinstance(optimizer, (LAMB, LANS, LARS)):
        optimizer.fused = name.endswith("(fused=True)")
        optimizer.foreach = not optimizer.fused


def timed_step(optimizer, name: str) -> float:
    set_path(optimizer, name)
    if any(p.is_cuda for g in optimizer.param_groups for p in g["params"]):
        torch.cuda.synchronize()
    start = time.perf_counter()
    optimizer.step()
    if any(p.is_cuda for g in optimizer.param_groups for p in g["params"]):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def reuse_freed_memory() -> None:
    """glibc: serve every allocation from the heap and never hand freed memory back to the OS, so a
    step's temporaries reuse the previous step's pages instead of faulting in fresh ones."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1)):
        raise SystemExit("--malloc reuse: mallopt refused the thresholds (not glibc?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("gpt2", "small"), default="gpt2",
                        help="gpt2: GPT-2 shapes (--layers/--width/--vocab/--positions); small: many small tensors")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-fused", action="store_true", help="skip the torch.compile'd paths")
    parser.add_argument("--no-peers", action="store_true", help="skip torch_optimizer and timm")
    parser.add_argument("--capturable", action="store_true",
                        help="also time LAMB/LANS/LARS(capturable=True) against their host-count twins")
    parser.add_argument("--malloc", choices=("default", "reuse"), default="default",
                        help="CPU: glibc as is, or recycle freed temporaries (see the module docstring)")
    args = parser.parse_args()
    if args.malloc == "reuse":
        reuse_freed_memory()

    torch.manual_seed(0)
    shapes = small_shapes() if args.case == "small" else gpt2_shapes(args.layers, args.width, args.vocab,
                                                                         args.positions)
    params = [torch.nn.Parameter(torch.randn(s, device=args.device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n_params = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n_params:,} parameters, device {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, malloc {args.malloc}")
    entries = build(params, fused=not args.no_fused, peers=not args.no_peers, capturable=args.capturable)

    start = time.perf_counter()
    first = {name: timed_step(optimizer, name) for name, optimizer in entries.items()}  # state, compilation
    print(f"warm-up (state allocation, compilation): {time.perf_counter() - start:.1f} s")
    for name, seconds in first.items():
        if "fused" in name:
            print(f"  first step of {name:<24} {seconds:7.1f} s")
    times: dict[str, list[float]] = {name: [] for name in entries}
    for _ in range(args.rounds):
        for name, optimizer in entries.items():
            times[name].append(timed_step(optimizer, name))

    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nmedian step time over {args.rounds} interleaved rounds")
    for name, median in medians.items():
        peer = "AdamW(fused=True)" if "fused" in name and name in medians else "AdamW(foreach=True)"
        peer = peer if peer in medians else "AdamW(foreach=True)"
        default_target = 1.5 if args.case == "small" else 1.3
        target = {"LAMB": default_target, "LANS": default_target, "LAMB(fused=True)": 2.0,
                  "LANS(fused=True)": 2.0}.get(name)
        note = f"  target <= {target}x" if target else ""
        print(f"  {name:<24} {median * 1e3:9.1f} ms   {median / medians[peer]:5.2f}x {peer}{note}")
    for name in [n for n in medians if n.endswith("(capturable=True)")]:
        twin = name.split("(")[0]
        print(f"  {name:<24} {medians[name] / medians[twin]:5.2f}x {twin} (host step counts)")


if __name__ == "__main__":
    main()
