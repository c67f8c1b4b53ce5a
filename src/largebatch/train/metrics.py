"""Where a run's records go: ``metrics.jsonl`` (one JSON object per line) and, if available,
TensorBoard event files. What a record holds -- loss, tokens/s, MFU with its denominator
(largebatch.models.flops), memory (largebatch.memory.measure) -- is the trainer's; how it is
printed is largebatch.train.progress; the PNG plots at the end are largebatch.train.plots.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from largebatch.checkpoint.files import atomic_write_text


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
