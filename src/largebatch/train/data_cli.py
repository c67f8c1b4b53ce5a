"""``largebatch data``: a run's tokenized data built ahead of it, and the data cache listed and cleaned.

    largebatch data prepare my.toml                  # the tokenizer and token streams my.toml's run reads
    largebatch data prepare --data.corpus='web/*.jsonl.gz' --data.vocab_size=32768
    largebatch data cache                            # the entries of .cache/largebatch: corpus, size, use
    largebatch data cache --cache-dir /shared/cache --unused-days 30 --dry-run
    largebatch data cache --remove 3f2a9c41d0e8b7a65c12

``prepare`` builds the cache entry a run of the config would build at its start (largebatch.data.build:
the split, the tokenizer trained on the training split, the token streams), in this one process, so a
job on a cluster starts by reading it instead of tokenizing on its nodes' clock; it prints what the run
will read. ``cache`` lists a cache directory's entries -- what each was built from, its tokens and size,
when it was built and last used by a start -- and the leftovers of builds, and removes entries by key or
by disuse (``--unused-days N``: not used by a start for N days). An entry is renamed aside before it is
deleted, so a start never reads half of one; a run that has its streams open keeps reading them.
"""

from __future__ import annotations

import sys
import time

from largebatch.arguments import OneLineParser, finite_float
from largebatch.typed_config import ConfigError, config_overrides


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="largebatch data", description="a run's tokenized data built ahead of it, and "
                           "the data cache listed and cleaned (see docs/data.md, \"Preparing and cleaning the cache\")")
    from largebatch.train.config import TrainConfig
    from largebatch.typed_config import add_config_arguments

    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    prepare = commands.add_parser("prepare", help="build the tokenizer and token streams a run of CONFIG reads",
                                  allow_abbrev=False,
                                  usage="largebatch data prepare [CONFIG] [--TABLE.FIELD VALUE ...]")
    prepare.add_argument("config", nargs="?", help="a TOML file or a shipped config's name (default: gpt-demo); "
                         "--table.field VALUE options override it, as for largebatch train")
    add_config_arguments(prepare, TrainConfig)
    cache = commands.add_parser("cache", help="list the data cache's entries; remove some")
    cache.add_argument("--cache-dir", default=None, help="the cache directory (default: data.cache_dir's "
                       "default, .cache/largebatch under the working directory)")
    cache.add_argument("--remove", nargs="+", metavar="KEY", default=[], help="remove these entries")
    cache.add_argument("--unused-days", type=finite_float, default=None, metavar="N",
                       help="remove the entries no start has used for N days")
    cache.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "cache":
        if unknown:
            return _fail(f"unexpected argument(s) {' '.join(unknown)}", 2)
        return _cache(args)
    try:
        from largebatch.train.cli import _unknown_options

        overrides = {**config_overrides(args), **_unknown_options(prepare, unknown)}
    except ConfigError as exc:
        return _fail(str(exc), 2)
    return _prepare(args.config, overrides)


def _fail(message: str, code: int) -> int:
    print(f"largebatch data: error: {message}", file=sys.stderr)
    return code


def _prepare(config: str | None, overrides: dict) -> int:
    from largebatch.data import build_data
    from largebatch.data.corpus import is_token_array_path
    from largebatch.models import model_spec
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.preflight import check_cache_dir, check_corpora, check_tokenizer_file

    try:
        cfg = load_config(resolve_config(config), overrides)
        check_corpora(cfg)
        check_tokenizer_file(cfg)
        check_cache_dir(cfg)
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc), 2)
    if not cfg.data.mixture and is_token_array_path(cfg.data.corpus):
        print(f"data.corpus={cfg.data.corpus!r} is a token array: a run reads it as it is (no cache entry); "
              "nothing to prepare")
        return 0
    from largebatch.train.phases import resolve_phases

    seq_len = resolve_phases(cfg.phases, cfg.schedule, cfg.model.seq_len, cfg.run.total_tokens,
                             cfg.run.micro_batch)[0].seq_len  # (the entry is the same at any length)
    start = time.perf_counter()
    try:
        data = build_data(cfg.data, seq_len=seq_len, objective=model_spec(cfg.model.kind).objective, log=print)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    stats = data.stats
    how = "already there" if stats.cache_hit else f"built in {time.perf_counter() - start:.1f} s"
    print(f"data cache entry {stats.cache_path}: {how}")
    print(f"data {stats.describe(cfg.run.total_tokens)}")
    return 0


def _cache(args) -> int:
    from pathlib import Path

    from largebatch.data import DataConfig
    from largebatch.data.build import (
        cache_entries,
        cache_leftovers,
        remove_cache_entry,
        remove_dead_staging,
        tree_bytes,
    )
    from largebatch.train.progress import human_bytes, human_count

    root = args.cache_dir or DataConfig().cache_dir
    where = Path(root).expanduser()
    if where.exists() and not where.is_dir():
        return _fail(f"--cache-dir {root}: a file, not a directory: give the data cache's directory "
                     "(data.cache_dir)", 2)
    if not where.is_dir():
        other = "" if args.cache_dir else "; give --cache-dir for another"
        print(f"data cache {root}: no such directory (no entry built there yet{other})")
        return 0 if not (args.remove or args.unused_days is not None) else 2
    entries = cache_entries(root)
    by_key = {entry.path.name: entry for entry in entries}
    args.remove = list(dict.fromkeys(Path(key).name for key in args.remove))  # (KEY/, a path; twice: once)
    unknown = [key for key in args.remove if key not in by_key]
    if unknown:
        return _fail(f"--remove {' '.join(unknown)}: no such entry in {root} (its entries: "
                     f"{', '.join(by_key) or 'none'})", 2)
    if args.unused_days is not None and args.unused_days < 0:
        return _fail(f"--unused-days {args.unused_days:g}: give a number of days >= 0", 2)
    now = time.time()
    print(f"data cache {root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
          f"{human_bytes(sum(e.bytes for e in entries))}")
    for e in entries:
        tokens = sum(e.tokens.values())
        state = f"; DAMAGED ({e.damage}): a start builds it again" if e.damage else ""
        print(f"  {e.path.name}  {human_bytes(e.bytes):>9}  {human_count(tokens) if tokens else '?':>7} tokens  "
              f"built {_date(e.built)}, last used {_days(now - e.used)}  {e.corpus}{state}")
    leftovers = cache_leftovers(root)
    if leftovers:
        print(f"  and {len(leftovers)} leftover(s) of builds under way or killed "
              f"({human_bytes(sum(tree_bytes(p) for p in leftovers))}): a removal takes the dead ones too")
    doomed = [by_key[key] for key in args.remove]
    if args.unused_days is not None:
        doomed += [e for e in entries if now - e.used > args.unused_days * 86400 and e not in doomed]
    if not doomed and not args.remove and args.unused_days is None:
        return 0
    verb = "would remove" if args.dry_run else "removed"
    failed = []
    for e in doomed:
        if not args.dry_run:
            try:
                remove_cache_entry(e.path)
            except OSError as exc:
                failed.append(f"{e.path.name} ({exc.strerror or exc}: {exc.filename or e.path})")
                continue
        print(f"{verb} {e.path.name} ({human_bytes(e.bytes)}, {e.corpus}, last used {_days(now - e.used)})")
    if not args.dry_run:  # the dead leftovers of every key (a live build's staging stays)
        for key in sorted({p.name[1:].split(".")[0] for p in leftovers}):
            for gone in remove_dead_staging(where / key):
                print(f"removed the leftover {gone.name}")
        stuck = [p.name for p in cache_leftovers(root) if ".damaged-" in p.name]
        if stuck:
            failed.append(f"{', '.join(stuck)} in {root}, set aside for removal, could not be deleted")
    if failed:
        return _fail(f"could not remove {'; '.join(failed)}: check the permissions", 1)
    print(f"{verb} {len(doomed)} entr{'y' if len(doomed) == 1 else 'ies'}, {human_bytes(sum(e.bytes for e in doomed))}")
    return 0


def _date(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _days(seconds: float) -> str:
    """Whole days ago, rounded down (as --unused-days counts: "6 days ago" is 6 to 7 days, which
    --unused-days 6 removes)."""
    days = int(max(seconds, 0.0) // 86400)
    return "today" if days < 1 else f"{days} day{'s' if days != 1 else ''} ago"
