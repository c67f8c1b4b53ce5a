"""StopRequest.poll on 2 real gloo ranks: a signal that reached one rank stops both, and the poll's
all-reduce is host traffic -- a CPU flag tensor over the control group -- so it never touches the
training device (here a 'meta' device, where any tensor op of the old device-side poll fails)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch

from largebatch.parallel import ParallelConfig, init_distributed, spawn
from largebatch.train.stopping import StopRequest, control_group


def _poll_worker(out: str) -> None:
    par = init_distributed(ParallelConfig())
    par = replace(par, device=torch.device("meta"))  # a device the poll must never use
    results = {"group_is_default": control_group(par) is None}
    with StopRequest(par) as stop:
        results["quiet"] = list(stop.poll())
        if par.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler: finish the step first
        results["signalled"] = list(stop.poll())
    with StopRequest(par, checkpoint_every_seconds=1e-9 if par.rank == 0 else 0.0) as stop:
        results["due"] = list(stop.poll())  # rank 0's interval elapsed: both checkpoint
    Path(out, f"rank{par.rank}.json").write_text(json.dumps(results))


def test_a_signal_on_one_rank_stops_both_without_touching_the_device(tmp_path):
    spawn(_poll_worker, 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["group_is_default"]  # gloo: the default group is the control group
        assert got["quiet"] == [None, False]
        assert got["signalled"] == [signal.SIGTERM, False]
        assert got["due"] == [None, True]


def test_one_process_polls_without_a_group():
    par = init_distributed(ParallelConfig())
    assert control_group(par) is None
    with StopRequest(par) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.poll() == (signal.SIGINT, False)
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):  # a closed terminal; Slurm's time-limit warning
        with StopRequest(par) as stop:
            os.kill(os.getpid(), sig)
            assert stop.poll() == (sig, False)
        assert signal.getsignal(sig) == signal.SIG_DFL  # given back


def test_an_ignored_signal_stays_ignored():
    """nohup ignores SIGHUP (a shell script's background job, SIGINT): a run must not take it back."""
    par = init_distributed(ParallelConfig())
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopRequest(par) as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.poll() == (None, False)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
