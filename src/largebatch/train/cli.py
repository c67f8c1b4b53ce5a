"""``largebatch train``: pretrain GPT or BERT.

    largebatch train                               # the default recipe (gpt-demo) on Shakespeare
    largebatch train bert-demo                     # a shipped config by name (see configs/)
    largebatch train my.toml                       # a config file
    largebatch train --optim.name=lans --run.total_tokens=2e6    # any field, from the command line
    largebatch train --resume runs/20261130-101500-gpt           # continue exactly where it stopped
    largebatch train my.toml --run.out_dir=runs/a  # again after a stop: continues runs/a (same config)
    largebatch train --help-config                 # every field, its type, default and meaning
    largebatch train my.toml --check               # check config, run dir, device and memory; exit
    largebatch train --help                        # these options, every field among them

Every field is an option: --table.field=VALUE or --table.field VALUE, VALUE read as in a TOML file
(--optim.betas=[0.9,0.98]); --table.field=none turns a setting off; --phases.N.field sets entry N of
the file's [[phases]]: --phases.1.schedule.peak_lr=3e-3 sets one key of that phase's schedule
overrides and keeps the others, --phases.1.schedule={peak_lr=3e-3} replaces them all.

Every check that needs no data and no model runs before any work starts (largebatch.train.preflight);
a bad value is one line naming the field, the value and the fix, exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from largebatch import TorchTooOld
from largebatch.arguments import TRAIN_EXTRA, OneLineParser, config_file, shipped_configs  # noqa: F401 (shipped_configs: re-exported)
from largebatch.typed_config import (
    ConfigError,
    add_config_arguments,
    config_overrides,
    describe_fields,
    from_dict,
    load_toml,
    parse_overrides,
)

DEFAULT_CONFIG = "gpt-demo"


def resolve_config(name: str | None) -> Path:
    """A path, or the name of a shipped config; None is the default recipe."""
    name = name or DEFAULT_CONFIG
    path = config_file(os.path.expanduser(name))  # ('~/x.toml' quoted: the shell left the ~)
    if path is not None:
        return path
    from largebatch.typed_config import ConfigError

    raise ConfigError(f"config {name!r} is neither a file nor a shipped config; shipped: "
                      f"{', '.join(shipped_configs())}")


def _usage() -> str:
    return (__doc__ or "").strip() + "\n"


def _fail(message: str, code: int) -> int:
    print(f"largebatch train: error: {message}", file=sys.stderr)
    return code


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _launch_time() -> str:
    """A timestamp every rank of a torchrun job agrees on (its run id), else the local time."""
    if _under_torchrun():
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not run_id or run_id == "none":
            raise ConfigError("under torchrun without a run id, ranks cannot agree on '{time}' in "
                              "run.out_dir: set --run.out_dir=runs/NAME explicitly")
        return run_id
    return time.strftime("%Y%m%d-%H%M%S")


def build_parser(train_config: type) -> argparse.ArgumentParser:
    """The command line: a config, --resume, --check, --help-config, and --table.field for every
    field of ``train_config`` (generated from the dataclasses, as --help-config describes them)."""
    parser = OneLineParser(prog="largebatch train", description=__doc__, allow_abbrev=False,
                           usage="largebatch train [CONFIG] [--resume RUN_DIR] [--check] [--help-config] "
                                 "[--TABLE.FIELD VALUE ...]",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help=f"a TOML file or a shipped config's name "
                        f"({', '.join(shipped_configs())}; default {DEFAULT_CONFIG})")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR with its saved config")
    parser.add_argument("--check", action="store_true",
                        help="check config, run dir, device and memory, print the model's layout and "
                             "the schedule, then exit")
    parser.add_argument("--help-config", action="store_true",
                        help="every field with its type, default and meaning, by table")
    add_config_arguments(parser, train_config)
    return parser


def _state_change_first(saved: Path, saved_cfg, overrides: dict, run_dir: str) -> None:
    """check_resume's refusal of ``overrides`` where it has one (the resumed config built without the
    cross-table checks, which a layout change can fail first: an export type that no longer fits a
    model whose layout cannot change anyway); nothing where the overrides cannot even be built."""
    from largebatch.train.config import TrainConfig
    from largebatch.train.preflight import check_resume
    from largebatch.typed_config import set_dotted

    tree = load_toml(saved)
    try:
        for key, value in overrides.items():
            set_dotted(tree, key, value)
        changed = from_dict(TrainConfig, tree)
    except (ConfigError, ValueError, TypeError):
        return
    check_resume(saved_cfg, changed, Path(run_dir))


def _unknown_options(parser: argparse.ArgumentParser, unknown: list[str]) -> dict:
    """What argparse did not declare: --phases.N.field (entries of the file's [[phases]]) and keys
    the config loader refuses by name with a did-you-mean; anything else is refused here."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for i, arg in enumerate(unknown):
        value = i > 0 and unknown[i - 1].startswith("--") and "=" not in unknown[i - 1]  # (--key VALUE)
        if not value and not arg.startswith("-") and os.path.exists(arg):  # the shell expanded a glob pattern
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value (a glob "
                              "pattern is expanded by the shell into several paths unless quoted, e.g. "
                              "--data.corpus 'data/train-*.parquet')")
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and "." not in flag:
            close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown option '{flag}'{hint} (largebatch train --help lists every field)")
    return parse_overrides(unknown)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # imported here so that importing this module stays instant
        from largebatch.train.config import TrainConfig
    except ImportError as exc:  # a missing extra or a broken install, said plainly
        if "-h" in argv or "--help" in argv:
            print(_usage())
            return 0
        if isinstance(exc, TorchTooOld):
            return _fail(str(exc), 2)
        missing = getattr(exc, "name", None) or ""
        if missing.split(".")[0] in TRAIN_EXTRA:
            return _fail(f"the trainer needs {missing.split('.')[0]!r}, part of the [train] extra: "
                         "pip install 'largebatch[train]'", 2)
        return _fail(f"cannot import the trainer: {exc}", 1)
    parser = build_parser(TrainConfig)
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help (0) or a one-line usage error (2)
        return int(exc.code or 0)
    if args.help_config:
        print(f"Every field of a training config, with its built-in default. `largebatch train` "
              f"without a config file starts from the shipped '{DEFAULT_CONFIG}' config, which "
              f"overrides some of these: {shipped_configs()[DEFAULT_CONFIG]}")
        print(describe_fields(TrainConfig))
        return 0

    from largebatch.train.stopping import exit_code, raise_on_signals

    with raise_on_signals():  # a signal during setup raises: cleanups run, the command says so
        try:
            return _launch(args, unknown, parser)
        except KeyboardInterrupt as exc:  # before a run directory was settled (config, preflight)
            signum = getattr(exc, "signum", signal.SIGINT)
            return _fail(f"interrupted before training ({signal.Signals(signum).name}); no run was started",
                         exit_code(signum))


def _launch(args, unknown: list[str], parser) -> int:
    """``main`` once the arguments are parsed: resolve the config and the run directory, check, train."""
    from largebatch.train.config import TrainConfig, load_config, out_dir_fields, run_dir_of
    from largebatch.train.preflight import check_resume, check_run_dir, make_run_dir, preflight, resume_tokenizer
    from largebatch.train.rundir import (
        check_config_home,
        config_differences,
        continues_run,
        finished_run,
        has_checkpoints,
        moved_run,
        stopped_in_this_job,
    )

    def complete(run_dir: Path, cfg, saved=None) -> bool:  # relaunching a finished run is a no-op: says so,
        # writes nothing; ``saved``: the config a --resume read (its changes would apply to no step)
        finished = None if check_only else finished_run(run_dir, cfg, resumed=saved is not None)
        if finished is not None:
            changed = config_differences(saved, cfg) if saved is not None else []
            unapplied = (f"; {'; '.join(changed)} would apply to no step (raise run.total_tokens to train on "
                         "with it)" if changed else "")
            if os.environ.get("RANK", "0") == "0":  # (under torchrun: rank 0's line, not one per rank)
                print(f"{run_dir}: already complete ({finished.get('steps')} steps, "
                      f"{finished['tokens']} tokens); nothing changed{unapplied}")
        return finished is not None

    config_path, resume_dir, check_only = args.config, args.resume, args.check
    cfg = None

    def settle(code: int | None, outcome: str, detail: str = "") -> int | None:
        """Under torchrun, every rank's outcome of these checks before the start (agree_at_start):
        a rank that would train while another exits returns 2 at once, naming it, instead of waiting
        in init_process_group for parallel.timeout_s. ``code``: this rank's own exit code (None: go)."""
        if check_only or not _under_torchrun():
            return code
        from largebatch.parallel.config import ParallelConfig
        from largebatch.parallel.mesh import agree_at_start

        timeout = (cfg.parallel if cfg is not None else ParallelConfig()).timeout_s
        try:
            views = agree_at_start(outcome, detail, timeout)
        except TimeoutError as exc:
            return _fail(str(exc), 1)
        if views is None or outcome == "fail":  # (its own error is printed already)
            return code
        failed = [(rank, why, host) for rank, (kind, why, host) in enumerate(views) if kind == "fail"]
        if failed:
            rank, why, host = failed[0]
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            return _fail(f"rank {rank} on {host}{more} stopped before the start: {why}", 2)
        kinds = {kind for kind, _, _ in views}
        if len(kinds) > 1:
            seen = "; ".join(f"rank {rank} on {host}: {kind}" for rank, (kind, _, host) in enumerate(views))
            return _fail(f"the ranks disagree on what to do with the run directory ({seen}): each decides "
                         "from the directory, so run.out_dir must be on a filesystem every node shares, "
                         "the same path on every node", 2)
        return code

    moved: list[str] = []  # a moved run's note: said once the resume is known to go on
    try:
        overrides = {**config_overrides(args), **_unknown_options(parser, unknown)}
        if resume_dir is not None:
            if config_path is not None:
                return _fail("give either a config file or --resume RUN_DIR, not both "
                             "(a resumed run uses the config saved in its directory)", 2)
            resume_dir = os.path.expanduser(resume_dir)
            saved = Path(resume_dir) / "config.toml"
            if not saved.is_file():
                message = f"--resume {resume_dir}: no config.toml there; is it a run directory?"
                return settle(_fail(message, 2), "fail", message)
            if overrides.get("model.document_mask") is False and "model.separator_id" not in overrides:
                overrides["model.separator_id"] = None  # the separator the run recorded goes with the mask
            saved_cfg = from_dict(TrainConfig, load_toml(saved))
            _leave_fp16(saved_cfg, overrides)
            # max_steps limits one invocation: a resumed run goes to the end unless told again
            try:
                cfg = load_config(saved, {"run.max_steps": None, **overrides}, resolve_init=False, run_dir=resume_dir)
            except ConfigError:  # an override the checkpoints cannot take is said first: the checks of the
                _state_change_first(saved, saved_cfg, overrides, resume_dir)  # new settings would name another fix
                raise
            run_dir, resume = Path(resume_dir), True
            cfg = resume_tokenizer(cfg, run_dir, "data.tokenizer_file" in overrides,
                                   lambda line: print(line, file=sys.stderr))
            check_resume(saved_cfg, cfg, run_dir)
            if complete(run_dir, cfg, saved_cfg):
                return settle(0, "finished")
            check_run_dir(run_dir)
            cfg = moved_run(cfg, run_dir, moved.append)  # (said once the checks below pass)
        else:
            cfg = load_config(resolve_config(config_path), overrides, warn=_note_once)
            check_config_home(config_path, cfg, overrides)
            timed = "time" in out_dir_fields(cfg.run.out_dir)
            stamp = _launch_time() if timed else ""  # (needs a run id under torchrun)
            run_dir = run_dir_of(cfg.run.out_dir, cfg.model.kind, stamp)
            if complete(run_dir, cfg):
                return settle(0, "finished")
            check_run_dir(run_dir)
        # the same command (or the run's own config.toml) again continues a run with checkpoints there:
        # checked as a resume (its tokenizer's size is the run's; init_from's weights are not read again)
        fresh = resume_dir is None and not has_checkpoints(run_dir)
        state = preflight(cfg, distributed=_under_torchrun(), fresh=fresh)
        for line in moved:
            _note_once(line)
        if resume_dir is None:
            if not check_only:  # two runs started in the same second: -2
                run_dir = make_run_dir(run_dir, unique=timed and not _under_torchrun())
            # the same command line starts a run and restarts it (a scheduler, torchrun --max-restarts)
            resume = continues_run(run_dir, cfg)
    except ConfigError as exc:
        return settle(_fail(str(exc), 2), "fail", str(exc))
    note = None if check_only else stopped_in_this_job(run_dir)
    if note is not None:  # torchrun --max-restarts took a stop for a failure: the stop stands
        from largebatch.train.stopping import exit_code

        name = signal.Signals(note["signal"]).name
        if os.environ.get("RANK", "0") == "0":
            print(f"[largebatch] this torchrun job stopped on {name} at step {note['step']} (checkpointed); "
                  f"torchrun started it again (--max-restarts), which would undo the stop: exiting "
                  f"again. Continue with the same command in a new job", file=sys.stderr, flush=True)
        return settle(exit_code(note["signal"]), "stopped")
    if (code := settle(None, "go")) is not None:
        return code
    if check_only:
        from largebatch.train.preflight import estimate_activations
        from largebatch.train.progress import human_bytes, human_count

        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank checks; one reports
            return 0
        activations, assumed = estimate_activations(cfg, state.vocab_size)
        acts = (f"activations at a step's peak ~{human_bytes(activations)} ({assumed}; closed form, "
                "docs/memory.md)" if activations is not None else f"activations not estimated ({assumed})")
        print(f"ok: {run_dir} ({'continues the run there' if resume else 'a new run'}); "
              f"{human_count(state.parameters)} parameters, {human_bytes(state.bytes)} of parameters, "
              f"gradients and {cfg.optim.name} state"
              f"{' and the weight average' if cfg.run.ema_decay is not None else ''} per process"
              + (f" (and {human_bytes(state.step_copy)} more while the optimizer steps: a copy of the parameters "
                 f"and the {cfg.optim.name} state, to take back "
                 f"{'an fp16 overflow' if cfg.run.dtype == 'fp16' else 'a non-finite step'})"
                 if state.step_copy else "") + f", {acts}; "
              f"{human_bytes(state.available)} "
              f"available ({state.source}); `largebatch memory --config FILE` breaks the activations down "
              f"and plans recomputation")
        print(f"model: {cfg.model.kind}, {cfg.model.layout_words()}")
        if activations is not None and state.bytes + max(activations, state.step_copy) > state.available:
            print(f"largebatch train: warning: the state and the predicted activations, "
                  f"{human_bytes(state.bytes + max(activations, state.step_copy))} per process, exceed the "
                  f"{human_bytes(state.available)} available: lower run.micro_batch, set run.recompute "
                  f"(`largebatch memory --config FILE --budget-gib G` plans it), or split the model "
                  f"(parallel.tp, parallel.pp)", file=sys.stderr)
        print(_schedule_tables(cfg, run_dir))
        return 0

    from largebatch.checkpoint import CheckpointError
    from largebatch.checkpoint.local import write_fix
    from largebatch.parallel import RankFailure
    from largebatch.train.loop import NonFiniteLoss, latest_any_checkpoint
    from largebatch.train.rundir import RunDirLocked

    try:
        summary = _run(cfg, run_dir, resume=resume)
    except RankFailure as exc:  # the rank and its error were printed by rank_guard
        return _fail(exc.line, 1)
    except (ConfigError, ValueError, FileNotFoundError, RunDirLocked) as exc:
        return _fail(str(exc), 2)
    except (NonFiniteLoss, CheckpointError) as exc:
        return _fail(str(exc), 1)
    except OSError as exc:  # e.g. the disk filled up between checkpoints (metrics, summary)
        last = latest_any_checkpoint(run_dir)
        kept = f"the newest checkpoint {last} is intact" if last else "no checkpoint was written"
        return _fail(f"could not write {exc.filename or run_dir}: {exc.strerror or exc}; {kept}. "
                     f"{write_fix(exc)} and run the same command again (or --resume {shlex.quote(str(run_dir))})", 1)
    except KeyboardInterrupt as exc:  # a signal during setup or the final plots: no step was lost
        from largebatch.train.stopping import exit_code

        signum = getattr(exc, "signum", signal.SIGINT)
        last = latest_any_checkpoint(run_dir)
        kept = (f"the newest checkpoint {last} is intact (continue with --resume {shlex.quote(str(run_dir))})"
                if last else "no checkpoint was written")
        return _fail(f"interrupted outside the training loop ({signal.Signals(signum).name}); {kept}",
                     exit_code(signum))
    if summary.get("signal"):  # stopped by a signal after a checkpoint (stopping.SIGNALS)
        from largebatch.train.stopping import exit_code

        return exit_code(summary["signal"])
    if not summary.get("stopped_early") and summary.get("is_main", True):
        print(format_summary(summary, run_dir))
    return 0


def _run(cfg, run_dir: Path, resume: bool) -> dict:
    """Train; under torchrun a failing rank is named (rank_guard) and the group is left cleanly."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from largebatch.parallel import rank_guard, shutdown
    from largebatch.train.loop import Trainer

    def run() -> dict:
        trainer = Trainer(cfg, run_dir, resume=resume)
        if not trainer.par.distributed:
            return trainer.fit()
        with rank_guard(trainer.par):
            summary = trainer.fit()
        shutdown(trainer.par)
        return {**summary, "is_main": trainer.is_main}

    if _under_torchrun():
        run = record(run)  # torchrun's error file: its summary names the failing rank and error
    return run()


def _schedule_tables(cfg, run_dir: Path) -> str:
    """Each phase's LR / batch schedule as the run will take it (``largebatch schedule``'s table, at
    this config's budget, micro-batch and replicas -- a continued run's granularity its checkpoints'),
    for ``--check``: `largebatch schedule` reads no config file, and its micro_batch default is 1."""
    from largebatch.parallel.mesh import resolve_sizes
    from largebatch.train.config import batch_replicas
    from largebatch.train.phases import resolve_phases

    _, dp, _ = resolve_sizes(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    granularity = batch_replicas(cfg, dp, run_dir)
    phases = resolve_phases(cfg.phases, cfg.schedule, cfg.model.seq_len, cfg.run.total_tokens,
                            cfg.run.micro_batch, init_from=cfg.model.init_from,
                            rotary=cfg.model.position == "rope")
    return "\n".join((f"phase {p.index}: " if cfg.phases else "")
                     + p.schedule.describe(p.total_tokens, p.seq_len, p.micro_batch, granularity)
                     for p in phases)


def _leave_fp16(saved_cfg, overrides: dict) -> None:
    """``--resume`` of an fp16 run with ``--run.dtype`` fp32 or bf16 (a move to a GPU with bf16, say):
    the fp16 run's own loss-scale settings go with fp16 -- set back to their defaults, with a note
    naming what is dropped -- where the command does not give them itself (a non-fp16 run refuses
    them). The checkpoint's loss scale is not read by the new precision."""
    if saved_cfg.run.dtype != "fp16" or overrides.get("run.dtype", "fp16") == "fp16":
        return
    import dataclasses

    from largebatch.train.config import RunConfig

    defaults = {f"run.{f.name}": f.default for f in dataclasses.fields(RunConfig)
                if f.name in ("loss_scale", "loss_scale_growth_steps")}
    dropped = [f"{name} = {getattr(saved_cfg.run, name[4:]):g}" for name, default in defaults.items()
               if name not in overrides and getattr(saved_cfg.run, name[4:]) != default]
    for name, default in defaults.items():
        overrides.setdefault(name, default)
    if dropped:
        _note_once(f"note: run.dtype = {overrides['run.dtype']!r} (the run trained in fp16): its "
                   f"{' and '.join(dropped)} go with fp16 and are set back to their defaults")


def _note_once(line: str) -> None:
    """A note on stderr, from rank 0 only under torchrun (every rank loads the config)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def _on_these(s: dict, key: str, whole: float) -> str:
    """The baseline on the evaluated tokens, where it differs from the whole split's in 4 digits."""
    value = s.get(key)
    return "" if value is None or f"{value:.4f}" == f"{whole:.4f}" else f" ({value:.4f} on the evaluated tokens)"


def _target_line(s: dict) -> str:
    """The summary's run.target_val_loss line: where the run reached it, or that it did not."""
    from largebatch.train.evaluate import target_reached

    t = s.get("target")
    if t is None:
        return f"target            val loss {s['target_val_loss']} not reached by the end of the run"
    ended = ("" if not s.get("stopped_at_target") else "; the run ended there (run.stop_at_target)"
             if s.get("steps") == t["step"] else f"; the run ended at step {s.get('steps')} (run.stop_at_target)")
    return f"target            {target_reached(s['target_val_loss'], t).removeprefix('target ')}{ended}"


def format_summary(s: dict, run_dir: Path) -> str:
    from largebatch.models.flops import mfu_over_peak
    from largebatch.train.progress import human_bytes, human_count

    lines = [
        "",
        "== summary ==",
        f"validation loss   {s['final_val_loss']:.4f} nats/token (ppl {s['final_val_ppl']:.1f}); "
        f"unigram baseline {s['unigram_val_loss']:.4f}{_on_these(s, 'unigram_eval_loss', s['unigram_val_loss'])}",
        *([f"bits per byte     {s['final_val_bpb']:.4f} of the evaluated validation text's UTF-8 (comparable "
           "across tokenizers; `largebatch perplexity RUN --split val` for the whole split)"]
          if s.get("final_val_bpb") is not None else []),
        *([f"val accuracy      {s['final_val_accuracy']:.4f} of predicted tokens ranked first; unigram "
            f"baseline {s['unigram_val_accuracy']:.4f}"
            f"{_on_these(s, 'unigram_eval_accuracy', s['unigram_val_accuracy'])}"]
          if s.get("final_val_accuracy") is not None else []),
        *([_target_line(s)] if s.get("target_val_loss") is not None else []),
        *([f"weight average    validation loss {s['final_val_loss_ema']:.4f} (run.ema_decay)"
           + ("" if s.get("final_val_bpb_ema") is None else f", bits per byte {s['final_val_bpb_ema']:.4f}")
           + ("" if s.get("final_val_accuracy_ema") is None else f", accuracy {s['final_val_accuracy_ema']:.4f}")]
          if s.get("final_val_loss_ema") is not None else []),
        *(["by corpus         " + ", ".join(
            f"{label} {loss:.4f}" + (f" ({s['final_val_bpb_by_corpus'][label]:.4f} bits/byte)"
                                     if label in (s.get("final_val_bpb_by_corpus") or {}) else "")
            for label, loss in s["final_val_loss_by_corpus"].items())]
          if s.get("final_val_loss_by_corpus") else []),
        f"steps             {s['steps']} optimizer steps, {human_count(s['tokens'])} tokens in "
        f"{s['train_seconds']:.1f} s of steps"
        + (f"; {s['wall_seconds']:.1f} s in all with setup, evaluations and checkpoints "
           f"({s['tokens_per_s_wall']:,.0f} tokens/s)" if s.get("wall_seconds") is not None else ""),
        f"throughput        {s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}% of "
        + (f"each launch's own peak and processes (this launch: {s['world_size']} x "
           f"{s['peak_flops'] / 1e12:.3f} TFLOP/s, {s['peak_flops_source']})" if s.get("peak_varied") else
           f"{s['peak_flops'] / 1e12:.3f} TFLOP/s ({s['peak_flops_source']})"),
        f"memory            {human_bytes(s['memory_bytes'])}",
    ]
    steady = s.get("tokens_per_s_after_first_step")
    if steady is not None and steady > 1.1 * s["tokens_per_s"]:  # a short run, or compilation
        lines.insert(-1, f"                  {steady:,.0f} tokens/s after this launch's first step (its "
                         "warm-up: allocations, and compilation under run.compile)")
    if s["mfu"] > 1:
        warning = mfu_over_peak(s["mfu"], s["peak_flops"], s["peak_flops_source"])
        lines.insert(-1, f"                  warning: {warning}")
    if s.get("noise_scale") is not None:
        lines.append(f"noise scale       B_simple ~ {s['noise_scale']:.0f} sequences")
        final = s.get("final_batch_size") or 0
        if s.get("uncapped_seesaw") and final > s["noise_scale"]:
            lines.append(f"                  note: Seesaw's schedule reached a batch of {final} sequences, "
                         f"{final / s['noise_scale']:.1f}x this estimate of the critical batch; its "
                         "loss-for-loss match with the LR schedule holds below the critical batch "
                         "(docs/schedules.md). schedule.noise_scale_multiple = 1 caps the batch at the "
                         "estimate as the run goes")
    if s.get("skipped_steps"):
        lines.append(f"skipped steps     {s['skipped_steps']} (non-finite loss or gradients)")
    if s.get("loss_scale") is not None:  # fp16
        lines.append(f"loss scale        {s['loss_scale']:g} at the end; {s.get('overflow_steps', 0)} step(s) "
                     "skipped for fp16 overflow")
    if "sample" in s:
        lines += ["sample:", "  " + s["sample"].replace("\n", "\n  ")]
    written = [f"{name}/" if (run_dir / name).is_dir() else name
               for name in ("metrics.jsonl", "loss.png", "schedule.png", "tensorboard", "wandb")
               if (run_dir / name).exists()]
    lines.append(f"run directory     {run_dir}" + (f"  ({', '.join(written)})" if written else ""))
    return "\n".join(lines)
