"""The random state a checkpoint carries so a resumed run draws the same numbers: torch, Python,
NumPy and (on CUDA) the device generator, of every rank (dropout streams differ across ranks).

Every value is a tensor or a plain Python value, so a checkpoint opens with torch.load's default
``weights_only=True`` (NumPy's state is kept as its fields: its array would need NumPy's pickle
globals). Checkpoints that hold NumPy's state tuple still load (``set_rng_state`` takes both)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        saved = (saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                 saved["cached_gaussian"])
    np.random.set_state(saved)
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng(state_rng: dict[str, Any], pstate) -> list[dict[str, Any]]:
    """Every rank's RNG state (dropout streams differ across data-parallel ranks)."""
    if not pstate.distributed:
        return [state_rng]
    gathered: list[Any] = [None] * pstate.world_size
    dist.all_gather_object(gathered, state_rng)
    return gathered
