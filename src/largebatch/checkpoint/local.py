"""Crash-safe checkpoints: a kill or a full disk never corrupts or loses a finished checkpoint.

Layout: ``RUN_DIR/checkpoints/step_00000123.pt``. A save writes ``.step_00000123.pt.tmp``, flushes
and fsyncs it, then ``os.replace``s it into place (atomic on POSIX) and fsyncs the directory; only
then are checkpoints beyond the newest ``keep_last`` deleted, and any of a later step (a trajectory
the run left when it resumed from an earlier checkpoint; ``files.superseded``). A reader only ever sees complete
files: temporaries are never listed, and a temporary left by a killed save is removed by the next
save. A failed write (no space, file-size limit, I/O error) removes its temporary and raises
:class:`CheckpointError` naming the checkpoint that is still intact.
"""

from __future__ import annotations

import errno
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import torch

from largebatch.checkpoint.background import BackgroundWrite, BackgroundWriter, staged
from largebatch.checkpoint.files import (
    checkpoint_dir,
    checkpoint_path,
    fsync_dir,
    latest_checkpoint,
    read_torch_file,
    remove_quietly,
    remove_superseded,
    remove_temporaries,
)


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; the message says what is still safe."""


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep the newest ``keep_last``."""
    if keep_last < 1:
        raise ValueError(f"keep_last = {keep_last}: at least 1 checkpoint must be kept")
    ckdir = checkpoint_dir(run_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(ckdir)
    final = checkpoint_path(run_dir, step, ".pt")
    tmp = ckdir / f".{final.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(ckdir)
    except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write in RuntimeError
        remove_quietly(tmp)  # the write's error is the one to report, not the cleanup's
        cause = os_error_in(exc)
        if cause is None:
            raise
        raise write_failure(final, run_dir, cause) from exc
    remove_superseded(run_dir, final, keep_last)
    return final


class LocalWrite(BackgroundWriter):
    """save_checkpoint in the background (largebatch.checkpoint.background): ``start`` copies the state
    to host memory and returns the checkpoint's path at once; the file is written, fsynced, renamed
    into place and the old ones rotated while training goes on. ``wait`` (the next ``start`` too)
    blocks until that write is done and raises its CheckpointError."""

    def __init__(self) -> None:
        self._write = BackgroundWrite()

    def start(self, run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path:
        if keep_last < 1:
            raise ValueError(f"keep_last = {keep_last}: at least 1 checkpoint must be kept")
        self._write.wait()
        host = staged(state)
        self._write.start(lambda: save_checkpoint(run_dir, step, host, keep_last))
        return checkpoint_path(run_dir, step, ".pt")

    def wait(self) -> None:
        self._write.wait()

    def close(self) -> tuple[BaseException | None, BaseException | None]:
        """Wait for the write in flight (through stop signals), after a failure elsewhere or at the end:
        (its error, a signal's exception that came meanwhile), returned, not raised."""
        return self._write.finish()


def write_failure(final: Path, run_dir: str | Path, cause: OSError, rank: int | None = None,
                  fix: str | None = None) -> CheckpointError:
    """The one-line error of a checkpoint that could not be written: which, why, what is still safe
    (the newest complete checkpoint of either format), and the fix (``fix``: another than the
    cause's, for a failure that is no disk's)."""
    previous = latest_checkpoint(run_dir, kinds=(".pt", ".dcp"))
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    if fix is None:
        fix = ("Keep RUN_DIR/checkpoints on a filesystem every rank shares, in place during the run,"
               if cause.errno == errno.ENOENT else write_fix(cause))
    where = f" (rank {rank})" if rank is not None else ""
    return CheckpointError(f"could not write checkpoint {final}: {cause.strerror or cause}{where}; {kept}. "
                           f"{fix} and run the same command again (or --resume {shlex.quote(str(run_dir))})")


def write_fix(cause: OSError) -> str:
    """What to do about a write that failed with ``cause``, as the start of "... and run the same
    command again": a read-only or forbidden place, a file-size limit (``ulimit -f``: "File too
    large"), or else a full disk or quota."""
    if cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "Make it writable"
    if cause.errno == errno.EFBIG:
        return "Raise the file-size limit (ulimit -f, or the job's)"
    return "Free disk space"


def os_error_in(exc: BaseException) -> OSError | None:
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (tensors and plain values only:
    files.read_torch_file)."""
    path = Path(path)
    try:
        return read_torch_file(path)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc
