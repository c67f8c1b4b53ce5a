"""What the trainer prints: its log lines (``ConsoleLog``), a progress bar in tokens, one log line
per record, human-readable counts and sizes."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable


class ConsoleLog:
    """The trainer's default log (and an experiment's): each line to standard output, flushed at
    once, so a pipe (``| tee train.log``) or a job's output file (Slurm's ``slurm-JOBID.out``) shows
    it when it is written, not 8 KiB later, and a killed job loses no line.

    When the reader of a pipe exits (``largebatch train CONFIG | head``), the next line meets a
    closed pipe (``BrokenPipeError``). A run is not lost to that: standard output is pointed at the
    null device (a later flush, the interpreter's at exit included, cannot raise again), ``notice``
    and the line go to standard error, as do the lines after it, and ``on_lost`` is called (the
    trainer asks to stop as on a signal: the step in progress finishes, a checkpoint is written, the
    process exits with 141, as a process that SIGPIPE ends)."""

    def __init__(self, notice: str = "ending this step, then checkpointing") -> None:
        self.notice = notice
        self.lost = False
        self.on_lost: Callable[[], None] | None = None

    def __call__(self, *parts: Any) -> None:
        if self.lost:
            self._stderr(*parts)
            return
        try:
            print(*parts, flush=True)
            return
        except BrokenPipeError:
            self.lost = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # (a stdout that is no file: nothing to point elsewhere)
            pass
        self._stderr(f"[largebatch] standard output was closed by its reader: {self.notice}; the rest "
                     f"of the log goes to standard error")
        self._stderr(*parts)
        if self.on_lost is not None:
            self.on_lost()

    @staticmethod
    def _stderr(*parts: Any) -> None:
        try:
            print(*parts, file=sys.stderr, flush=True)
        except OSError:  # standard error closed too (``2>&1 | head``): nothing is left to tell
            pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


class Progress:
    """A progress bar in tokens. The ETA is the remaining tokens at the recent training tokens/s (so it
    stays right as batches grow), stretched by the wall-clock time per second of training so far
    (evaluations, checkpoints and logging happen between the steps a tokens/s measures: without the
    stretch the ETA came out 1.5-2x short on a 100,000-step run that logged every step to TensorBoard)."""

    def __init__(self, total_tokens: int, enabled: bool | None = None, stream=None,
                 clock=time.monotonic):
        self.total = total_tokens
        self.stream = sys.stderr if stream is None else stream  # (read now: contextlib.redirect_stderr)
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self._rate = None  # EMA of tokens/s
        self._last: tuple[int, float] | None = None  # (tokens, clock) at the last update
        self._train_s = self._wall_s = 0.0  # since the first update: training time, and wall time

    def update(self, tokens: int, tokens_per_s: float, text: str = "") -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self._last is not None and tokens > self._last[0] and tokens_per_s > 0:
            self._train_s += (tokens - self._last[0]) / tokens_per_s
            self._wall_s += now - self._last[1]
        self._last = (tokens, now)
        self._rate = tokens_per_s if self._rate is None else 0.8 * self._rate + 0.2 * tokens_per_s
        stretch = max(1.0, self._wall_s / self._train_s) if self._train_s > 0 else 1.0
        frac = min(1.0, tokens / self.total)
        eta = (self.total - tokens) / self._rate * stretch if self._rate else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        self.stream.write(f"\r[{bar}] {100 * frac:5.1f}% {human_count(tokens)}/"
                          f"{human_count(self.total)} tok  ETA {format_seconds(eta)}  {text}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def format_record(r: dict[str, Any]) -> str:
    """One train record as the log line the trainer prints."""
    text = (f"step {r['step']:>5}  tokens {human_count(r['tokens']):>7}  loss {r['loss']:.4f}  "
            f"lr {r['lr']:.2e}  batch {r['batch_size']:>4}  tok/s {r['tokens_per_s']:,.0f}  "
            f"mfu {100 * r['mfu']:.1f}%  mem {human_bytes(r['memory_bytes'])}  "
            f"|g| {r['grad_norm']:.3f}")
    if "trust_median" in r:
        text += (f"  trust {r['trust_min']:.3g}/{r['trust_median']:.3g}/{r['trust_max']:.3g}"
                 f" pinned {r['trust_pinned']}")
    if r.get("noise_scale") is not None:
        text += f"  B_noise {r['noise_scale']:.0f}"
    if r.get("overflow"):  # fp16: this step's gradients overflowed; its update was taken back
        text += "  (overflow: skipped)"
    if r.get("loss_scale") is not None:  # fp16
        text += f"  scale {r['loss_scale']:.10g}"
        if r.get("overflow_steps"):
            text += f" ({r['overflow_steps']} overflowed)"
    return text
