"""Run the arms of a controlled comparison through the trainer, one after another, in-process.

An experiment is a list of ``Arm`` s: the same model, data and token budget (``base_overrides``)
with a few config fields changed per arm. Each arm is one ``largebatch.train`` run in
``OUT/runs/<arm name>/`` (config.toml, metrics.jsonl, summary.json, plots but at smoke size), so every number in a
report can be traced to a run directory and recomputed from its metrics.jsonl.

Sizes: ``smoke`` (seconds, for the test suite), ``quick`` (a tiny model past the unigram plateau:
seconds to ~21 minutes per experiment on a 2-core CPU with the seeds and noise floor), ``full`` (the
documented runs; see docs/results.md for their measured runtimes).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any, Callable

SIZES = ("smoke", "quick", "full")

# The model, data and budget of each size. Tiny GPTs on the bundled Shakespeare corpus.
SIZE_OVERRIDES: dict[str, dict[str, Any]] = {
    "smoke": {"model.n_layer": 1, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
              "data.vocab_size": 512, "run.total_tokens": 12_288, "run.eval_tokens": 2_048},
    # quick: vocabulary 512 and 2% warmup so every arm leaves the unigram plateau early (measured:
    # cosine at batch 16 left it at step 38-39 of 192 at both seeds; at vocabulary 1024 and 10% warmup
    # at step 79-116, when a change of summation order alone moved the final loss by 0.09)
    "quick": {"model.n_layer": 2, "model.n_embd": 96, "model.n_head": 2, "model.seq_len": 64,
              "data.vocab_size": 512, "schedule.warmup": 0.02, "run.total_tokens": 196_608,
              "run.eval_tokens": 16_384},
    "full": {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.seq_len": 128,
             "data.vocab_size": 2048, "run.total_tokens": 1_572_864, "run.eval_tokens": 65_536},
}

# Fields every experiment run shares: quiet, no sample, no TensorBoard, 20 evaluations, no per-run
# PNGs (the report plots the arms together; a run's own plots took ~5 s of a ~60 s quick arm, most of
# a smoke arm; metrics.jsonl holds every number and largebatch.train.plots.plot_run draws them).
COMMON_OVERRIDES: dict[str, Any] = {
    "data.corpus": "shakespeare", "model.kind": "gpt", "model.dropout": 0.0, "run.plots": False,
    "run.device": "auto", "run.dtype": "fp32", "run.tensorboard": False, "run.progress": "off",
    "run.sample_tokens": 0, "run.recompute": "none", "schedule.warmup": 0.1,
    # evaluations in micro-batches of 64 sequences, not the training micro-batch: the same numbers to
    # ~1e-8 (summation order) at a fraction of the time (measured, one quick seesaw arm: 31.2 -> 22.8 s
    # of CPU; evaluation was over half of a quick or smoke arm); a run-restart field, so arms
    # evaluated the older way are still kept by --resume
    "run.eval_micro_batch": 64,
    "schedule.final_lr": 0.1, "schedule.lr_schedule": "cosine",
}


def check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"size={size!r}: must be one of {', '.join(SIZES)} "
                         f"(the CLI flags --smoke, --quick, or none for full)")
    return size


def check_seed_count(seeds: int, available: int) -> int:
    """``seeds`` if it is an integer from 1 to ``available`` (the experiment's seed list)."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= available:
        raise ValueError(f"seeds={seeds!r}: must be an integer from 1 to {available} (seeds per arm)")
    return seeds


def base_overrides(size: str) -> dict[str, Any]:
    """The shared config of every arm of an experiment at this size."""
    overrides = {**COMMON_OVERRIDES, **SIZE_OVERRIDES[check_size(size)]}
    overrides["run.eval_every_tokens"] = overrides["run.total_tokens"] // 20
    return overrides


@dataclass(frozen=True)
class Arm:
    """One run of a comparison: a name (its directory) and the config fields it changes."""

    name: str
    overrides: dict[str, Any]
    group: str = ""
    """Arms with the same group are compared with each other (e.g. one starting batch size)."""
    label: str = ""
    """Legend text; defaults to the name."""

    @property
    def legend(self) -> str:
        return self.label or self.name


@dataclass
class ArmResult:
    arm: Arm
    run_dir: Path
    summary: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    diverged: str | None = None
    """Why the run stopped on a non-finite loss (an LR grid's top LR may): the arm then counts as
    infinitely bad (final_val_loss = inf) instead of ending the experiment."""

    @property
    def final_val_loss(self) -> float:
        return math.inf if self.diverged or not self.val else self.val[-1]["val_loss"]

    @property
    def steps(self) -> int:
        return self.train[-1]["step"] if self.train else 0

    @property
    def tokens(self) -> int:
        return self.train[-1]["tokens"]

    @property
    def final_batch(self) -> int:
        """The largest batch the schedule reached (batches never shrink here; the last step itself
        may be shorter, trimmed to the token budget)."""
        return max(r["batch_size"] for r in self.train)

    @property
    def unigram_loss(self) -> float | None:
        """The validation loss of the unigram model of the training split (summary.json)."""
        return self.summary.get("unigram_val_loss")

    @property
    def plateau_escape(self) -> tuple[float, float] | None:
        """(optimizer step, fraction of the run's tokens) at which the validation loss first falls
        ESCAPE_NATS below the unigram loss, linearly interpolated between the two evaluations around
        the crossing; None when it never does (the arm ended on the plateau) or nothing was recorded.

        Small GPTs first learn the unigram distribution, then sit near its loss until context is
        used; when each run leaves that plateau is chaotic (a change of summation order moves it),
        and a comparison of arms that leave it late measures that moment, not the schedule."""
        return plateau_escape(self.val, self.unigram_loss, self.tokens if self.train else 0)


ESCAPE_NATS = 0.25
"""How far below the unigram loss a run's validation loss must fall to count as off the plateau."""


def plateau_escape(val: list[dict], unigram: float | None, total_tokens: int,
                   margin: float = ESCAPE_NATS) -> tuple[float, float] | None:
    """See ArmResult.plateau_escape: (step, token fraction) of the first crossing of unigram - margin."""
    if unigram is None or not val or total_tokens <= 0:
        return None
    target = unigram - margin
    previous = None
    for record in val:
        loss = record["val_loss"]
        if math.isfinite(loss) and loss <= target:
            if previous is None:
                return float(record["step"]), record["tokens"] / total_tokens
            w = (previous["val_loss"] - target) / (previous["val_loss"] - loss)
            step = previous["step"] + w * (record["step"] - previous["step"])
            tokens = previous["tokens"] + w * (record["tokens"] - previous["tokens"])
            return step, tokens / total_tokens
        previous = record
    return None


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, val records) of a run directory's metrics.jsonl, in order."""
    from largebatch.train.metrics import restored_record

    train, val = [], []
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:  # (a line cut short raises: the arm is trained again, not reported from part of it)
            record = restored_record(json.loads(line))  # (the non-finite numbers back in place)
            (val if record.get("kind") == "val" else train).append(record)
    return train, val


def steps_to_reach(result: ArmResult, target_loss: float) -> int | None:
    """Optimizer steps at the first evaluation whose validation loss is <= target (None: never)."""
    for record in result.val:
        if record["val_loss"] <= target_loss:
            return record["step"]
    return None


_PEAK_FLOPS: dict[str, float] = {}


def _peak_flops() -> float:
    """The fp32 matmul peak of the device the arms run on ("auto": CUDA if present, else CPU),
    measured once per process, so every arm's MFU has the same denominator."""
    import torch

    from largebatch.models.flops import measure_peak_flops
    from largebatch.train.loop import resolve_device

    device = resolve_device("auto")
    if device.type not in _PEAK_FLOPS:
        _PEAK_FLOPS[device.type] = measure_peak_flops(device, torch.float32)
    return _PEAK_FLOPS[device.type]


@dataclass(frozen=True)
class Execution:
    """How an experiment's arms are run; never what they compute."""

    jobs: int = 1
    """Arms trained at once, in ``jobs`` worker processes spawned once per ``run_arms`` call, each with
    threads/jobs torch threads and training one arm after another. Small models scale poorly over threads. Measured on
    2 cores at full size: 33 arms in 3,410 s with 2 jobs, their own wall times summing to 6,775 s
    (~2x the arms per hour). SIGTERM or Ctrl-C: no arm is started after it, the running ones are
    sent SIGTERM (they checkpoint) and waited for, then ArmsInterrupted is raised."""
    resume: bool = False
    """Keep an arm whose run directory holds a finished run (summary.json) of the same config: a
    stopped or crashed full-size experiment continues where it stopped."""
    kept: list[tuple[str, float]] | None = None
    """If a list: every arm kept by ``resume`` is appended as (name, its own wall seconds from
    arm.json), so a report can say what the earlier invocations took (experiments/cli.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.jobs, int) or isinstance(self.jobs, bool) or self.jobs < 1:
            raise ValueError(f"jobs={self.jobs!r}: must be an integer >= 1 (arms trained at once)")

    def flags(self) -> str:
        """The CLI flags that reproduce this execution (for a report's command line)."""
        return (f" --jobs {self.jobs}" if self.jobs > 1 else "") + (" --resume" if self.resume else "")


BASE_CONFIG = "config"
"""An experiment's base may name a config file under this key (no dot, so it is no config field): its
arms are that file plus the overrides, instead of the default config plus the overrides."""

THREADS = "threads"
"""An arm may pin its torch thread count under this key (no dot: no config field), e.g. the noise
floor's thread-count perturbation (experiments/floor.py); other arms run with the experiment's."""

_ARM_RECORD = "arm.json"  # written next to summary.json when an arm finishes: its config and wall time
_UNFINISHED = "its earlier run did not finish"  # the one stale case that _train may continue
_ARM_START = ".arm-start.json"  # written when an arm starts afresh: its thread count (``_continues``)


def arm_threads(execution: Execution) -> int:
    """The torch threads each arm runs with (the parallel runner splits them between jobs)."""
    import torch

    return max(1, torch.get_num_threads() // execution.jobs) if execution.jobs > 1 else torch.get_num_threads()


def _arm_overrides(arm: Arm, base: dict[str, Any], peak_flops: float) -> dict[str, Any]:
    return {"run.peak_flops": peak_flops, **base, **arm.overrides}


def _resolved(overrides: dict[str, Any]):
    """The TrainConfig an arm's overrides resolve to (its base config, then its fields)."""
    from largebatch.train.config import load_config

    return load_config(overrides.get(BASE_CONFIG),
                       {k: v for k, v in overrides.items() if k not in (BASE_CONFIG, THREADS)})


def _check_config(arm: Arm, overrides: dict[str, Any]) -> None:
    """ConfigError naming the arm if its config does not resolve (what the trainer would refuse)."""
    from largebatch.typed_config import ConfigError

    try:
        _resolved(overrides)
    except ConfigError as exc:
        raise ConfigError(f"arm {arm.name!r}: {exc}") from None


def _finished(run_dir: Path, overrides: dict[str, Any], log: Callable[[str], None] = lambda _: None,
              threads: int | None = None) -> tuple[float, str | None] | None:
    """(wall seconds, divergence or None) of a finished or diverged run in run_dir whose config is
    the one ``overrides`` resolve to now (the trainer's own test, largebatch.train.rundir: the
    resolved fields that change the trajectory, so a base config read from another checkout still
    matches and a changed code default does not), at the same thread count; else None, saying why
    when run_dir held a record."""
    from largebatch.train.config import TrainConfig
    from largebatch.train.rundir import config_differences
    from largebatch.typed_config import from_dict, load_toml

    record_path = run_dir / _ARM_RECORD
    if not record_path.exists():  # never finished; stopped after a checkpoint, or before any
        if any((run_dir / "checkpoints").glob("step_*")):
            log(f"  {run_dir.name}: {_UNFINISHED}: continued from its newest checkpoint where one of this "
                "config fits, else trained again")
        return None
    record, why = _read_record(record_path), None
    summary_path = run_dir / "summary.json"
    if record is None or not isinstance(record.get("wall_seconds"), (int, float)):
        why = f"its record {record_path} is unreadable (cut short by a kill or a full disk)"
    elif not (record.get("diverged") or summary_path.exists()):
        why = _UNFINISHED
    elif not record.get("diverged") and _read_record(summary_path) is None:
        why = f"its {summary_path.name} is unreadable (cut short by a kill or a full disk)"
    elif (recorded_threads := record.get("overrides", {}).get(THREADS)) != overrides.get(THREADS):
        why = f"it ran with {recorded_threads} threads"
    elif (ran := record.get("threads")) is not None and threads is not None \
            and ran != overrides.get(THREADS, threads):  # (records before the count was kept: not known)
        why = f"it ran with {ran} torch threads, this invocation's arms run with {overrides.get(THREADS, threads)}"
    elif not record.get("diverged") and (cut := _metrics_cut_short(run_dir)) is not None:
        why = cut
    else:
        saved = from_dict(TrainConfig, load_toml(run_dir / "config.toml"))
        differences = config_differences(saved, _resolved(overrides))
        why = "; ".join(differences) or None
    if why is not None:
        log(f"  {run_dir.name}: " + (f"{why}: continued from its newest checkpoint where one of this "
                                     "config fits, else trained again" if why is _UNFINISHED
                                     else f"trained again ({why})"))
        return None
    return float(record["wall_seconds"]), record.get("diverged")


def _metrics_cut_short(run_dir: Path) -> str | None:
    """Why a finished arm's metrics.jsonl is not the whole run its summary.json reports (missing, a
    line cut short, or ending before the final validation the summary holds), or None."""
    path = run_dir / "metrics.jsonl"
    try:
        _, val = read_metrics(run_dir)
    except FileNotFoundError:
        return f"its {path.name} is missing"
    except (OSError, ValueError):  # an unreadable file, or a line cut short
        return f"its {path.name} is unreadable (cut short by a kill or a full disk)"
    summary = _read_record(run_dir / "summary.json") or {}
    if not val or val[-1].get("step") != summary.get("steps") \
            or val[-1].get("val_loss") != summary.get("final_val_loss"):
        return f"its {path.name} is cut short (it ends before the final validation its summary.json holds)"
    return None


def _read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object read from ``path``, its non-finite numbers back in place (summary.json is strict
    JSON); None when it cannot be read or parsed (a file cut short)."""
    from largebatch.train.metrics import restored_record

    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return restored_record(record) if isinstance(record, dict) else None


def _train(run_dir: Path, overrides: dict[str, Any], threads: int | None = None,
           resume: bool = False) -> tuple[float, str | None]:
    """Train one arm into a fresh run_dir (``resume``: continue an interrupted run of it there, when
    its checkpoints are of the same config and it started at the same thread count; ``_continues``);
    returns (wall seconds, why it diverged or None). A non-finite loss ends the arm, not the
    experiment. Runs in a worker process too."""
    import torch

    from largebatch.checkpoint.files import atomic_write_text
    from largebatch.train.loop import NonFiniteLoss, Trainer

    cfg = _resolved(overrides)
    threads = overrides.get(THREADS, threads)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    ran_with = torch.get_num_threads()  # recorded: --resume keeps an arm only at the same count
    continued = resume and _continues(run_dir, cfg, ran_with)
    if not continued:
        if run_dir.exists():  # a fresh run: the trainer appends to an existing metrics.jsonl
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        atomic_write_text(run_dir / _ARM_START, json.dumps({"threads": ran_with}))
    start, diverged = time.perf_counter(), None
    with open(run_dir / "train.log", "a" if continued else "w") as log_file:
        try:
            summary = Trainer(cfg, run_dir, resume=continued, log=lambda text: print(text, file=log_file)).fit()
            if summary.get("signal"):  # a stopping.SIGNALS signal: it checkpointed; end the experiment
                raise ArmsInterrupted(summary["signal"], [run_dir.name], [])
        except NonFiniteLoss as exc:
            diverged = str(exc)
            print(f"diverged: {exc}", file=log_file)
        finally:
            torch.set_num_threads(previous)
    wall = time.perf_counter() - start
    record = {"overrides": overrides, "wall_seconds": wall, "diverged": diverged, "process": os.getpid(),
              "threads": ran_with}
    atomic_write_text(run_dir / _ARM_RECORD, json.dumps(record, indent=2))  # never half a record
    return wall, diverged


def _continues(run_dir: Path, cfg, threads: int) -> bool:
    """Whether an unfinished arm's run directory can be continued: it holds checkpoints of this config
    (the trainer's own test), written by a run that started at ``threads`` torch threads (so the
    continued run is the uninterrupted one, to the bit). A stopped full-size arm (8-16 minutes here)
    was trained again from its first step."""
    from largebatch.train.rundir import continues_run
    from largebatch.typed_config import ConfigError

    started = _read_record(run_dir / _ARM_START)
    if started is None or started.get("threads") != threads or (run_dir / "summary.json").exists():
        return False  # (a finished arm trained again, its history damaged or of another config: afresh)
    try:
        return continues_run(run_dir, cfg)
    except ConfigError:  # checkpoints of another config: trained afresh
        return False


def _result(arm: Arm, run_dir: Path, wall: float, diverged: str | None, log: Callable[[str], None],
            note: str = "") -> ArmResult:
    train, val = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result = ArmResult(arm, run_dir, summary, train, val, wall, diverged)
    outcome = (f"diverged at step {result.steps + 1}" if diverged
               else f"val loss {result.final_val_loss:.4f}  steps {result.steps:>5}  "
                    f"final batch {result.final_batch:>4}")
    log(f"  {arm.name:<28} {outcome}  {wall:5.1f} s{note}")
    return result


def run_arms(arms: list[Arm], base: dict[str, Any], out_dir: Path, log: Callable[[str], None] = print,
             execution: Execution = Execution()) -> list[ArmResult]:
    """Train ``arms`` (each: base config + its changes) into out_dir/runs/<name>/; results in arm order.
    ``execution``: how many at once, and whether finished arms are kept (Execution)."""
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arms: duplicate names {sorted(n for n in set(names) if names.count(n) > 1)}")
    peak = _peak_flops()
    jobs = [(arm, Path(out_dir) / "runs" / arm.name, _arm_overrides(arm, base, peak)) for arm in arms]
    results: dict[str, ArmResult] = {}
    todo = []
    for arm, _, overrides in jobs:  # every arm's config, before any arm trains
        _check_config(arm, overrides)
    for arm, run_dir, overrides in jobs:
        finished = _finished(run_dir, overrides, log, arm_threads(execution)) if execution.resume else None
        if finished is None:
            todo.append((arm, run_dir, overrides))
        else:
            results[arm.name] = _result(arm, run_dir, *finished, log, "  (kept: finished earlier)")
            if execution.kept is not None:
                execution.kept.append((arm.name, finished[0]))
    if execution.jobs == 1 or len(todo) <= 1:
        for k, (arm, run_dir, overrides) in enumerate(todo):
            try:
                outcome = _train(run_dir, overrides, arm_threads(execution), execution.resume)  # (as the workers)
            except ArmsInterrupted as exc:
                raise ArmsInterrupted(exc.signum, [arm.name], [a.name for a, _, _ in todo[k + 1:]]) from None
            results[arm.name] = _result(arm, run_dir, *outcome, log)
    else:
        # closed at once when ``log`` raises (its reader gone: the running arms are stopped and checkpoint)
        with contextlib.closing(_train_in_processes(todo, execution.jobs, execution.resume)) as finished:
            for arm, run_dir, outcome in finished:
                results[arm.name] = _result(arm, run_dir, *outcome, log)
    return [results[arm.name] for arm in arms]


class ArmsInterrupted(KeyboardInterrupt):
    """A stopping.SIGNALS signal reached an experiment training arms in processes: none more was
    started and the running ones were sent that signal (they checkpoint and exit) and waited for."""

    def __init__(self, signum: int, stopped: list[str], not_started: list[str], killed: bool = False):
        super().__init__(signum, stopped, not_started)
        self.signum, self.stopped, self.not_started = signum, stopped, not_started
        self.killed = killed
        """A second signal came while the running arms were checkpointing: they were killed, and
        each continues from its last checkpoint (the one before this stop, if any)."""


class ArmWorkerLost(RuntimeError):
    """A worker process stopped, or died, on its own (a signal sent to it alone, the kernel's OOM
    killer); the other arms were stopped. ``signum``: the signal, when it is known."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


class _Interrupt:
    """The parent's handler for stopping.SIGNALS: raises ``make(signum)``, except while a worker
    process is being started (``held()``), when the signal is kept and raised once the start is
    over. multiprocessing's spawn writes the new process its start-up data after the process exists;
    an exception raised in that write closes the pipe half-written, and the new process then dies
    in multiprocessing's own start-up code with an EOFError traceback, before any code of ours
    runs (a Ctrl-C in the first second of an experiment). A second signal while held keeps the
    first one's number."""

    def __init__(self, make: Callable[[int], BaseException]):
        self.make = make
        self.holding = False
        self.kept: int | None = None

    def __call__(self, signum, frame) -> None:
        if self.holding:
            self.kept = signum if self.kept is None else self.kept
            return
        raise self.make(signum)

    @contextlib.contextmanager
    def held(self):
        self.holding, self.kept = True, None
        try:
            yield
        finally:
            self.holding, signum, self.kept = False, self.kept, None
        if signum is not None:  # (an error in the start is raised as it is: the process ends either way)
            raise self.make(signum)


_PARENT_CHECK_S = 2.0  # an idle worker looks this often whether its parent still lives


def _die_with_parent(parent: int) -> None:
    """Have the kernel send this worker SIGTERM when its parent dies (Linux: prctl
    PR_SET_PDEATHSIG), as a SIGKILL or the OOM killer gives the parent no chance to stop its workers;
    elsewhere the idle worker's check of its parent (_next_task) remains. SIGTERM: a training arm
    checkpoints and the worker exits; an idle one exits at once. (The kernel ties the request to the
    thread that started the worker: start workers from a thread that outlives them.)"""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc to ask: the parent check still holds
            pass
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


def _next_task(channel, parent: int):
    """The next task from ``channel`` (this worker's end of its pipe to the parent); None when the
    parent has died or closed the pipe (the worker is an orphan, or no longer needed)."""
    while True:
        try:
            if channel.poll(_PARENT_CHECK_S):
                return channel.recv()
        except (EOFError, OSError):
            return None
        if os.getppid() != parent:
            return None


def _send(channel, message) -> None:
    """Send ``message`` to the parent; nothing when it has gone (the worker then just ends)."""
    try:
        channel.send(message)
    except OSError:  # BrokenPipeError: the parent died or stopped listening
        pass


@dataclass
class _ArmStopped:
    """What a worker sends when a signal to it alone stopped its arm (the trainer checkpointed)."""

    signum: int


@dataclass
class _ArmFailure:
    """What a worker sends instead of an outcome when its arm raised: the exception (when it
    pickles) and its traceback as text."""

    error: BaseException | None
    traceback: str


def _arm_worker(channel, threads: int, parent: int | None = None, resume: bool = False) -> None:
    """A worker process: trains the arms it is sent, one after another, until it gets None. One
    process trains many arms, as the serial path does, so each arm pays no interpreter and torch
    start-up (~4 s of CPU, a sixth of a quick arm). An arm that raises is sent back as an
    _ArmFailure, and the worker stops. ``channel``: its own pipe to the parent, both ways (no lock
    shared with other workers: a worker killed mid-write cannot block the others' exit; sends are
    synchronous, so no feeder thread is left to join at exit). ``parent``: the parent's pid; the
    worker ends when it dies."""
    os.setpgrp()  # out of the terminal's process group: Ctrl-C reaches the parent, which decides
    parent = os.getppid() if parent is None else parent
    _die_with_parent(parent)
    try:
        _arm_tasks(channel, threads, parent, resume)
    except KeyboardInterrupt:  # SIGINT passed on by the parent before an arm's trainer took it over
        return  # (starting up, between arms): nothing to save; the parent names the arms it stopped


def _arm_tasks(channel, threads: int, parent: int, resume: bool = False) -> None:
    while (task := _next_task(channel, parent)) is not None:
        index, run_dir, overrides = task
        try:
            outcome = _train(run_dir, overrides, threads, resume)
        except ArmsInterrupted as exc:  # SIGTERM (from the parent, or to this worker alone): checkpointed
            _send(channel, (index, _ArmStopped(exc.signum)))  # unread when the parent sent it
            return
        except Exception as exc:  # noqa: BLE001 -- any error of the arm goes to the parent, as in one process
            try:
                pickle.loads(pickle.dumps(exc))
            except Exception:  # noqa: BLE001 -- an exception that does not cross processes: its text does
                exc = None
            _send(channel, (index, _ArmFailure(exc, traceback.format_exc())))
            return
        _send(channel, (index, outcome))


def _raise_failure(arm: Arm, failure: _ArmFailure):
    """Raise, in the parent, the error an arm raised in its worker (the serial path's exception,
    with the worker's traceback as a note), or a RuntimeError holding that traceback."""
    where = f"arm {arm.name!r} failed in its worker process; the worker's traceback:\n{failure.traceback}"
    if failure.error is None:
        raise RuntimeError(where)
    failure.error.add_note(where)
    raise failure.error


def _train_in_processes(todo: list[tuple[Arm, Path, dict[str, Any]]], jobs: int, resume: bool = False):
    """Yield (arm, run_dir, (wall, diverged)) as arms finish, in ``jobs`` worker processes (spawned
    once; each trains the next pending arm when it is free).

    SIGTERM, SIGINT (Ctrl-C), SIGHUP, SIGUSR1 or SIGUSR2 to this process (those it does not ignore):
    no arm is started after it, every running arm gets the same signal (its trainer checkpoints and
    exits) and is waited for,
    then ArmsInterrupted is raised -- no process is left behind training on its own."""
    import torch

    from largebatch.train.stopping import REPEAT_WINDOW_S, take_signals

    ctx = multiprocessing.get_context("spawn")
    threads = max(1, torch.get_num_threads() // jobs)
    pending = list(enumerate(todo))
    workers: list[tuple[Any, Any]] = []  # (process, the parent's end of its pipe)
    busy: dict[int, int] = {}  # worker number -> index of the arm it trains

    interrupt = _Interrupt(lambda signum: ArmsInterrupted(signum, [], []))

    def lost(w: int) -> ArmWorkerLost:
        """Worker ``w`` ended, or closed its pipe, without sending its arm's outcome."""
        process = workers[w][0]
        process.join(5.0)  # its exit code, once it has ended
        arm, run_dir, _ = todo[busy[w]]
        code = process.exitcode
        if code == 0:  # its trainer took a signal sent to the worker alone, and checkpointed
            return ArmWorkerLost(f"arm {arm.name!r} was stopped by a signal to its worker process; "
                                 f"run the same command with --resume to continue")
        log_file = run_dir / "train.log"
        seen = f"; its trainer's log: {log_file}" if log_file.is_file() and log_file.stat().st_size else ""
        how = (f"was killed by {_signal_name(-code)}" if code is not None and code < 0
               else f"died (exit code {code})")
        return ArmWorkerLost(f"arm {arm.name!r}: its worker process {how}{seen}; run the same command "
                             f"with --resume to keep the finished arms",
                             -code if code is not None and code < 0 else None)

    previous = take_signals(interrupt)  # those not ignored (nohup)
    try:
        while pending or busy:
            while pending and len(busy) < jobs:
                free = next((w for w in range(len(workers)) if w not in busy), None)
                if free is None:
                    mine, theirs = ctx.Pipe()
                    process = ctx.Process(target=_arm_worker, args=(theirs, threads, os.getpid(), resume),
                                          name=f"arms-{len(workers)}")
                    with interrupt.held():  # a signal now is raised once the worker is listed
                        with passive_openmp():
                            process.start()
                        theirs.close()  # the worker holds it now: its death reads as EOF here
                        workers.append((process, mine))
                    free = len(workers) - 1
                index, (arm, run_dir, overrides) = pending.pop(0)
                busy[free] = index
                try:
                    workers[free][1].send((index, run_dir, overrides))
                except OSError:  # the worker died while idle
                    raise lost(free) from None
            ready = wait_for([workers[w][1] for w in busy] + [workers[w][0].sentinel for w in busy], 1.0)
            messages = [w for w in busy if workers[w][1] in ready]  # the sentinels are ints: never equal
            if not messages:  # no message: a worker that ended is lost
                dead = [w for w in busy if not workers[w][0].is_alive()]
                if dead:
                    raise lost(dead[0])
                continue
            for w in messages:
                try:
                    index, outcome = workers[w][1].recv()
                except (EOFError, OSError):  # it died before it could send
                    raise lost(w) from None
                del busy[w]
                arm, run_dir, _ = todo[index]
                if isinstance(outcome, _ArmFailure):
                    _raise_failure(arm, outcome)
                if isinstance(outcome, _ArmStopped):  # a signal to the worker alone: it checkpointed
                    raise ArmWorkerLost(f"arm {arm.name!r} was stopped by {_signal_name(outcome.signum)} sent "
                                        f"to its worker process alone; run the same command with --resume to "
                                        f"continue", outcome.signum)
                yield arm, run_dir, outcome
        for process, channel in workers:
            _send(channel, None)
        for process, channel in workers:
            process.join()
            channel.close()
    except ArmsInterrupted as exc:
        stopped, not_started = [todo[i][0].name for i in busy.values()], [todo[i][0].name for i, _ in pending]
        first, first_at = exc.signum, time.monotonic()

        def second(signum, frame):  # another signal while the arms checkpoint: kill them, stop at once
            if signum == first and time.monotonic() - first_at < REPEAT_WINDOW_S:
                return  # a repeat of the first (a cluster signals every process; a terminal twice)
            raise ArmsInterrupted(first, stopped, not_started, killed=True)

        take_signals(second)
        try:
            _stop(workers, exc.signum)
        except ArmsInterrupted as again:
            _stop(workers, signal.SIGKILL)  # (no grace: killed and reaped at once)
            raise again from None
        raise ArmsInterrupted(exc.signum, stopped, not_started) from None
    except BaseException:
        _stop(workers)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def passive_openmp():
    """Processes started inside get OMP_WAIT_POLICY=PASSIVE, unless the user set a policy. Arms run
    side by side share the cores, and an arm may run more threads than its share (the noise floor's
    thread-count perturbation): with OpenMP's default spin-waiting every parallel region then stalls
    on threads that are not scheduled. Measured, 2 jobs on 2 cores with a third process busy: a quick
    seesaw arm at 2 threads took 1,003 s spinning, 35 s passive; the policy changes no number."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _worker_start(threads: int, parent: int | None = None) -> None:
    import torch

    os.setpgrp()  # out of the terminal's process group: Ctrl-C reaches the parent, which decides
    if parent is not None:
        _die_with_parent(parent)  # a pool's idle worker waits for the parent's next task
    torch.set_num_threads(threads)


def map_in_processes(fn: Callable[..., Any], tasks: list[tuple], jobs: int, what: str) -> list[Any]:
    """``[fn(*task) for task in tasks]`` in ``jobs`` worker processes (spawned once, each with its
    share of the torch threads), in task order. ``fn`` must be a module-level function.

    For work that keeps nothing worth saving (fine-tuning a finished arm): on a stopping.SIGNALS
    signal the pending tasks are dropped, the workers killed and waited for, and ArmsInterrupted
    raised naming ``what``; a worker that dies raises RuntimeError."""
    import torch

    from largebatch.train.stopping import take_signals

    threads = max(1, torch.get_num_threads() // jobs)
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(threads, os.getpid()))

    interrupt = _Interrupt(lambda signum: ArmsInterrupted(signum, [what], []))
    previous = take_signals(interrupt)  # those not ignored (nohup)
    try:
        with interrupt.held():  # the first submit starts the workers
            futures = [pool.submit(fn, *task) for task in tasks]
        outcomes = [future.result() for future in futures]
    except BaseException as exc:
        for sig, handler in previous.items():  # a second signal now ends this process at once
            signal.signal(sig, handler)
        workers = list((pool._processes or {}).values())  # the pool has no public kill
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()
            worker.join()
        if isinstance(exc, ArmsInterrupted):
            raise
        if type(exc).__name__ == "BrokenProcessPool":
            raise RuntimeError(f"{what}: a worker process died ({exc})") from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    pool.shutdown()
    return outcomes


def _stop(workers, signum: int = signal.SIGTERM, grace_s: float = 120.0) -> None:
    """Send ``signum`` to each worker process, wait for it (a trainer finishes its step and
    checkpoints), else kill; what they still send is read and dropped (a worker never blocks on a
    full pipe). ``workers``: (process, the parent's end of its pipe) pairs. The signal this process
    got is the one to pass on: a cluster that signals every process of a job (Slurm's
    ``--signal=USR1@...``) has reached the workers with it already, and a trainer takes a repeat of
    its signal as that signal, where another one would mean "exit now, no checkpoint". Except
    SIGINT, passed on as SIGTERM: the workers are out of the terminal's process group, so Ctrl-C
    reaches them only as this copy; SIGTERM asks a trainer for the same (checkpoint, exit) and ends a
    worker that is still starting up at once, where SIGINT raised KeyboardInterrupt in it, a
    traceback per worker."""
    workers = list(workers)
    if signum == signal.SIGINT:
        signum = signal.SIGTERM
    for process, _ in workers:
        if process.is_alive():
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:  # it ended meanwhile
                pass
    deadline = time.monotonic() + grace_s
    channels = [channel for _, channel in workers if not channel.closed]
    for process, _ in workers:
        while process.is_alive() and (left := deadline - time.monotonic()) > 0:
            for ready in wait_for([process.sentinel, *channels], left):
                if ready in channels:
                    try:
                        ready.recv()
                    except (EOFError, OSError):  # that worker has ended
                        channels.remove(ready)
        if process.is_alive():
            process.kill()
        process.join()
    for channel in channels:
        channel.close()
