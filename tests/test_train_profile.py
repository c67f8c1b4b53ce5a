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
    assert said[0].startswith(f"profile of step 2 written to {single}: "), said
    assert said[1].startswith(f"profile of steps {v}-{v + 1} written to {window}: "), said
    # the line names the table's first operators, in its order, with their shares (which operators
    # come first depends on the machine's timing: not asserted)
    for line, folder in zip(said, (single, window)):
        top = [part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", ")]
        assert len(top) == 4 and all(share.endswith("%") and share[:-1].isdigit() for _, share in top), line
        names = [name.replace("(between operators)", "ProfilerStep*") for name, _ in top]
        assert names == _table_names((folder / "rank0.txt").read_text())[:4], line


def _table_names(table: str) -> list[str]:
    """The operators' names of a rank's table, in its order (its rows lie between the second and the
    third dashed line)."""
    lines = table.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    return [line.split()[0] for line in lines[rules[1] + 1:rules[2]]]


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
    assert (f"profile of steps 4-5 (of 3-5: the launch resumed inside it) written to {out / 'profile' / 'steps_4-5'}"
            in "\n".join(lines))
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


class _Failing(Trainer):
    """A run whose step ``at`` fails: with ``StepInterrupted`` (a stop signal between its micro-batches,
    after its first forward and backward ran) or with another error (as an out-of-memory one would)."""

    at, error = 0, None

    def train_step(self):
        if self.pos.step + 1 == self.at:
            batch = self.data.train.get_batch(range(4))
            _, loss, _ = self._forward(batch)
            loss.backward()
            raise self.error
        return super().train_step()


def _failing(overrides: dict, at: int, error: BaseException) -> tuple[_Failing, list[str]]:
    lines: list[str] = []
    trainer = _Failing(load_config(resolve_config(None), overrides), overrides["run.out_dir"], log=lines.append)
    trainer.at, trainer.error = at, error
    return trainer, lines


def test_a_step_dropped_by_a_stop_signal_is_not_counted_and_the_stop_is_not_in_a_step(reference_run, tmp_path):
    """A stop signal inside step 5 of the window 3-9: steps 3 and 4 are written; the dropped step is in
    the timeline as far as it ran, its range ending there, and not in the table (its ProfilerStep count
    is 2); the checkpoint after it lies outside every step."""
    import signal

    from largebatch.train.stopping import StepInterrupted

    cache, _, _ = reference_run
    out = tmp_path / "run"
    trainer, lines = _failing(tiny_overrides(cache, out, **{"run.profile_steps": "3-9"}), 5,
                              StepInterrupted(signal.SIGTERM))
    result = trainer.fit()
    assert result["stopped_early"] and result["step"] == 4
    folder = out / "profile" / "steps_3-4"
    assert f"profile of steps 3-4 (of 3-9: the run stopped) written to {folder}: " in "\n".join(lines)
    events = _trace(folder)
    assert _steps_in(events) == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    dropped = next(e for e in events if e.get("name") == "ProfilerStep#5")
    saving = [e for e in events if e.get("name", "").startswith("aten::") and e["ts"] > dropped["ts"] + dropped["dur"]]
    assert not saving  # the profile ended before the checkpoint was written
    row = next(line.split() for line in (folder / "rank0.txt").read_text().splitlines()
               if line.split()[:1] == ["ProfilerStep*"])
    assert int(row[-1]) == 2


def test_a_failure_in_a_window_is_the_error_the_run_raises(reference_run, tmp_path):
    """A step that fails in the window's first step (after its warm-up step, nothing recorded yet): the
    caller gets that step's error, not the profiler's; so does a failure later in the window, whose
    recorded steps are written."""
    cache, _, _ = reference_run
    for at, window in ((4, "4-6"), (5, "3-6")):
        out = tmp_path / f"run{at}"
        trainer, lines = _failing(tiny_overrides(cache, out, **{"run.profile_steps": window}), at,
                                  RuntimeError("out of memory (a stand-in)"))
        with pytest.raises(RuntimeError, match="a stand-in"):
            trainer.fit()
        said = "\n".join(lines)
        if at == 4:
            assert "profile of steps 4-6: not written (the run failed before a step of it was done)" in said
            assert not (out / "profile").exists()
        else:
            assert f"profile of steps 3-4 (of 3-6: the run failed) written to {out / 'profile' / 'steps_3-4'}" in said


def test_a_stop_right_after_a_windows_warm_up_step_writes_nothing_and_exits_cleanly(reference_run, tmp_path):
    cache, _, _ = reference_run
    out = tmp_path / "run"
    result, lines = _fit(tiny_overrides(cache, out, **{"run.profile_steps": "4-5", "run.max_steps": 3}))
    assert result["stopped_early"] and result["step"] == 3
    assert "profile of steps 4-5: not written (the run stopped before a step of it was done)" in lines
    assert not (out / "profile").exists()


def test_windows_the_run_ends_inside_or_before_are_said_to_be_so(reference_run, tmp_path):
    cache, ref, _ = reference_run
    last = [r["step"] for r in read_metrics(ref) if r["kind"] == "train"][-1]
    out = tmp_path / "run"
    windows = f"{last - 1}-{last + 20},{last + 30}-{last + 40}"
    _, lines = _fit(tiny_overrides(cache, out, **{"run.profile_steps": windows}))
    said = "\n".join(lines)
    assert (f"profile of steps {last - 1}-{last} (of {last - 1}-{last + 20}: the run ended) written to "
            f"{out / 'profile' / f'steps_{last - 1}-{last}'}") in said
    assert f"profile of steps {last + 30}-{last + 40}: not recorded (the run ended at step {last})" in said
    events = _trace(out / "profile" / f"steps_{last - 1}-{last}")
    end = next(e["ts"] + e["dur"] for e in events if e.get("name") == f"ProfilerStep#{last}")
    assert not [e for e in events if e.get("name") == "aten::argmax" and e["ts"] > end]  # the final
    # evaluation is not in it (the profile ends before the final checkpoint and evaluation)
