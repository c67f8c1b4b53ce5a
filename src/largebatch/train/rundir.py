"""Run directories on a shared cluster: one run per directory, one command line to start or restart.

* **Start or continue.** ``largebatch train CONFIG --run.out_dir=D`` on a directory that holds
  checkpoints of the same config continues from the newest intact one, so a job scheduler (or
  ``torchrun --max-restarts N``) can relaunch the very same command line. A different config is
  refused with the differing fields named. Fields that do not change the trajectory
  (:data:`RESTART_FIELDS`: the mesh, logging, checkpoint cadence, this invocation's step limit) may
  differ.
* **A lock.** :class:`RunLock` holds an OS lock (``fcntl.flock``) on ``RUN_DIR/.lock`` for the life
  of the run; the kernel releases it when the process dies, however it dies. A second run into a
  locked directory (a second ``--resume``, a run started twice) fails at once naming the holder. On a
  filesystem without file locks the run goes on unlocked, with a warning.
* **Unique default directories.** ``runs/{time}-{kind}`` is claimed with an atomic ``mkdir``; two
  runs started in the same second get ``...-gpt`` and ``...-gpt-2``.
* **Atomic rewrites.** ``largebatch.checkpoint.files.atomic_write_text`` (temporary, fsync, rename)
  for config.toml (and a truncation for the metrics history cut at resume): a kill leaves the old
  file or the new one, never a mix.
* **A run directory that moved.** A run's config.toml names the directory it ran in; after the
  directory is moved or copied, ``--resume NEW`` writes NEW there (:func:`moved_run`), and launching
  the config.toml of a run directory whose ``run.out_dir`` names another directory is refused
  (:func:`check_config_home`): it would continue, and rotate the checkpoints of, the run it was
  copied from.
* **The tokenizer travels with the run.** :func:`keep_tokenizer` writes ``RUN_DIR/tokenizer.json``
  (the one trained on the corpus or read from data.tokenizer_file), which export and finetune read
  first: a deleted data cache or a moved tokenizer file no longer means retraining it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shlex
import socket
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from largebatch.checkpoint.files import atomic_write_text, checkpoint_dir, list_checkpoints
from largebatch.data.corpus import CORPORA
from largebatch.train.config import TrainConfig, out_dir_fields, out_dir_naming, replace_section, run_dir_of
from largebatch.typed_config import ConfigError, from_dict, load_toml, to_dict

LOCK_NAME = ".lock"
SHARED_NAME = ".shared"  # rank 0's note, read back by every rank (lock_run_dir); removed at once
"""How long a rank looks for rank 0's note before it takes the directory as not shared (a network
filesystem may show a new file on another node only after its attribute cache expires, ~3-60 s on
NFS; the note is written with fsync, and opening a file revalidates it)."""
# may differ between the launch that wrote the checkpoints and the one that continues it
RESTART_FIELDS = ("run.max_steps", "run.progress", "run.out_dir", "run.checkpoint_every_tokens",
                  "run.checkpoint_every_seconds", "run.keep_checkpoints", "run.async_checkpoint",
                  "run.tensorboard", "run.wandb",
                  "run.wandb_project", "run.plots", "run.profile_steps", "run.profile_memory",
                  "run.peak_flops", "run.device", "run.log_every_steps", "run.sample_tokens",
                  "run.sample_prompt", "run.eval_micro_batch", "run.ema_decay", "run.time_limit",
                  "run.target_val_loss", "run.stop_at_target",
                  "model.vocab_size", "parallel.",
                  "data.cache_dir",  # the cache is keyed on content: moving it changes no token
                  "model.hf_model_type")  # what the export writes (export --hf-model-type chooses it too)


class RunDirLocked(RuntimeError):
    """Another live process holds the run directory."""


TOKENIZER_NAME = "tokenizer.json"
TIMINGS_NAME = ".timings.json"  # run.time_limit: the longest checkpoint save timed (a stop's own included)


def keep_tokenizer(run_dir: Path, tokenizer, is_main: bool = True, corpus: str | None = None) -> None:
    """Write the run's tokenizer to ``RUN_DIR/tokenizer.json`` (atomically; rank 0 only; unchanged
    files are not rewritten). ``tokenizer`` None (a token array without one): nothing to keep.
    ``corpus``: the setting the data came from, as the error names it (``data.corpus='plays'``,
    ``data.mixture={...}``).

    A run that holds checkpoints keeps the tokenizer they were trained with: when the data now gives
    another vocabulary (a tokenizer trained again on a ``corpus`` whose text changed since the run
    started), ValueError -- on every rank, before anything is written -- instead of replacing the
    run's tokenizer and training on ids that mean other tokens."""
    if tokenizer is None:
        return

    path = Path(run_dir) / TOKENIZER_NAME
    text = tokenizer.to_str()
    if path.is_file() and list_checkpoints(run_dir, kinds=(".pt", ".dcp")):
        from tokenizers import Tokenizer

        try:
            kept = Tokenizer.from_file(str(path)).get_vocab()
        except Exception:  # noqa: BLE001 -- an unreadable copy: nothing to compare, it is rewritten
            kept = None
        if kept is not None and kept != tokenizer.get_vocab():
            where = corpus if corpus is not None else "the data"
            raise ValueError(f"{where} no longer gives the tokenizer this run trained with ({path}): its text "
                             "changed since the checkpoints were written, and they index that tokenizer's "
                             "ids; restore the corpus, or start a new run (another run.out_dir) on the new text")
    if is_main and (not path.is_file() or path.read_text() != text):
        atomic_write_text(path, text)


ORDERED_TABLES = ("data.mixture",)
"""Config tables compared whole, as (key, value) pairs in order: a mixture's corpora are its keys,
and their order is part of the sample order (each corpus's place seeds its own)."""


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" in ORDERED_TABLES:
            out[f"{prefix}{key}"] = list(value.items())
        elif isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing_fields(saved, new, selected: Callable[[str], bool]) -> list[str]:
    """'table.field: saved -> new' for every ``selected`` field that differs between two configs (a
    path field naming one file or directory two ways -- "plays", "./plays", its absolute path, a link
    to it -- does not differ; nor does a mixture whose corpora are so named, in the same order, with
    weights that give the same draws: 3 and 1, 6 and 2; nor a model.separator_id left unset on one
    side, which the trainer fills as it did: the run's tokenizer's)."""
    a, b = _flat(to_dict(saved)), _flat(to_dict(new))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and selected(k) and not _same_path_field(k, a.get(k), b.get(k))
            and not _same_mixture(k, a.get(k), b.get(k)) and not _filled_separator(k, a, b)]


def _filled_separator(key: str, a: dict, b: dict) -> bool:
    """model.separator_id unset on one side on a text corpus: the trainer fills in the tokenizer's
    (the only id its streams allow) and records it, so it is the other side's. (On token arrays an
    unset id is data.tokenizer_file's separator, which may be another: a difference.)"""
    from largebatch.data.corpus import is_token_array_path

    return (key == "model.separator_id" and None in (a.get(key), b.get(key))
            and not any(not c.get("data.mixture") and is_token_array_path(c.get("data.corpus") or "")
                        for c in (a, b)))


def _same_mixture(key: str, a, b) -> bool:
    if key != "data.mixture" or not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return False
    from largebatch.data.sampler import mixture_counts

    same_names = all(x == y or _same_path_field("data.corpus", x, y) for (x, _), (y, _) in zip(a, b))
    return same_names and mixture_counts([w for _, w in a]) == mixture_counts([w for _, w in b])


PATH_FIELDS = ("data.corpus", "data.val_corpus", "data.tokenizer_file")  # a file or directory (or a corpus name)


def _same_path_field(key: str, a, b) -> bool:
    return (key in PATH_FIELDS and isinstance(a, str) and isinstance(b, str)
            and a not in CORPORA and b not in CORPORA and same_directory(a, b))


def among(key: str, fields: tuple[str, ...]) -> bool:
    """Whether a flat config key is one of ``fields`` (a name ending in '.' is a whole table)."""
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in fields)


def config_differences(saved, new) -> list[str]:
    """'table.field: saved -> new' for every field that differs and changes the trajectory."""
    return differing_fields(saved, new, lambda k: not among(k, RESTART_FIELDS))


def same_directory(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one directory or file (through links or two mounts of one disk: by
    inode when both exist)."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.absolute() == b.absolute()


def _concrete(out_dir: str) -> bool:
    """run.out_dir names one directory: it has no {time} ({kind} is the config's own; {{ a brace})."""
    return "time" not in out_dir_fields(out_dir)


def moved_run(cfg: TrainConfig, run_dir: Path, note: Callable[[str], None]) -> TrainConfig:
    """``cfg`` (a ``--resume run_dir``'s) naming ``run_dir`` as its run.out_dir: a run whose
    config.toml names another directory was moved or copied there, and the record follows it."""
    if not _concrete(cfg.run.out_dir) or same_directory(run_dir_of(cfg.run.out_dir, cfg.model.kind), run_dir):
        return cfg
    note(f"note: {run_dir} was moved or copied from run.out_dir = {cfg.run.out_dir!r}; its config.toml "
         f"names {str(Path(run_dir).absolute())!r} from now on")
    return replace_section(cfg, "run", out_dir=out_dir_naming(run_dir))


def check_config_home(config: str | Path | None, cfg: TrainConfig, overrides: dict) -> None:
    """Refuse to launch a run directory's own config.toml when its ``run.out_dir`` names another
    directory (the run was moved or copied, or the file was copied into a run directory): the launch
    would continue, and rotate the checkpoints of, the run in that other directory."""
    if config is None or "run.out_dir" in overrides or not _concrete(cfg.run.out_dir):
        return
    home = Path(config).expanduser().parent
    if Path(config).name != "config.toml" or not (has_checkpoints(home) or (home / "metrics.jsonl").is_file()):
        return
    if not same_directory(run_dir_of(cfg.run.out_dir, cfg.model.kind), home):
        raise ConfigError(f"{config} is the config of the run in {str(home)!r}, but its run.out_dir = "
                          f"{cfg.run.out_dir!r} names another directory (the run was moved or copied): "
                          f"continue it with --resume {shlex.quote(str(home))}, or give --run.out_dir "
                          "for the run this launch writes")


def has_checkpoints(run_dir: Path) -> bool:
    return bool(list_checkpoints(run_dir, kinds=(".pt", ".dcp")))


STOP_NOTE = ".stopped"
"""A run directory's note of a stop by signal under torchrun: {"run_id", "signal", "step"}."""


def note_stop(run_dir: Path, signum: int, step: int) -> None:
    """Note that this torchrun job stopped on ``signum`` after checkpointing (rank 0; outside
    torchrun nothing restarts a process, and nothing is written)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        atomic_write_text(run_dir / STOP_NOTE, json.dumps({"run_id": run_id, "signal": signum, "step": step}))


def stopped_in_this_job(run_dir: Path) -> dict | None:
    """The stop note of THIS torchrun job when torchrun started its workers again after it
    (``--max-restarts``: a worker's exit on a stop signal looks like a failure to torchrun, when
    only the workers were signalled), else None. Such an attempt must not undo the stop: it exits
    again. A later job (a requeue, another torchrun) has another run id or restart count 0, and
    goes on; its first attempt removes the note."""
    path = run_dir / STOP_NOTE
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if restart > 0 and isinstance(note, dict) and note.get("run_id") == os.environ.get("TORCHELASTIC_RUN_ID") \
            and isinstance(note.get("signal"), int):
        return note
    if restart == 0:
        path.unlink(missing_ok=True)
    return None


def finished_run(run_dir: Path, cfg, resumed: bool = False) -> dict | None:
    """The summary.json of a run of ``cfg`` that ``run_dir`` holds finished (written only at a run's
    end; its tokens reach ``cfg``'s budget and its config.toml differs from ``cfg`` in no field that
    changes the trajectory), else None. Read before anything is written or checked for writing, so
    relaunching a finished run changes no file, also on a read-only disk or with its checkpoints
    deleted. ``resumed``: ``cfg`` is the saved config with ``--resume``'s changes, which check_resume
    has allowed; a finished run is then finished whatever they are, since they would apply to no
    step (before, the run trained no step and its config.toml took the changes it never ran with)."""
    summary, saved = run_dir / "summary.json", run_dir / "config.toml"
    try:
        finished = json.loads(summary.read_text())
        same = resumed or not config_differences(from_dict(TrainConfig, load_toml(saved)), cfg)
    except (OSError, ValueError, ConfigError):  # none there, or unreadable: not a finished run of cfg
        return None
    tokens = finished.get("tokens") if isinstance(finished, dict) else None
    ended = isinstance(tokens, int) and tokens >= cfg.run.total_tokens
    # run.stop_at_target: a run that ended at its target is finished while the target is the same
    at_target = (isinstance(finished, dict) and finished.get("stopped_at_target") is True and cfg.run.stop_at_target
                 and finished.get("target_val_loss") == cfg.run.target_val_loss)
    return finished if same and (ended or at_target) else None


def continues_run(run_dir: Path, cfg) -> bool:
    """Whether launching ``cfg`` into ``run_dir`` continues the run there (it holds checkpoints of
    the same config); ConfigError when it holds checkpoints of another config, or a finished run
    (its summary.json) without one (another config or budget: nothing to continue from, and a
    fresh start would overwrite its metrics and leave its summary)."""
    if not has_checkpoints(run_dir):
        if (run_dir / "summary.json").is_file():
            raise ConfigError(f"run.out_dir = {str(run_dir)!r} holds a finished run (summary.json) of another "
                              f"config or a smaller budget, and no checkpoint to continue it from; choose "
                              f"another --run.out_dir")
        return False
    saved_path = run_dir / "config.toml"
    if not saved_path.is_file():
        raise ConfigError(f"run.out_dir = {str(run_dir)!r} holds checkpoints but no config.toml; "
                          f"choose another --run.out_dir")
    # not re-checked against this launch: its mesh may differ (checked for the new config only)
    differences = config_differences(from_dict(TrainConfig, load_toml(saved_path)), cfg)
    if differences:
        raise ConfigError(f"run.out_dir = {str(run_dir)!r} holds checkpoints of another config "
                          f"({'; '.join(differences)}); choose another --run.out_dir, or continue "
                          f"that run with its own config: --resume {shlex.quote(str(run_dir))} (a "
                          "resume takes the config it saved, and refuses changes to what its checkpoints "
                          "depend on)")
    return True


def claim_new_dir(path: str | Path) -> Path:
    """Create ``path`` (or ``path-2``, ``path-3``, ...) atomically; the first that did not exist."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ConfigError(f"run.out_dir = {str(path)!r}: 10000 directories of that name exist; "
                      f"set --run.out_dir")


class RunLock:
    """An exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``, held until :meth:`release` or death.

    On a filesystem without file locks (NFS without its lock service: ENOLCK; Lustre mounted
    without ``flock``, some FUSE filesystems: ENOSYS / EOPNOTSUPP) the directory cannot be locked;
    the run goes on unlocked and :attr:`warning` says so (the caller logs it), rather than no run
    being possible there at all."""

    def __init__(self, run_dir: str | Path, user: str = "run", option: str = "--run.out_dir"):
        """``user``: what holds such a directory (the refusal's words); ``option``: the one that
        chooses another."""
        self._fd: int | None = None  # set first: __del__ runs even when mkdir below fails
        self.warning: str | None = None
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no locks here
                os.close(self._fd)
                self._fd = None
                self.warning = (f"{user} directory {run_dir} is not locked: its filesystem does not "
                                f"support file locks (flock: {exc.strerror or exc}); a second {user} "
                                f"started into it would mix its files with this one's, so start none "
                                f"(or choose an {option} on a filesystem with locks)")
                return
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise RunDirLocked(f"{user} directory {run_dir} is in use by another {user} (pid {holder}, "
                               f"lock {self.path}); wait for it to end, or choose another "
                               f"{option}") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the lock
            self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without finishing (an exception in a library loop)
        try:
            self.release()
        except OSError:  # at interpreter exit after a failure the descriptor can be gone already
            pass


def lock_run_dir(run_dir: Path, par, shared_wait_s: float) -> RunLock | None:
    """Rank 0 locks the run directory; every rank learns whether it could (a collective under
    torchrun), so all ranks of a refused job fail with the same message. Under torchrun every rank
    must also see the directory rank 0 writes (``check_shared``, waiting up to ``shared_wait_s``)."""
    lock, error = None, None
    if par.is_main:
        try:
            lock = RunLock(run_dir)
        except RunDirLocked as exc:
            error = str(exc)
    if par.distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise RunDirLocked(error)
    if par.distributed:
        try:
            check_shared(run_dir, par.is_main, shared_wait_s)
        except ConfigError:
            if lock is not None:
                lock.release()
            raise
    return lock


def check_shared(run_dir: Path, is_main: bool, wait_s: float) -> None:
    """Every rank of the job sees the files rank 0 writes in ``run_dir`` (a collective). Each rank
    writes its checkpoint shards there and reads all of them back, and each decides from the
    directory whether a launch continues the run: on nodes that do not share the directory, rank 0
    wrote checkpoints it reported as good but no process could load (the other ranks' shards lay on
    their own disks), and the next launch hung in mismatched collectives until ``parallel.timeout_s``.
    Rank 0 writes a random note, every other rank reads it back within ``wait_s`` seconds
    (``parallel.shared_fs_wait_s``); ConfigError on every rank, naming the ranks that could not,
    when any could not."""
    box = [secrets.token_hex(16) if is_main else None]
    # the run directory, and checkpoints/ in it, where the shards go (a link or a mount per node there
    # hid each node's shards from the others while the run directory itself was shared)
    notes = [run_dir / SHARED_NAME, checkpoint_dir(run_dir) / SHARED_NAME]
    if is_main:
        notes[1].parent.mkdir(parents=True, exist_ok=True)
        for note in notes:
            atomic_write_text(note, box[0])
    dist.broadcast_object_list(box, src=0)
    seen = [is_main] * len(notes)
    deadline = time.monotonic() + wait_s
    while not all(seen):
        for i, note in enumerate(notes):
            try:
                seen[i] = seen[i] or note.read_text() == box[0]
            except OSError:
                pass
        if all(seen) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if is_main:
        for note in notes:
            note.unlink(missing_ok=True)
    blind = [f"{rank} on {host}" for rank, ((ok, _), host) in enumerate(views) if not ok]
    local = [f"{rank} on {host}" for rank, ((ok, ok_ck), host) in enumerate(views) if ok and not ok_ck]
    if local and not blind:
        raise ConfigError(f"run.out_dir={str(run_dir)!r}: rank{'s' if len(local) > 1 else ''} "
                          f"{', '.join(local)} see the run directory but not the files rank 0 writes in "
                          f"its checkpoints/ (on {views[0][1]}; waited parallel.shared_fs_wait_s = "
                          f"{wait_s:g} s): that directory is node-local (a link "
                          "or a mount per node), where every rank writes its shards and reads all of "
                          f"them back; make {str(checkpoint_dir(run_dir))!r} a directory of the shared "
                          "filesystem")
    if blind:
        raise ConfigError(f"run.out_dir={str(run_dir)!r}: rank{'s' if len(blind) > 1 else ''} "
                          f"{', '.join(blind)} cannot see the files rank 0 writes there (on "
                          f"{views[0][1]}; waited parallel.shared_fs_wait_s = {wait_s:g} s): every rank "
                          "writes its checkpoint shards into the run directory and reads all of them "
                          "back, so it must be on a filesystem all nodes share; set run.out_dir to such "
                          "a path (the same on every node), or raise parallel.shared_fs_wait_s if it is "
                          "one whose caches are slow")
