"""A 2-rank torchrun training job whose rank 1 is SIGKILLed, then resumed, against one process
(tests/parallel_train.py is a minimal loop with a hook to kill a rank at a given step). The trainer
itself under torchrun (dp = 2, tp = 2 + SP, FSDP resumed on one process) is tested in
tests/test_train_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("parallel_train.py")


def launch(out: Path, *args: str, nproc: int) -> subprocess.CompletedProcess:
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([*launcher, str(SCRIPT), str(out), *args], env=env, capture_output=True,
                          text=True, timeout=240)


def run(out: Path, *args: str, nproc: int) -> dict:
    done = launch(out, *args, nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single") / "out.json", nproc=1)


def test_killed_two_rank_run_resumes_and_finishes_like_one_process(tmp_path, single):
    """Rank 1 is SIGKILLed at step 12 (last checkpoint: step 10); torchrun ends the job naming it;
    the resumed 2-rank run finishes with the single-process run's numbers."""
    run_dir = tmp_path / "run"
    killed = launch(tmp_path / "killed.json", "--run-dir", str(run_dir), "--checkpoint-every", "5",
                    "--die-at-step", "12", nproc=2)
    assert killed.returncode != 0 and not (tmp_path / "killed.json").exists()
    assert "rank      : 1" in killed.stderr or "rank: 1" in killed.stderr, killed.stderr[-2000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000005.dcp", "step_00000010.dcp"]  # no temporary left by the crash
    resumed = run(tmp_path / "resumed.json", "--run-dir", str(run_dir), "--resume", nproc=2)
    assert len(resumed["grad_norms"]) == len(single["grad_norms"])
    for mine, theirs in zip(resumed["grad_norms"], single["grad_norms"]):
        assert mine == pytest.approx(theirs, rel=1e-5)
    assert resumed["val_after"] == pytest.approx(single["val_after"], abs=1e-4)
