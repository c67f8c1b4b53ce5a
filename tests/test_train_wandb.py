"""run.wandb: the trainer's records in a real Weights & Biases run (offline, read back from the file
``wandb sync`` would upload), across a SIGTERM sent to the whole process group as a cluster sends it
and the resume that continues the run; and the checks before any work."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from largebatch.train.cli import main
from largebatch.train.metrics import read_metrics
from test_train import _train_losses, tiny_overrides
from test_train_cluster import ENV, _args, _wait_for_train_records
from wandb_records import read_run

pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def _fresh_wandb():
    """W&B reads its environment once per process (its service and settings are kept): each test
    starts and ends with them shut down, so its own WANDB_* settings apply and its files are whole."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def _files_whole() -> None:
    """W&B's service shut down: finish() may return before its file is whole (a loaded machine read a
    resumed run's file without its run record)."""
    import wandb

    wandb.teardown()


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, with no setting of the machine's (a key, a project, a directory) leaking in."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    return {**{k: v for k, v in ENV.items() if not k.startswith("WANDB_")}, "WANDB_MODE": "offline",
            "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}


def test_a_runs_records_reach_wandb_across_a_sigterm_and_its_resume(reference_run, tmp_path, capsys, offline):
    """A SIGTERM to the job's process group (W&B's own service process gets it too) checkpoints, ends the
    W&B run as preempted with exit code 143, and the same command continues that W&B run (the id kept in
    RUN_DIR/wandb-run.json): its history holds every record of metrics.jsonl at its step once, with its
    numbers; the summary holds summary.json's; the config is the run's. Training is the uninterrupted
    reference run's, to the bit."""
    cache, ref_dir, _ = reference_run
    out = tmp_path / "run"
    o = tiny_overrides(cache, out, **{"run.wandb": True, "run.wandb_project": "lb-tests"})
    proc = subprocess.Popen([sys.executable, "-m", "largebatch", "train", *_args(o)], env=offline,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_train_records(out, 3, proc)
        os.killpg(proc.pid, signal.SIGSTOP)  # held mid-run (a loaded machine must not let it finish first)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as Slurm and Kubernetes send it
        os.killpg(proc.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-2000:]
    first = json.loads((out / "wandb-run.json").read_text())
    assert main(_args(o)) == 0  # the same command line continues the run
    capsys.readouterr()
    import wandb

    wandb.teardown()  # W&B's service process has written the whole file (finish() may return before)
    assert json.loads((out / "wandb-run.json").read_text()) == first
    assert first["project"] == "lb-tests"
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    launches = [read_run(f) for f in files]
    assert [f.parent.name.rsplit("-", 1)[1] for f in files] == [first["id"]] * 2  # (W&B names them by run id)
    assert {r["id"] for r in launches} <= {first["id"], None}
    assert (launches[0]["exit_code"], launches[0]["preempting"]) == (143, True)
    assert (launches[1]["exit_code"], launches[1]["preempting"]) == (0, False)

    # offline, W&B cannot know what an earlier launch's file holds: the resume sends the records kept
    # up to the checkpoint again, so the newest file alone is the whole history (what `wandb sync` of it
    # gives), every step once, in order
    first_steps = [row["_step"] for row in launches[0]["history"]]
    steps = [row["_step"] for row in launches[1]["history"]]
    assert steps == sorted(set(steps)) and set(first_steps) <= set(steps), (first_steps, steps)
    by_step = {row["_step"]: row for row in launches[1]["history"]}
    records = read_metrics(out)
    assert sorted(by_step) == sorted({r["step"] for r in records})
    for record in records:  # each record's numbers in its step's row (an evaluation's val_* merged into it)
        row = by_step[record["step"]]
        for key, value in record.items():
            if (key not in ("step", "wall_time", "kind") and isinstance(value, (int, float)) and math.isfinite(value)
                    and (record["kind"] == "train" or key.startswith("val_") or key == "tokens")):
                assert row[key] == value, (record["step"], key)
    summary = json.loads((out / "summary.json").read_text())
    assert launches[1]["summary"]["final_val_loss"] == summary["final_val_loss"]
    assert launches[1]["summary"]["tokens"] == summary["tokens"]
    assert launches[1]["config"]["model"]["n_layer"] == 2
    assert launches[1]["config"]["schedule"]["batch_policy"] == "seesaw"
    assert _train_losses(out) == _train_losses(ref_dir)


def test_wandb_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """Without an API key (and not offline) wandb.init failed once the data and model were built; the
    check before any work says so with the ways out. A project name W&B refuses, and the package
    missing, are one line naming the field."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # no terminal to ask for a key on
    args = [f"--run.out_dir={tmp_path / 'run'}", "--run.wandb=true", "--check"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "run.wandb = true, but W&B has no API key" in err and "WANDB_MODE=offline" in err, err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--run.wandb_project=team/gpt"]) == 2
    assert "run.wandb_project = 'team/gpt': W&B takes 1 to 128 characters without" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when it is not installed
    assert main(args) == 2
    assert "run.wandb = true needs the package wandb: pip install wandb" in capsys.readouterr().err


def test_a_phase_switch_two_trainers_and_a_disabled_wandb(tmp_path, offline, monkeypatch):
    """At a [[phases]] switch a step holds the ending phase's evaluation and the next phase's: the
    second overwrote the first's val_loss, and its phase and seq_len relabelled the step's training
    numbers; now each phase's evaluation has its own key. Two runs alive in one process (two Trainers)
    each get their own W&B run (they shared the first's). WANDB_MODE=disabled records no run id for a
    later launch to continue (it continued a fake one). A hard kill loses what W&B had not written:
    a resume sends the kept records again, here into a run whose file lost them all."""
    from largebatch.train.metrics import MetricsLog, WandbSettings

    config = {"model": {"n_layer": 2}, "phases": [{"seq_len": 32}, {"seq_len": 64}]}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    logs = [MetricsLog(d, tensorboard=False, wandb=WandbSettings(config)) for d in (one, two)]
    records = [{"kind": "train", "phase": 0, "seq_len": 32, "step": 32, "tokens": 8192, "loss": 6.02},
               {"kind": "val", "phase": 0, "seq_len": 32, "step": 32, "tokens": 8192, "val_loss": 6.06},
               {"kind": "val", "phase": 1, "seq_len": 64, "step": 32, "tokens": 8192, "val_loss": 6.05},
               {"kind": "train", "phase": 1, "seq_len": 64, "step": 33, "tokens": 8448, "loss": 6.01}]
    for record in records:
        logs[0].log(record)
    logs[1].log(records[0])
    logs[0].summary({"final_val_loss": 6.05, "final_val_loss_by_corpus": {"plays": 5.9, "web_.jsonl": 6.3}})
    for log in logs:
        log.close()
    _files_whole()
    ids = [json.loads((d / "wandb-run.json").read_text())["id"] for d in (one, two)]
    assert ids[0] != ids[1]
    run = read_run(next((one / "wandb").glob("offline-run-*/run-*.wandb")))
    rows = {row["_step"]: row for row in run["history"]}
    assert {k: v for k, v in rows[32].items() if not k.startswith("_")} == {
        "phase": 0, "seq_len": 32, "tokens": 8192, "loss": 6.02, "val_loss/phase_0": 6.06, "val_loss/phase_1": 6.05}
    assert len(read_run(next((two / "wandb").glob("offline-run-*/run-*.wandb")))["history"]) == 1
    # a mixture's per-corpus losses (a table in summary.json) as numbers of W&B's summary
    assert {k: v for k, v in run["summary"].items() if k.startswith("final_val_loss")} == {
        "final_val_loss": 6.05, "final_val_loss/plays": 5.9, "final_val_loss/web_.jsonl": 6.3}

    # a resume of `one` from step 32 (its file as a hard kill can leave it: no records at all)
    for file in (one / "wandb").glob("offline-run-*"):
        shutil.rmtree(file)
    log = MetricsLog(one, tensorboard=False, resume_step=32, wandb=WandbSettings(config))
    log.close()
    _files_whole()
    run = read_run(next((one / "wandb").glob("offline-run-*/run-*.wandb")))
    assert run["id"] == ids[0] and [row["_step"] for row in run["history"]] == [32]
    assert run["history"][0]["val_loss/phase_1"] == 6.05 and run["history"][0]["loss"] == 6.02

    monkeypatch.setenv("WANDB_MODE", "disabled")
    three = tmp_path / "three"
    three.mkdir()
    log = MetricsLog(three, tensorboard=False, wandb=WandbSettings(config))
    log.log(records[0])
    log.close()
    assert not (three / "wandb-run.json").exists()
