"""Running this checkout's code in a fresh Python process (a startup's imports, a private mount
namespace): the environment that puts ``src`` first on the import path."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def src_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout's ``src`` first on PYTHONPATH, and ``extra`` set."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **extra}


def spawn_again_after_a_native_crash(fn, nprocs: int, *args, before_again=None) -> None:
    """``spawn``, once more where a rank died of a native crash (no Python error: a SIGSEGV in gloo's
    own threads, seen once in a 4-rank pipeline x tensor-parallel spawn on 2 oversubscribed cores)
    and the others only lost it; with a warning naming the crash, so the retry shows in the summary.
    ``before_again`` clears what the first spawn wrote; any other failure, or a second crash, fails."""
    from largebatch.parallel import RankFailure, spawn

    try:
        spawn(fn, nprocs, *args)
    except RankFailure as failure:
        if not failure.crashes:  # (set where a native crash is named as the cause)
            raise
        warnings.warn(f"{fn.__name__} on {nprocs} ranks: {failure.line}; spawned once more", stacklevel=2)
        if before_again is not None:
            before_again()
        spawn(fn, nprocs, *args)
