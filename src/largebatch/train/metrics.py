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

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None,
                 evaluates_again: bool = False):
        """``resume_step``: the checkpoint's step (None: a fresh run). ``evaluates_again``: the resumed
        run evaluates at that step again (the end of the run: its final checkpoint is written before
        the final evaluation), so a validation record at it is dropped, not kept twice."""
        self.path = run_dir / "metrics.jsonl"
        self.notes: list[str] = []
        self._failed = False
        kept: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            records, bad = _parse_lines(self.path.read_text(errors="replace"))
            if bad:
                self.notes.append(f"{self.path}: dropped {bad} unreadable line(s) (a write cut short "
                                  f"by a kill or a full disk)")
            kept = [r for r in records if r.get("step", 0) < resume_step or r.get("step", 0) == resume_step
                    and not (evaluates_again and r.get("kind") == "val")]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        # a fresh run starts a fresh file; a resumed one continues the kept records
        self._file = open(self.path, "a" if resume_step is not None else "w", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional for library users
                return
            events = run_dir / "tensorboard"
            if resume_step is None:  # a fresh run over an earlier attempt's events (killed before any
                for old in events.glob("events.out.tfevents.*"):  # checkpoint): they would show twice
                    old.unlink(missing_ok=True)
            # TensorBoard drops earlier events from the purge step on: from the resume step when its
            # validation is redone, the kept records of that step written again
            self._tb = SummaryWriter(log_dir=str(events), purge_step=None if resume_step is None else
                                     resume_step + (0 if evaluates_again else 1))
            if evaluates_again:
                for record in kept:
                    if record.get("step", 0) == resume_step:
                        self._scalars(record)

    def log(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:
            self._failed = True
            exc.filename = exc.filename or str(self.path)
            raise
        if self._tb is not None:
            self._scalars(record)

    def _scalars(self, record: dict[str, Any]) -> None:
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
