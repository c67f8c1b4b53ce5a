"""Checkpoints across ranks with torch.distributed.checkpoint (DCP), resumable on any mesh.

Layout: ``RUN_DIR/checkpoints/step_00000123.dcp/`` -- DCP's shard files and metadata (model and
optimizer state, each tensor saved once, by the ranks that own its shards) plus ``extra.pt``
(rank 0's picklable state: schedule, noise scale, progress, RNG, config). Because DCP records the
global shape and placement of every shard, a checkpoint written by 2 ranks (FSDP or tensor
parallel) loads onto 1 rank, or onto another mesh, and the optimizer state (DTensors shaped like
the parameters, see largebatch.parallel.norms) is resharded with the parameters (docs/papers.md:
sharding). Under pipeline parallel each rank saves the parameters of its stages under their
one-process names; the optimizer state is flattened to one entry per parameter (torchtitan's
``flatten_optimizer_state_dict``: each stage's hyperparameters are saved with its own parameters,
not once as rank 0's param_groups), so a checkpoint written on pp = 2 loads on pp = 1 or another pp.
A one-process ``.pt`` checkpoint loads onto any mesh too (:func:`load_full_state`): its full tensors
are sharded as the parameters are now, and its optimizer state is matched to the parameters by the
names its groups keep (largebatch.optim.param_groups).

Crash safety, as the single-process checkpoints of largebatch.checkpoint.local: every rank writes
into ``.step_00000123.dcp.tmp/``; after a barrier rank 0 adds ``extra.pt``, fsyncs, and renames the
directory into place (atomic on POSIX); only then are older checkpoints beyond ``keep_last``
removed. A reader never lists temporaries, and a temporary left by a killed save is removed by the
next save (a save that fails on rank 0 for any other reason, e.g. a peer lost mid-save, removes it
at once). A failed write on any rank (a full or read-only disk) fails the save on every rank with
one :class:`~largebatch.checkpoint.local.CheckpointError` naming the checkpoint, the cause and the
checkpoint still intact; the partial temporary is removed.
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from largebatch import LONG_WAIT_GROUP
from largebatch.checkpoint.background import BackgroundWrite, BackgroundWriter, staged
from largebatch.checkpoint.files import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    read_torch_file,
    remove_superseded,
    remove_temporaries,
)
from largebatch.checkpoint.local import CheckpointError, os_error_in, write_failure
from largebatch.parallel.mesh import ParallelState
from largebatch.parallel.parallelize import unwrap

EXTRA = "extra.pt"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _take_saved_tensors(optim_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Where the checkpoint holds a tensor and the template a Python value (a step count saved by a
    ``capturable`` optimizer, loaded into one that keeps ints), a tensor template of the saved shape:
    the optimizer's load_state_dict turns it into its own kind of count."""
    for key, value in optim_state.items():
        meta = saved.get(f"optim.{key}")
        if isinstance(meta, TensorStorageMetadata) and not isinstance(value, torch.Tensor):
            optim_state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)


def list_distributed_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete DCP checkpoints of a run, oldest first."""
    return list_checkpoints(run_dir, kinds=(".dcp",))


def latest_distributed_checkpoint(run_dir: str | Path) -> Path | None:
    return latest_checkpoint(run_dir, kinds=(".dcp",))


def _barrier(state: ParallelState) -> None:
    if state.distributed:
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_distributed(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     extra: dict[str, Any], state: ParallelState, keep_last: int = 2,
                     tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Save model + optimizer (sharded, every rank) and ``extra`` (rank 0) atomically; collective.
    ``tensors``: more entries of tensors by name, saved sharded beside them (``{"ema": {name: DTensor}}``
    is saved as ``ema.NAME``)."""
    final, tmp = _prepare(run_dir, step, state, keep_last)
    try:
        return _save_into(tmp, final, run_dir, model, optimizer, extra, state, keep_last, tensors)
    except CheckpointError:  # a failed write: every rank agreed, and the temporary is gone already
        raise
    except BaseException:  # (a peer lost mid-save: its collectives raise; a signal's exception)
        if state.is_main:  # its partial temporary goes now, not at the next save (a shared disk's space)
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prepare(run_dir: str | Path, step: int, state: ParallelState, keep_last: int) -> tuple[Path, Path]:
    """(the checkpoint of ``step``, its temporary); rank 0 makes the directory and removes the
    temporaries of saves that were killed."""
    if keep_last < 1:
        raise ValueError(f"keep_last = {keep_last}: at least 1 checkpoint must be kept")
    final = checkpoint_path(run_dir, step, ".dcp")
    tmp = final.with_name(f".{final.name}.tmp")
    if state.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_temporaries(final.parent)  # left by saves that were killed
    return final, tmp


def _complete(tmp: Path, final: Path, extra: dict[str, Any], state: ParallelState) -> tuple[int, OSError] | None:
    """Rank 0, every rank's shards written into ``tmp``: the shards checked, ``extra.pt`` added,
    everything fsynced and renamed into place. The failure, if any."""
    failure = _unseen_shards(tmp, state)
    if failure is not None:
        return failure
    try:
        torch.save(extra, tmp / EXTRA)
        _fsync_tree(tmp)
        _put_in_place(tmp, final)
    except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write in RuntimeError
        cause = os_error_in(exc)
        if cause is None:
            raise
        return state.rank, cause
    return None


def _save_into(tmp: Path, final: Path, run_dir: str | Path, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, extra: dict[str, Any], state: ParallelState,
               keep_last: int, tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    _barrier(state)
    model_state, optim_state = get_state_dict(unwrap(model), optimizer, options=FLAT)
    failure: tuple[int, OSError] | None = None
    try:
        dcp.save({"model": model_state, "optim": optim_state, **(tensors or {})}, checkpoint_id=tmp)
    except CheckpointException as exc:  # raised on every rank, with every rank's error
        failure = _write_error(exc)
    _barrier(state)  # every shard is written (or every rank knows it was not)
    if state.is_main and failure is None:
        failure = _complete(tmp, final, extra, state)
    failure = _agree(failure, state)
    if failure is not None:
        if state.is_main:  # the partial shards: a full disk gets its space back
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(state)
        rank, cause = failure
        raise write_failure(final, run_dir, cause, rank if state.distributed else None)
    if state.is_main:
        remove_superseded(run_dir, final, keep_last)
    _barrier(state)
    return final


class DistributedWrite(BackgroundWriter):
    """save_distributed in the background (largebatch.checkpoint.background), as torchtitan's async
    checkpointing: ``start`` (collective) copies every rank's shards to host memory and hands them to
    DCP's ``async_save``, which writes them in a thread, its own collectives on a gloo group of their
    own (the training's collectives go on beside them); when rank 0's write is done, every rank's is
    (DCP's coordinator gathers their results before it writes the metadata), and rank 0's thread puts
    ``extra.pt`` in, fsyncs, renames the checkpoint into place and rotates the old ones, so a
    checkpoint is in place as soon as it is written. ``wait`` (collective; the next ``start`` too)
    agrees on the outcome: a failed write raises its CheckpointError on every rank."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self._write = BackgroundWrite()
        self._group = None
        self._pending: tuple[Path, Path, str | Path] | None = None  # (in flight: its path, temporary, run dir)
        self._failure: tuple[int, OSError] | None = None

    def start(self, run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict[str, Any], keep_last: int = 2,
              tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
        self.wait()
        state = self.state
        if self._group is None and state.distributed:  # (collective: every rank's first save)
            # parallel.timeout_s, kept while a step's shorter parallel.step_timeout_s applies to the
            # training's groups: the write goes on across steps (mesh.set_collective_timeout)
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=state.timeout_s),
                                         group_desc=LONG_WAIT_GROUP)
        final, tmp = _prepare(run_dir, step, state, keep_last)
        _barrier(state)
        model_state, optim_state = get_state_dict(unwrap(model), optimizer, options=FLAT)
        future = dcp.async_save({"model": model_state, "optim": optim_state, **(tensors or {})}, checkpoint_id=tmp,
                                process_group=self._group)  # (the shards are on the host when it returns)
        host_extra = staged(extra) if state.is_main else None

        def finish() -> None:
            self._failure = _finish_async(future, tmp, final, run_dir, host_extra, state, keep_last)

        self._pending = (final, tmp, run_dir)
        self._write.start(finish)
        return final

    def wait(self) -> None:
        if self._pending is None:
            return
        final, tmp, run_dir = self._pending
        self._pending = None
        mine: tuple[int, int | None, str] | None = None  # (rank, errno: None for no disk's error, message)
        try:
            self._write.wait()
        except BaseException as exc:  # noqa: BLE001 -- another error (a lost peer's), on this rank alone maybe
            mine = (self.state.rank, None, f"{type(exc).__name__}: {exc}")
        if mine is None and self._failure is not None:
            rank, cause = self._failure
            mine = (rank, cause.errno, cause.strerror or str(cause))
        self._failure = None
        failure = _first_failure(mine, self.state)  # every rank's view: any of them stops them all
        if failure is not None:
            if self.state.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            # rank 0 may have put the checkpoint in place (its shards all there) before another rank's
            # thread failed on something else: the run stops, and says the checkpoint is good
            in_place = _agree(self.state.is_main and final.is_dir(), self.state)
            _barrier(self.state)
            rank, code, message = failure
            where = rank if self.state.distributed else None
            if in_place:
                raise CheckpointError(f"checkpoint {final} is complete and in place, but the write failed "
                                      f"afterwards on rank {rank}: {message}; see the ranks' messages above for "
                                      f"the cause, and run the same command again (or --resume "
                                      f"{shlex.quote(str(run_dir))})")
            if code is None:  # no disk's error: no disk's advice
                raise write_failure(final, run_dir, OSError(errno.EIO, message), where,
                                    fix="See the ranks' messages above for the cause,")
            raise write_failure(final, run_dir, OSError(code, message), where)

    def close(self) -> tuple[BaseException | None, BaseException | None]:
        """Wait for this rank's write in flight (through stop signals), after a failure elsewhere (no
        collective: the other ranks may be gone); on rank 0 the checkpoint is then in place if it was
        written. (its error, a signal's exception that came meanwhile), returned, not raised."""
        self._pending = None
        error, interrupted = self._write.finish()
        failure, self._failure = self._failure, None
        if error is None and failure is not None:
            error = failure[1]
        return error, interrupted


def _first_failure(failure: tuple[int, int | None, str] | None,
                   state: ParallelState) -> tuple[int, int | None, str] | None:
    """The failure of the lowest failing rank, every rank's view gathered (rank 0 sees DCP's failures
    of every rank; another error may be one rank's alone): the same answer on every rank."""
    if not state.distributed:
        return failure
    views: list = [None] * state.world_size
    dist.all_gather_object(views, failure)
    return min((view for view in views if view is not None), default=None, key=lambda view: view[0])


def _finish_async(future, tmp: Path, final: Path, run_dir: str | Path, extra: dict[str, Any] | None,
                  state: ParallelState, keep_last: int) -> tuple[int, OSError] | None:
    """A background write's end, in its thread: this rank's shards written (DCP's future), then on rank
    0 the checkpoint completed and put in place, or its temporary removed. The failure, if any."""
    failure: tuple[int, OSError] | None = None
    try:
        future.result()
    except CheckpointException as exc:  # raised on every rank, with every rank's error
        failure = _write_error(exc)
    if not state.is_main:
        return failure
    if failure is None:
        failure = _complete(tmp, final, extra, state)
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        remove_superseded(run_dir, final, keep_last)
    return failure


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename the written ``tmp`` to ``final``. A checkpoint of the same step already there (a step
    saved again, e.g. after a resume) is renamed aside first and removed only once the new one is in,
    so a crash never leaves the step with neither: the old one was deleted first (``rmtree``, seconds
    for a large checkpoint) and a kill in between lost it. A kill between the two renames leaves it
    as ``.step_N.dcp.old.tmp``, a temporary the next save removes."""
    if not final.exists():
        os.replace(tmp, final)
        return
    aside = final.with_name(f".{final.name}.old.tmp")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(aside, final)  # the finished one back in place
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _unseen_shards(tmp: Path, state: ParallelState) -> tuple[int, OSError] | None:
    """(0, OSError) when a shard file the checkpoint's .metadata names is missing or short in rank 0's
    view of ``tmp``: every rank reported its write done, so another rank wrote it where rank 0 cannot
    see it (RUN_DIR/checkpoints on a node-local disk: a link or a mount per node). Renamed into
    place, that checkpoint was reported good, could not be loaded, and the next launch of the job hung
    in mismatched collectives until parallel.timeout_s."""
    try:
        metadata = dcp.FileSystemReader(str(tmp)).read_metadata()
    except Exception:  # noqa: BLE001 -- no readable .metadata: reported as a missing file below
        metadata = None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data.values() if metadata is not None else ()):
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    short = [name for name, size in sorted(needed.items())
             if not (tmp / name).is_file() or (tmp / name).stat().st_size < size]
    if metadata is not None and not short:
        return None
    what = ", ".join(short[:3]) + (f" (+{len(short) - 3} more)" if len(short) > 3 else "") if short else ".metadata"
    return state.rank, FileNotFoundError(
        errno.ENOENT, f"the shard files {what} that the other ranks wrote are not in rank 0's view of "
        f"{tmp.parent}: RUN_DIR/checkpoints must be one directory that every node shares, not a "
        "node-local disk (a link or a mount per node)")


def _write_error(exc: CheckpointException) -> tuple[int, OSError]:
    """(rank, OSError) of the first rank whose write failed; other failures are re-raised as
    they are (DCP's exception is a BaseException that no ``except Exception`` would catch)."""
    for rank, (error, _trace) in sorted(exc.failures.items()):
        if (cause := os_error_in(error)) is not None:
            return rank, cause
    raise RuntimeError(str(exc)) from None


def _agree(failure: tuple[int, OSError] | None, state: ParallelState) -> tuple[int, OSError] | None:
    """Rank 0's view of the save after its own writes: every rank raises, or none does."""
    if not state.distributed:
        return failure
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_distributed(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     state: ParallelState, tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Load a DCP checkpoint into ``model`` (and ``optimizer``) as sharded NOW; returns ``extra``.
    ``tensors``: more entries saved beside them (see save_distributed), loaded in place into the
    tensors given; an entry the checkpoint does not hold in full is left as it is and removed from
    ``tensors`` (so what remains there was loaded).

    Works on any mesh, including a single process without torch.distributed (2 ranks -> 1).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        # the run directory it may lie in: a step_N.dcp's, or the one given (or its checkpoints/)
        run = next((d for d in (path.parent.parent, path, path.parent) if (d / "checkpoints").is_dir()),
                   path.parent.parent)
        others = [p.name for p in list_distributed_checkpoints(run) if p != path and (p / ".metadata").is_file()]
        choice = (f"pick one of {others}" if others else f"no complete one is in {run / 'checkpoints'}")
        what = ("a .pt checkpoint: read it with largebatch.checkpoint.load_checkpoint" if path.suffix == ".pt" else
                "a step_N.dcp directory is needed" if path.is_dir() and not path.name.endswith(".dcp") else
                "no .metadata")
        raise FileNotFoundError(f"{path} is not a complete distributed checkpoint ({what}); {choice}")
    try:  # first, so that a damaged .metadata is one line (DCP logs a traceback per fallback)
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 -- unpickling garbage raises about anything
        first = (str(exc).splitlines() or [""])[0]
        raise CheckpointError(f"could not read checkpoint {path}: its .metadata is damaged "
                              f"({type(exc).__name__}{': ' + first if first else ''})") from None
    try:
        with warnings.catch_warnings():  # one process without torch.distributed is a supported load
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return _load(path, model, optimizer, tensors)
    except CheckpointException as exc:  # a BaseException: no ``except Exception`` would see it
        raise CheckpointError(f"could not read checkpoint {path}: {_read_error(exc)}") from None


def _read_error(exc: CheckpointException) -> str:
    """The first failing rank's error in one line (a damaged shard: a truncated or overwritten file
    fails to unpickle)."""
    if not exc.failures:
        return (str(exc).splitlines() or ["unknown error"])[0]
    rank, (error, _trace) = min(exc.failures.items())
    first = (str(error).splitlines() or [""])[0]
    where = f" on rank {rank}" if len(exc.failures) > 1 or rank != 0 else ""
    return f"{type(error).__name__}{': ' + first if first else ''}{where}"


def _load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
          tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    module = unwrap(model)
    more: dict[str, dict[str, torch.Tensor]] = {}
    if tensors:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for entry in list(tensors):
            if tensors[entry] and all(f"{entry}.{name}" in keys for name in tensors[entry]):
                more[entry] = tensors[entry]
            else:
                del tensors[entry]
    if optimizer is None:
        target = {"model": get_model_state_dict(module), **more}
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(module, target["model"])
    else:
        # templates with the current sharding; checkpoints written before the flat layout load too
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        options = FLAT if any(key.startswith("optim.param_groups.") for key in keys) else None
        model_state, optim_state = get_state_dict(module, optimizer, options=options)
        if options is FLAT:
            _take_saved_tensors(optim_state, keys)
        target = {"model": model_state, "optim": optim_state, **more}
        dcp.load(target, checkpoint_id=path)
        set_state_dict(module, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"],
                       options=options)
    try:  # tensors and plain values only (files.read_torch_file)
        return read_torch_file(path / EXTRA)
    except Exception as exc:  # noqa: BLE001 -- a missing or damaged file: unpickling raises about anything
        first = (str(exc).splitlines() or [""])[0]
        raise CheckpointError(f"could not read checkpoint {path}: its {EXTRA} is missing or damaged "
                              f"({type(exc).__name__}{': ' + first if first else ''})") from None


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                    optim_state: dict[str, Any]) -> None:
    """A one-process checkpoint's full model and optimizer state dicts put into ``model`` and
    ``optimizer`` as they are sharded NOW (FSDP, tensor parallel, this rank's pipeline stages): the
    templates DCP would fill (see _load) are filled from the full tensors instead, each rank cutting
    its own shard (no communication), and the optimizer's integer parameter ids are matched to the
    parameter names its groups keep (``names``, largebatch.optim.param_groups)."""
    module = unwrap(model)
    full: dict[str, Any] = {f"model.{key}": value for key, value in model_state.items()}
    for index, group in enumerate(optim_state["param_groups"]):
        names = group.get("names")
        if names is None or len(names) != len(group["params"]):
            raise ValueError(f"the optimizer state's param_groups[{index}] has no parameter names, so it "
                             "cannot be matched to a sharded model: resume it on one process")
        for param_id, name in zip(group["params"], names):
            for key, value in optim_state["state"].get(param_id, {}).items():
                full[f"optim.state.{name}.{key}"] = value
            for key, value in group.items():
                if key != "params":
                    full[f"optim.param_groups.{name}.{key}"] = value
    model_template, optim_template = get_state_dict(module, optimizer, options=FLAT)
    for prefix, template in (("model.", model_template), ("optim.", optim_template)):
        for key, like in template.items():
            if prefix + key not in full:
                raise ValueError(f"the checkpoint has no {key!r} for this model: resume it with the "
                                 "model and optimizer that wrote it")
            template[key] = _shard_like(full[prefix + key], like)
    set_state_dict(module, optimizer, model_state_dict=model_template, optim_state_dict=optim_template,
                   options=FLAT)


def _shard_like(value: Any, like: Any) -> Any:
    """``value`` (a full tensor, or a Python value) placed as ``like`` is: this rank's shard of a
    DTensor, cut locally from the full tensor every rank holds."""
    if not isinstance(value, torch.Tensor) or not isinstance(like, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"a saved tensor of shape {tuple(value.shape)} where the model has {tuple(like.shape)}")
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return value.to(like.device)
