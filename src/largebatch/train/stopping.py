"""Stopping a run cleanly: SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2, and checkpoints on a
wall-clock interval.

Slurm and Kubernetes send SIGTERM before they kill a job (Slurm: ``KillWait``, 30 s by default;
Kubernetes: ``terminationGracePeriodSeconds``, 30 s by default); Slurm's ``--signal=USR1@120`` (or
USR2) warns a job's processes that its time limit is near, so that it can save and be requeued; a
terminal sends SIGINT on Ctrl-C and SIGHUP when it closes (an ssh session dropped); torchrun
forwards SIGTERM, SIGINT and SIGHUP to its workers, and SIGUSR1/SIGUSR2 when listed in its
``--signals-to-handle``. While ``fit`` runs, :class:`StopRequest` turns each into a request: the
step in progress finishes, a checkpoint is written, the resume command is printed and the process
exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP, 138 for
SIGUSR1, 140 for SIGUSR2). Left alone, SIGUSR1 and SIGUSR2 would end the process at once, with no
checkpoint. A signal after the last step lets the final checkpoint, evaluation and summary finish:
the run ends complete (exit 0). A signal the process was started ignoring stays ignored (``nohup`` ignores SIGHUP; a
shell script's ``&`` job ignores SIGINT): that is the user's choice that the run outlive the
terminal. A second signal exits at once (the checkpoint being written, if any, stays a temporary;
the previous one is intact). A repeat of the same signal within ``REPEAT_WINDOW_S`` counts as the
first: torchrun forwards the signal it gets to its workers, which a cluster may have signalled
already (Slurm signals every process of a job step).

Under torchrun the ranks must stop at the same step, or the checkpoint (a collective) would hang:
after every step one all-reduce (MAX) of [signal, checkpoint due] makes every rank take the same
decision, whichever rank the signal reached first. The wall-clock interval
(``run.checkpoint_every_seconds``) is decided the same way. That all-reduce is host traffic: its
flag tensor lives on the CPU and goes over a gloo group (``control_group``: the default group when
that is gloo, else one gloo side group over all ranks, created once), so under NCCL polling never
queues a collective on the device nor waits for the device's queue to drain.

``run.time_limit`` stops a launch before a wall-clock limit the same way, without a signal:
:class:`TimeLimit` measures this launch's steps, checkpoint saves and evaluations, and after each
step the ranks agree (the same all-reduce) to stop when the time left no longer holds the next step
and a checkpoint with a 25% margin; the run then checkpoints and exits 0, as after ``run.max_steps``.
For clusters that give no warning signal (or jobs that ask for none), and for Slurm's
``SLURM_JOB_END_TIME`` (``run.time_limit = "slurm"``).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from largebatch.parallel.mesh import ParallelState
from largebatch.signals import (
    REPEAT_WINDOW_S,
    SIGNALS,
    SignalledOutside,
    exit_code,
    raise_on_signals,
    take_signals,
)

__all__ = ["REPEAT_WINDOW_S", "SIGNALS", "SignalledOutside", "StepInterrupted", "StopRequest", "TimeLimit",
           "control_group", "exit_code", "raise_on_signals", "slurm_end_time", "take_signals"]

_SIDE_GROUPS: dict[int, object] = {}  # id(default group) -> its gloo side group


def control_group(par: ParallelState):
    """The process group for host-side control flags (CPU tensors): None (the default group) when the
    default backend is gloo, else a gloo group over all ranks, created on first use -- collectively,
    so every rank must call this at the same point (``StopRequest.__init__`` does)."""
    import torch.distributed as dist

    if not par.distributed or dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _SIDE_GROUPS:
        _SIDE_GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=par.timeout_s))
    return _SIDE_GROUPS[key]


class StepInterrupted(Exception):
    """A stop signal between the micro-batches of a step: the step was dropped (nothing of it is
    kept), and the run checkpoints at the step before it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """A context manager for the training loop: records the ``SIGNALS`` (those not ignored), and says
    when to checkpoint."""

    def __init__(self, par: ParallelState, checkpoint_every_seconds: float = 0.0):
        self.par = par
        self.every = checkpoint_every_seconds
        self.signum: int | None = None
        self._first_at = 0.0
        self._last_checkpoint = time.monotonic()
        self._previous: dict[int, object] = {}
        self._ending = False
        self.time_up = False  # run.time_limit reached on some rank (the last poll's answer)
        self.group = control_group(par)  # every rank builds its StopRequest at the same point

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
            self._previous = take_signals(self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self.par.is_main:
                doing = ("the run is at its end: finishing its final checkpoint, evaluation and summary" if self._ending
                         else "ending this step (dropped if its micro-batches are not done), then checkpointing")
                print(f"[largebatch] {name}: {doing} (send a second signal to exit at once)",
                      file=sys.stderr, flush=True)
        elif signum != self.signum or now - self._first_at > REPEAT_WINDOW_S:
            print(f"[largebatch] second signal ({name}): exiting now without a checkpoint; the "
                  f"previous checkpoint is intact", file=sys.stderr, flush=True)
            os._exit(exit_code(signum))

    def request(self, signum: int) -> None:
        """Stop as if ``signum`` had arrived (the step in progress finishes, then a checkpoint), for
        a cause that is no signal: standard output closed by its reader (``train.progress.ConsoleLog``,
        SIGPIPE). Unlike a signal, a repeat never exits at once."""
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()

    def poll(self, time_up: bool = False) -> tuple[int | None, bool]:
        """(the signal to stop on or None, whether a time-based checkpoint is due): the same on every
        rank. Call once per step, on every rank (under torchrun it is one small all-reduce of a CPU
        tensor over ``control_group``: no device sync). ``time_up``: this rank finds run.time_limit
        reached (``TimeLimit``); ``self.time_up`` is then whether any rank does."""
        due = bool(self.every) and time.monotonic() - self._last_checkpoint >= self.every
        signum = self.signum or 0
        if self.par.distributed:
            flags = torch.tensor([signum, int(due), int(time_up)], dtype=torch.int64)  # on the CPU
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            signum, due, time_up = int(flags[0]), bool(flags[1]), bool(flags[2])
        self.time_up = bool(time_up)
        return (signum or None), due

    @property
    def is_ending(self) -> bool:
        return self._ending

    def ending(self) -> None:
        """The training loop is over; the final checkpoint, evaluation and summary follow. A signal
        from here on lets them finish (the run then ends complete, exit 0): losing a finished run to
        a warning such as Slurm's SIGUSR1 would waste it; a second signal still exits at once."""
        self._ending = True

    def checkpointed(self) -> None:
        """A checkpoint was written: the wall-clock interval starts again."""
        self._last_checkpoint = time.monotonic()


SLURM_END = "SLURM_JOB_END_TIME"  # the job's end, Unix seconds, in every task's environment (Slurm >= 21.08)
TIME_LIMIT_SAFETY = 1.25  # the margin on the measured step, checkpoint and evaluation seconds


def slurm_end_time() -> float:
    """The Slurm job's end (``SLURM_JOB_END_TIME``, Unix seconds); ValueError naming the fix when the
    process is not in a Slurm job, or in one of a Slurm that does not set it."""
    raw = os.environ.get(SLURM_END, "").strip()
    try:
        end = float(raw)
    except ValueError:
        end = math.nan
    if not math.isfinite(end) or end <= 0:
        got = f"is {raw!r}" if raw else "is not set"
        raise ValueError(f"run.time_limit = 'slurm' reads the job's end from {SLURM_END}, which {got} (not in a "
                         "Slurm job, or a Slurm older than 21.08): give the job's limit as a duration instead, "
                         "e.g. --run.time_limit=3h50m")
    return end


def write_seconds(directory: Path, nbytes: int = 64 * 2**20) -> float:
    """Seconds to write and fsync ``nbytes`` (random bytes: no filesystem compresses them) into a
    file in ``directory``, removed after: the disk's rate where a checkpoint goes, for a save no
    launch has timed yet."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".write-test-{os.getpid()}"
    block = os.urandom(min(nbytes, 4 * 2**20))
    began = time.perf_counter()
    try:
        with open(path, "wb") as file:
            for _ in range(max(1, nbytes // len(block))):
                file.write(block)
            file.flush()
            os.fsync(file.fileno())
        return time.perf_counter() - began
    finally:
        path.unlink(missing_ok=True)


class TimeLimit:
    """``run.time_limit`` for one launch: whether the time left still holds the run's next step and a
    checkpoint, as this launch has measured them.

    The deadline is ``limit`` seconds after ``started`` (the trainer's start, ``time.monotonic()``), or
    the Slurm job's end for ``"slurm"``. After each step the run continues only while the time left
    is at least ``TIME_LIMIT_SAFETY`` x (the next step + a checkpoint + the evaluations due before
    that step): the step from the most seconds per token any step of this launch took (the launch's
    first step, which carries its warm-up, only until a second one is measured) times the next
    step's tokens (a Seesaw milestone doubles the batch, and so the step); the checkpoint from the
    longest save the run has timed (this launch's, a background write's own seconds included, or an
    earlier launch's: ``save_seconds``), else from the checkpoint's bytes at the rate a test write
    measured on its disk (``estimated_save``); an evaluation from the longest the run has timed
    (``eval_seconds``). Under torchrun the ranks agree (``StopRequest.poll``), so they stop at the
    same step."""

    def __init__(self, limit: float | str, started: float, save_seconds: float = 0.0, eval_seconds: float = 0.0,
                 estimated_save: float = 0.0):
        now = time.monotonic()
        if limit == "slurm":
            self.deadline = now + (slurm_end_time() - time.time())
            self.source = f"the Slurm job's end ({SLURM_END})"
        else:
            self.deadline = started + float(limit)
            self.source = f"run.time_limit = {float(limit):g} s from the launch's start"
        self.per_token = 0.0  # the most seconds per token of this launch's steps (after its first)
        self.first_per_token: float | None = None  # its first step's (warm-up included)
        self.save = float(save_seconds or 0.0)  # the longest save timed
        self.estimated_save = float(estimated_save or 0.0)  # before any: from the bytes and the disk's rate
        self.evaluation = float(eval_seconds or 0.0)  # the longest evaluation timed

    def step_done(self, seconds: float, tokens: int) -> None:
        rate = seconds / max(tokens, 1)
        if self.first_per_token is None:
            self.first_per_token = rate
        else:
            self.per_token = max(self.per_token, rate)

    def saved(self, seconds: float) -> None:
        self.save = max(self.save, seconds)

    def evaluated(self, seconds: float) -> None:
        self.evaluation = max(self.evaluation, seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def needed(self, next_tokens: int, evaluations: int = 0) -> float:
        """Seconds the next step (of ``next_tokens``), a checkpoint after it, and ``evaluations``
        evaluations before it take, with the safety margin."""
        rate = self.per_token if self.per_token else (self.first_per_token or 0.0)
        save = self.save or self.estimated_save
        return TIME_LIMIT_SAFETY * (rate * next_tokens + save + self.evaluation * evaluations)

    def is_up(self, next_tokens: int, evaluations: int = 0) -> bool:
        return self.left() < self.needed(next_tokens, evaluations)
