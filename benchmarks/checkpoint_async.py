"""What a checkpoint costs the training loop, written synchronously against in the background
(run.async_checkpoint, largebatch.checkpoint.background), on a GPT's real model and LAMB state.

For each round (interleaved: sync, then async): the seconds the loop is held by a save (sync: the
whole write, fsync and rename; async: the copy to host memory), the background write's own seconds
until the checkpoint is in place, and the training steps taken while it was written against the
same steps with no write in flight (on a CPU the write competes with the step for cores and memory
bandwidth: the honest price of hiding it). Ratios are async / sync in the same rounds.

    PYTHONPATH=src python benchmarks/checkpoint_async.py [--preset gpt2-small] [--rounds 3] [--dir DIR]
    PYTHONPATH=src python benchmarks/checkpoint_async.py --device cuda   # staging is a device-to-host copy

``--dir`` is where the checkpoints go (a temporary directory by default; give a shared disk's path
to measure it): its own disk's write speed is most of the synchronous time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from largebatch.checkpoint import save_checkpoint
from largebatch.checkpoint.local import LocalWrite
from largebatch.models import build_model, preset
from largebatch.optim import LAMB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = preset(args.preset)
    model = build_model(cfg).to(device)
    optimizer = LAMB(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab_size, (1, args.seq), device=device)

    def step() -> None:
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # the optimizer's state exists from here
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{state_bytes / 2**30:.2f} GiB of model + LAMB state; checkpoints in {root}; "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    writes = LocalWrite()
    for r in range(args.rounds):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": r}
        t0 = time.perf_counter()
        save_checkpoint(root / "sync", r, state, keep_last=1)
        sync_held = time.perf_counter() - t0
        t0 = time.perf_counter()
        step()
        idle_step = time.perf_counter() - t0
        t0 = time.perf_counter()
        writes.start(root / "async", r, state, keep_last=1)
        async_held = time.perf_counter() - t0
        steps, busy = 0, 0.0
        while writes._write.busy:  # the training goes on beside the write
            t1 = time.perf_counter()
            step()
            busy += time.perf_counter() - t1
            steps += 1
        writes.wait()
        in_place = time.perf_counter() - t0
        rows.append((sync_held, async_held, in_place, idle_step, busy / steps if steps else float("nan"), steps))
        print(f"round {r}: sync held {sync_held:.2f} s; async held {async_held:.2f} s, in place after "
              f"{in_place:.2f} s with {steps} steps beside it ({busy / max(steps, 1):.3f} s each, "
              f"{idle_step:.3f} s alone)")
    sync_held, async_held, in_place, idle, beside, _ = (statistics.median(c) for c in zip(*rows))
    print(f"median: the loop held {async_held:.2f} s by an async save against {sync_held:.2f} s by a sync "
          f"one ({async_held / sync_held:.2f}x); the async checkpoint in place after {in_place:.2f} s "
          f"({in_place / sync_held:.2f}x the sync write); a step beside the write {beside / idle:.2f}x "
          f"a step alone")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
