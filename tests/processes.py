"""Running this checkout's code in a fresh Python process (a startup's imports, a private mount
namespace): the environment that puts ``src`` first on the import path."""

from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def src_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout's ``src`` first on PYTHONPATH, and ``extra`` set."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **extra}
