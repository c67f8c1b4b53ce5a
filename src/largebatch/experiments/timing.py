"""Interleaved timing on a shared, noisy machine: every round runs each candidate once, in an order
rotated by one each round, so a slow spell hits all candidates alike; results are per-round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(candidates: dict[str, Callable[[], object]], rounds: int,
                     device: torch.device | None = None) -> dict[str, list[float]]:
    """name -> seconds of each of ``rounds`` calls (after one untimed warm-up round). On CUDA the
    device is synchronised around every call."""
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    cuda = device is not None and device.type == "cuda"
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            candidates[name]()
            if cuda:
                torch.cuda.synchronize(device)
            if r:  # round 0 warms up (kernels, caches, optimizer state)
                times[name].append(time.perf_counter() - start)
    return times


def median_ratios(times: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Median over rounds of each candidate's time divided by the reference's in the same round."""
    return {name: statistics.median(t / b for t, b in zip(series, times[reference]))
            for name, series in times.items()}
