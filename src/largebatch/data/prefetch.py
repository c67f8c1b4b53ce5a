"""The next optimizer step's micro-batches built on a background thread while this step computes.

The data order is keyed on the global sample index (sampler.py), so a batch is a pure function of
its indices: the trainer asks for the indices the next step will take (from the schedule, at the
tokens this step ends on) and, at the next step, uses the prepared batches only if it asks for the
same indices -- a prediction that changed (an adaptive schedule, a resume) costs a synchronous
build, never a different batch. On CUDA the batches are pinned, so the copies to the device run
asynchronously (``.to(device, non_blocking=True)``).

A handoff to the thread is not free: waking it and sharing the interpreter lock with the step cost
~0.4-0.6 ms a step on a 2-core CPU (benchmarks/step_overhead.py), more than a small batch takes to
build (0.04-0.16 ms for a GPT batch of 2-16 sequences, 0.8 ms for the BERT demo's masked batch of
32). So a batch whose last build took less than ``background_above_s`` (1 ms) is built when it is
needed; a slower one (large batches, masking, a slow corpus) on the thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

Batch = dict[str, torch.Tensor]


def _key(chunks: Sequence[Sequence[int]]) -> tuple:
    return tuple(tuple(chunk) for chunk in chunks)


BACKGROUND_ABOVE_S = 1e-3  # builds faster than this are done when needed (module docstring)


class Prefetcher:
    """``get(chunks)``: the batches of these index chunks (prepared if they were ``prefetch``ed);
    ``prefetch(chunks)``: start building them on the worker thread, if the last build took at least
    ``background_above_s`` (0: always). ``hits`` / ``misses`` count the prepared batches used or not."""

    def __init__(self, get_batch: Callable[[Sequence[int]], Batch], pin_memory: bool = False,
                 background_above_s: float = BACKGROUND_ABOVE_S):
        self.get_batch, self.pin_memory = get_batch, pin_memory
        self.background_above_s = background_above_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="largebatch-prefetch")
        self._pending: tuple[tuple, Future] | None = None
        self.hits = self.misses = 0
        self.last_build_s: float | None = None  # seconds the last build took, on either thread

    def _build(self, chunks: Sequence[Sequence[int]]) -> list[Batch]:
        start = time.perf_counter()
        batches = [self.get_batch(chunk) for chunk in chunks]
        if self.pin_memory:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        self.last_build_s = time.perf_counter() - start
        return batches

    def prefetch(self, chunks: Sequence[Sequence[int]]) -> None:
        if self.last_build_s is not None and self.last_build_s < self.background_above_s:
            self._pending = None  # cheaper to build it when it is asked for
            return
        chunks = [list(c) for c in chunks]
        self._pending = (_key(chunks), self._pool.submit(self._build, chunks))

    def get(self, chunks: Sequence[Sequence[int]]) -> list[Batch]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == _key(chunks):
            self.hits += 1
            return pending[1].result()  # an error on the worker is raised here
        self.misses += 1
        return self._build(chunks)

    def close(self) -> None:
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)
