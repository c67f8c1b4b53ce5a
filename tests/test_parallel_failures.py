"""A failing or stuck rank ends a real 2-rank gloo job with a message naming it; nothing hangs; a
rank that finished exits without the interpreter teardown that can abort it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import parallel_cases as cases
from largebatch.parallel import RankFailure, spawn
from largebatch.parallel.mesh import end_process


def test_failing_rank_is_named_and_the_job_ends():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(cases.fail_on_rank_one, 2)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed first")
    assert "rank 1/2 (dp 1/2, tp 0/1)" in message and "injected failure while loading a batch" in message
    assert time.monotonic() - start < 40  # far below the 60 s collective timeout: no waiting on the dead


def test_a_rank_killed_by_a_native_crash_is_named_and_leaves_its_python_stack(capfd):
    """A spawned rank that dies of a fatal signal raises no Python exception: the parent learns only
    the signal, and names it first although its peer then raised (the peer used to be named as the
    first failure, its "Connection reset by peer" taken for the cause). faulthandler has the rank
    write every thread's Python stack to stderr first."""
    with pytest.raises(RankFailure) as info:
        spawn(cases.abort_on_rank_one, 2)
    message = str(info.value)
    # named first, though rank 0's Python error (its collective losing the peer) is the only one written
    assert message.startswith("rank 1 of 2 exited before finishing: killed by SIGABRT (a native crash"), message
    assert "-- rank 0 raised:" in message and "failed first" not in message, message
    assert info.value.crashes == ((1, "SIGABRT"),)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "abort_on_rank_one" in err, err[-3000:]


def test_the_tests_spawn_again_after_a_native_crash_only(tmp_path):
    """The suite's one retry (tests/processes.py): a spawn whose rank died of a native crash runs once
    more, with a warning, after its clean-up; a Python error is not retried."""
    from processes import spawn_again_after_a_native_crash

    cleared = []
    with pytest.warns(UserWarning, match=r"abort_the_first_time_on_rank_one on 2 ranks: rank 1 of 2 .*SIGABRT"):
        spawn_again_after_a_native_crash(cases.abort_the_first_time_on_rank_one, 2, str(tmp_path),
                                         before_again=lambda: cleared.append(True))
    assert cleared == [True]
    # rank 1 got to the end once, in the second spawn (rank 0 may have finished in the first one too)
    assert (tmp_path / "finished_rank1").read_text() == "x" and (tmp_path / "finished_rank0").read_text() in ("x", "xx")
    # a Python error is the cause, though the rank then died of SIGABRT in its exit: not retried
    with pytest.raises(RankFailure) as info:
        spawn_again_after_a_native_crash(cases.raise_then_abort_on_rank_one, 2, str(tmp_path))
    assert str(info.value).startswith("rank 1 of 2 failed first") and "a Python error, not a crash" in str(info.value)
    assert info.value.crashes == () and (tmp_path / "tries").read_text() == "x"
    # SIGKILL (the out-of-memory killer's): named, no stack to point to, not a crash to retry
    with pytest.raises(RankFailure) as info:
        spawn_again_after_a_native_crash(cases.sigkill_on_rank_one, 2)
    assert str(info.value).startswith("rank 1 of 2 exited before finishing: killed by SIGKILL (from outside")
    assert info.value.crashes == ()


def test_a_save_that_loses_a_peer_removes_its_temporary(tmp_path):
    """A peer lost in the middle of a distributed save: rank 0's save raises and its partial
    temporary is removed at once (it used to stay until the next save, on a shared disk)."""
    import json

    spawn(cases.peer_lost_during_save, 2, str(tmp_path))
    record = json.loads((tmp_path / "save_rank0.json").read_text())
    assert record["outcome"] != "saved", record
    assert record["left"] == [], record


def test_stuck_rank_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(cases.stuck_rank_one, 2)
    message = str(info.value)
    assert "rank 0/2 (dp 0/2, tp 0/1)" in message
    assert "another rank died or is stuck" in message
    assert time.monotonic() - start < 40  # the 3 s timeout fired; rank 1 would sleep 60 s


def test_a_finished_rank_exits_after_its_atexit_handlers_without_the_teardown(tmp_path):
    """gloo's worker threads outlive destroy_process_group (DDP keeps the group alive); one that
    releases the last barrier's work while the interpreter tears down aborts the finished rank
    (SIGABRT). end_process leaves the group, runs the atexit handlers and skips the teardown."""
    spawn(cases.finish_after_ddp, 2, str(tmp_path))
    for rank in (0, 1):
        assert (tmp_path / f"atexit_rank{rank}.txt").read_text() == "False"  # ran, after the group was left
        assert (tmp_path / f"teardown_rank{rank}.txt").read_text() == ""  # the teardown never ran
    # the mark does see a teardown: a plain process that exits normally writes it
    control = tmp_path / "control.txt"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import parallel_cases as c; "
            "from pathlib import Path; c._MARK = c.TeardownMark(Path(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(control)], check=True, timeout=120)
    assert control.read_text() == "teardown"


def test_end_process_is_a_no_op_in_a_process_that_joined_no_group():
    assert end_process(7) == 7  # pytest's own process: the code comes back, the process goes on


def test_a_failing_rank_ends_at_once_without_waiting_for_its_peers():
    """end_process with a non-zero code skips the last barrier: a rank that failed while its peer
    is busy elsewhere (here: asleep, in no collective) exits at once with its code, instead of
    waiting in the barrier for parallel.timeout_s."""
    from largebatch.parallel.launch import free_port
    from processes import src_env

    code = ("import sys, time; from largebatch.parallel import ParallelConfig, init_distributed; "
            "from largebatch.parallel.mesh import end_process; "
            "state = init_distributed(ParallelConfig(dp=2, timeout_s=60)); "
            "end_process(3) if state.rank == 1 else time.sleep(60)")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=src_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port, OMP_NUM_THREADS="1"))
             for r in (0, 1)]
    try:
        assert procs[1].wait(timeout=40) == 3, procs[1].stderr.read()  # rank 0 sleeps 60 s, in no collective
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_only_a_backends_own_errors_count_as_a_peer_failure():
    """rank_guard waits for and names another rank only after a communication backend's error (what
    a peer's death or hang causes); a rank's own error that says "timed out" or "reset by peer" (a
    data loader, an HTTP read) is its own: taken as a peer's, the first failure blamed live ranks."""
    import torch.distributed as dist

    from largebatch.parallel.mesh import collective_failure

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:30942")
    stuck = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                         "30000ms for recv operation to complete")
    wrapped = RuntimeError("checkpoint save failed")
    wrapped.__cause__ = gloo
    assert collective_failure(gloo) and collective_failure(stuck) and collective_failure(wrapped)
    assert collective_failure(dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"))
    for own in (RuntimeError("HTTP read timed out fetching shard"), ConnectionResetError("connection reset by peer"),
                BrokenPipeError("broken pipe"), TimeoutError("DataLoader timed out after 60 seconds")):
        assert not collective_failure(own), own


def test_the_rank_that_came_late_is_told_so_and_ranks_failing_together_are_not():
    """The failure reports in a real TCPStore, as torchrun's agent store holds them: every other rank's
    collective timed out 7-8 s before this one's (they waited for it: stuck in its step, it woke to
    closed connections); it used to read "none of them first: the network". Ranks whose collectives
    fail within milliseconds of each other still read as the network's."""
    import json
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from largebatch.parallel import ParallelState
    from largebatch.parallel.mesh import _first_failure

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))
    now = time.time()
    for attempt, ago in (("late", (7.0, 8.0, 7.5)), ("together", (0.002, 0.001, 0.003))):
        box = dist.PrefixStore(attempt, store)
        for rank, seconds in zip((0, 1, 3), ago):
            box.set(str(rank), json.dumps({"who": f"rank {rank}/4", "text": "Timed out", "peer": True,
                                           "time": now - seconds}))
        line = _first_failure(box, ParallelState(rank=2, world_size=4), 0.5, failed_at=now)
        if attempt == "late":
            assert line.startswith("(this rank came late") and "7-8 s before its own" in line, line
        else:
            assert "none of them first: the network" in line, line
    # pp 2 x dp 2 (stages {0, 1} and {2, 3}): rank 0's dp partner 1 is stuck; 2 and 3, the other stage,
    # wait in a receive and have not reported yet. The line named all three as killed or stuck
    line = _first_failure(dist.PrefixStore("pipeline", store), ParallelState(rank=0, world_size=4, pp_size=2),
                          0.2, failed_at=now)
    assert "ranks 1, 2, 3 of 4 reported no error" in line, line
    assert "; 2, 3 of another pipeline stage may only be waiting on a transfer" in line, line
