"""Start N local processes the way torchrun does, for tests, notebooks and one-machine experiments.

``spawn(fn, nprocs, *args)`` runs ``fn(*args)`` in ``nprocs`` fresh processes with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set, so the worker calls
``largebatch.parallel.init_distributed`` exactly as under ``torchrun``. When ``fn`` returns, the rank
leaves its process group (barrier, then ``destroy_process_group``) if ``fn`` did not, and exits
through ``mesh.end_process`` (no interpreter teardown, at which torch's backend threads can abort a
finished rank). A rank that raises ends the
whole job: the others are terminated and :class:`~largebatch.parallel.mesh.RankFailure` names the
rank that failed FIRST (the root cause; peers that then fail in a collective come after), with its
traceback. For real jobs use torchrun (multi-node rendezvous, restarts; its "first observed
failure" report plays the same role); this is its single-machine, in-Python twin.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from largebatch.parallel.mesh import (
    _BACKEND_MARKERS,
    RankFailure,
    _enable_faulthandler,
    end_process,
    leave_process_group,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, fn: Callable, nprocs: int, port: int, threads: int, error_dir: str,
           args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    _enable_faulthandler()  # a native crash: the parent learns only the signal's name
    try:
        fn(*args)
    except BaseException:
        # when, and what: the parent reports the earliest failure as the root cause
        Path(error_dir, f"rank{local_rank}").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    leave_process_group()  # if fn did not
    end_process(0)  # a rank that joined through init_distributed exits here, without the teardown


def _failures(error_dir: str) -> list[tuple[float, int, str]]:
    found = []
    for path in Path(error_dir).glob("rank*"):
        stamp, _, text = path.read_text().partition("\n")
        found.append((float(stamp), int(path.name[4:]), text))
    return sorted(found)


# signals a rank's own code or libraries end it with (a segfault, glibc's abort on a corrupted heap)
NATIVE_CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})


def _killed(context, first: int, raised: set[int]) -> list[tuple[int, signal.Signals | int]]:
    """(rank, signal) of each rank a signal ended with no Python error written: the one seen first
    whatever the signal, the others only for a native crash (the clean-up SIGTERMs, then SIGKILLs,
    the living). A rank that raised and then aborted in its interpreter teardown counts as raised."""
    killed = []
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if code is None or code >= 0 or rank in raised:
            continue
        try:
            sig = signal.Signals(-code)
        except ValueError:
            sig = -code
        if rank == first or sig in NATIVE_CRASHES:
            killed.append((rank, sig))
    return killed


def _how(sig: signal.Signals | int) -> str:
    name = sig.name if isinstance(sig, signal.Signals) else f"signal {sig}"
    if sig in NATIVE_CRASHES:
        return f"killed by {name} (a native crash: every thread's Python stack at the crash is on its stderr)"
    if sig == signal.SIGKILL:
        return f"killed by {name} (from outside the process, as the out-of-memory killer does; no stack)"
    return f"killed by {name} (a signal from outside the process)"


def _lost_a_peer(text: str) -> bool:
    """Whether a rank's written error is a communication backend's (what a dead peer causes here)."""
    return any(marker in text for marker in _BACKEND_MARKERS) or re.search(r"\bDist\w*Error\b", text) is not None


def spawn(fn: Callable, nprocs: int, *args, threads_per_rank: int = 1) -> None:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; raise RankFailure naming the first that failed.
    A rank killed by a signal (a native crash: SIGSEGV, SIGABRT; or SIGKILL) leaves no Python error,
    and its peers then fail in their next collective ("Connection reset by peer"): the killed rank
    is named first where it was seen first or every error written is such a lost peer's, and
    ``RankFailure.crashes`` then lists the native crashes."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs = {nprocs!r}: must be a positive number of processes")
    with tempfile.TemporaryDirectory(prefix="largebatch-spawn-") as error_dir:
        context = mp.spawn(_entry, args=(fn, nprocs, free_port(), threads_per_rank, error_dir, args),
                           nprocs=nprocs, join=False)
        try:
            while not context.join():
                pass
            return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            first, failures = exc.error_index, _failures(error_dir)
            killed = _killed(context, first, {rank for _, rank, _ in failures})
            if not failures and not killed:  # ended without a Python exception or a signal (os._exit)
                raise RankFailure(f"rank {exc.error_index} of {nprocs} exited before finishing: "
                                  f"{exc}") from None
        # a signal is the cause where it was seen first, or where every error written is a lost peer's
        if killed and (first in {rank for rank, _ in killed}
                       or all(_lost_a_peer(text) for _, _, text in failures)):
            head = "; ".join(f"rank {rank} of {nprocs} exited before finishing: {_how(sig)}"
                             for rank, sig in killed)
            raised = "".join(f"\n-- rank {rank} raised:\n{text}" for _, rank, text in failures)
            crashes = tuple((rank, sig.name) for rank, sig in killed if sig in NATIVE_CRASHES)
            raise RankFailure(head + raised, crashes=crashes)
        first_time, first_rank, first_text = failures[0]
        others = "".join(f"\n-- then rank {rank} ({t - first_time:+.2f} s):\n{text}"
                         for t, rank, text in failures[1:])
        others += "".join(f"\n-- and rank {rank} {_how(sig)}" for rank, sig in killed)
        raise RankFailure(f"rank {first_rank} of {nprocs} failed first:\n{first_text}{others}")
