"""largebatch experiment: a smoke-size Seesaw experiment end to end (report numbers vs the runs'
metrics.jsonl, recomputed here), its verdicts at 1 and 2 torch threads, arms in parallel processes
and --resume, the bert-lans smoke run, and the helpers' arithmetic against independent references.
(tests/test_experiments_floor.py holds the optimizers and noise-scale experiments and the GPU check.)"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import statistics
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.experiments import cli, runner
from largebatch.experiments.noise_scale import rank_correlation
from largebatch.experiments.optimizers import best_per_cell, degrades_beyond, grid_extensions, ladder_step
from largebatch.experiments.report import ESCAPE_HEADER, fmt_loss
from largebatch.experiments.runner import Arm, ArmResult, check_size

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse_tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a report as a list of {header: cell} rows."""
    tables, lines = [], markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            headers = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(headers, (c.strip() for c in row.strip("|").split("|")))))
            tables.append(rows)
    return tables


def load_jsonl(path: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return ([r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "val"])


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 300 and height >= 200, (path, width, height)


def escape_reference(val: list[dict], unigram: float, tokens: int, margin: float = 0.25) -> str:
    """The report's plateau-escape cell, recomputed: the first evaluation at or below unigram - margin,
    the step and token share interpolated linearly from the evaluation before it."""
    target = unigram - margin
    for i, record in enumerate(val):
        if record["val_loss"] <= target:
            if i == 0:
                return f"step {record['step']:.0f} ({100 * record['tokens'] / tokens:.0f}%)"
            a = val[i - 1]
            w = (a["val_loss"] - target) / (a["val_loss"] - record["val_loss"])
            step = a["step"] + w * (record["step"] - a["step"])
            share = (a["tokens"] + w * (record["tokens"] - a["tokens"])) / tokens
            return f"step {step:.0f} ({100 * share:.0f}%)"
    return "never"


def claim_reference(mean: float, low: float, high: float, floor: float, expect: str) -> str:
    """A paper's claim judged from scratch: a gap is established when the interval excludes 0 and the
    mean exceeds the floor; equivalence when the interval lies within +-floor."""
    if high - low <= 1e-12:  # the same gap at every seed: no interval
        return "not resolvable at this scale (the same gap at every seed: sd 0, no interval)"
    gap = (low > 0 or high < 0) and abs(mean) > floor
    same = floor <= 0.05 and low >= -0.05 and high <= 0.05
    if expect == "same":
        if gap:
            return "agrees (ends lower)" if mean < 0 else "contradicts (ends higher)"
        return "agrees (equivalent within 0.05)" if same else "not resolvable at this scale"
    if gap:
        return "agrees" if mean > 0 else "contradicts (ends lower)"
    return "contradicts (equivalent within 0.05)" if same else "not resolvable at this scale"


def test_claim_verdicts_cover_every_case():
    from largebatch.experiments.floor import claim_verdict

    cases = [(0.10, (0.05, 0.15), 0.02), (-0.10, (-0.15, -0.05), 0.02), (0.01, (0.005, 0.015), 0.02),
             (0.0, (-0.01, 0.01), 0.02), (0.0, (-0.5, 0.5), 0.02), (0.03, (0.01, 0.05), 0.0),
             (0.0, (-0.04, 0.04), 0.3), (0.0, (-0.04, 0.04), 0.05), (0.0, (-0.06, 0.04), 0.01)]
    for expect in ("same", "worse"):
        for mean, ci, floor in cases:
            assert claim_verdict(mean, ci, floor, expect) == claim_reference(mean, *ci, floor, expect)
    # a floor of 0.3 nats: no interval, however narrow, makes two arms equivalent
    assert claim_verdict(0.0, (-0.04, 0.04), 0.3, "worse") == "not resolvable at this scale"
    assert claim_verdict(0.0, (-0.04, 0.04), 0.05, "same") == "agrees (equivalent within 0.05)"
    assert claim_verdict(None, None, 0.1, "same").startswith("not resolvable")
    with pytest.raises(ValueError, match="expect='better'"):
        claim_verdict(0.0, (0.0, 0.0), 0.0, "better")


def test_the_same_gap_at_every_seed_establishes_nothing():
    """sd 0 (every seed gave the same gap: deterministic runs) makes a zero-width t interval, which
    excludes 0 for any gap but 0. Neither a comparison's verdict nor a claim's is decided on it,
    however far the gap is past the floor."""
    from largebatch.experiments.floor import Gaps, claim_verdict, verdict
    from largebatch.stats import ci95

    for gaps in ([0.3, 0.3, 0.3], [-0.3, -0.3], [4 / 14 - 5 / 14, 5 / 14 - 6 / 14]):
        g = Gaps("arm - baseline", gaps)
        assert g.ci95[1] - g.ci95[0] < 1e-12  # zero width, away from 0
        assert verdict(g.mean, g.ci95, 0.01, "worse", "better").endswith("no difference established")
        assert verdict(g.mean, g.ci95, None, "worse", "better").endswith("no difference established")
        for expect in ("same", "worse"):
            assert claim_verdict(g.mean, g.ci95, 0.01, expect).startswith("not resolvable at this scale")
    # gaps that differ in more than the last bits are judged as before
    low, high = ci95([0.3, 0.31, 0.29])
    assert low > 0 and verdict(0.3, (low, high), 0.01, "worse", "better") == "worse"
    assert claim_verdict(0.3, (low, high), 0.01, "worse") == "agrees"


def test_arm_processes_wait_passively_unless_the_user_chose(monkeypatch):
    import multiprocessing

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ctx = multiprocessing.get_context("spawn")
    with runner.passive_openmp():
        child = ctx.Process(target=os_environ_probe, args=("OMP_WAIT_POLICY", 17))
        child.start()
    child.join()
    assert child.exitcode == 17 and "OMP_WAIT_POLICY" not in os.environ  # the child saw PASSIVE
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with runner.passive_openmp():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def os_environ_probe(name: str, code: int) -> None:
    raise SystemExit(code if os.environ.get(name) == "PASSIVE" else 1)


def test_plateau_escape_interpolates_between_evaluations():
    val = [{"step": 0, "tokens": 0, "val_loss": 6.9}, {"step": 10, "tokens": 1000, "val_loss": 5.9},
           {"step": 20, "tokens": 2000, "val_loss": 5.5}, {"step": 30, "tokens": 3000, "val_loss": 5.0}]
    # unigram 5.9: target 5.65, crossed 0.25/0.4 of the way from step 10 to step 20
    step, share = runner.plateau_escape(val, 5.9, 4000)
    assert step == pytest.approx(16.25) and share == pytest.approx(1625 / 4000)
    assert runner.plateau_escape(val, 7.5, 4000) == (0.0, 0.0)  # below the target from the start
    assert runner.plateau_escape(val, 5.2, 4000) is None  # never 0.25 below: still on the plateau
    assert runner.plateau_escape(val, None, 4000) is None and runner.plateau_escape([], 5.9, 4000) is None
    result = ArmResult(Arm("a", {}), Path("."), {"unigram_val_loss": 5.9},
                       train=[{"step": 40, "tokens": 4000, "batch_size": 1}], val=val)
    assert result.plateau_escape == pytest.approx((16.25, 0.40625))


@pytest.fixture(scope="module")
def seesaw_smoke(tmp_path_factory):
    """One seesaw smoke run on one torch thread, shared by the report check and the thread-count check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("smoke") / "seesaw"
        assert cli.main(["seesaw", "--smoke", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_seesaw_smoke_report_agrees_with_metrics(seesaw_smoke, one_thread):
    out = seesaw_smoke
    report = (out / "report.md").read_text()
    assert f"largebatch experiment seesaw --smoke --out {out}" in report
    tables = [t for t in parse_tables(report) if t and "optimizer steps" in t[0]]
    assert len(tables) == 4  # below and above the measured critical batch, 2 seeds each (default)
    for table in tables:
        cosine_train, _ = load_jsonl(out / "runs" / table[0]["arm"] / "metrics.jsonl")
        cosine_steps = cosine_train[-1]["step"]
        for row in table:
            train, val = load_jsonl(out / "runs" / row["arm"] / "metrics.jsonl")
            assert float(row["final val loss"]) == pytest.approx(val[-1]["val_loss"], abs=5.1e-5)
            assert int(row["optimizer steps"]) == train[-1]["step"] == len(train)
            assert int(row["final batch"]) == max(r["batch_size"] for r in train)  # not the trimmed last
            saved = 100 * (1 - train[-1]["step"] / cosine_steps)
            assert float(row["steps saved"].rstrip("%")) == pytest.approx(saved, abs=0.051)
            assert int(row["tokens"]) == train[-1]["tokens"] >= 12_288  # the budget (trimmed last step)
            unigram = json.loads((out / "runs" / row["arm"] / "summary.json").read_text())["unigram_val_loss"]
            assert row[ESCAPE_HEADER] == escape_reference(val, unigram, train[-1]["tokens"])
    below = {row["arm"]: row for row in tables[0]}
    # each seed's arms share that seed's init and data order, and the seeds differ
    seven = json.loads((out / "runs" / "below-cosine-seed7" / "arm.json").read_text())["overrides"]
    assert seven["run.seed"] == seven["data.seed"] == 7
    assert [r["arm"] for r in tables[1]] == [r["arm"] + "-seed7" for r in tables[0]]
    assert tables[1][0]["final val loss"] != tables[0][0]["final val loss"]
    # the paired-gap summary over seeds, recomputed from the runs (numpy, sample sd)
    summaries = [t for t in parse_tables(report) if t and "mean gap vs cosine" in t[0]]
    assert len(summaries) == 2
    for summary, per_seed in zip(summaries, (tables[:2], tables[2:])):
        final = lambda arm: load_jsonl(out / "runs" / arm / "metrics.jsonl")[1][-1]["val_loss"]  # noqa: E731
        for i, row in enumerate(summary[1:], start=1):
            gaps = np.array([final(t[i]["arm"]) - final(t[0]["arm"]) for t in per_seed])
            assert float(row["mean gap vs cosine"]) == pytest.approx(gaps.mean(), abs=5.1e-5)
            assert float(row["sd"]) == pytest.approx(gaps.std(ddof=1), abs=5.1e-5)
            assert float(row["min"]) == pytest.approx(gaps.min(), abs=5.1e-5)
            assert row["seeds at or below cosine"] == f"{int((gaps <= 0).sum())} of 2"
            half = 12.706 * gaps.std(ddof=1) / np.sqrt(2)  # Student t(0.975, 1 degree of freedom)
            low, high = (float(v) for v in re.findall(r"[-+][\d.]+", row["95% CI of the mean"]))
            assert (low, high) == pytest.approx((gaps.mean() - half, gaps.mean() + half), abs=5.1e-5)
        cosine = np.array([final(t[0]["arm"]) for t in per_seed])
        assert float(summary[0]["sd"]) == pytest.approx(cosine.std(ddof=1), abs=5.1e-5)
    # the noise floor: every seed-1337 arm re-run with another data order, gaps recomputed from the runs
    floors = [t for t in parse_tables(report) if t and "noise floor" in t[0] and "gap vs cosine" in t[0]]
    assert len(floors) == 2
    for floor_rows, table in zip(floors, (tables[0], tables[2])):
        final = lambda arm: load_jsonl(out / "runs" / arm / "metrics.jsonl")[1][-1]["val_loss"]  # noqa: E731
        cosine = table[0]["arm"]
        for row in floor_rows:
            gap = final(row["arm"]) - final(cosine)
            moved = final(row["arm"] + "-data") - final(cosine + "-data")
            assert float(row["gap vs cosine"]) == pytest.approx(gap, abs=5.1e-5)
            assert float(row["gap, other data order"]) == pytest.approx(moved, abs=5.1e-5)
            assert float(row["noise floor"]) == pytest.approx(abs(moved - gap), abs=5.1e-5)
        data = json.loads((out / "runs" / (cosine + "-data") / "arm.json").read_text())["overrides"]
        assert data["data.seed"] == 1 and data.get("run.seed", 1337) == 1337
    # above the critical batch the budget gives cosine at least the size's minimum steps (8 here)
    above_cosine, _ = load_jsonl(out / "runs" / tables[2][0]["arm"] / "metrics.jsonl")
    above_batch = above_cosine[0]["batch_size"]
    assert len(above_cosine) >= 8 and above_cosine[-1]["tokens"] >= max(12_288, 8 * above_batch * 32)
    # cosine at batch 8 x seq 32 over 12,288 tokens; Seesaw r=1/2 reaches 8 * 2**k_max with
    # k_max = floor(log(final/peak) / log r) = floor(log 0.1 / log 0.5) = 3 (docs/papers.md: schedules)
    # only in its last step, which the budget trims: the largest whole batch is one doubling less
    assert int(below["below-cosine"]["optimizer steps"]) == 12_288 // (8 * 32)
    assert int(below["below-seesaw-r0.5"]["final batch"]) == 8 * 2 ** math.floor(
        math.log(0.1) / math.log(0.5)) // 2
    assert int(below["below-seesaw-r0.5"]["optimizer steps"]) < 48
    # r = 1/1.1 at micro-batch 1: after milestone k the batch is floor(8 x 1.1**k) sequences (never
    # shrinking); at the group's micro-batch 2 it is a multiple of 2, so it grows every few milestones
    ideal = list(itertools.accumulate((math.floor(8 * 1.1**k + 1e-9) for k in range(25)), max))
    batches = {}
    for arm in ("below-seesaw-r0.91", "below-seesaw-r0.91-mb1"):
        overrides = json.loads((out / "runs" / arm / "arm.json").read_text())["overrides"]
        train, _ = load_jsonl(out / "runs" / arm / "metrics.jsonl")
        batches[overrides["run.micro_batch"]] = [r["batch_size"] for r in train[:-1]]  # last: trimmed
    assert set(batches[1]) <= set(ideal) and {9, 11} <= set(batches[1])
    assert all(b % 2 == 0 for b in batches[2]) and len(set(batches[1])) > len(set(batches[2]))
    # the report labels the arm and gives the granularity's own paired difference, from the runs
    assert "Seesaw r=1/1.1, micro-batch 1 (batch x1.1 per milestone)" in report
    for group, per_seed in (("below", tables[:2]), ("above", tables[2:])):
        final = lambda arm: load_jsonl(out / "runs" / arm / "metrics.jsonl")[1][-1]["val_loss"]  # noqa: E731
        rows = [{r["arm"].split("-seed")[0].split("-", 1)[1]: r["arm"] for r in t} for t in per_seed]
        diffs = [final(r["seesaw-r0.91-mb1"]) - final(r["seesaw-r0.91"]) for r in rows]
        line = re.search(rf"^- {group}: batch granularity, .* at micro-batch \d+: ([-+][\d.]+) ± ([\d.]+)",
                         report, re.M)
        assert float(line.group(1)) == pytest.approx(statistics.fmean(diffs), abs=5.1e-5), line
        assert float(line.group(2)) == pytest.approx(statistics.stdev(diffs), abs=5.1e-5)
    # the paper's claims: each gap per seed, its t interval and its floor, recomputed from the runs
    claims = [t for t in parse_tables(report) if t and "claim (Meterez et al. 2025)" in t[0]]
    assert len(claims) == 1 and len(claims[0]) == 5
    final = lambda arm: load_jsonl(out / "runs" / arm / "metrics.jsonl")[1][-1]["val_loss"]  # noqa: E731
    for row in claims[0]:
        arm, reference = row["gap"].split(" minus ")
        gaps = np.array([final(arm + suffix) - final(reference + suffix) for suffix in ("", "-seed7")])
        moved = final(arm + "-data") - final(reference + "-data")
        floor = abs(moved - gaps[0])
        half = 12.706 * gaps.std(ddof=1) / np.sqrt(2)
        assert float(row["mean"]) == pytest.approx(gaps.mean(), abs=5.1e-5)
        assert float(row["noise floor"]) == pytest.approx(floor, abs=5.1e-5)
        low, high = (float(v) for v in re.findall(r"[-+][\d.]+", row["95% CI"]))
        assert (low, high) == pytest.approx((gaps.mean() - half, gaps.mean() + half), abs=5.1e-5)
        expect = "same" if "reaches" in row["claim (Meterez et al. 2025)"] else "worse"
        runs = [name + suffix for name in (arm, reference) for suffix in ("", "-seed7")]
        unigram = {run: json.loads((out / "runs" / run / "summary.json").read_text())["unigram_val_loss"]
                   for run in runs}
        stuck = [run for run in runs
                 if escape_reference(load_jsonl(out / "runs" / run / "metrics.jsonl")[1], unigram[run], 1) == "never"]
        assert row["verdict"] == (f"not resolvable at this scale ({len(stuck)} of 4 runs on the plateau)" if stuck else
                                  claim_reference(gaps.mean(), gaps.mean() - half, gaps.mean() + half, floor, expect))
    # the measured critical batch: median B_simple over the second half of the cosine run
    train, _ = load_jsonl(out / "runs" / "below-cosine" / "metrics.jsonl")
    noise = [r["noise_scale"] for r in train[len(train) // 2:] if r["noise_scale"] is not None]
    stated = float(re.search(r"\*\*([\d.]+) sequences\*\*", report).group(1))
    assert stated == pytest.approx(statistics.median(noise), abs=0.051)
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {"val_loss.png", "schedules.png"} <= set(plots)
    for name in plots:
        assert_png(out / name)
    # benchmarks/seesaw_lr_check.py: an arm re-run at its own LR gives its loss bit for bit
    spec = importlib.util.spec_from_file_location("lr_check", ROOT / "benchmarks" / "seesaw_lr_check.py")
    lr_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr_check)
    assert lr_check.main([str(out), "--arms", "below-cosine", "--lrs", "3e-3", "1e-2"]) == 0
    _, original = load_jsonl(out / "runs" / "below-cosine" / "metrics.jsonl")
    _, same = load_jsonl(out / "lr-check" / "runs" / "below-cosine-lr0.003" / "metrics.jsonl")
    _, other = load_jsonl(out / "lr-check" / "runs" / "below-cosine-lr0.01" / "metrics.jsonl")
    assert [v["val_loss"] for v in same] == [v["val_loss"] for v in original]
    assert other[-1]["val_loss"] != original[-1]["val_loss"]


def test_rank_correlation_matches_numpy_spearman():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=50)
    ys = 0.5 * xs + rng.normal(size=50)
    ranks = lambda v: np.argsort(np.argsort(v)).astype(np.float64)  # noqa: E731
    expected = np.corrcoef(ranks(xs), ranks(ys))[0, 1]
    assert rank_correlation(list(xs), list(ys)) == pytest.approx(expected, abs=1e-12)
    assert rank_correlation([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0)


def _result(name: str, batch: int, lr: float, loss: float) -> ArmResult:
    arm = Arm(f"{name}-b{batch}-lr{lr}", {"optim.name": name, "schedule.batch_size": batch,
                                          "schedule.peak_lr": lr})
    return ArmResult(arm, Path("."), {}, [{"step": 1, "tokens": 1, "batch_size": batch}],
                     [{"step": 1, "tokens": 1, "val_loss": loss}])


def test_best_lr_per_cell_and_degradation_point():
    results = [_result("adamw", 4, 1e-3, 5.0), _result("adamw", 4, 3e-3, 4.9),
               _result("adamw", 32, 1e-3, 4.93), _result("adamw", 128, 1e-3, 5.2)]
    best = best_per_cell(results)
    assert best[("adamw", 4)].arm.overrides["schedule.peak_lr"] == 3e-3
    assert degrades_beyond(best, "adamw", [4, 32, 128]).startswith("32 (at 128: +0.300")
    best[("adamw", 128)] = _result("adamw", 128, 1e-3, 4.94)
    assert degrades_beyond(best, "adamw", [4, 32, 128]) == "holds to 128"


def test_the_lr_ladder_steps_by_half_decades():
    # 1, 3, 10, 30 x 10^k: the spacing of the optimizers experiment's LR grids
    assert [ladder_step(x, 1) for x in (1e-4, 3e-4, 1e-3, 0.03, 1.0, 3.0, 10.0)] == \
        [3e-4, 1e-3, 3e-3, 0.1, 3.0, 10.0, 30.0]
    assert [ladder_step(x, -1) for x in (1e-3, 3e-4, 0.1, 1.0, 3.0, 30.0)] == \
        [3e-4, 1e-4, 0.03, 0.3, 1.0, 10.0]
    for lr, direction in ((2e-3, 1), (1e-3, 0)):
        with pytest.raises(ValueError, match="ladder_step: lr="):
            ladder_step(lr, direction)


def test_the_grid_extends_past_an_end_that_holds_the_best_lr():
    added = {}
    tried = {"falls": {1e-3: 5.0, 3e-3: 4.9},  # best at the top: one point above
             "rises": {1e-3: 5.0, 3e-3: 5.4},  # best at the bottom: one point below
             "inside": {1e-3: 5.0, 3e-3: 4.8, 1e-2: 4.9},  # interior optimum: done
             "single": {1e-3: 5.0},  # one point: no direction to go
             "diverged": {1e-3: math.inf, 3e-3: math.nan},  # nothing finite: no direction
             "nan-top": {1e-3: 5.0, 3e-3: math.nan}}  # a NaN is never the best: extend below
    assert grid_extensions(tried, added, 2) == [("falls", 1e-2), ("rises", 3e-4), ("nan-top", 3e-4)]
    tried["falls"][1e-2] = 4.7  # still falling: a second point above, then the cap
    tried["rises"][3e-4] = 5.1  # the old end is now inside: done
    tried["nan-top"][3e-4] = 5.2
    assert grid_extensions(tried, added, 2) == [("falls", 3e-2)]
    tried["falls"][3e-2] = 4.6
    assert grid_extensions(tried, added, 2) == []  # 2 points added above: the cap
    assert added["falls"] == {-1: 0, 1: 2} and added["rises"] == {-1: 1, 1: 0}
    assert grid_extensions({"falls": {1e-3: 5.0, 3e-3: 4.9}}, {}, 0) == []  # extend 0: the grid as given


def test_the_recompute_report_names_only_files_it_wrote(tmp_path):
    """The recompute experiment measures in-process and trains no arm: its report pointed at
    runs/<arm>/metrics.jsonl, which it never writes; an experiment with arms still does."""
    path = cli.run_experiment("recompute", "smoke", tmp_path / "recompute")
    text = path.read_text()
    assert "runs/<arm>" not in text and not (tmp_path / "recompute" / "runs").exists()
    assert "measured" in text and "predicted" in text


def test_bad_input_names_the_argument(tmp_path, capsys):
    with pytest.raises(ValueError, match="sesaw.*seesaw"):
        cli.run_experiment("sesaw", "smoke", tmp_path)
    with pytest.raises(ValueError, match="size='huge'.*smoke, quick, full"):
        check_size("huge")
    with pytest.raises(SystemExit):
        cli.main(["seesaw", "--quick", "--smoke"])
    with pytest.raises(ValueError, match="seeds=2: only seesaw, optimizers, noise-scale, bert-lans repeat"):
        cli.run_experiment("recompute", "smoke", tmp_path, seeds=2)
    for name in ("seesaw", "optimizers", "noise-scale"):
        with pytest.raises(ValueError, match="seeds=0: must be an integer from 1 to 8"):
            cli.run_experiment(name, "smoke", tmp_path, seeds=0)
    with pytest.raises(SystemExit):
        cli.main(["recompute", "--smoke", "--seeds", "3"])
    for name, seeds in (("optimizers", "0"), ("noise-scale", "9"), ("optimizers", "-1")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            cli.main([name, "--smoke", "--seeds", seeds, "--out", str(tmp_path / "never")])
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--seeds {seeds}: must be an integer" in err, err
        assert f"seeds={seeds}" not in err  # the flag names the value once
    for name, expected in (("all", "'all' runs each experiment at its own default seeds"),
                           ("recompute", "recompute takes no --seeds")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            cli.main([name, "--smoke", "--seeds", "2", "--out", str(tmp_path / "never")])
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "never").exists()


def _losses(run_dir: Path) -> list[tuple]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r["tokens"], r.get("loss"), r.get("val_loss")) for r in records]


def test_parallel_arms_equal_serial_and_resume_keeps_finished_arms(tmp_path, one_thread, capsys):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"  # one seed: 3 arms, no floor
    cli.run_experiment("noise-scale", "smoke", serial, log=lambda _: None, seeds=1)
    cli.run_experiment("noise-scale", "smoke", parallel, log=lambda _: None, jobs=2, seeds=1)
    arms = sorted(p.name for p in (serial / "runs").iterdir())
    assert arms == sorted(p.name for p in (parallel / "runs").iterdir()) and len(arms) == 3
    for arm in arms:  # two worker processes, one thread each: bit-for-bit the serial losses
        assert _losses(parallel / "runs" / arm) == _losses(serial / "runs" / arm)
    # the two workers are spawned once: one of them trained two of the three arms, one after another
    processes = [json.loads((parallel / "runs" / arm / "arm.json").read_text())["process"] for arm in arms]
    assert len(set(processes)) == 2 and os.getpid() not in processes, processes
    assert "--jobs 2" in (parallel / "report.md").read_text()

    # A crash mid-arm leaves no summary.json: --resume retrains that arm only and keeps the others.
    crashed, kept = parallel / "runs" / arms[0], [parallel / "runs" / a for a in arms[1:]]
    (crashed / "summary.json").unlink()
    mtimes = {run: (run / "metrics.jsonl").stat().st_mtime_ns for run in kept}
    capsys.readouterr()
    assert cli.main(["noise-scale", "--smoke", "--seeds", "1", "--out", str(parallel), "--resume"]) == 0
    assert capsys.readouterr().out.count("(kept: finished earlier)") == len(kept)
    assert {run: (run / "metrics.jsonl").stat().st_mtime_ns for run in kept} == mtimes
    assert (crashed / "summary.json").exists()
    assert _losses(crashed) == _losses(serial / "runs" / arms[0])
    # the header gives this invocation's time and, apart, the kept arms' own (from their arm.json)
    walls = sum(json.loads((run / "arm.json").read_text())["wall_seconds"] for run in kept)
    header = re.search(r"; (\d+) s in this invocation, which kept (\d+) arm\(s\) trained by an earlier one "
                       r"\(--resume\); those took (\d+) s more", (parallel / "report.md").read_text())
    assert header and int(header.group(2)) == len(kept) and int(header.group(3)) == round(walls), header
    assert "s in all." in (serial / "report.md").read_text()  # nothing kept: one number
    before = [t for t in parse_tables((serial / "report.md").read_text())]
    after = [t for t in parse_tables((parallel / "report.md").read_text())]
    assert after == before  # the same numbers, from kept and retrained arms alike

    # an arm is kept only for the same resolved config: the same base config read from another
    # file (another checkout's copy) is kept; a changed field is trained again, saying which
    record = json.loads((kept[0] / "arm.json").read_text())
    assert runner._finished(kept[0], record["overrides"]) is not None
    moved = tmp_path / "elsewhere.toml"
    moved.write_text((kept[0] / "config.toml").read_text())  # the same settings, as a base config
    assert runner._finished(kept[0], {**record["overrides"], runner.BASE_CONFIG: str(moved)}) is not None
    said = []
    assert runner._finished(kept[0], {**record["overrides"], "schedule.peak_lr": 1.0}, said.append) is None
    assert len(said) == 1 and "trained again (schedule.peak_lr: " in said[0] and "-> 1.0" in said[0], said
    assert runner._finished(kept[0], {**record["overrides"], runner.THREADS: 2}, said.append) is None
    # an unpinned arm is kept only at the thread count it ran with (arm.json records it): one trained
    # on 1 thread was kept by a --resume on 2, and the report said every arm ran on 2
    assert record["threads"] == 1 and runner._finished(kept[0], record["overrides"], threads=1) is not None
    said.clear()
    assert runner._finished(kept[0], record["overrides"], said.append, threads=2) is None
    assert "it ran with 1 torch threads, this invocation's arms run with 2" in said[0], said
    # a metrics history cut short (or gone) is trained again: the report read its records, not the summary
    for damage, why in (("cut", "is cut short (it ends before the final validation"), ("gone", "is missing")):
        copy = tmp_path / f"damaged-{damage}"
        shutil.copytree(kept[0], copy)
        lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
        if damage == "cut":
            (copy / "metrics.jsonl").write_text("".join(lines[:-3]))
        else:
            (copy / "metrics.jsonl").unlink()
        said.clear()
        assert runner._finished(copy, record["overrides"], said.append, threads=1) is None
        assert why in said[0], said
    # stopped mid-run: no record yet, a checkpoint: said to be continued (it said nothing)
    copy = tmp_path / "stopped"
    shutil.copytree(kept[0], copy)
    (copy / runner._ARM_RECORD).unlink()
    (copy / "checkpoints").mkdir(exist_ok=True)
    (copy / "checkpoints" / "step_00000003.pt").write_bytes(b"")
    said.clear()
    assert runner._finished(copy, record["overrides"], said.append, threads=1) is None
    assert said == ["  stopped: its earlier run did not finish: continued from its newest checkpoint where one "
                    "of this config fits, else trained again"], said
    shutil.rmtree(copy / "checkpoints")
    said.clear()
    assert runner._finished(copy, record["overrides"], said.append, threads=1) is None and not said
    with pytest.raises(ValueError, match="jobs=0: must be an integer >= 1"):
        runner.Execution(jobs=0)


def test_resume_continues_an_interrupted_arm_from_its_checkpoint(tmp_path, one_thread):
    """An arm stopped mid-run (a signal, a time limit) left its checkpoints, which --resume threw
    away: the arm trained again from its first step (8-16 minutes a full-size arm). It continues from
    them now, to the uninterrupted arm's losses, to the bit; at another thread count than it started
    with, or without --resume, it trains afresh."""
    base = {**runner.base_overrides("smoke"), "run.checkpoint_every_seconds": None}
    arm = runner.Arm("continued", {"run.seed": 3})
    whole = runner.run_arms([arm], base, tmp_path / "whole", log=lambda _: None)[0]
    run_dir = tmp_path / "stopped" / "runs" / arm.name
    overrides = runner._arm_overrides(arm, base, runner._peak_flops())
    runner._train(run_dir, {**overrides, "run.max_steps": 3})  # stopped after 3 of its steps
    assert not (run_dir / "summary.json").exists() and list((run_dir / "checkpoints").glob("step_*.pt"))
    said = []
    result = runner.run_arms([arm], base, tmp_path / "stopped", log=said.append,
                             execution=runner.Execution(resume=True))[0]
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and f"{run_dir / 'checkpoints'}" in log
    assert _losses(run_dir) == _losses(whole.run_dir) and result.final_val_loss == whole.final_val_loss
    # another thread count than it started with: afresh (the continued run would not be the same run)
    runner._train(run_dir, {**overrides, "run.max_steps": 3})
    assert not runner._continues(run_dir, runner._resolved(overrides), threads=2)
    assert runner._continues(run_dir, runner._resolved(overrides), threads=1)
    # a finished arm trained again (its metrics history damaged, say) starts afresh: continuing it
    # would keep the damaged history
    assert not runner._continues(whole.run_dir, runner._resolved(overrides), threads=1)


def test_a_diverging_arm_is_recorded_and_the_experiment_goes_on(tmp_path, one_thread):
    base = runner.base_overrides("smoke")
    common = {"optim.name": "lars", "optim.weight_decay": 0.01, "schedule.batch_size": 8}
    arms = [runner.Arm("lars-huge", {**common, "schedule.peak_lr": 1e6}),  # loss -> inf in a few steps
            runner.Arm("lars-ok", {**common, "schedule.peak_lr": 1.0})]
    logged = []
    huge, ok = runner.run_arms(arms, base, tmp_path, logged.append)
    assert huge.diverged.startswith("loss is") and huge.final_val_loss == math.inf
    assert ok.diverged is None and math.isfinite(ok.final_val_loss)
    assert "diverged at step" in logged[0]
    record = json.loads((huge.run_dir / "arm.json").read_text())
    assert record["diverged"] == huge.diverged and not (huge.run_dir / "summary.json").exists()
    # the LR grid picks the finite arm; a report prints the diverged one as such
    assert [r.arm.name for r in best_per_cell([huge, ok]).values()] == ["lars-ok"]
    assert fmt_loss(huge.final_val_loss) == "diverged"
    # --resume keeps a diverged arm (same config): it is not trained again
    mtime = (huge.run_dir / "arm.json").stat().st_mtime_ns
    again = runner.run_arms(arms, base, tmp_path, logged.append, runner.Execution(resume=True))
    assert (huge.run_dir / "arm.json").stat().st_mtime_ns == mtime
    assert again[0].diverged == huge.diverged and again[1].final_val_loss == ok.final_val_loss




def _verdicts(report: str) -> list[str]:
    """Every verdict of a seesaw report: per arm (the findings) and per claim of the paper."""
    claims = [t for t in parse_tables(report) if t and "claim (Meterez et al. 2025)" in t[0]]
    return [line.rsplit(": ", 1)[1] for line in report.splitlines()
            if line.startswith(("- below:", "- above:")) and "noise floor" in line] + [
        row["verdict"] for table in claims for row in table]


def test_seesaw_without_the_granularity_pair(tmp_path, seesaw_smoke, monkeypatch, one_thread):
    """The quick and full sizes run the micro-batch-1 twin only with --granularity (its runs take 2-3x
    the others'): the smoke run's arms, kept by --resume, make a report without it that still judges
    every claim."""
    import shutil
    from dataclasses import replace

    from largebatch.experiments import seesaw

    for size in ("quick", "full"):  # on request only (--granularity): 2-3x an arm's time
        assert "seesaw-r0.91-mb1" not in seesaw.arm_kinds(seesaw.SETTINGS[size])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["optimizers", "--quick", "--granularity", "--check"])
    assert exit_info.value.code == 2
    monkeypatch.setitem(seesaw.SETTINGS, "smoke", replace(seesaw.SETTINGS["smoke"], granularity=False))
    out = tmp_path / "seesaw"
    shutil.copytree(seesaw_smoke, out)
    for report in out.glob("report.*"):
        report.unlink()
    assert cli.main(["seesaw", "--smoke", "--out", str(out), "--resume"]) == 0
    report = (out / "report.md").read_text()
    assert "which kept 24 arm(s)" in report  # 2 groups x (4 arms x 2 seeds + 4 with another data order)
    groups = [t for t in parse_tables(report) if t and "optimizer steps" in t[0]]
    assert len(groups) == 4 and all(len(t) == 4 for t in groups)  # cosine, r=1/2, r=1/1.1, Smith
    assert not any("mb1" in row["arm"] for t in groups for row in t)
    floors = [t for t in parse_tables(report) if t and "gap vs cosine" in t[0]]
    assert len(floors) == 2 and all(len(t) == 3 for t in floors)  # one row per arm against cosine
    claims = [t for t in parse_tables(report) if t and "claim (Meterez et al. 2025)" in t[0]]
    assert len(claims) == 1 and len(claims[0]) == 5
    assert "- Batch granularity (Seesaw r=1/1.1, micro-batch 1" in report and "not run (add --granularity)" in report
    assert ": batch granularity," not in report
    # every arm was kept from the smoke run: nothing trained again
    assert {p.name for p in (out / "runs").iterdir()} == {p.name for p in (seesaw_smoke / "runs").iterdir()}


def test_one_seed_runs_no_floor_and_the_report_states_the_arms_thread_count(tmp_path, seesaw_smoke, one_thread):
    """`seesaw --seeds 1` ran the noise floor's arms (twice the arms at smoke size) though no verdict
    can use a floor without an interval; the other experiments skip it. The header gave the parent's
    thread count (2 with `--jobs 2`, where every arm ran 1), and the command left it out."""
    import shutil

    from largebatch.experiments.report import Report

    out = tmp_path / "seesaw"
    shutil.copytree(seesaw_smoke, out)
    for report in out.glob("report.*"):
        report.unlink()
    assert cli.main(["seesaw", "--smoke", "--seeds", "1", "--out", str(out), "--resume"]) == 0
    report = (out / "report.md").read_text()
    assert "which kept 10 arm(s)" in report  # 2 groups x 5 arms at seed 1337; no floor arm trained
    assert {p.name for p in (out / "runs").iterdir()} == {p.name for p in (seesaw_smoke / "runs").iterdir()}
    assert not [t for t in parse_tables(report) if t and "gap vs cosine" in t[0]]
    assert "Every arm ran with 1 torch thread(s)." in report
    assert f"Reproduce: `OMP_NUM_THREADS=1 largebatch experiment seesaw --smoke --seeds 1 --out {out}" in report
    torch.set_num_threads(2)  # a parent of 2 threads whose arms ran 1 each (--jobs 2)
    path = Report("x", "X", "largebatch experiment x", threads=1).write(tmp_path)
    assert "CPU (1 torch thread(s) per arm)" in path.read_text()
    assert "Reproduce: `OMP_NUM_THREADS=2 largebatch experiment x`" in path.read_text()


def test_seesaw_findings_judge_runs_on_the_plateau_as_the_claims_do(seesaw_smoke):
    """A gap to cosine between runs that never left the unigram plateau measures when each escaped, not
    the schedules: the claims table said "not resolvable" there while the "What this shows" line of
    the same arm said "better than cosine" (the smoke size's runs all stay on the plateau)."""
    from largebatch.experiments.seesaw import LABELS

    report = (seesaw_smoke / "report.md").read_text()
    claims = [row for t in parse_tables(report) if t and "claim (Meterez et al. 2025)" in t[0] for row in t]
    judged = 0
    for row in claims:
        first, reference = row["gap"].split(" minus ")
        group, arm = first.split("-", 1)
        if reference != f"{group}-cosine" or "runs on the plateau" not in row["verdict"]:
            continue
        line = next(x for x in report.splitlines() if x.startswith(f"- {group}: {LABELS[arm]} ends"))
        assert line.endswith(f": {row['verdict']}."), (line, row["verdict"])
        judged += 1
    assert judged >= 2, claims  # the smoke size's arms stay on the plateau: the rule is exercised


def test_seesaw_verdicts_do_not_change_with_the_thread_count(tmp_path, seesaw_smoke):
    """Each comparison's verdict (seed interval and noise floor together) is the same at 1 and at 2
    torch threads, where only the summation order differs (the 1-thread run is the shared smoke run)."""
    threads = torch.get_num_threads()
    verdicts = [_verdicts((seesaw_smoke / "report.md").read_text())]
    try:
        torch.set_num_threads(2)
        out = tmp_path / "threads2"
        assert cli.main(["seesaw", "--smoke", "--out", str(out)]) == 0
        verdicts.append(_verdicts((out / "report.md").read_text()))
    finally:
        torch.set_num_threads(threads)
    assert len(verdicts[0]) == 8 + 5 and verdicts[0] == verdicts[1]


def test_a_correlations_interval_stays_within_its_range():
    """The t interval of a mean of per-seed rank correlations, cut to [-1, 1] (at 2 seeds the t
    quantile 12.7 sent it to [-4.8, +5.2]); cutting never moves it across 0, so verdicts stand."""
    from largebatch.experiments.floor import Gaps, verdict
    from largebatch.stats import T_975

    rhos = [-0.9, 0.7]
    half = T_975[1] * statistics.stdev(rhos) / math.sqrt(2)
    assert statistics.fmean(rhos) - half < -1 and statistics.fmean(rhos) + half > 1  # the raw interval
    g = Gaps("rho", rhos, bounds=(-1.0, 1.0))
    assert g.ci95 == (-1.0, 1.0)
    assert verdict(g.mean, g.ci95, None, "positive", "negative").startswith("interval contains 0")
    near = Gaps("rho", [-0.95, -0.9, -0.99], bounds=(-1.0, 1.0))
    unclipped = Gaps("rho", [-0.95, -0.9, -0.99])
    assert near.ci95[0] == -1.0 and near.ci95[1] == unclipped.ci95[1] < 0
    assert verdict(near.mean, near.ci95, 0.05, "positive", "negative") == "negative"


def test_a_claim_about_the_wrong_side_of_the_critical_batch_is_not_judged():
    """A "below the critical batch" claim whose group started at 8 sequences, when the measured
    critical batch came out at 7.7, tests nothing about below: not resolvable, whatever the gap."""
    from largebatch.experiments.floor import Comparison, Gaps
    from largebatch.experiments.seesaw import Claim, wrong_side

    assert wrong_side("below", 8, 7.7) == "start batch 8 is not below the measured critical batch 7.7"
    assert wrong_side("below", 16, 20.7) == "" and wrong_side("below", 16, None) == ""
    assert wrong_side("above", 64, 20.7) == "" and wrong_side("above", 16, 20.7) != ""
    established = Comparison(Gaps("below-seesaw-r0.5 minus below-cosine", [0.30, 0.31, 0.29]), None, "worse", "better")
    judged = Claim("below: same", "below-seesaw-r0.5", "below-cosine", "same", established)
    assert judged.verdict == "contradicts (ends higher)"
    misplaced = Claim("below: same", "below-seesaw-r0.5", "below-cosine", "same", established, (),
                      wrong_side("below", 8, 7.7))
    assert misplaced.verdict == ("not resolvable at this scale (start batch 8 is not below the measured "
                                 "critical batch 7.7)")


def test_a_record_cut_short_means_the_arm_is_trained_again(tmp_path):
    """arm.json or summary.json cut short (a kill or a full disk during a write): --resume trains the
    arm again, saying why in one line, instead of failing on the JSON."""
    run_dir = tmp_path / "runs" / "arm"
    run_dir.mkdir(parents=True)
    record = json.dumps({"overrides": {}, "wall_seconds": 1.0, "diverged": None, "process": 1})
    (run_dir / "summary.json").write_text("{}")
    for cut in ('{"overrides": {"run.total_', "", "\xff\xfe"):
        (run_dir / "arm.json").write_text(cut)
        said = []
        assert runner._finished(run_dir, {}, said.append) is None
        assert len(said) == 1 and "arm: trained again (its record" in said[0] and "unreadable" in said[0], said
    (run_dir / "arm.json").write_text(record)
    (run_dir / "summary.json").write_text('{"final_val_loss": 5.')
    said = []
    assert runner._finished(run_dir, {}, said.append) is None
    assert len(said) == 1 and "summary.json is unreadable" in said[0], said


def test_a_rerun_without_resume_drops_the_old_report_and_says_what_it_retrains(tmp_path, seesaw_smoke,
                                                                              monkeypatch, capsys):
    """Run again without --resume into a directory of finished arms: one line of warning that they
    are trained again, and the previous report.md and plots are gone from the start (an interrupted
    rerun leaves no report of arms that no longer exist). An earlier version's directory (no
    experiment.json) is accepted and marked."""
    import shutil
    import signal

    out = tmp_path / "seesaw"
    shutil.copytree(seesaw_smoke, out)
    (out / cli.MARKER).unlink(missing_ok=True)
    assert (out / "report.md").is_file() and list(out.glob("*.png"))

    def stopped(run_dir, overrides, threads=None, resume=False):  # SIGTERM reaches the first arm trained again
        raise runner.ArmsInterrupted(signal.SIGTERM, [run_dir.name], [])

    monkeypatch.setattr(runner, "_train", stopped)
    capsys.readouterr()
    assert cli.main(["seesaw", "--smoke", "--out", str(out)]) == 128 + signal.SIGTERM
    printed, said = capsys.readouterr()
    arms = len(list((out / "runs").iterdir()))
    assert (f"warning: {out} holds {arms} finished arm(s) of an earlier run; without --resume they are "
            f"trained again (stop now and add --resume to keep them)") in printed
    assert not (out / "report.md").exists() and not list(out.glob("*.png"))
    assert json.loads((out / cli.MARKER).read_text()) == {"experiment": "seesaw", "size": "smoke"}
    # the arms after this set depend on its results: the line does not claim that nothing else is left
    assert ("not started: below-seesaw-r0.5, " in said
            and "-seed7, and any arm the experiment plans from these arms' results." in said), said


def test_a_full_disk_ends_the_experiment_in_one_line(tmp_path, seesaw_smoke):
    """No file may grow past 64 KiB (RLIMIT_FSIZE, as a full disk would refuse the write): the plots
    of a report, then an arm's checkpoint, cannot be written. Each ends the experiment with one line:
    what failed, the free space, and the fix (the same command with --resume)."""
    import resource
    import shutil
    import subprocess
    import sys

    out = tmp_path / "seesaw"
    shutil.copytree(seesaw_smoke, out)

    def limited(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "largebatch", "experiment", "seesaw", "--smoke", "--out", str(out), *extra],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=300,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)))
        lines = [line for line in done.stderr.splitlines() if not line.startswith("[largebatch]")]
        assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        line = lines[0]
        assert line.startswith("largebatch experiment: error: seesaw: could not write "), line
        assert "free on the file system of" in line and line.endswith(
            "Free space (or lift the limit), then run the same command with --resume to keep the finished arms")
        return line

    line = limited("--resume")  # every arm kept: the first plot is what cannot be written
    assert ".png: File too large" in line, line
    assert not (out / "report.md").exists()
    line = limited()  # the first arm trained again: its checkpoint cannot be written
    assert "could not write checkpoint " in line and "--resume /" not in line and "--resume " + str(out) not in line


def test_a_mean_accuracys_interval_stays_within_0_and_1():
    """bert-lans reports downstream accuracies with a 95% t interval over the fine-tuning runs; at
    2 runs far apart it reaches past [0, 1] and is cut there (an accuracy has no other values)."""
    from largebatch.experiments.bert_lans import _interval
    from largebatch.stats import T_975

    accs = [0.95, 0.55]
    half = T_975[1] * statistics.stdev(accs) / math.sqrt(2)
    assert statistics.fmean(accs) - half < 0 and statistics.fmean(accs) + half > 1  # the raw interval
    assert _interval(accs) == " [0.0000, 1.0000]"
    close = [0.50, 0.52, 0.51]
    half = T_975[2] * statistics.stdev(close) / math.sqrt(3)
    assert _interval(close) == f" [{0.51 - half:.4f}, {0.51 + half:.4f}]"  # inside: unchanged


def test_the_t_quantiles_are_the_distributions():
    """Every tabulated 0.975 quantile against Student's t distribution itself: its density (from
    lgamma) integrated by Simpson's rule from 0 to the quantile gives 0.475, to 1e-9; df 1 and 2 also
    in closed form (tan(0.475 pi); (2p - 1) / sqrt(2 p (1 - p)))."""
    from largebatch.stats import T_975

    def density(t, v):
        return math.exp(math.lgamma((v + 1) / 2) - math.lgamma(v / 2)) / math.sqrt(v * math.pi) \
            * (1 + t * t / v) ** (-(v + 1) / 2)

    for v, q in T_975.items():
        n = 4000
        h = q / n
        area = (density(0, v) + density(q, v)
                + sum((4 if i % 2 else 2) * density(i * h, v) for i in range(1, n))) * h / 3
        assert area == pytest.approx(0.475, abs=1e-9), v
    assert T_975[1] == pytest.approx(math.tan(0.475 * math.pi), abs=1e-9)
    assert T_975[2] == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), abs=1e-9)
