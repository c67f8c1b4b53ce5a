"""Checkpoints written while training goes on (``run.async_checkpoint``), as torchtitan's
``checkpoint.async_mode`` writes them: the state is copied to host memory at the save (the only part
the training loop waits for), and the file is written, fsynced, renamed into place and the old
checkpoints rotated by a background thread, one checkpoint at a time.

What stays as it was: a checkpoint is in place only once complete (the same temporary and rename as
:mod:`.local` and :mod:`.distributed`), so a kill during a background write leaves the previous
checkpoint, and the temporary is removed by the next save. A failed write (a full disk) raises its
:class:`~largebatch.checkpoint.local.CheckpointError` at the next save or at the run's end, whichever
comes first -- on every rank. What changes: a checkpoint is in place (fsynced and renamed, by the
thread) only once its write is done, so a hard kill during the write loses it, and with it the steps
since the one before; a stop by a signal and the end of the run wait for it.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable

import torch


def staged(tree: Any) -> Any:
    """A copy of a state tree (dicts, lists, tuples, tensors, plain values) whose tensors are host
    copies: what a background write can read while the training changes the originals. Each memory
    block (storage) is copied once and the tensors stay views into it as they were -- tied embeddings
    (two names, one storage), an optimizer's moments kept as views of one flat buffer -- so the file
    holds what a synchronous save writes; a state_dict's ``_metadata`` (module versions) is kept."""
    return _staged(tree, {})


def _staged(tree: Any, storages: dict[tuple, torch.UntypedStorage]) -> Any:
    if isinstance(tree, torch.Tensor):
        return _host_view(tree.detach(), storages)
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) is not dict else {}
        for key, value in tree.items():
            out[key] = _staged(value, storages)
        if hasattr(tree, "_metadata"):
            out._metadata = copy.deepcopy(tree._metadata)
        return out
    if isinstance(tree, list):
        return [_staged(value, storages) for value in tree]
    if type(tree) is tuple:
        return tuple(_staged(value, storages) for value in tree)
    return copy.deepcopy(tree)


def _host_view(tensor: torch.Tensor, storages: dict[tuple, torch.UntypedStorage]) -> torch.Tensor:
    """``tensor`` as the same view of a host copy of its storage (copied once per storage)."""
    if tensor.layout != torch.strided or type(tensor) is not torch.Tensor:  # (sparse, subclasses: a plain copy)
        return tensor.to("cpu", copy=True)
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), tensor.device)
    host = storages.get(key)
    if host is None:
        host = torch.UntypedStorage(storage.nbytes())
        host.copy_(storage)
        storages[key] = host
    view = torch.empty(0, dtype=tensor.dtype)
    return view.set_(host, tensor.storage_offset(), tensor.shape, tensor.stride())


class BackgroundWrite:
    """At most one write in flight, in a thread of its own. ``start`` waits for the previous write
    first (raising its error); ``wait`` blocks until the write in flight is done and raises its error,
    once; ``finish`` waits through stop signals (a cluster's SIGTERM while the run is already failing)
    and returns the write's error and the signal's exception instead of raising them. The waits poll
    an event the thread sets when it is done, never ``Thread.join`` alone: a signal's exception raised
    in a join marked a thread still writing as ended, and the interpreter then exited without waiting
    for it, leaving the checkpoint a temporary. The thread is not a daemon: an interpreter that exits
    still finishes the checkpoint it was writing."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.seconds: float | None = None  # the last finished write's own seconds

    def start(self, write: Callable[[], Any]) -> None:
        self.wait()
        done = self._done = threading.Event()

        def run() -> None:
            began = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 -- handed to the training thread by wait()
                self._error = exc
            finally:
                self.seconds = time.perf_counter() - began
                done.set()

        self._thread = threading.Thread(target=run, name="largebatch-checkpoint-write")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            while not self._done.wait(0.5):
                pass
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self) -> tuple[BaseException | None, BaseException | None]:
        """(the write's error, the first signal's exception that arrived while waiting), the write done."""
        interrupted = None
        while self._thread is not None:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001 -- a signal's, or the write's own (returned below)
                if self._thread is not None:  # the wait was interrupted: the write goes on
                    interrupted = interrupted or exc
                    continue
                return exc, interrupted
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 -- the write's error, kept from an earlier wait
            return exc, interrupted
        return None, interrupted

    @property
    def busy(self) -> bool:
        return self._thread is not None and not self._done.is_set()


class BackgroundWriter:
    """What a checkpoint writer that keeps its BackgroundWrite as ``_write`` tells the trainer."""

    _write: BackgroundWrite

    @property
    def seconds(self) -> float | None:
        """The last finished background write's own seconds (None before the first)."""
        return self._write.seconds

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._write.busy
