"""Profiles of chosen optimizer steps (``run.profile_steps``), written while the run trains.

``run.profile_steps = "10-12"`` records steps 10 to 12 of the run (its ``step`` numbers in
metrics.jsonl) with ``torch.profiler``: the operators on the host and, on CUDA, the kernels on the
device, with their input shapes. The step before a window runs under the profiler as warm-up
(its start-up cost is not in the record) where it is a step of the same launch. Each rank writes

* ``RUN_DIR/profile/steps_10-12/rank{R}.pt.trace.json.gz``: the timeline, in the Chrome trace
  format that Perfetto (ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profiler open;
* ``rank{R}.txt``: the operators ranked by their own time on the device (CUDA) or host (CPU);

and rank 0 logs where, with the operators that took most of the time. ``run.profile_memory``
also records every allocation (the table gains memory columns) and, on CUDA, the allocator's
history as ``rank{R}.memory.pickle`` (``torch.cuda.memory._dump_snapshot``, opened by PyTorch's
memory viewer). Several windows: ``"10-12,500-501"``.

A window a resumed run has already passed is not recorded again; one it is inside is recorded from
the launch's first step. A launch that stops, ends or fails inside a window writes the steps it
recorded, named as such, before its checkpoint and final evaluation; a step a stop signal dropped is
not counted. Profiled steps are slower than the others (the profiler's own cost): their metrics
records carry ``"profiled": true``.
"""

from __future__ import annotations

import bisect
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList

from largebatch.checkpoint.files import atomic_write_text

PROFILE_DIR = "profile"
TOP_OPERATORS = 40  # rows of the per-rank table


def profile_windows(spec: str | int | None) -> list[tuple[int, int]]:
    """``"10-12,500"`` -> ``[(10, 12), (500, 500)]`` (first and last step, both counted from 1);
    ValueError saying what is wrong (the caller names the field)."""
    if spec is None:
        return []
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError("give the steps as a string such as '10-12' or '10-12,500-501', or one step number")
    windows = []
    for part in str(spec).split(","):
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if found is None:
            raise ValueError(f"{part.strip()!r} is not a step or a range of steps; write e.g. '10-12' "
                             "(steps 10, 11 and 12) or '10'")
        first = int(found.group(1))
        last = int(found.group(2)) if found.group(2) is not None else first
        if first < 1:
            raise ValueError("steps count from 1 (the run's first optimizer step), as in metrics.jsonl")
        if last < first:
            raise ValueError(f"the range {first}-{last} ends before it starts; write {last}-{first}")
        windows.append((first, last))
    windows.sort()
    for (_, last), (first, end) in zip(windows, windows[1:]):
        if first <= last + 1:
            raise ValueError(f"the ranges overlap or touch (..{last}, {first}..{end}); write them as one")
    return windows


class StepProfiler:
    """Records the steps of ``windows`` (``profile_windows``) with torch.profiler.

    The loop calls :meth:`before` with the number the coming step will have, :meth:`after` once it
    is done (outside the step's timing), :meth:`interrupted` when a stop signal drops the step under
    way, and :meth:`close` when the launch stops, ends or fails (a window cut short is written with
    the steps it holds; close never raises: a profile is no reason to fail a run, nor to hide why
    it failed)."""

    def __init__(self, windows: list[tuple[int, int]], run_dir: Path, rank: int, device: torch.device,
                 memory: bool, log: Callable[[str], None], first_step: int, is_main: bool):
        # (the window as asked, and the part of it this launch can record: a resume's first step on)
        self.windows = [((a, b), (max(a, first_step), b)) for a, b in windows if b >= first_step]
        self.run_dir, self.rank, self.device = Path(run_dir), rank, device
        self.memory, self.log, self.is_main = memory, log, is_main
        self.first_step = first_step  # this launch's first step: a window starting there has no warm-up
        self.prof: torch.profiler.profile | None = None
        self.window: tuple[int, int] | None = None  # the open window's part this launch records
        self.asked: tuple[int, int] | None = None  # the open window as run.profile_steps gives it
        self.why = ""  # why the open window ends early, once it does
        self.done = 0  # steps this launch took
        self.recorded: list[int] = []  # steps of the open window done under the active profiler
        self.step_range = None  # the record_function range of the step under way
        self.unreported = False  # a step was recorded since the last metrics record (take_unreported)

    def take_unreported(self) -> bool:
        """Whether a step since the last call was recorded (the metrics record then says so)."""
        unreported, self.unreported = self.unreported, False
        return unreported

    def before(self, step: int) -> None:
        if self.prof is not None:
            self._enter_step(step)
            return
        if not self.windows:
            return
        first, last = self.windows[0][1]
        warmup = 1 if first - 1 == step and step >= self.first_step else 0
        if step != first - warmup:
            return
        self.asked, self.window = self.windows.pop(0)
        self.recorded, self.why = [], ""
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with warnings.catch_warnings():  # (a window at the launch's first step has no warm-up step)
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(skip_first=step, wait=0, warmup=warmup,
                                               active=last - first + 1, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                           profile_memory=self.memory, schedule=schedule,
                                           on_trace_ready=self._write)
        # the schedule counts the run's steps; each step's range is ours (ProfilerStep#10 is the
        # run's step 10, and holds it alone: not the evaluation or checkpoint after it)
        self.prof.step_num, self.prof.current_action, self.prof.record_steps = step, schedule(step), False
        if self.memory and cuda:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.prof.start()
        self._enter_step(step)

    def _enter_step(self, step: int) -> None:
        self.step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.step_range.__enter__()

    def _exit_step(self) -> None:
        step_range, self.step_range = self.step_range, None
        if step_range is not None:
            step_range.__exit__(None, None, None)

    def after(self, step: int) -> None:
        self.done += 1
        if self.prof is None:
            return
        self._exit_step()
        if self.window is not None and self.window[0] <= step:
            self.recorded.append(step)
            self.unreported = True
        self.prof.step()  # the window's last step: the trace is written (on_trace_ready)
        if step >= self.window[1]:
            self._end()

    def interrupted(self) -> None:
        """A stop signal dropped the step under way (the resume takes it again): its range ends here,
        and it is not among the recorded steps (in the timeline as far as it ran; not in the table)."""
        self._exit_step()

    def close(self, why: str) -> None:
        """End the open window, ``why`` (``"the run stopped"``, ``"the run ended"``, ...): its recorded
        steps are written. A window the run ended before is said to be so. Never raises."""
        try:
            if self.prof is not None:
                self.why = why
                self._end()
            if self.windows and self.is_main and why == "the run ended":
                asked = ", ".join(_steps(*window) for window, _ in self.windows)
                self.log(f"profile of {asked}: not recorded (the run ended at step "
                         f"{self.first_step - 1 + self.done})")
            self.windows = []
        except Exception as exc:  # noqa: BLE001 -- the profiler's own failure: said, never raised
            self.log(f"warning: the profiler could not be stopped ({type(exc).__name__}: {exc})")

    def _end(self) -> None:
        prof, self.prof = self.prof, None
        self._exit_step()  # (a step cut short by a stop signal)
        try:
            if self.recorded and prof.current_action == torch.profiler.ProfilerAction.RECORD:
                prof.current_action = torch.profiler.ProfilerAction.RECORD_AND_SAVE  # (written on stop)
            with warnings.catch_warnings():  # (stopped during the warm-up step: nothing to write)
                warnings.filterwarnings("ignore", "Incorrect schedule")
                prof.stop()
        finally:
            if self.memory and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
            if not self.recorded and self.is_main:
                self.log(f"profile of {_steps(*self.asked)}: not written ({self.why or 'the run stopped'} "
                         "before a step of it was done)")
            self.window = None

    def _write(self, prof: torch.profiler.profile) -> None:
        if not self.recorded:  # (torch writes on a stop during the first recorded step too)
            return
        try:
            self._export(prof)
        except Exception as exc:  # a full disk, a read-only run directory: the run goes on without it
            self.log(f"warning: the profile of {_steps(self.recorded[0], self.recorded[-1])} was not "
                     f"written ({type(exc).__name__}: {exc}); the run goes on")

    def _export(self, prof: torch.profiler.profile) -> None:
        first, last = self.recorded[0], self.recorded[-1]
        folder = self.run_dir / PROFILE_DIR / _steps(first, last).replace(" ", "_")  # steps_3-5, step_3
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}.pt.trace.json.gz"
        _atomic(trace, prof.export_chrome_trace)
        cuda = self.device.type == "cuda"
        averages = step_events(prof, cuda, self.memory, len(self.recorded)).key_averages()
        table = averages.table(sort_by=_own_time(cuda), row_limit=TOP_OPERATORS)
        header = (f"{_steps(first, last)} of {self.run_dir}, rank {self.rank}, {self.device}: operators inside "
                  f"the steps by their own {'device' if cuda else 'host'} time ({TOP_OPERATORS} most; "
                  "ProfilerStep#N's own time is the step's time outside every operator)\n")
        atomic_write_text(folder / f"rank{self.rank}.txt", header + table + "\n")
        if self.memory and cuda:
            _atomic(folder / f"rank{self.rank}.memory.pickle", torch.cuda.memory._dump_snapshot)
        if self.is_main:
            why = [reason for reason, applies in (("the launch resumed inside it", first > self.asked[0]),
                                                  (self.why or "cut short", last < self.asked[1])) if applies]
            cut = f" (of {_steps(*self.asked).split()[1]}: {'; '.join(why)})" if why else ""
            self.log(f"profile of {_steps(first, last)}{cut} written to {folder}: {top_operators(averages, cuda)}")


def step_events(prof: torch.profiler.profile, cuda: bool, memory: bool, steps: int) -> EventList:
    """The recorded events inside the first ``steps`` steps' ranges (``ProfilerStep#N``, named
    ``ProfilerStep*`` there; after them, only a step a stop signal dropped): an evaluation or a
    checkpoint between two of the window's steps is in the trace, outside every step, and not here."""
    events = prof.events()
    # (the host's ranges: on CUDA each range is also recorded on the device, as an annotation there)
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU)
    steps = ranges[:steps]
    starts = [start for start, _ in steps]

    def inside(event) -> bool:
        i = bisect.bisect_right(starts, event.time_range.start) - 1
        return i >= 0 and event.time_range.end <= steps[i][1]

    kept = EventList([e for e in events if inside(e)], use_device="cuda" if cuda else None,
                     profile_memory=memory)
    # the events' tree (parents, children, own times) was built over all of them; a kept event's
    # children lie inside its range, so inside the same step: the tree holds as it is
    kept._tree_built = True
    return kept


def top_operators(averages, cuda: bool, shown: int = 4) -> str:
    """The operators with most own time as ``"aten::mm 41%, aten::bmm 12%, ..."`` (shares of the
    profile's own time: host time on CPU, kernel time on CUDA)."""
    key = _own_time(cuda)
    # a step's own host time (ProfilerStep#N) is what no operator inside it took: Python, the data; on
    # the device a range is an annotation spanning the kernels, not time of its own (left out, as torch's
    # table leaves it out of its totals)
    rows = [("(between operators)" if event.key.startswith("ProfilerStep") else event.key,
             getattr(event, key)) for event in averages
            if not (cuda and getattr(event, "is_user_annotation", False))]
    total = sum(time for _, time in rows)
    if total <= 0:
        return "no operator time recorded"
    rows.sort(key=lambda row: -row[1])
    return ", ".join(f"{name} {100 * time / total:.0f}%" for name, time in rows[:shown])


def _own_time(cuda: bool) -> str:
    """The averages' field of an operator's own time: on the device (CUDA) or the host."""
    return "self_device_time_total" if cuda else "self_cpu_time_total"


def _steps(first: int, last: int) -> str:
    return f"steps {first}-{last}" if last > first else f"step {first}"


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    """``write(name)`` a temporary beside ``path``, then rename it into place (a crash mid-write
    leaves no half file under the final name)."""
    part = path.with_name(f".part{os.getpid()}.{path.name}")  # (the same suffix: .gz is compressed)
    try:
        write(str(part))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
