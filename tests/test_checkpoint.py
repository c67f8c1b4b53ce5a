"""Checkpoints are atomic: a kill mid-save or a full disk never loses the previous checkpoint."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from largebatch.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _state(n, fill):
    return {"w": torch.full((n,), float(fill)), "step": fill}


def test_save_load_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _state(10, step), keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000003.pt", "step_00000004.pt"]
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 4 and torch.equal(state["w"], torch.full((10,), 4.0))


def test_a_save_below_a_later_checkpoint_keeps_itself_and_ends_the_later_ones(tmp_path):
    """A run resumed from step 3 (its newer checkpoints damaged) saves step 4: the later ones, of
    either format, are of a trajectory it left and go; retention then counts from step 4."""
    from largebatch.checkpoint.files import checkpoint_dir, superseded

    for step in (2, 3, 5):
        save_checkpoint(tmp_path, step, _state(4, step), keep_last=5)
    (checkpoint_dir(tmp_path) / "step_00000006.pt").write_bytes(b"cut short")
    (checkpoint_dir(tmp_path) / "step_00000007.dcp").mkdir()  # a torchrun save of the left trajectory
    assert [p.name for p in superseded(tmp_path, checkpoint_dir(tmp_path) / "step_00000004.pt", 2)] == [
        "step_00000005.pt", "step_00000006.pt", "step_00000007.dcp"]  # 4 not written yet: 2, 3 kept
    save_checkpoint(tmp_path, 4, _state(4, 4), keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path, (".pt", ".dcp"))] == ["step_00000004.pt"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 4


def test_kill_during_save_keeps_previous(tmp_path):
    save_checkpoint(tmp_path, 1, _state(10, 1))
    # a real process, killed with SIGKILL while it writes a large checkpoint
    script = textwrap.dedent(f"""
        import torch, sys
        from largebatch.checkpoint import save_checkpoint
        print("saving", flush=True)
        save_checkpoint({str(tmp_path)!r}, 2, {{"w": torch.randn(150_000_000)}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    tmp = tmp_path / "checkpoints" / ".step_00000002.pt.tmp"
    deadline = time.time() + 60
    while not (tmp.exists() and tmp.stat().st_size > 0) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp.exists(), "the kill should have landed mid-write"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1
    save_checkpoint(tmp_path, 3, _state(10, 3))  # the next save clears the stale temporary
    assert not tmp.exists()


def test_full_disk_error_keeps_previous(tmp_path):
    save_checkpoint(tmp_path, 1, _state(10, 1))
    # RLIMIT_FSIZE makes the kernel refuse writes past 1 MB (EFBIG), as a full disk would (ENOSPC)
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from largebatch.checkpoint import save_checkpoint, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            save_checkpoint({str(tmp_path)!r}, 2, {{"w": torch.randn(1_000_000)}})
        except CheckpointError as exc:
            print("ERROR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ERROR could not write checkpoint" in out.stdout, out.stdout + out.stderr
    assert "step_00000001.pt is intact" in out.stdout
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoints" / "step_00000001.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="could not read checkpoint"):
        load_checkpoint(path)


def test_single_process_save_clears_a_killed_distributed_save(tmp_path):
    """A torchrun save killed mid-way leaves `.step_N.dcp.tmp/`, a directory; a run resumed in one
    process must clear it and save (a file-only cleanup failed on it, breaking every later save)."""
    stale = tmp_path / "checkpoints" / ".step_00000005.dcp.tmp"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"half a shard")
    (tmp_path / "checkpoints" / ".step_00000004.pt.tmp").write_bytes(b"half a file")
    save_checkpoint(tmp_path, 6, _state(10, 6))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000006.pt"]


def test_rng_state_round_trips_numpy_in_both_of_its_forms():
    """NumPy's state is saved as plain fields (weights_only loads it); the tuple older checkpoints
    hold is still accepted. Either way the next draws equal the ones after the save."""
    import random

    import numpy as np

    from largebatch.checkpoint.rng import rng_state, set_rng_state

    np.random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in the state
    saved, legacy = rng_state(torch.device("cpu")), np.random.get_state()
    expected = (np.random.standard_normal(5), np.random.randint(0, 1000, 5), random.random())
    for state in (saved, {**saved, "numpy": legacy}):
        set_rng_state(state, torch.device("cpu"))
        got = (np.random.standard_normal(5), np.random.randint(0, 1000, 5), random.random())
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
    assert isinstance(saved["numpy"], dict) and saved["numpy"]["keys"].dtype == torch.int64


def test_a_sharded_checkpoint_whose_shards_rank_0_cannot_see_is_not_put_in_place(tmp_path):
    """Every rank reports its DCP shard written, but a node-local checkpoints/ (a link or a mount per
    node) holds it where rank 0 cannot see it: rank 0 renamed such a checkpoint into place, reported
    it good, and no process could load it. Rank 0 now checks the files .metadata names (present, as
    long as the byte ranges it lists) before the rename; a save with one missing or cut short fails
    with the fix."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from largebatch.checkpoint.distributed import _unseen_shards
    from largebatch.checkpoint.local import write_failure
    from largebatch.parallel.mesh import ParallelState

    tmp = tmp_path / "checkpoints" / ".step_00000004.dcp.tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DCP in one process says it assumes one)
        dcp.save({"model": {"w": torch.randn(64, 64)}, "optim": {"m": torch.randn(64)}}, checkpoint_id=tmp)
    assert _unseen_shards(tmp, ParallelState()) is None
    shard = next(tmp.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # a shard cut short
    rank, cause = _unseen_shards(tmp, ParallelState())
    assert rank == 0 and shard.name in cause.strerror and "node-local disk" in cause.strerror
    shard.unlink()  # and one that is not there at all
    rank, cause = _unseen_shards(tmp, ParallelState())
    message = str(write_failure(tmp_path / "checkpoints" / "step_00000004.dcp", tmp_path, cause, rank))
    assert f"the shard files {shard.name} that the other ranks wrote are not in rank 0's view" in message
    assert "Keep RUN_DIR/checkpoints on a filesystem every rank shares" in message and "(rank 0)" in message
    (tmp / ".metadata").unlink()
    assert ".metadata" in _unseen_shards(tmp, ParallelState())[1].strerror


def test_retention_counts_both_formats_and_never_the_checkpoint_just_written(tmp_path):
    """A run continued from torchrun (.dcp) on one process (.pt) kept keep_last of each format (after
    an elastic shrink: step_10.dcp, step_20.dcp, step_190.pt, step_196.pt with keep 2); the newest
    keep_last of both are kept now, and a save of a step another format also holds keeps itself."""
    from largebatch.checkpoint.files import checkpoint_dir, superseded

    ckdir = checkpoint_dir(tmp_path)
    for step in (10, 20):
        (ckdir / f"step_{step:08d}.dcp").mkdir(parents=True)
    for step in (190, 196):
        save_checkpoint(tmp_path, step, _state(4, step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path, (".pt", ".dcp"))] == ["step_00000190.pt", "step_00000196.pt"]
    (ckdir / "step_00000196.dcp").mkdir()  # the same step in the other format, listed before the .pt
    assert superseded(tmp_path, ckdir / "step_00000196.dcp", 1) == [ckdir / "step_00000190.pt",
                                                                   ckdir / "step_00000196.pt"]
    assert superseded(tmp_path, ckdir / "step_00000196.pt", 2) == [ckdir / "step_00000190.pt"]


def test_a_one_process_checkpoint_tells_the_replicas_its_batches_were_built_for(tmp_path):
    """A run that went from 2 ranks to one process keeps the 2 ranks' batches (multiples of
    micro_batch x 2), and its .pt says so in its schedule; checkpoint_dp_size took every .pt for 1,
    so the next launch on 2 ranks built its schedule for 1 replica and its resume was refused
    ("checkpoint schedule has dp_size=2 but this one has dp_size=1"), and a one-process --check
    printed batches for 1 replica where the run took the 2 ranks' (batch_replicas returned 1 at once
    for one process)."""
    from largebatch.checkpoint import checkpoint_dp_size, save_checkpoint
    from largebatch.train.config import batch_replicas, load_config

    run_dir = tmp_path / "run"
    state = {"model": {"w": torch.zeros(3)}, "schedule": {"config": {"dp_size": 2}}}
    save_checkpoint(run_dir, 7, state)
    assert checkpoint_dp_size(run_dir) == 2
    cfg = load_config(overrides={"run.out_dir": str(run_dir)})
    assert batch_replicas(cfg, 1, run_dir) == 2 and batch_replicas(cfg, 1) == 2
    save_checkpoint(run_dir, 8, {**state, "schedule": {"config": {"dp_size": 1}}})
    assert checkpoint_dp_size(run_dir) == 1 and batch_replicas(cfg, 2, run_dir) == 1
    assert batch_replicas(cfg, 2, tmp_path / "empty") == 2  # a new run: this launch's ranks


def test_a_step_saved_again_keeps_the_finished_one_until_the_new_one_is_in(tmp_path, monkeypatch):
    """A DCP checkpoint of a step that is already there (saved again after a resume) replaced it by
    deleting it first, then renaming the new one in: a crash in between lost a finished checkpoint.
    Now the old one is renamed aside and removed only after; a rename that fails puts it back."""
    import warnings

    from largebatch.checkpoint import CheckpointError
    from largebatch.checkpoint.distributed import load_distributed, save_distributed
    from largebatch.parallel.mesh import ParallelState

    def saved(value: float) -> Path:
        model = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(model.weight, value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (DCP in one process says it assumes one)
            return save_distributed(tmp_path, 5, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    {"value": value}, ParallelState())

    def weight(path: Path) -> float:
        model = torch.nn.Linear(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_distributed(path, model, None, ParallelState())
        return float(model.weight[0, 0])

    final = saved(1.0)
    rename = os.replace

    def failing(src, dst):  # the new checkpoint's rename into place fails (the old one aside)
        if str(src).endswith(".dcp.tmp") and not str(src).endswith(".old.tmp"):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError, match="could not write checkpoint .*step_00000005.dcp: Input/output error"):
        saved(2.0)
    monkeypatch.setattr(os, "replace", rename)
    assert weight(final) == 1.0  # the finished one, back in place
    assert saved(3.0) == final and weight(final) == 3.0
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_00000005.dcp"]  # nothing aside left


class _RunsAShellCommand:
    """What a crafted checkpoint can carry: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_not_unpickled_and_an_earlier_versions_numpy_state_still_loads(tmp_path):
    """Every checkpoint read (resume, --check's replica count, export, a .dcp's extra.pt) used
    weights_only=False, so a .pt planted in a run directory ran its code on `largebatch train --resume
    RUN --check`, where plain torch.load refuses it. They read with weights_only=True now; an earlier
    version's NumPy random-state tuple (an array) still loads."""
    import pickle

    import numpy as np

    from largebatch.checkpoint import load_checkpoint
    from largebatch.checkpoint.files import checkpoint_dp_size, read_torch_file
    from largebatch.checkpoint.local import CheckpointError

    marker = tmp_path / "ran"
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_00000002.dcp").mkdir(parents=True)
    crafted = {"schedule": {"config": {"dp_size": 1}}, "payload": _RunsAShellCommand(marker)}
    torch.save(crafted, ckpts / "step_00000001.pt")
    torch.save(crafted, ckpts / "step_00000002.dcp" / "extra.pt")
    with pytest.raises(CheckpointError, match=r"holds more than tensors and plain values \(.*GLOBAL posix.system"):
        load_checkpoint(ckpts / "step_00000001.pt")
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.system"):
        read_torch_file(ckpts / "step_00000002.dcp" / "extra.pt")
    assert checkpoint_dp_size(tmp_path / "run") is None  # (the resume then says why)
    assert not marker.exists()
    np.random.seed(4)
    legacy = {"rng": {"numpy": np.random.get_state()}, "model": {"w": torch.ones(3)}}
    torch.save(legacy, tmp_path / "legacy.pt")
    loaded = load_checkpoint(tmp_path / "legacy.pt")["rng"]["numpy"]
    assert loaded[0] == "MT19937" and np.array_equal(loaded[1], legacy["rng"]["numpy"][1])


def test_load_distributed_given_a_run_directory_names_its_complete_checkpoint(tmp_path):
    """Given the run directory or its checkpoints/ instead of a step_N.dcp, the error said no complete
    checkpoint existed (it looked two levels up from the path given) though one did."""
    import torch.distributed.checkpoint as dcp

    from largebatch.checkpoint.distributed import load_distributed
    from largebatch.parallel.mesh import ParallelState

    model = torch.nn.Linear(3, 2)
    step = tmp_path / "run" / "checkpoints" / "step_00000005.dcp"
    with pytest.warns(UserWarning, match="save in a single process"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=step)
    assert (step / ".metadata").is_file()
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        expected = rf"a step_N.dcp directory is needed\); pick one of \['{step.name}'\]"
        with pytest.raises(FileNotFoundError, match=expected):
            load_distributed(given, model, None, ParallelState())


def test_a_checkpoint_written_under_numpy_1_names_its_array_globals_as_numpy_1_did(tmp_path):
    """NumPy 1 pickles an array through numpy.core.multiarray._reconstruct, NumPy 2 through
    numpy._core's: a checkpoint's older RNG tuple must load under weights_only whichever wrote it."""
    import zipfile

    import numpy as np

    from largebatch.checkpoint.files import read_torch_file

    keys = np.random.RandomState(5).get_state()[1]
    torch.save({"rng": {"numpy": ("MT19937", keys, 3, 0, 0.0)}}, tmp_path / "now.pt")
    with zipfile.ZipFile(tmp_path / "now.pt") as z:
        files = {name: z.read(name) for name in z.namelist()}
    pickled = next(name for name in files if name.endswith("data.pkl"))
    for written, other in ((b"numpy._core.multiarray", b"numpy.core.multiarray"),
                           (b"numpy.core.multiarray", b"numpy._core.multiarray")):
        if written in files[pickled]:
            files[pickled] = files[pickled].replace(written, other)
            break
    else:
        raise AssertionError("no NumPy array global in the pickle")
    with zipfile.ZipFile(tmp_path / "other.pt", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    for name in ("now.pt", "other.pt"):
        assert np.array_equal(read_torch_file(tmp_path / name)["rng"]["numpy"][1], keys)
    # a caller's own safe globals stay (leaving torch's context removed every global it listed)
    torch.serialization.add_safe_globals([np.ndarray])
    try:
        read_torch_file(tmp_path / "now.pt")
        assert np.ndarray in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()


def test_a_background_write_holds_the_state_of_its_start_laid_out_as_a_synchronous_one(tmp_path):
    """run.async_checkpoint: LocalWrite copies the state to host memory at ``start`` and writes it in a
    thread. The training then changes the tensors in place (as an optimizer step does): the file holds
    the values of the start, and loads as the synchronous save of that state does -- tied tensors one
    storage, moments kept as views of one flat buffer still views of one -- into the same bytes of state."""
    from largebatch.checkpoint.background import staged
    from largebatch.checkpoint.local import LocalWrite

    flat = torch.arange(12, dtype=torch.float32)
    weight = torch.randn(4, 3)
    state = {"step": 5, "model": {"emb": weight, "head": weight.view(4, 3), "bias": torch.zeros(3)},
             "optimizer": {"state": {0: {"exp_avg": flat[:6].view(2, 3), "exp_avg_sq": flat[6:]},
                                     1: {"step": torch.tensor(5.0)}},
                           "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
             "rng": (torch.get_rng_state(), [1, 2])}
    before = staged(state)
    writes = LocalWrite()
    path = writes.start(tmp_path / "async", 5, state)
    flat.add_(100.0)  # the training goes on while the file is written
    weight.mul_(-1.0)
    state["model"]["bias"].fill_(7.0)
    writes.wait()
    assert path == tmp_path / "async" / "checkpoints" / "step_00000005.pt" and path.is_file()
    save_checkpoint(tmp_path / "sync", 5, before)
    got, want = load_checkpoint(path), load_checkpoint(tmp_path / "sync" / "checkpoints" / "step_00000005.pt")
    assert torch.equal(got["model"]["emb"], want["model"]["emb"]) and not torch.equal(got["model"]["emb"], weight)
    assert got["model"]["emb"].untyped_storage().data_ptr() == got["model"]["head"].untyped_storage().data_ptr()
    moments = got["optimizer"]["state"][0]
    assert moments["exp_avg"].untyped_storage().data_ptr() == moments["exp_avg_sq"].untyped_storage().data_ptr()
    assert torch.equal(moments["exp_avg"].flatten(), torch.arange(6, dtype=torch.float32))
    assert torch.equal(moments["exp_avg_sq"], torch.arange(6, 12, dtype=torch.float32))
    assert torch.equal(got["model"]["bias"], torch.zeros(3))
    assert torch.equal(got["rng"][0], want["rng"][0]) and got["rng"][1] == [1, 2]
    assert got["step"] == 5 and got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert path.stat().st_size == (tmp_path / "sync" / "checkpoints" / "step_00000005.pt").stat().st_size


def test_a_background_write_that_fails_raises_at_the_next_save_and_keeps_the_previous(tmp_path):
    """A write that fails in the background (a file-size limit: the kernel refuses it as a full disk
    would) is not lost: the next save (or the run's end) raises its CheckpointError, naming the
    checkpoint still intact, and the partial temporary is gone."""
    save_checkpoint(tmp_path, 1, _state(10, 1))
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from largebatch.checkpoint import CheckpointError
        from largebatch.checkpoint.local import LocalWrite
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        writes = LocalWrite()
        writes.start({str(tmp_path)!r}, 2, {{"w": torch.randn(1_000_000)}})
        print("started", flush=True)
        try:
            writes.start({str(tmp_path)!r}, 3, {{"w": torch.randn(10)}})
        except CheckpointError as exc:
            print("ERROR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("started\nERROR could not write checkpoint"), out.stdout + out.stderr
    assert "step_00000002.pt" in out.stdout and "step_00000001.pt is intact" in out.stdout
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


def test_the_background_checkpoint_benchmark_runs(tmp_path):
    """benchmarks/checkpoint_async.py on the demo GPT, one round: it saves both ways and says how long
    the loop was held (the numbers are the benchmark's to report, not this test's)."""
    script = Path(__file__).parents[1] / "benchmarks" / "checkpoint_async.py"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script), "--preset", "demo", "--rounds", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "median: the loop held" in out.stdout and "by a sync one" in out.stdout, out.stdout
    assert [p.name for p in list_checkpoints(tmp_path / "sync")] == ["step_00000000.pt"]
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == ["step_00000000.pt"]


def test_a_signal_while_a_failing_run_waits_for_its_background_write_lets_the_write_finish(tmp_path):
    """A run that fails (a non-finite loss) waits for the checkpoint it is writing in the background;
    a SIGTERM or Ctrl-C then (its exception raised where the main thread waits) was taken for the
    write's own failure ("failed too: SIGTERM"), and Python marked the thread, still writing, as ended:
    the process exited with the checkpoint a temporary. Now the wait goes on through the signal, the
    checkpoint is in place, and the signal is handed back for the caller to raise."""
    script = textwrap.dedent(f"""
        import os, signal, time, torch
        from largebatch.checkpoint.local import LocalWrite
        real_fsync = os.fsync
        os.fsync = lambda fd: (time.sleep(1.5), real_fsync(fd))  # a slow disk
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)  # as raise_on_signals does outside the loop
        writes = LocalWrite()
        writes.start({str(tmp_path)!r}, 1, {{"x": torch.arange(1000.0)}})
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # while close() waits
        error, interrupted = writes.close()
        print("closed", repr(error), type(interrupted).__name__, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "closed None KeyboardInterrupt", out.stdout + out.stderr
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert torch.equal(load_checkpoint(list_checkpoints(tmp_path)[0])["x"], torch.arange(1000.0))
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


BACKGROUND_AGREEMENT = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, case, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import largebatch.checkpoint.distributed as distributed
    from largebatch.checkpoint.local import CheckpointError
    from largebatch.parallel.mesh import ParallelState
    state = ParallelState(rank=rank, world_size=2, mesh=object(), timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    finish = distributed._finish_async
    if case == "rank1" and rank == 1:  # an error of one rank's thread alone, after its shards are written
        def failing(*args, **kwargs):
            finish(*args, **kwargs)
            raise RuntimeError("a gloo error seen on rank 1 only")
        distributed._finish_async = failing
    if case == "rank0" and rank == 0:  # a lost peer's error, no disk's
        def failing(*args, **kwargs):
            raise RuntimeError("Connection closed by peer")
        distributed._finish_async = failing
    writes = distributed.DistributedWrite(state)
    writes.start(root, 1, model, optimizer, {"step": 1})
    dist.all_reduce(torch.ones(1))  # the training's collectives meanwhile
    try:
        writes.wait()
        said = "ok"
    except CheckpointError as exc:
        said = str(exc)
    with open(os.path.join(root, f"rank{rank}.txt"), "w") as file:  # (one pipe for both: lines interleave)
        file.write(said)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3]), nprocs=2)
"""


def test_a_background_write_failing_on_one_rank_stops_every_rank_with_its_cause(tmp_path):
    """run.async_checkpoint under torchrun: an error of one rank's write thread that is not DCP's (which
    every rank sees) was kept by that rank alone, and rank 0's view ("all well") was broadcast over it:
    no rank raised. Every rank's view is gathered now, and every rank raises the lowest failing rank's
    error; one that is no disk's is not given a disk's advice ("Free disk space"), and one that came
    after rank 0 had put a complete checkpoint in place says so (it said "could not write" it)."""
    import socket

    script = tmp_path / "agree.py"
    script.write_text(BACKGROUND_AGREEMENT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"), OMP_NUM_THREADS="1")
    for case, cause, rank in (("rank1", "RuntimeError: a gloo error seen on rank 1 only", 1),
                              ("rank0", "RuntimeError: Connection closed by peer", 0)):
        for attempt in range(3):  # a free port found here can be taken by another test's processes first
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            root = tmp_path / f"{case}-{attempt}"
            out = subprocess.run([sys.executable, str(script), case, str(port), str(root)], capture_output=True,
                                 text=True, timeout=180, env=env)
            said = [root / f"rank{k}.txt" for k in (0, 1)]
            if all(path.exists() for path in said):  # (what the ranks said is the test, not how they exit)
                break
        assert all(path.exists() for path in said), out.stdout + out.stderr[-3000:]
        lines = [path.read_text() for path in said]
        final = root / "checkpoints" / "step_00000001.dcp"
        for line in lines:
            if case == "rank1":  # rank 0 had put it in place, every shard there: said, not "could not write"
                assert (f"checkpoint {final} is complete and in place, but the write failed afterwards on rank 1: "
                        f"{cause}" in line and "Free disk space" not in line), line
            else:
                assert (f"could not write checkpoint {final}: {cause} (rank {rank})" in line
                        and "See the ranks' messages above" in line and "Free disk space" not in line), line
        assert final.is_dir() == (case == "rank1")
        assert not list((root / "checkpoints").glob(".*.tmp"))
