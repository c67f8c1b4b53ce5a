"""Where checkpoints live and which are complete: listing, selection and the cleanup of temporaries.

Layout: ``RUN_DIR/checkpoints/step_00000123.pt`` (one file, :mod:`largebatch.checkpoint.local`) or
``RUN_DIR/checkpoints/step_00000123.dcp/`` (a directory, :mod:`largebatch.checkpoint.distributed`).
Both formats are written as a temporary ``.step_00000123.<kind>.tmp`` renamed into place, so a
reader that lists only names matching ``step_N.pt`` / ``step_N.dcp`` never sees a partial one.
:func:`atomic_write_text` gives the same guarantee to a run's small text files (config.toml, the
metrics history trimmed at resume).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^step_(\d{8,})(\.pt|\.dcp)$")


def read_torch_file(path: str | Path, mmap: bool = False):
    """``torch.load`` of a checkpoint file (a ``.pt``, a ``.dcp``'s ``extra.pt``) with
    ``weights_only=True``: tensors and plain Python values, all a checkpoint holds, so a file crafted
    to run code when unpickled is refused when a run directory is resumed, checked or exported.
    Checkpoints of an earlier version keep NumPy's random state as its tuple, whose array needs
    NumPy's array-rebuilding globals: those alone are allowed besides (pickle.UnpicklingError names
    any other)."""
    import numpy as np
    import torch

    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct  # (NumPy 2's module, 1's)
    array_globals = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
                     *((reconstruct, f"{module}.multiarray._reconstruct")  # as either NumPy wrote the file
                       for module in ("numpy.core", "numpy._core"))]
    known = torch.serialization.get_safe_globals()  # (leaving the context removes what it added: not a caller's)
    with torch.serialization.safe_globals([g for g in array_globals if g not in known]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:  # torch's text: a paragraph, with the global in one line
            found = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), "")
            raise pickle.UnpicklingError(
                f"{path} holds more than tensors and plain values ({found or str(exc).splitlines()[0]}), "
                "which no checkpoint of this project holds: it was written by something else or altered, "
                "and is not unpickled; one you trust reads with torch.load(path, weights_only=False)") from None


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int, kind: str) -> Path:
    """Where the checkpoint of ``step`` goes: ``RUN_DIR/checkpoints/step_00000123{kind}`` (".pt", ".dcp")."""
    return checkpoint_dir(run_dir) / f"step_{step:08d}{kind}"


def list_checkpoints(run_dir: str | Path, kinds: tuple[str, ...] = (".pt",)) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporaries of killed saves are ignored).

    ``kinds``: ".pt" files written by largebatch.checkpoint.local, ".dcp" directories written by
    largebatch.checkpoint.distributed under torchrun, or both.
    """
    ckdir = checkpoint_dir(run_dir)
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir()
             if (m := _NAME.match(p.name)) and m.group(2) in kinds]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint's name holds (``step_00000100.pt`` -> 100)."""
    return int(_NAME.match(path.name).group(1))


def checkpoint_dp_size(run_dir: str | Path) -> int | None:
    """The data-parallel replica count the newest checkpoint of ``run_dir`` was written with (its
    batches are multiples of micro_batch x that count): a ``.dcp``'s from its small ``extra.pt``, a
    ``.pt``'s from its schedule entry, the tensors memory-mapped and unread (a run that went from 2
    ranks to one process keeps the 2 ranks' batches, and its ``.pt`` says so; it was taken for 1, so
    the next launch on 2 ranks built the schedule for 1 and its resume was refused). None without a
    checkpoint, or when it cannot be read (the trainer's resume then says why)."""
    found = list_checkpoints(run_dir, (".pt", ".dcp"))
    if not found:
        return None

    try:
        extra = (read_torch_file(found[-1], mmap=True) if found[-1].suffix == ".pt" else
                 read_torch_file(found[-1] / "extra.pt"))
        return int(extra["schedule"].get("config", {}).get("dp_size", 1))
    except Exception:  # noqa: BLE001 -- damaged or of another layout: the resume reports it
        return None


def latest_checkpoint(run_dir: str | Path, kinds: tuple[str, ...] = (".pt",)) -> Path | None:
    ckpts = list_checkpoints(run_dir, kinds)
    return ckpts[-1] if ckpts else None


def superseded(run_dir: str | Path, written: Path, keep_last: int) -> list[Path]:
    """The checkpoints a save of ``written`` ends: those beyond the newest ``keep_last`` up to its
    step (``written`` one of them, whatever the order of another of its step), of either format (a
    run continued from one process on torchrun, or back, kept ``keep_last`` of each), and every one
    of a LATER step. A later one exists only when this run resumed from an earlier checkpoint (the
    newest was damaged): it is of a trajectory the run left, and were it kept, retention would count
    it among the newest and delete the one just written (only a damaged checkpoint was then left),
    and a relaunch would resume from it."""
    step = checkpoint_step(written)
    both = list_checkpoints(run_dir, (".pt", ".dcp"))
    later = [p for p in both if checkpoint_step(p) > step]
    older = [p for p in both if p not in later and p != written]
    room = keep_last - (1 if written.exists() else 0)  # (asked before the write: keep_last of the others)
    return later + older[:max(0, len(older) - room)]


def remove_superseded(run_dir: str | Path, written: Path, keep_last: int) -> None:
    """Delete what ``superseded`` lists (after ``written`` is complete and in place)."""
    for old in superseded(run_dir, written, keep_last):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
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


def remove_quietly(path: Path) -> None:
    """Remove a temporary after a failed write, never hiding that failure: on a read-only file
    system even unlinking a file that was never created fails (EROFS)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: a temporary in the same directory, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
