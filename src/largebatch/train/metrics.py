"""Where a run's records go: ``metrics.jsonl`` (one JSON object per line), if available
TensorBoard event files, and with ``run.wandb`` a Weights & Biases run. What a record holds --
loss, tokens/s, MFU with its denominator (largebatch.models.flops), memory
(largebatch.memory.measure) -- is the trainer's; how it is printed is largebatch.train.progress;
the PNG plots at the end are largebatch.train.plots.

metrics.jsonl is strict JSON (RFC 8259), which jq, JavaScript, polars and DuckDB read: a number that
is not finite (a skipped step's NaN loss, an infinite gradient norm) is written as ``null``, and the
record's ``"nonfinite"`` object keeps what it was, by JSON Pointer (RFC 6901) to the value:
``{"loss": null, ..., "nonfinite": {"/loss": "NaN"}}`` ("NaN", "Infinity" or "-Infinity"). Python's
json module would write a bare ``NaN``, which those readers refuse. ``read_metrics`` gives the
records back with the floats in place.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

WANDB_RECORD = "wandb-run.json"  # RUN_DIR/wandb-run.json: the W&B run a resume continues
NONFINITE = "nonfinite"  # a record's key: where its non-finite numbers were, and what they were


def _pointer(path: tuple) -> str:
    """The JSON Pointer (RFC 6901) of ``path``'s keys: "/" each, "~" and "/" in a key as "~0", "~1"."""
    return "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in path)


def strict_record(record: Any, path: tuple = (), found: dict[str, str] | None = None) -> Any:
    """``record`` with every non-finite float (at any depth) as None, and at the top its ``nonfinite``
    object naming each by JSON Pointer: what ``json.dumps(..., allow_nan=False)`` takes."""
    top = found is None
    found = {} if top else found
    if top and isinstance(record, dict) and NONFINITE in record:
        raise ValueError(f"a metrics record may not hold a key named {NONFINITE!r}: metrics.jsonl names its "
                         "non-finite numbers under it; give the value another name")
    if isinstance(record, float) and not math.isfinite(record):  # (numpy's floats too)
        found[_pointer(path)] = "NaN" if math.isnan(record) else "Infinity" if record > 0 else "-Infinity"
        return None
    if isinstance(record, dict):
        out = {key: strict_record(value, (*path, key), found) for key, value in record.items()}
    elif isinstance(record, (list, tuple)):
        out = [strict_record(value, (*path, i), found) for i, value in enumerate(record)]
    else:
        return record
    if top and found:
        out[NONFINITE] = found
    return out


def restored_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record of metrics.jsonl with the non-finite numbers its ``nonfinite`` object names put back
    (the inverse of strict_record); a record without one as it is."""
    found = record.get(NONFINITE) if isinstance(record, dict) else None
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        return record  # (not the writer's: a record of another program's, left as it is)
    del record[NONFINITE]
    for pointer, spelled in found.items():
        keys = [part.replace("~1", "/").replace("~0", "~") for part in str(pointer).split("/")[1:]]
        inside: Any = record
        try:
            for key in keys[:-1]:
                inside = inside[int(key) if isinstance(inside, list) else key]
            last = keys[-1]
            inside[int(last) if isinstance(inside, list) else last] = float(spelled)
        except (LookupError, ValueError, TypeError):  # (a record edited by hand: left as it is)
            continue
    return record


class MetricsLog:
    """Append-only metrics.jsonl plus optional TensorBoard scalars.

    At resume the records after the checkpoint are dropped (the resumed run writes them again) by
    truncating the file, read from its end (_resume_cut: a restart costs the same at step 100 and
    step 1,000,000); lines that do not parse (a last line cut short by a kill or a full disk) are
    dropped too and reported in ``notes``. A failed write raises the OSError (one line, see the CLI).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None,
                 evaluates_again: bool = False, wandb: WandbSettings | None = None):
        """``resume_step``: the checkpoint's step (None: a fresh run). ``evaluates_again``: the resumed
        run evaluates at that step again (the end of the run: its final checkpoint is written before
        the final evaluation), so a validation record at it is dropped, not kept twice. ``wandb``:
        the records go to a Weights & Biases run too (WandbRun)."""
        self._wandb = None
        self.path = run_dir / "metrics.jsonl"
        self.notes: list[str] = []
        self._failed = False
        kept: list[dict[str, Any]] = []  # the kept records of the resume step (TensorBoard writes them again)
        if resume_step is not None and self.path.exists():
            cut, kept, bad = _resume_cut(self.path, resume_step, evaluates_again)
            if bad:
                self.notes.append(f"{self.path}: dropped {bad} unreadable line(s) (a write cut short "
                                  f"by a kill or a full disk)")
            with open(self.path, "r+b") as file:
                file.truncate(cut)  # one metadata update: the old length or the new one, never half
                if cut and not _ends_with_newline(file, cut):
                    file.write(b"\n")
        earlier = self.path.exists()  # an earlier attempt of this run logged here
        if wandb is not None and not wandb_disabled():  # (after the cut: a resume sends W&B the kept records it lacks)
            self._wandb = WandbRun(run_dir, wandb, resume_step, self.path)
        # a fresh run starts a fresh file; a resumed one continues the kept records
        self._file = open(self.path, "a" if resume_step is not None else "w", buffering=1)
        self._tb = None
        events = run_dir / "tensorboard"
        if resume_step is None and earlier:  # a fresh run over an earlier attempt's events (killed
            for old in events.glob("events.out.tfevents.*"):  # before any checkpoint): they would show twice
                if old.is_file() and not old.is_symlink():  # (not a user's folder or link of that name)
                    old.unlink(missing_ok=True)
            if not tensorboard and events.is_dir() and not any(events.iterdir()):
                events.rmdir()  # (with run.tensorboard = false the run has none)
        if not tensorboard and (resume_step is None or not any(events.glob("events.out.tfevents.*"))):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional for library users
            return
        # TensorBoard drops earlier events from the purge step on: from the resume step when its
        # validation is redone, the kept records of that step written again. A resume without
        # TensorBoard still purges what the run wrote past its checkpoint, then writes nothing.
        # (without TensorBoard from the resume step's end: its evaluation, redone, is not written again)
        self._tb = SummaryWriter(log_dir=str(events), purge_step=None if resume_step is None else
                                 resume_step + (0 if evaluates_again and tensorboard else 1))
        if evaluates_again and tensorboard:
            for record in kept:
                self._scalars(record)
        if not tensorboard:
            self._tb.close()
            self._tb = None

    def log(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
        except OSError as exc:
            self._failed = True
            exc.filename = exc.filename or str(self.path)
            raise
        if self._tb is not None:
            self._scalars(record)
        if self._wandb is not None:
            self._wandb.log(record)

    def summary(self, summary: dict[str, Any]) -> None:
        """The end-of-run numbers (summary.json's), as the W&B run's summary."""
        if self._wandb is not None:
            self._wandb.summary(summary)

    def _scalars(self, record: dict[str, Any]) -> None:
        """Every finite number of ``record`` as a scalar at its step; ``wall_time`` as each event's
        own time (TensorBoard's relative-time axis), not as a curve of its own. An evaluation's
        record gives its ``val_*`` numbers only: its step's training record gave the others (tokens,
        phase, seq_len), which would otherwise show twice at that step."""
        step, wall = int(record.get("step", 0)), record.get("wall_time")
        for key, value in _scalars_of(record):
            self._tb.add_scalar(key, value, step, walltime=wall)

    def close(self, exit_code: int = 0, preempted: bool = False) -> None:
        """Close the file and the writers; ``exit_code`` and ``preempted`` (stopped by a signal, to be
        continued) end the W&B run as finished, failed or preempted."""
        try:
            self._file.close()
        except OSError:
            if not self._failed:  # after a failed write, flushing its remainder fails again
                raise
        finally:
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                wandb, self._wandb = self._wandb, None
                wandb.finish(exit_code, preempted)


def wandb_disabled() -> bool:
    """W&B switched off by its environment (``WANDB_MODE=disabled``, ``WANDB_DISABLED=true``): no W&B run
    is started, and none recorded for a later launch to continue."""
    return (os.environ.get("WANDB_MODE", "").strip().lower() == "disabled"
            or os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true"))


class WandbSettings:
    """What a W&B run is started with: the run's config (a nested dict, shown as ``model.n_layer``
    and so on) and ``run.wandb_project``."""

    def __init__(self, config: dict[str, Any], project: str | None = None):
        self.config, self.project = config, project


class WandbRun:
    """The run's Weights & Biases run, on rank 0: every finite number of each record at the record's
    optimizer step (W&B's step), with the names metrics.jsonl uses (``loss``, ``lr``, ``tokens``, ...);
    an evaluation's ``val_*`` numbers (and its ``tokens``, for a tokens x-axis) join its step's row --
    with ``[[phases]]``, as ``val_loss/phase_K``: at a phase switch two evaluations share a step, the
    ending phase's and the next one's at its own sequence length. The run's config, and summary.json's
    numbers as the run's summary.

    The run is named after the run directory (``WANDB_NAME`` otherwise) and keeps its files in
    ``RUN_DIR/wandb`` (``WANDB_DIR`` otherwise). Its id, project and entity are kept in
    ``RUN_DIR/wandb-run.json``: a resume continues that W&B run (W&B's ``resume="allow"``), in the project
    it was started in; a fresh run in the directory starts a new one. At a resume, the records
    metrics.jsonl keeps (those up to the checkpoint) that W&B lacks are sent first: online, those from
    the step the resumed W&B run reports on (a hard kill loses what W&B had not sent yet); offline,
    where W&B cannot know, all of them, so that each launch's offline file holds the whole history
    (``wandb sync`` of a later file of one id replaces what an earlier one gave). ``WANDB_MODE=disabled``
    records nothing. W&B's own environment variables apply (``WANDB_ENTITY``, ``WANDB_API_KEY``,
    ``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ...)."""

    def __init__(self, run_dir: Path, settings: WandbSettings, resume_step: int | None, metrics: Path):
        import wandb

        from largebatch.checkpoint.files import atomic_write_text
        from largebatch.typed_config import ConfigError

        record = run_dir / WANDB_RECORD
        saved = _saved_wandb_run(record) if resume_step is not None else None
        project = (saved or {}).get("project") or settings.project or os.environ.get("WANDB_PROJECT") or "largebatch"
        entity = (saved or {}).get("entity") or None
        try:  # (create_new: a second Trainer alive in the process gets its own run, not the first's)
            self.run = wandb.init(project=project, entity=entity, id=(saved or {}).get("id"), resume="allow",
                                  name=None if os.environ.get("WANDB_NAME") else run_dir.absolute().name,
                                  dir=None if os.environ.get("WANDB_DIR") else str(run_dir), reinit="create_new")
        except Exception as exc:  # noqa: BLE001 -- wandb's CommError, UsageError, a timeout ...
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"run.wandb = true, but W&B could not start the run ({reason}): check the "
                              "network and WANDB_API_KEY, or set WANDB_MODE=offline to write it to RUN_DIR/wandb "
                              "and upload it later with `wandb sync`") from None
        self._phased = len(settings.config.get("phases") or ()) > 1
        self._first_step = int(self.run.step or 0)  # a resumed run's next step, as W&B's history holds it
        self.run.config.update(settings.config, allow_val_change=True)  # (a resume may change restart fields)
        atomic_write_text(record, json.dumps({"id": self.run.id, "project": self.run.project or project,
                                              "entity": self.run.entity or entity, "url": self.run.url}))
        if resume_step is not None and metrics.exists():
            for kept in _records_from(metrics, self._first_step):
                self.log(kept)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if step < self._first_step:  # W&B holds this step already (it would drop it, with a warning)
            return
        suffix = f"/phase_{record.get('phase', 0)}" if self._phased and record.get("kind") == "val" else ""
        values = {key + ("" if key == "tokens" else suffix): value
                  for key, value in _scalars_of(record, evaluation_keeps=("tokens",))}
        if values:
            self.run.log(values, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        flat = {**summary, **{f"final_val_loss/{label}": loss for label, loss in
                              (summary.get("final_val_loss_by_corpus") or {}).items()},  # (data.mixture)
                **{f"final_val_bpb/{label}": bits for label, bits in
                   (summary.get("final_val_bpb_by_corpus") or {}).items()},
                **{f"target/{key}": value for key, value in (summary.get("target") or {}).items()}}
        self.run.summary.update({key: value for key, value in flat.items()
                                 if isinstance(value, (int, float, str)) and not (isinstance(value, float)
                                                                                  and not math.isfinite(value))})

    def finish(self, exit_code: int, preempted: bool) -> None:
        if preempted:
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)


def _records_from(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of metrics.jsonl from ``step`` on, in order: read from the end up to the first
    record before it (the whole file from step 0)."""
    if step <= 0:
        return list(iter_metrics(path.parent))
    found = []
    for _, line in _lines_from_the_end(path):
        record = next(iter(_parsed([line])), None)
        if record is None:
            continue
        if int(record.get("step", 0)) < step:
            break
        found.append(record)
    return found[::-1]


def _parsed(lines) -> Iterator[dict[str, Any]]:
    """The JSON records of ``lines`` (str or bytes); blank lines and lines that do not parse (cut short
    by a kill or a full disk) skipped."""
    for line in lines:
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            yield restored_record(record)


def _saved_wandb_run(record: Path) -> dict[str, Any] | None:
    """RUN_DIR/wandb-run.json's {id, project, entity}, or None (absent or unreadable: a new W&B run)."""
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("id"), str) and saved["id"] else None


def _scalars_of(record: dict[str, Any], evaluation_keeps: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(name, value) of every finite number of ``record`` but its ``step`` and ``wall_time``; of an
    evaluation's record, its ``val_*`` numbers (and ``evaluation_keeps``) only: its step's training
    record gives the others (tokens, phase, seq_len)."""
    evaluation = record.get("kind") == "val"
    for key, value in record.items():
        if key in ("step", "wall_time") or (evaluation and not key.startswith("val_") and key not in evaluation_keeps):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield key, value


def _ends_with_newline(file, end: int) -> bool:
    file.seek(end - 1)
    return file.read(1) == b"\n"


def _lines_from_the_end(path: Path, block: int = 1 << 20):
    """(end offset, bytes) of each line of ``path`` (without its newline), the last first: the file is
    read backwards a block at a time, so what is not asked for is never read."""
    with open(path, "rb") as file:
        end = file.seek(0, 2)
        tail = b""  # the start of a line, read with the block after it (it begins at ``end``)
        while end > 0:
            start = max(0, end - block)
            file.seek(start)
            line_end = end + len(tail)  # where the last line read ends (before its newline, if any)
            lines = (file.read(end - start) + tail).split(b"\n")
            tail = lines.pop(0) if start > 0 else b""  # it may begin in the block before
            for line in reversed(lines):
                yield line_end, line
                line_end -= len(line) + 1
            end = start


def _resume_cut(path: Path, resume_step: int, evaluates_again: bool,
                block: int = 1 << 20) -> tuple[int, list[dict[str, Any]], int]:
    """(the length metrics.jsonl keeps at a resume from ``resume_step``, the kept records of that step,
    how many unreadable lines were dropped).

    A run appends its records in step order (a step's train record, then its evaluation), so the
    records a resume drops -- those past its checkpoint, and the checkpoint step's evaluation when it
    ``evaluates_again`` -- and the lines a kill or a full disk cut short are all at the end: the file
    is read from the end up to the last record kept, whatever the length of the run before it."""
    cut, kept, bad = 0, [], 0
    for end, line in _lines_from_the_end(path, block):
        if not line.strip():
            continue
        try:
            record = restored_record(json.loads(line))  # (kept records are replayed: their floats back)
        except ValueError:
            if not cut:
                bad += 1
            continue
        step = record.get("step", 0)
        if not cut:
            if step > resume_step or step == resume_step and evaluates_again and record.get("kind") == "val":
                continue
            cut = end + 1
        if step < resume_step:
            break
        kept.insert(0, record)
    return min(cut, path.stat().st_size), kept, bad


def iter_metrics(run_dir: str | Path):
    """The records of a run one at a time, read a line at a time (a million-step run's file is not
    held whole); a line cut short by a kill or a full disk is skipped."""
    with open(Path(run_dir) / "metrics.jsonl", errors="replace") as file:
        yield from _parsed(file)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run; a line cut short by a kill or a full disk is skipped."""
    return list(iter_metrics(run_dir))
