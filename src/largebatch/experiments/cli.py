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
import shlex
import signal
import sys
import time
from pathlib import Path

from largebatch.arguments import OneLineParser, check_output_dir

EXPERIMENTS = ("seesaw", "optimizers", "recompute", "noise-scale", "bert-lans")
SEEDED = ("seesaw", "optimizers", "noise-scale", "bert-lans")  # the experiments that repeat their arms over --seeds


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
    out.mkdir(parents=True, exist_ok=True)
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
    return Path(out_dir) if out_dir else Path("runs") / "experiments" / f"{name}-{size}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="largebatch experiment", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=EXPERIMENTS + ("all",))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="tiny model: seconds (recompute) to ~21 minutes (optimizers, with its seeds "
                           "and noise floor; estimated) on 2 CPU cores with --jobs 2")
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
                        help="check the arguments and the report directory, print what would run, exit")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1 (arms trained at once)")
    if args.seeds is not None:
        if args.name not in SEEDED:
            parser.error(f"--seeds {args.seeds}: only {', '.join(SEEDED)} repeat their arms over seeds")
        try:
            _module(args.name).check_seeds(args.seeds)
        except ValueError as exc:
            parser.error(f"--seeds {args.seeds}: {exc}")
    if args.granularity and args.name != "seesaw":
        parser.error(f"--granularity: only seesaw has the micro-batch-1 arms, not {args.name}")
    size_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    names = EXPERIMENTS if args.name == "all" else (args.name,)
    outs = {name: _report_dir(name, size_name, args.out if args.name != "all" or args.out is None
                              else Path(args.out) / name) for name in names}
    for name, out in outs.items():  # every report directory, before the first arm trains
        try:
            check_output_dir(out, "--out")
        except ValueError as exc:
            parser.error(str(exc))
    if args.check:
        print("ok: " + "; ".join(f"{name} ({size_name}) -> {out}" for name, out in outs.items()))
        return 0
    from largebatch.experiments.runner import ArmsInterrupted
    from largebatch.typed_config import ConfigError

    for name, out in outs.items():
        try:
            run_experiment(name, size_name, out, jobs=args.jobs, resume=args.resume, seeds=args.seeds,
                           granularity=args.granularity)
        except ConfigError as exc:  # an arm's config that the trainer would refuse: before it trains
            print(f"largebatch experiment: error: {name}: {exc}", file=sys.stderr)
            return 2
        except ArmsInterrupted as exc:
            print(f"largebatch experiment: error: {signal.Signals(exc.signum).name}: {name} stopped; "
                  f"arms interrupted: {', '.join(exc.stopped) or 'none'}; not started: "
                  f"{', '.join(exc.not_started) or 'none'}. Run the same command with --resume to keep "
                  f"the finished arms", file=sys.stderr)
            return 128 + exc.signum
        except KeyboardInterrupt:  # Ctrl-C between arms (setup, a report): no arm was running
            print(f"largebatch experiment: error: SIGINT: {name} stopped between arms. Run the same "
                  f"command with --resume to keep the finished arms", file=sys.stderr)
            return 130
    return 0
