"""Honest run metrics: throughput, MFU with its denominator, memory, logs and plots.

* MFU = model FLOPs per token x tokens/s / peak FLOP/s (Chowdhery et al. 2022, PaLM App. B): model
  FLOPs count no recomputation (recompute shows up as lower MFU, not as more work). The peak is
  either declared by the user (``run.peak_flops``, e.g. 989e12 for an H100 in bf16) or measured
  here with a large matmul in the run's dtype, and is always printed next to the MFU.
* Memory: peak device memory on CUDA (``torch.cuda.max_memory_allocated``), else the process's
  resident set size.
* Every logged record goes to ``metrics.jsonl``, to TensorBoard event files if available, and at the
  end to PNG plots (loss vs tokens and vs steps; LR and batch size vs tokens).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048,
                       seconds: float = 1.5) -> float:
    """Best achieved FLOP/s of an n x n x n matmul on ``device`` -- an honest MFU denominator.

    The best of many repetitions, so a busy moment on a shared machine lowers it little; on a
    machine shared with other jobs it can still be low (and MFU then high): declare the peak with
    ``run.peak_flops`` for numbers to compare across machines.
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # warm up kernels and caches
        a @ b
    best = math.inf
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2.0 * n**3 / best


def memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; current resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def mfu_over_peak(mfu: float, peak_flops: float, source: str) -> str:
    """Why an MFU above 100% is not a result: the peak it divides by is too low."""
    return (f"MFU {100 * mfu:.0f}% is above 100%: the peak of {peak_flops / 1e12:.3g} TFLOP/s it "
            f"divides by was {source}, so it is too low (a matmul measured under load, or a wrong "
            f"declaration); declare the device's peak with --run.peak_flops")


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


class MetricsLog:
    """Append-only metrics.jsonl plus optional TensorBoard scalars.

    At resume the records after the checkpoint are dropped (the resumed run writes them again) by an
    atomic rewrite; lines that do not parse (a last line cut short by a kill or a full disk) are
    dropped too and reported in ``notes``. A failed write raises the OSError (one line, see the CLI).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.notes: list[str] = []
        self._failed = False
        if resume_step is not None and self.path.exists():
            records, bad = _parse_lines(self.path.read_text(errors="replace"))
            if bad:
                self.notes.append(f"{self.path}: dropped {bad} unreadable line(s) (a write cut short "
                                  f"by a kill or a full disk)")
            kept = [json.dumps(r) + "\n" for r in records if r.get("step", 0) <= resume_step]
            from largebatch.train.rundir import atomic_write_text

            atomic_write_text(self.path, "".join(kept))
        # a fresh run starts a fresh file; a resumed one continues the kept records
        self._file = open(self.path, "a" if resume_step is not None else "w", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                         purge_step=resume_step + 1 if resume_step else None)
            except ImportError:  # tensorboard is optional for library users
                self._tb = None

    def log(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:
            self._failed = True
            exc.filename = exc.filename or str(self.path)
            raise
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            if not self._failed:  # after a failed write, flushing its remainder fails again
                raise
        if self._tb is not None:
            self._tb.close()


def _parse_lines(text: str) -> tuple[list[dict[str, Any]], int]:
    """(the records of a metrics.jsonl text, how many non-empty lines did not parse)."""
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            bad += 1
    return records, bad


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run; a line cut short by a kill or a full disk is skipped."""
    return _parse_lines((Path(run_dir) / "metrics.jsonl").read_text(errors="replace"))[0]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write loss.png (vs tokens and vs steps) and schedule.png (LR, batch vs tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train:
        return []
    out = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens", "tokens seen"), (axes[1], "step", "optimizer step")):
        ax.plot([r[key] for r in train], [r["loss"] for r in train], lw=1, label="train")
        if val:
            ax.plot([r[key] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "loss.png")

    fig, ax1 = plt.subplots(figsize=(7, 4))
    tokens = [r["tokens"] for r in train]
    ax1.plot(tokens, [r["lr"] for r in train], color="tab:blue")
    ax1.set_xlabel("tokens seen")
    ax1.set_ylabel("learning rate", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(tokens, [r["batch_size"] for r in train], color="tab:orange", where="post")
    ax2.set_ylabel("batch size (sequences)", color="tab:orange")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "schedule.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "schedule.png")
    return out


class Progress:
    """A progress bar in tokens. The ETA uses recent tokens/s, so it stays right as batches grow."""

    def __init__(self, total_tokens: int, enabled: bool | None = None, stream=sys.stderr):
        self.total = total_tokens
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self._rate = None  # EMA of tokens/s

    def update(self, tokens: int, tokens_per_s: float, text: str = "") -> None:
        if not self.enabled:
            return
        self._rate = tokens_per_s if self._rate is None else 0.8 * self._rate + 0.2 * tokens_per_s
        frac = min(1.0, tokens / self.total)
        eta = (self.total - tokens) / self._rate if self._rate else float("nan")
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
    return text
