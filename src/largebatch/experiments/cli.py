"""``largebatch experiment NAME [--quick | --smoke] [--out DIR]``: run a controlled comparison on
the bundled Shakespeare corpus and write a report directory (report.md, PNG plots, runs/<arm>/).

    largebatch experiment seesaw --quick          # Meterez et al. 2025: Seesaw vs cosine
    largebatch experiment optimizers --quick      # You et al. 2017/2019, Zheng et al. 2020
    largebatch experiment recompute --quick       # Korthikanti et al. 2022
    largebatch experiment noise-scale --quick     # McCandlish et al. 2018
    largebatch experiment bert-lans --quick       # Zheng et al. 2020: LANS / LAMB / AdamW, two-phase BERT
    largebatch experiment all --quick
    largebatch experiment optimizers --jobs 2 --resume   # full size: 2 arms at once; keep finished arms
    largebatch experiment seesaw --quick --seeds 5       # every arm at 5 seeds: paired gaps, mean +- sd
    largebatch experiment seesaw --quick --granularity   # also Seesaw r=1/1.1 at micro-batch 1
    largebatch experiment optimizers --quick --seeds 3   # each cell's best LR at 3 seeds, noise floor, verdicts
    largebatch experiment all --quick --check            # check the arguments and --out only; exit
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from largebatch.arguments import OneLineParser, check_output_dir

EXPERIMENTS = ("seesaw", "optimizers", "recompute", "noise-scale", "bert-lans")
SEEDED = ("seesaw", "optimizers", "noise-scale", "bert-lans")  # the experiments that repeat their arms over --seeds


MARKER = "experiment.json"
"""Written into a report directory before its first arm: which experiment, at which size, owns it."""


def _module(name: str):
    return importlib.import_module(f"largebatch.experiments.{name.replace('-', '_')}")


def run_experiment(name: str, size: str = "quick", out_dir: str | Path | None = None,
                   log=print, jobs: int = 1, resume: bool = False, seeds: int | None = None,
                   granularity: bool = False) -> Path:
    """Run one experiment at a size (smoke | quick | full); returns the path of its report.md.
    ``jobs``: arms trained at once (processes); ``resume``: keep arms that already finished;
    ``seeds``: seeds per arm (the SEEDED experiments; default: the size's); ``granularity``: seesaw
    also runs Seesaw r=1/1.1 at micro-batch 1 (False: the size's default)."""
    from largebatch.experiments.runner import Execution, check_size

    if name not in EXPERIMENTS:
        raise ValueError(f"experiment {name!r}: choose one of {', '.join(EXPERIMENTS)}")
    check_size(size)
    extra = {}
    if seeds is not None:
        if name not in SEEDED:
            raise ValueError(f"seeds={seeds!r}: only {', '.join(SEEDED)} repeat their arms over seeds; "
                             f"drop --seeds for {name!r}")
        extra["seeds"] = _module(name).check_seeds(seeds)
    if granularity:
        if name != "seesaw":
            raise ValueError(f"granularity=True: only seesaw has the micro-batch-1 arms; drop --granularity "
                             f"for {name!r}")
        extra["granularity"] = True
    execution = Execution(jobs=jobs, resume=resume, kept=[])
    out = _report_dir(name, size, out_dir)
    check_experiment_dir(out, name, size)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)  # one experiment per directory: a second would delete the arms this one trains
    if lock.warning:
        log(f"warning: {lock.warning}")
    try:
        return _run_locked(name, size, out, log, execution, seeds, granularity, extra)
    finally:
        lock.release()


def _lock(out: Path):
    """The report directory's lock (the trainer's: an flock on OUT/.lock, freed when this process
    ends however it ends); RunDirLocked naming the holder's pid when another experiment has it."""
    from largebatch.train.rundir import RunLock

    return RunLock(out, user="experiment", option="--out")


def _run_locked(name, size, out, log, execution, seeds, granularity, extra) -> Path:
    check_experiment_dir(out, name, size)  # again, now that no other experiment can write it
    from largebatch.checkpoint.files import atomic_write_text

    atomic_write_text(out / MARKER, json.dumps({"experiment": name, "size": size}) + "\n")
    finished = sorted(p.parent.name for p in (out / "runs").glob(f"*/{_ARM_RECORD}"))
    if finished and not execution.resume:
        log(f"warning: {out} holds {len(finished)} finished arm(s) of an earlier run; without --resume "
            f"they are trained again (stop now and add --resume to keep them)")
    stale = [p for p in [out / "report.md", *sorted(out.glob("*.png"))] if p.is_file()]
    for path in stale:  # the arms they describe are about to change; the run writes them anew at its end
        path.unlink()
    if stale:
        log(f"{name}: removed the previous report ({', '.join(p.name for p in stale)}); this run writes it "
            f"again when it ends")
    flag = {"smoke": " --smoke", "quick": " --quick", "full": ""}[size]
    seeds_flag = (f" --seeds {seeds}" if seeds is not None else "") + (" --granularity" if granularity else "")
    command = (f"largebatch experiment {name}{flag}{seeds_flag} --out {shlex.quote(str(out))}"
               f"{execution.flags()}")
    start = time.perf_counter()
    report = _module(name).run(size, out, command, log=log, execution=execution, **extra)
    report.seconds = time.perf_counter() - start
    report.kept = sorted(set(execution.kept))  # an arm a report reads twice is listed once
    path = report.write(out)
    log(f"{name}: report {path} ({report.seconds:.0f} s)")
    return path


def _report_dir(name: str, size: str, out_dir: str | Path | None) -> Path:
    return Path(out_dir).expanduser() if out_dir else Path("runs") / "experiments" / f"{name}-{size}"


_ARM_RECORD = "arm.json"  # runner._ARM_RECORD (not imported: the runner imports torch)


class _OutputClosed(KeyboardInterrupt):
    """Standard output's reader exited (``largebatch experiment ... | head``): stop as on a signal.
    (A KeyboardInterrupt, as runner.ArmsInterrupted: no ``except Exception`` on the way swallows it.)"""


def _console_log():
    """The experiment's log: train.progress.ConsoleLog (flushed lines), raising _OutputClosed when its
    pipe's reader has gone: no arm is started after it, the running ones checkpoint and stop."""
    from largebatch.train.progress import ConsoleLog

    log = ConsoleLog("no arm is started after this line, and the running ones checkpoint and stop")

    def closed():
        raise _OutputClosed()

    log.on_lost = closed
    return log


class ExperimentDirError(ValueError):
    """The report directory holds something else than this experiment at this size."""


def check_experiment_dir(out: Path, name: str, size: str) -> None:
    """ExperimentDirError unless ``out`` may hold this experiment at this size: absent or empty, or marked
    (OUT/experiment.json) for the same experiment and size, or an unmarked report directory of an
    earlier version (it holds runs/ or report.md; it gets the marker)."""
    out = Path(out)
    if not out.is_dir():
        return
    marker = out / MARKER
    if marker.exists():
        try:
            owner = json.loads(marker.read_text())
            theirs = (str(owner["experiment"]), str(owner["size"]))
        except (OSError, ValueError, TypeError, KeyError):
            theirs = None
        if theirs is None:  # cut short: written atomically, so not by an experiment
            raise ExperimentDirError(f"--out {out}: its {MARKER} is unreadable, so which experiment it holds is "
                             f"unknown; choose another --out (or delete {marker} if it holds {name} at "
                             f"{size} size)")
        if theirs != (name, size):
            raise ExperimentDirError(f"--out {out} holds the experiment {theirs[0]} at {theirs[1]} size, not {name} "
                             f"at {size} size; choose another --out")
        return
    entries = {p.name for p in out.iterdir()} - {".lock"}
    if entries and not entries & {"runs", "report.md"}:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise ExperimentDirError(f"--out {out} is not empty ({shown}) and is not an experiment's report directory "
                         f"(no {MARKER}, runs/ or report.md); choose a new or empty directory")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _write_failure(exc: BaseException, out: Path) -> str:
    """One line for a file that could not be written (a full disk, a quota, a file-size limit): what
    failed, the free space where the report goes, and the fix."""
    text = str(exc) if not isinstance(exc, OSError) else (
        f"could not write {exc.filename}: {exc.strerror}" if exc.filename and exc.strerror
        else f"could not write a file: {exc.strerror or exc}")
    text = re.sub(r"\.?\s*(Free disk space|Make it writable|Raise the file-size limit \([^)]*\)) and run the same "
                  r"command again \(or --resume [^)]*\)\s*$", "", text.splitlines()[0] if text else "").rstrip(". ")
    base = next((p for p in [out, *out.absolute().parents] if p.exists()), None)
    try:
        free = f"{_bytes(shutil.disk_usage(base).free)} free on the file system of {out}" if base else ""
    except OSError:
        free = ""
    return (f"{text}{'; ' + free if free else ''}. Free space (or lift the limit), then run the same "
            f"command with --resume to keep the finished arms")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="largebatch experiment", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=EXPERIMENTS + ("all",))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="tiny model: seconds (recompute) to ~16-19 minutes (optimizers, with its "
                           "seeds and noise floor; measured) on 2 CPU cores with --jobs 2")
    size.add_argument("--smoke", action="store_true", help="seconds; what the test suite runs")
    parser.add_argument("--out", default=None,
                        help="report directory (default runs/experiments/NAME-SIZE; with 'all', "
                             "one subdirectory per experiment)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="arms trained at once, one process each (threads split between them); "
                             "measured here at full size: 2 one-thread jobs on 2 cores, ~2x the arms "
                             "per hour of one job")
    parser.add_argument("--resume", action="store_true",
                        help="keep arms whose run directory holds a finished run of the same config")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seesaw, optimizers, noise-scale, bert-lans: seeds per arm (1-8; bert-lans "
                             "1-5; default 2); the report gives the paired gaps with their intervals, "
                             "noise floors and verdicts")
    parser.add_argument("--granularity", action="store_true",
                        help="seesaw: also run Seesaw r=1/1.1 at micro-batch 1 (the batch grows by 1.1x at "
                             "every milestone instead of by whole micro-batches), 2-3x an arm's time; "
                             "on by default at --smoke only")
    parser.add_argument("--check", action="store_true",
                        help="check the arguments and the report directory, print where the report would go, exit")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1 (arms trained at once)")
    if args.out is not None and not args.out.strip():
        parser.error(f"--out {args.out!r}: the directory name is empty; give one, or drop --out for the "
                     f"default (runs/experiments/NAME-SIZE)")
    if args.jobs > (cpus := _cpu_count()):
        print(f"largebatch experiment: warning: --jobs {args.jobs} is more than the {cpus} CPU core(s) "
              f"here; the arms share them, so each arm runs slower", file=sys.stderr)
    if args.seeds is not None:
        if args.name == "all":
            parser.error(f"--seeds {args.seeds}: 'all' runs each experiment at its own default seeds; to "
                         f"choose them, run one of {', '.join(SEEDED)} with --seeds")
        if args.name not in SEEDED:
            parser.error(f"--seeds {args.seeds}: {args.name} takes no --seeds; only {', '.join(SEEDED)} "
                         "repeat their arms over seeds")
        try:
            _module(args.name).check_seeds(args.seeds)
        except ValueError as exc:  # "seeds=N: must be ...": the flag already names the value
            parser.error(f"--seeds {args.seeds}: {str(exc).removeprefix(f'seeds={args.seeds!r}: ')}")
    if args.granularity and args.name != "seesaw":
        parser.error(f"--granularity: only seesaw has the micro-batch-1 arms, not {args.name}")
    size_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    names = EXPERIMENTS if args.name == "all" else (args.name,)
    outs = {name: _report_dir(name, size_name, args.out if args.name != "all" or args.out is None
                              else Path(args.out) / name) for name in names}
    if args.name == "all" and args.out is not None and (Path(args.out) / MARKER).exists():
        parser.error(f"--out {args.out} is the report directory of one experiment; 'all' writes one "
                     f"subdirectory per experiment under --out: choose a new or empty directory")
    for name, out in outs.items():  # every report directory, before the first arm trains
        try:
            check_output_dir(out, "--out")
            check_experiment_dir(out, name, size_name)
        except ValueError as exc:
            parser.error(str(exc))
        if args.check and (out / ".lock").is_file():  # one that ran before: is it running now?
            from largebatch.train.rundir import RunDirLocked

            try:
                _lock(out).release()
            except RunDirLocked as exc:
                parser.error(f"{name}: {exc}")
    if args.check:
        print("ok: " + "; ".join(f"{name} ({size_name}) -> {out}" for name, out in outs.items()))
        return 0
    from largebatch.train.stopping import raise_on_signals

    with raise_on_signals():  # a signal outside the arms' training (setup, between arms) says so too
        return _run_all(outs, size_name, args)


def _run_all(outs: dict, size_name: str, args) -> int:
    from largebatch.checkpoint.local import CheckpointError
    from largebatch.experiments.runner import ArmsInterrupted, ArmWorkerLost
    from largebatch.train.rundir import RunDirLocked
    from largebatch.typed_config import ConfigError

    log = _console_log()
    for name, out in outs.items():
        try:
            run_experiment(name, size_name, out, log=log, jobs=args.jobs, resume=args.resume,
                           seeds=args.seeds, granularity=args.granularity)
        except (ConfigError, RunDirLocked, ExperimentDirError) as exc:  # an arm's config that the trainer
            # would refuse, a directory another experiment holds: before an arm trains
            print(f"largebatch experiment: error: {name}: {exc}", file=sys.stderr)
            return 2
        except ArmWorkerLost as exc:  # a signal, or the OOM killer, reached one worker alone
            print(f"largebatch experiment: error: {name}: {exc}", file=sys.stderr)
            return 128 + exc.signum if exc.signum else 2
        except (OSError, CheckpointError) as exc:  # a full disk, a quota, a file-size limit
            print(f"largebatch experiment: error: {name}: {_write_failure(exc, out)}", file=sys.stderr)
            return 1
        except _OutputClosed:
            print(f"largebatch experiment: error: standard output was closed by its reader: {name} "
                  f"stopped. Run the same command with --resume to keep the finished arms", file=sys.stderr)
            return 128 + signal.SIGPIPE
        except ArmsInterrupted as exc:
            killed = (" (a second signal killed them before they checkpointed: each continues from its last "
                      "checkpoint, if it has one)" if exc.killed and exc.stopped else "")
            print(f"largebatch experiment: error: {signal.Signals(exc.signum).name}: {name} stopped; "
                  f"arms interrupted: {', '.join(exc.stopped) or 'none'}{killed}; not started: "
                  f"{''.join(a + ', ' for a in exc.not_started)}and any arm the experiment plans from these "
                  f"arms' results. Run the same command with --resume to keep the finished arms", file=sys.stderr)
            return 128 + exc.signum
        except KeyboardInterrupt as exc:  # no arm training: setup, a fine-tuning in this process, a report
            signum = getattr(exc, "signum", signal.SIGINT)
            print(f"largebatch experiment: error: {signal.Signals(signum).name}: {name} stopped outside the "
                  f"arms' training (setup, fine-tuning, a report). Run the same command with --resume to keep "
                  f"the finished arms", file=sys.stderr)
            return 128 + signum
    return 0
