"""Start N local processes the way torchrun does, for tests, notebooks and one-machine experiments.

``spawn(fn, nprocs, *args)`` runs ``fn(*args)`` in ``nprocs`` fresh processes with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set, so the worker calls
``largebatch.parallel.init_distributed`` exactly as under ``torchrun``. A rank that raises ends the
whole job: the others are terminated and :class:`~largebatch.parallel.mesh.RankFailure` names the
first rank that failed, with its traceback. For real jobs use torchrun (multi-node rendezvous,
restarts); this is its single-machine, in-Python twin.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.multiprocessing as mp

from largebatch.parallel.mesh import RankFailure


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, fn: Callable, nprocs: int, port: int, threads: int, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    fn(*args)


def spawn(fn: Callable, nprocs: int, *args, threads_per_rank: int = 1) -> None:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; raise RankFailure naming the first that failed."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs = {nprocs!r}: must be a positive number of processes")
    try:
        mp.spawn(_entry, args=(fn, nprocs, free_port(), threads_per_rank, args), nprocs=nprocs, join=True)
    except mp.ProcessRaisedException as exc:
        raise RankFailure(f"rank {exc.error_index} of {nprocs} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RankFailure(f"rank {exc.error_index} of {nprocs} exited with code {exc.exit_code} "
                          f"(signal {exc.signal_name}) before finishing") from None
