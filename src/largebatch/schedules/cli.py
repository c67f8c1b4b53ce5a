"""``largebatch schedule``: print a schedule's phase table and optimizer steps next to its base
schedule's, and optionally plot LR and batch size against tokens.

    largebatch schedule --run.total_tokens 1e9 --model.seq_len 1024 --schedule.batch_size 256
        --run.micro_batch 8 --schedule.batch_policy seesaw --schedule.ratio 1/1.1 --plot seesaw.png

Every ``ScheduleConfig`` field is an option spelled as in ``largebatch train``
(``--schedule.peak_lr``, ``--schedule.max_batch_size=none`` ...), generated from the dataclass with
the field's type, default and docstring as its help; so are the budget and batch sizes the schedule
needs (``--run.total_tokens``, ``--model.seq_len``, ``--run.micro_batch``, ``--parallel.dp``).
Older spellings stay as aliases: ``--peak-lr`` for ``--schedule.peak_lr`` (every field, dashes for
underscores), ``--total-tokens``, ``--seq-len``, ``--micro-batch``, ``--dp``.

A training config's schedule: ``largebatch schedule --config CONFIG [--phase N] [--plot OUT.png]`` (a
``largebatch train`` TOML file or a shipped config's name) reads its [schedule], run.total_tokens,
model.seq_len, run.micro_batch and parallel.dp (the trainer's defaults where it sets none; a
parallel.dp of 0 means the launch's ranks and is taken as 1 unless --parallel.dp says); with
[[phases]], --phase N gives phase N's (its budget, seq_len, micro_batch and [schedule] overrides).
A flag given beside it overrides the config's value. ``largebatch train CONFIG --check`` prints the
schedule as a launch will take it (its replicas counted from the launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys

from largebatch.arguments import OneLineParser, check_output_file, token_count, token_formatter
from largebatch.schedules.config import ScheduleConfig, batch_table, fraction
from largebatch.typed_config import add_config_arguments, config_overrides, parse_value

PLOT_SUFFIXES = (".png", ".pdf", ".svg")

TRAIN_DEFAULTS = {"run.total_tokens": 600_000, "run.micro_batch": 8, "model.seq_len": 128}
"""The trainer's defaults of the fields --config reads beyond [schedule] (this layer cannot import
the trainer's config; a test holds them equal)."""
def parse_tokens(text: str) -> int:
    """'2e9', '300M', '1.5B' -> an integer token count (``largebatch.arguments.token_count``)."""
    try:
        return token_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: {exc}") from None


def parse_number(text: str) -> float:
    """A float, or a fraction such as '1/1.1' (Seesaw's ratio): ``schedules.config.fraction``."""
    try:
        return fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_table(text: str) -> list[list[float]]:
    """'0:64,0.5:128' -> [[0.0, 64], [0.5, 128]] (token fraction: batch size); a TOML array
    '[[0, 64], [0.5, 128]]' as in a config file is read as such."""
    if text.strip().startswith("["):
        value = parse_value(text)
        if isinstance(value, list):
            return value
    try:
        table = batch_table(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not all(math.isfinite(f) for f, _ in table):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions must be finite, e.g. 0:64,0.5:128")
    return table


def positive_int(text: str) -> int:
    """A positive whole number (sequences, tokens per sequence, ranks)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive whole number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="largebatch schedule", description=__doc__, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a `largebatch train` TOML file or a shipped config's name: its "
                        "schedule, budget, sequence length, micro-batch and data-parallel size (flags given "
                        "beside it override them)")
    parser.add_argument("--phase", type=int, help="with --config holding [[phases]]: phase N's schedule (0, 1, ...)")
    parser.add_argument("--run.total_tokens", "--total-tokens", dest="total_tokens", type=parse_tokens,
                        help="token budget, e.g. 2e9 or 300M (required without --config)")
    parser.add_argument("--model.seq_len", "--seq-len", dest="seq_len", type=positive_int,
                        help="tokens per sequence (required without --config)")
    parser.add_argument("--run.micro_batch", "--micro-batch", dest="micro_batch", type=positive_int,
                        help="sequences per micro-batch (default 1, or the --config's; largebatch train's is 8)")
    parser.add_argument("--parallel.dp", "--dp", dest="dp", type=positive_int,
                        help="data-parallel ranks (default 1, or the --config's parallel.dp)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="write LR and batch size vs tokens to this file (.png, .pdf or .svg; its "
                             "directory must exist and be writable, checked before any work)")
    names = [f.name for f in dataclasses.fields(ScheduleConfig)]
    add_config_arguments(parser, ScheduleConfig, "schedule.",
                         aliases={f"schedule.{n}": ("--" + n.replace("_", "-"),) for n in names},
                         types={"schedule.ratio": parse_number, "schedule.batch_table": parse_table})
    return parser


def plot(config: ScheduleConfig, total_tokens: int, seq_len: int, micro_batch: int, dp: int,
         path: str) -> None:
    import numpy as np
    from matplotlib.figure import Figure  # not pyplot: a caller's backend and figures are left alone

    schedule = config.build(total_tokens, seq_len, micro_batch, dp)
    base = config.build_base(total_tokens, micro_batch, dp)
    tokens = np.unique(np.concatenate([np.linspace(0, total_tokens - 1, 2000),
                                       np.array(schedule.breakpoints(), dtype=float)]))
    fig = Figure(figsize=(8, 6))
    ax_lr, ax_batch = fig.subplots(2, 1, sharex=True)
    for sched, name, style in ((base, "base", "--"), (schedule, config.batch_policy, "-")):
        ax_lr.plot(tokens, [sched.lr(t) for t in tokens], style, label=name, drawstyle="steps-post")
        ax_batch.plot(tokens, [sched.batch_size(t) for t in tokens], style, label=name,
                      drawstyle="steps-post")
    ax_lr.set_ylabel("learning rate")
    ax_batch.set_ylabel("batch size (sequences)")
    ax_batch.set_xlabel("tokens consumed")
    ax_batch.xaxis.set_major_formatter(token_formatter())
    ax_lr.legend()
    ax_lr.set_title(f"{config.lr_schedule} / {config.batch_policy}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def from_train_config(args: argparse.Namespace) -> dict:
    """The [schedule] fields of ``args.config`` (phase ``args.phase``'s, with [[phases]]); fills the
    budget, sequence length, micro-batch and replicas the flags left unset."""
    from largebatch.arguments import required_config_file
    from largebatch.typed_config import load_toml

    tree = load_toml(required_config_file(args.config))
    run, model, par = (tree.get(name, {}) for name in ("run", "model", "parallel"))
    schedule = dict(tree.get("schedule", {}))
    phases = tree.get("phases") or []
    total, seq_len = run.get("total_tokens", TRAIN_DEFAULTS["run.total_tokens"]), model.get("seq_len")
    micro_batch = run.get("micro_batch", TRAIN_DEFAULTS["run.micro_batch"])
    if phases and args.phase is None:
        raise ValueError(f"--config {args.config}: it has [[phases]] 0..{len(phases) - 1}, each with its own budget "
                         "and schedule; give --phase N")
    if args.phase is not None:
        if not 0 <= args.phase < len(phases):
            have = f"phases 0..{len(phases) - 1}" if phases else "no [[phases]]"
            raise ValueError(f"--phase {args.phase}: {args.config} has {have}; give one of those, or leave "
                             "--phase out")
        phase = phases[args.phase]
        total, seq_len = phase.get("total_tokens", total), phase.get("seq_len", seq_len)
        micro_batch = phase.get("micro_batch") or micro_batch
        schedule.update(phase.get("schedule", {}))
        args.phase_fields = set(phase.get("schedule", {}))  # the phase's own (main checks them)
    if args.total_tokens is None:
        args.total_tokens = token_count(total) if isinstance(total, str) else total
    if args.seq_len is None:
        args.seq_len = seq_len or TRAIN_DEFAULTS["model.seq_len"]
    if args.micro_batch is None:
        args.micro_batch = micro_batch
    if args.dp is None:
        args.dp = par.get("dp") or 1
    return schedule


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        fields = {key.split(".", 1)[1]: value for key, value in config_overrides(args).items()}
        if args.config is not None:
            fields = {**from_train_config(args), **fields}
        elif args.phase is not None:
            raise ValueError(f"--phase {args.phase}: needs --config, a `largebatch train` TOML with [[phases]]")
        missing = [flag for flag, value in (("--run.total_tokens", args.total_tokens),
                                            ("--model.seq_len", args.seq_len)) if value is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} required (or --config CONFIG, a `largebatch train` TOML "
                             "whose budget and sequence length the schedule takes)")
        args.micro_batch, args.dp = args.micro_batch or 1, args.dp or 1
        config = ScheduleConfig.from_dict(fields)
        if args.plot is not None:  # before the work: a plot that cannot be written is known now
            args.plot = os.path.expanduser(args.plot)  # ~/p.png (the shell expands only an unquoted ~ alone)
            check_output_file(args.plot, "--plot", suffixes=PLOT_SUFFIXES)
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError(f"--plot {args.plot!r} needs matplotlib, part of the [train] extra: pip "
                                 "install 'largebatch[train]', or leave --plot out for the table alone")
        text = config.describe(args.total_tokens, args.seq_len, args.micro_batch, args.dp)
        # refused as `largebatch train --check` refuses it; for a phase of [[phases]] (--phase) only the
        # fields its own table or the flags set: it may inherit fields set for another phase's policy
        problem = (config.unread_fields_problem() if args.phase is None else config.unread_fields_problem(
            getattr(args, "phase_fields", set()) | {key.split(".", 1)[1] for key in config_overrides(args)},
            f"phases[{args.phase}].schedule", "phase"))
        if problem is not None:
            raise ValueError(problem)
        if args.plot is not None:  # drawn before the table is printed: `| head` must not lose it
            try:
                plot(config, args.total_tokens, args.seq_len, args.micro_batch, args.dp, args.plot)
            except OSError as exc:  # checked above; a disk that fills meanwhile still gets one line
                raise ValueError(f"--plot {args.plot!r}: could not write it ({exc.strerror or exc}); "
                                 "choose a writable file") from None
            text += f"\nwrote {args.plot}"
        print(text)
    except ValueError as exc:
        print(f"largebatch schedule: error: {exc}", file=sys.stderr)
        return 2
    return 0
