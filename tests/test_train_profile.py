"""run.profile_steps: chosen optimizer steps recorded with torch.profiler while the run trains -- the
trace each rank writes (read back as the Chrome trace JSON it is), the table of the steps' operators,
the records that say which steps ran under the profiler, a window cut short by a stop and finished
by the resume, and a run whose profile cannot be written (it trains on). Profiling changes no
number of the run: the losses are the reference run's, to the bit."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from largebatch.train.profile import profile_windows
from largebatch.typed_config import ConfigError
from test_train import _train_losses, tiny_overrides


@pytest.mark.parametrize("spec, windows", [
    ("10-12", [(10, 12)]), ("7", [(7, 7)]), (7, [(7, 7)]), (" 3 - 4 , 9 ", [(3, 4), (9, 9)]),
    ("500-501,10-12", [(10, 12), (500, 501)]), ("1-1", [(1, 1)]), (None, [])])
def test_profile_steps_are_read_as_ranges_of_steps(spec, windows):
    assert profile_windows(spec) == windows


@pytest.mark.parametrize("spec, says", [
    ("0-2", "count from 1"), ("5-3", "write 3-5"), ("3-5,5-6", "overlap or touch"),
    ("3-5,6", "overlap or touch"), ("ten", "'ten' is not a step"), ("3-", "'3-' is not a step"),
    ("", "'' is not a step"), ("3-5,", "'' is not a step")])
def test_a_bad_profile_steps_is_refused_naming_the_field(spec, says):
    with pytest.raises(ConfigError, match="run.profile_steps") as caught:
        load_config(resolve_config(None), {"run.profile_steps": spec})
    assert says in str(caught.value)


def test_profile_memory_without_profile_steps_is_refused():
    with pytest.raises(ConfigError, match=r"run.profile_memory = true .* set run.profile_steps"):
        load_config(resolve_config(None), {"run.profile_memory": True})


def _fit(overrides: dict, resume: bool = False) -> tuple[dict, list[str]]:
    lines: list[str] = []
    cfg = load_config(resolve_config(None), overrides)
    return Trainer(cfg, overrides["run.out_dir"], resume=resume, log=lines.append).fit(), lines


def _trace(folder: Path, rank: int = 0) -> list[dict]:
    """The trace's events, read as Perfetto and chrome://tracing read it (gzip'd Chrome trace JSON)."""
    with gzip.open(folder / f"rank{rank}.pt.trace.json.gz", "rt") as file:
        return json.load(file)["traceEvents"]


def _steps_in(events: list[dict]) -> list[str]:
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_profiled_steps_are_written_as_traces_and_a_table_and_change_no_number(reference_run, tmp_path):
    """Two windows, one a single step and one across an evaluation: each is a trace of exactly its
    steps (ProfilerStep#N is the run's step N), holding the evaluation between them outside every
    step, and a table of the operators inside the steps only (the evaluation's argmax is in the trace,
    not in the table) with the allocations' columns; the records of those steps and of no other say
    "profiled"; the losses are the unprofiled reference run's, bit for bit."""
    cache, ref, _ = reference_run
    evaluated = [r["step"] for r in read_metrics(ref) if r["kind"] == "val" and r["step"] > 2]
    v = evaluated[0]  # an evaluation runs between steps v and v + 1
    out = tmp_path / "run"
    summary, lines = _fit(tiny_overrides(cache, out, **{"run.profile_steps": f"{v}-{v + 1},2",
                                                        "run.profile_memory": True}))
    assert _train_losses(out) == _train_losses(ref)
    single, window = out / "profile" / "step_2", out / "profile" / f"steps_{v}-{v + 1}"
    assert sorted(p.name for p in (out / "profile").iterdir()) == sorted([single.name, window.name])
    assert _steps_in(_trace(single)) == ["ProfilerStep#2"]
    events = _trace(window)
    assert _steps_in(events) == [f"ProfilerStep#{v}", f"ProfilerStep#{v + 1}"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    inside = [any(a <= e["ts"] <= b for a, b in steps) for e in events if e.get("name") == "aten::mm"]
    argmax = [e for e in events if e.get("name") == "aten::argmax"]  # the evaluation's accuracy
    assert argmax and not any(a <= e["ts"] <= b for a, b in steps for e in argmax)
    assert sum(inside) > 20 and not all(inside)  # the evaluation's forward multiplies too
    table = (window / "rank0.txt").read_text()
    assert "Self CPU Mem" in table and "aten::argmax" not in table
    row = next(line.split() for line in table.splitlines() if line.split()[:1] == ["aten::mm"])
    assert int(row[-1]) == sum(inside)  # its "# of Calls": the steps' matrix products, not the evaluation's
    assert "aten::argmax" not in (single / "rank0.txt").read_text()
    profiled = [r["step"] for r in read_metrics(out) if r.get("profiled")]
    assert profiled == [2, v, v + 1]
    said = [line for line in lines if line.startswith("profile of")]
    assert said[0].startswith(f"profile of step 2 written to {single}: ") and "aten::mm" in said[1], said
    assert said[1].startswith(f"profile of steps {v}-{v + 1} written to {window}: "), said


def test_a_window_cut_by_a_stop_is_written_and_the_resume_records_the_rest(reference_run, tmp_path):
    """Stopped (run.max_steps) inside the window 3-5 after step 3: that step is written, named as what it
    is; the resume records steps 4 and 5 (the launch's first step has no warm-up step before it), and the
    run is the reference's to the bit."""
    cache, ref, _ = reference_run
    out = tmp_path / "run"
    o = tiny_overrides(cache, out, **{"run.profile_steps": "3-5"})
    _, lines = _fit({**o, "run.max_steps": 3})
    assert f"profile of step 3 (of 3-5: the run stopped) written to {out / 'profile' / 'step_3'}" in "\n".join(lines)
    _, lines = _fit(o, resume=True)
    assert _steps_in(_trace(out / "profile" / "step_3")) == ["ProfilerStep#3"]
    assert _steps_in(_trace(out / "profile" / "steps_4-5")) == ["ProfilerStep#4", "ProfilerStep#5"]
    assert [r["step"] for r in read_metrics(out) if r.get("profiled")] == [3, 4, 5]
    assert _train_losses(out) == _train_losses(ref)
    # a window the run has passed is not recorded again
    _, lines = _fit({**o, "run.profile_steps": "2-3"}, resume=True)
    assert not [line for line in lines if line.startswith("profile of")]


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_goes_on(reference_run, tmp_path):
    cache, ref, _ = reference_run
    out = tmp_path / "run"
    out.mkdir()
    (out / "profile").write_text("a file where the profile's directory would go")
    summary, lines = _fit(tiny_overrides(cache, out, **{"run.profile_steps": "2"}))
    warning = [line for line in lines if "profile" in line and line.startswith("warning:")]
    assert len(warning) == 1 and "profile of step 2 was not written (NotADirectoryError" in warning[0], lines
    assert (out / "summary.json").is_file() and _train_losses(out) == _train_losses(ref)
