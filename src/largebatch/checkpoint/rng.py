"""The random state a checkpoint carries so a resumed run draws the same numbers: torch, Python,
NumPy and (on CUDA) the device generator, of every rank (dropout streams differ across ranks)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


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
    gathered: list[Any] = [None] * pstate.world_size
    dist.all_gather_object(gathered, state_rng)
    return gathered
