"""The schedule examples run end to end (at a reduced size) and do what they say."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_loop_grows_the_batch_by_micro_batches(capsys):
    held_out = load("schedule_plain_loop").main(["--tokens", "40000"])
    out = capsys.readouterr().out
    # Seesaw at ratio 1/2, final 0.1: three milestones, batch 8 -> 64 in micro-batches of 8; the
    # batch-64 step is the last and takes only the 40,000 - 36,864 tokens left: 49 sequences of 64
    for batch, micro in ((8, 1), (16, 2), (32, 4), (49, 7)):
        assert f"batch {batch:3d} = {micro} micro-batch{'es' if micro > 1 else ''} of 8" in out
    assert "40,000 tokens in" in out
    lrs = [float(x) for x in re.findall(r"lr (\S+)\n", out)]
    assert lrs[0] == 0 and lrs[1:] == pytest.approx([2e-2 * 0.5**(k / 2) for k in (1, 2, 3)],
                                                    rel=1e-2)  # x sqrt(1/2) per milestone
    assert held_out < math.log(256) - 1  # it learned something about English


def test_hf_trainer_logs_the_schedule(capsys):
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    evaluation = load("schedule_hf_trainer").main(["--steps", "16"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s*(\d+)\s+([\d,]+)\s+(\S+)\s+(\S+)\s+\S+$", out, re.MULTILINE)
    assert len(rows) >= 8
    for _, _, logged, scheduled in rows:  # Trainer's logged LR is the schedule's, printed .3e
        assert float(logged) == float(scheduled)
    assert float(rows[0][2]) == 0.0 and max(float(r[2]) for r in rows) == 3e-3
    assert math.isfinite(evaluation["eval_loss"])
