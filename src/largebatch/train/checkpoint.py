"""Crash-safe checkpoints: a kill or a full disk never corrupts or loses a finished checkpoint.

Layout: ``RUN_DIR/checkpoints/step_00000123.pt``. A save writes ``.step_00000123.pt.tmp``, flushes
and fsyncs it, then ``os.replace``s it into place (atomic on POSIX) and fsyncs the directory; only
then are checkpoints beyond the newest ``keep_last`` deleted. A reader only ever sees complete
files: temporaries are never listed, and a temporary left by a killed save is removed by the next
save. A failed write (no space, file-size limit, I/O error) removes its temporary and raises
:class:`CheckpointError` naming the checkpoint that is still intact.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from largebatch.train.rundir import remove_quietly

_NAME = re.compile(r"^step_(\d{8,})(\.pt|\.dcp)$")


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; the message says what is still safe."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path, kinds: tuple[str, ...] = (".pt",)) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporaries of killed saves are ignored).

    ``kinds``: ".pt" files written by :func:`save_checkpoint`, ".dcp" directories written by
    largebatch.parallel.checkpoint under torchrun, or both.
    """
    ckdir = checkpoint_dir(run_dir)
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir()
             if (m := _NAME.match(p.name)) and m.group(2) in kinds]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path, kinds: tuple[str, ...] = (".pt",)) -> Path | None:
    ckpts = list_checkpoints(run_dir, kinds)
    return ckpts[-1] if ckpts else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_temporaries(ckdir: Path) -> None:
    """Remove what killed saves left: ``.step_*.pt.tmp`` files and ``.step_*.dcp.tmp/`` directories
    (a run resumed in one process after a crash during a torchrun save finds the latter)."""
    for stale in ckdir.glob(".step_*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep the newest ``keep_last``."""
    if keep_last < 1:
        raise ValueError(f"keep_last = {keep_last}: at least 1 checkpoint must be kept")
    ckdir = checkpoint_dir(run_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(ckdir)
    final = ckdir / f"step_{step:08d}.pt"
    tmp = ckdir / f".{final.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(ckdir)
    except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write in RuntimeError
        remove_quietly(tmp)  # the write's error is the one to report, not the cleanup's
        cause = _os_error_in(exc)
        if cause is None:
            raise
        previous = latest_checkpoint(run_dir)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        fix = ("Make it writable" if cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
               else "Free disk space")
        raise CheckpointError(
            f"could not write checkpoint {final}: {cause.strerror or cause}; {kept}. "
            f"{fix} and run the same command again (or --resume {run_dir})"
        ) from exc
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


def _os_error_in(exc: BaseException) -> OSError | None:
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (a trusted file of this run)."""
    path = Path(path)
    try:
        # weights_only=False: the file holds Python RNG states and config dicts written by us.
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng(state_rng: dict[str, Any], pstate) -> list[dict[str, Any]]:
    """Every rank's RNG state (dropout streams differ across data-parallel ranks)."""
    if not pstate.distributed:
        return [state_rng]
    import torch.distributed as dist

    gathered: list[Any] = [None] * pstate.world_size
    dist.all_gather_object(gathered, state_rng)
    return gathered
