"""largebatch experiment, the optimizers and noise-scale experiments at smoke size: seeds, noise
floors and verdicts against the runs' metrics.jsonl (recomputed here), the same verdicts at 1 and 2
torch threads; and the GPU check's code paths on CPU. (tests/test_experiments.py holds the seesaw
experiment and the runner; the two files run in parallel under `make test`.)"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.experiments import cli
from largebatch.experiments.report import ESCAPE_HEADER, fmt_loss
from test_experiments import ROOT, assert_png, load_jsonl, parse_tables


def test_gpu_check_code_paths_on_cpu(capsys, one_thread):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    # --no-fused: LAMB/LANS(fused=True) compile for ~28 s here; tests/test_optim_fused.py compiles
    # and checks them, and the GPU run takes them (the same timing loop, two more entries)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--no-fused"]) == 0
    text = capsys.readouterr().out
    for name in ("sdpa/none", "sdpa/selective", "sdpa/full", "explicit/none", "explicit/full",
                 "AdamW(foreach=True)", "LAMB", "LANS", "cosine", "seesaw r=1/2"):
        assert re.search(rf"^{re.escape(name)}\s", text, re.M), name
    # no fused paths, and no fused peer timed with nothing to compare it with
    assert "LAMB(fused=True)" not in text and "LANS(fused=True)" not in text and "AdamW(fused=True)" not in text
    # asked for the GPU where there is none: one line, not a traceback
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cuda", "--tiny"] if not torch.cuda.is_available() else ["--help"])
    assert "no CUDA device here" in capsys.readouterr().err or torch.cuda.is_available()
    assert "OOM" not in text
    assert "optimizer (model)" in text and "optimizer (small tensors)" in text
    # the ~350M GPT the GPU run uses really is ~350M parameters (12 L h^2 + embeddings)
    big = gpu_check.BIG
    approx = 12 * big.n_layer * big.n_embd ** 2 + (big.vocab_size + big.seq_len) * big.n_embd
    assert 330e6 < approx < 370e6
    seesaw = re.search(r"^seesaw r=1/2\s+(\d+)", text, re.M)
    cosine = re.search(r"^cosine\s+(\d+)", text, re.M)
    assert int(seesaw.group(1)) < int(cosine.group(1))  # fewer steps at equal tokens


# ---------------------------------------------------------------- optimizers and noise-scale: seeds, floor, verdicts
T_975_1DF = 12.706  # Student t(0.975) at 1 degree of freedom: the 95% interval over the default 2 seeds


def _smoke(factory, name: str, threads: int = 1) -> Path:
    """One smoke run of an experiment at ``threads`` torch threads (the default 2 seeds)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = factory.mktemp("smoke") / f"{name}-{threads}"
        assert cli.main([name, "--smoke", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(previous)
    return out


@pytest.fixture(scope="module")
def optimizers_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "optimizers")


@pytest.fixture(scope="module")
def noise_scale_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "noise-scale")


def _final(out: Path, arm: str) -> float:
    return load_jsonl(out / "runs" / arm / "metrics.jsonl")[1][-1]["val_loss"]


def _expected_verdict(gaps: list[float], floor: float, worse: str, better: str) -> str:
    """floor.verdict, written out again: the t interval excludes 0 and the mean exceeds the floor."""
    g = np.array(gaps)
    half = T_975_1DF * g.std(ddof=1) / np.sqrt(len(g))
    low, high = g.mean() - half, g.mean() + half
    if high - low <= 1e-12:
        return "the same gap at every seed (sd 0): no interval, no difference established"
    if low <= 0 <= high:
        return "interval contains 0: no difference established"
    if abs(g.mean()) <= floor:
        return f"within the noise floor {floor:.4f}: no difference established"
    return worse if low > 0 else better


def _check_comparison(row: dict[str, str], gaps: list[float], floor: float, worse: str, better: str,
                      tol: float = 5.1e-5, bounds: tuple[float, float] | None = None) -> str:
    """The row's mean, sd, interval, floor and verdict against the gaps recomputed from the runs
    (``tol``: the rounding of the printed numbers, and of the inputs when they come from a report;
    ``bounds``: the values' own range, to which the printed interval is cut)."""
    g = np.array(gaps)
    assert int(row["seeds"]) == len(g) == 2
    assert float(row["mean"]) == pytest.approx(g.mean(), abs=tol)
    assert float(row["sd"]) == pytest.approx(g.std(ddof=1), abs=tol)
    half = T_975_1DF * g.std(ddof=1) / np.sqrt(2)
    low, high = (float(v) for v in re.findall(r"[-+][\d.]+", row["95% CI of the mean"]))
    expected_ci = (g.mean() - half, g.mean() + half)
    if bounds is not None:
        expected_ci = (max(expected_ci[0], bounds[0]), min(expected_ci[1], bounds[1]))
    assert (low, high) == pytest.approx(expected_ci, abs=T_975_1DF * tol)
    assert float(row["noise floor"]) == pytest.approx(floor, abs=tol)
    expected = _expected_verdict(gaps, floor, worse, better)
    assert row["verdict"] == expected, (row, gaps, floor)
    return expected


def _expected_escape(out: Path, arm: str) -> str:
    """ArmResult.plateau_escape + fmt_escape, written out again from metrics.jsonl and summary.json."""
    train, val = load_jsonl(out / "runs" / arm / "metrics.jsonl")
    target = json.loads((out / "runs" / arm / "summary.json").read_text())["unigram_val_loss"] - 0.25
    for before, record in zip([None] + val, val):
        if record["val_loss"] <= target:
            if before is None:
                return f"step {record['step']:.0f} ({100 * record['tokens'] / train[-1]['tokens']:.0f}%)"
            w = (before["val_loss"] - target) / (before["val_loss"] - record["val_loss"])
            step = before["step"] + w * (record["step"] - before["step"])
            tokens = before["tokens"] + w * (record["tokens"] - before["tokens"])
            return f"step {step:.0f} ({100 * tokens / train[-1]['tokens']:.0f}%)"
    return "never"


def _claims(report: str) -> dict[str, str]:
    """{claim: agrees | contradicts | not resolvable at this scale} from "What this shows"."""
    return dict(re.findall(r"^- (.+?): \*\*(agrees|contradicts|not resolvable at this scale)\*\*", report, re.M))


def _status(verdict: str, agrees: str, contradicts: str) -> str:
    return "agrees" if verdict == agrees else "contradicts" if verdict == contradicts else \
        "not resolvable at this scale"


def test_optimizers_smoke_report_agrees_with_metrics(optimizers_smoke, one_thread):
    """Best LR on the first seed, that arm at 2 seeds; each gap to AdamW, each degradation from batch B
    to 8B and its difference from AdamW's: mean, sd, t interval, data-order floor and verdict, all
    recomputed from the runs' metrics.jsonl; each claim's status follows its verdict."""
    from largebatch.experiments import optimizers

    out = optimizers_smoke
    report = (out / "report.md").read_text()
    assert f"largebatch experiment optimizers --smoke --out {out}" in report
    assert "Every arm ran with 1 torch thread(s)." in report
    assert "LARS's own settings: schedule.warmup 0.25, optim.trust_coefficient 0.001" in report
    tables = parse_tables(report)
    best = next(t for t in tables if t and "batch 2" in t[0] and "optimizer" in t[0])
    assert all("(one LR: not tuned" in row[f"batch {b}"] for row in best for b in (2, 16, 64))  # a 1-point grid
    every = next(t for t in tables if t and "seed" in t[0] and "arm" in t[0])
    grid = next(t for t in tables if t and "arm" in t[0] and "seed" not in t[0])
    assert len(grid) == 12 and len(every) == 24  # 4 optimizers x 3 batches; each best arm at 2 seeds
    arm_of = {(r["optimizer"], int(r["batch"]), r["seed"]): r["arm"] for r in every}
    for row in every:
        train, val = load_jsonl(out / "runs" / row["arm"] / "metrics.jsonl")
        assert float(row["final val loss"]) == pytest.approx(val[-1]["val_loss"], abs=5.1e-5)
        assert int(row["optimizer steps"]) == train[-1]["step"]
        assert row["off the plateau (val < unigram - 0.25)"] == _expected_escape(out, row["arm"])
        overrides = json.loads((out / "runs" / row["arm"] / "arm.json").read_text())["overrides"]
        if row["seed"] == "7":
            assert overrides["run.seed"] == overrides["data.seed"] == 7
            first = arm_of[(row["optimizer"], int(row["batch"]), "1337")]
            assert row["arm"] == first + "-seed7" and row["peak lr"] in first  # the first seed's best LR
        if row["optimizer"] == "lars":  # LARS's warmup, as the report states
            assert overrides["schedule.warmup"] == 0.25 and overrides["optim.trust_coefficient"] == 0.001
        else:
            assert overrides["schedule.warmup"] == 0.1  # the shared warmup
    for row in grid:  # the grid's best (lowest final loss) per cell is the seed-1337 best-LR arm
        cell = [r for r in grid if r["optimizer"] == row["optimizer"] and r["batch"] == row["batch"]]
        assert arm_of[(row["optimizer"], int(row["batch"]), "1337")] == min(
            cell, key=lambda r: _final(out, r["arm"]))["arm"]
    batches = [2, 16, 64]
    claims = _claims(report)
    stuck_runs = {r["arm"] for r in every if _expected_escape(out, r["arm"]) == "never"}

    def judged(verdict, agrees, contradicts, *pairs):  # a seed whose compared runs both stayed on the plateau
        both = any(all(arm_of[(n, b, seed)] in stuck_runs for n, b in pair) for pair in pairs for seed in ("1337", "7"))
        return "not resolvable at this scale" if both else _status(verdict, agrees, contradicts)

    def loss(name, batch, seed, kind=""):
        return _final(out, arm_of[(name, batch, "1337")] + kind if kind else arm_of[(name, batch, seed)])

    def floor_of(diff):
        return abs(diff("1337", "-data") - diff("1337"))

    gap_rows = next(t for t in tables if t and "optimizer" in t[0] and "verdict" in t[0])
    assert [(int(r["batch"]), r["optimizer"]) for r in gap_rows] == [
        (b, n) for b in batches for n in ("lamb", "lans", "lars")]
    verdicts = {}
    for row in gap_rows:
        name, b = row["optimizer"], int(row["batch"])

        def diff(seed, kind="", name=name, b=b):
            return loss(name, b, seed, kind) - loss("adamw", b, seed, kind)
        verdicts[(name, b)] = _check_comparison(row, [diff("1337"), diff("7")], floor_of(diff),
                                                "worse than adamw", "better than adamw")
        # the floor's own arm: every seed-1337 best arm re-run with data.seed 1 and the same init
        data = json.loads((out / "runs" / (arm_of[(name, b, "1337")] + "-data") / "arm.json").read_text())
        assert data["overrides"]["data.seed"] == 1 and data["overrides"].get("run.seed", 1337) == 1337
    degrade_rows = {r["comparison"]: r for t in tables if t and "comparison" in t[0] and "verdict" in t[0]
                    for r in t}
    for name in optimizers.OPTIMIZERS:
        def degrade(seed, kind="", name=name):
            return loss(name, 16, seed, kind) - loss(name, 2, seed, kind)
        v = _check_comparison(degrade_rows[f"{name}: batch 16 - batch 2"], [degrade("1337"), degrade("7")],
                              floor_of(degrade), "degrades", "improves")
        own = ((name, 2), (name, 16))
        if name == "adamw":
            assert claims["adamw degrades from batch 2 to 16 at equal tokens (the papers' premise)"] == \
                judged(v, "degrades", "improves", own)
            continue
        assert claims[f"{name} holds its loss from batch 2 to 16 at equal tokens (its paper's claim)"] == \
            judged(v, "improves", "degrades", own)

        def relative(seed, kind="", name=name):
            return (loss(name, 16, seed, kind) - loss(name, 2, seed, kind)
                    - (loss("adamw", 16, seed, kind) - loss("adamw", 2, seed, kind)))
        v = _check_comparison(degrade_rows[f"{name} minus adamw"], [relative("1337"), relative("7")],
                              floor_of(relative), "degrades more than adamw", "degrades less than adamw")
        if name in ("lamb", "lans"):
            assert claims[f"{name} degrades less than adamw from batch 2 to 16 (the papers' claim)"] == \
                judged(v, "degrades less than adamw", "degrades more than adamw", own, (("adamw", 2), ("adamw", 16)))
            for b in batches[1:]:
                assert claims[f"{name} beats adamw at batch {b}"] == judged(
                    verdicts[(name, b)], "better than adamw", "worse than adamw", ((name, b), ("adamw", b)))
    for b in batches:
        key = next(c for c in claims if c.startswith(f"lars trails adamw on this transformer at batch {b} "))
        assert claims[key] == judged(verdicts[("lars", b)], "worse than adamw", "better than adamw",
                                     (("lars", b), ("adamw", b)))
    assert "LARS fails" not in report and "does not carry over" not in report
    stuck = sum(_expected_escape(out, r["arm"]) == "never" for r in every)
    assert f"never leave the unigram plateau: {stuck} of 24" in report
    for name in ("loss_vs_batch.png", "val_loss.png"):
        assert_png(out / name)


def test_noise_scale_smoke_report_agrees_with_metrics(noise_scale_smoke, one_thread):
    """Every arm at 2 seeds: the paired gaps to constant batch (and capped minus uncapped) and the
    Spearman rho per seed, with intervals, data-order floors and verdicts recomputed from the runs."""
    out = noise_scale_smoke
    report = (out / "report.md").read_text()
    assert f"largebatch experiment noise-scale --smoke --out {out}" in report
    assert "Every arm ran with 1 torch thread(s)." in report
    tables = parse_tables(report)
    arms_table = next(t for t in tables if t and "final B_simple" in t[0] and "arm" in t[0])
    assert [r["arm"] for r in arms_table] == ["constant", "seesaw", "seesaw-capped", "constant-seed7",
                                              "seesaw-seed7", "seesaw-capped-seed7"]
    for row in arms_table:
        _, val = load_jsonl(out / "runs" / row["arm"] / "metrics.jsonl")
        assert float(row["final val loss"]) == pytest.approx(val[-1]["val_loss"], abs=5.1e-5)
        assert row["off the plateau (val < unigram - 0.25)"] == _expected_escape(out, row["arm"])

    def rho(arm):  # numpy's Pearson correlation of the ranks
        train, _ = load_jsonl(out / "runs" / arm / "metrics.jsonl")
        records = [r for r in train if r["noise_scale"] is not None]
        ranks = lambda v: np.argsort(np.argsort(v)).astype(np.float64)  # noqa: E731
        return np.corrcoef(ranks([r["loss"] for r in records]), ranks([r["noise_scale"] for r in records]))[0, 1]

    per_seed = next(t for t in tables if t and "seed" in t[0] and "arm" not in t[0])
    assert [r["seed"] for r in per_seed] == ["1337", "7"]
    for row, arm in zip(per_seed, ("constant", "constant-seed7")):
        assert float(row["Spearman rho(train loss, B_simple)"]) == pytest.approx(rho(arm), abs=5.1e-5)
    rows = {r["comparison"]: r for t in tables if t and "verdict" in t[0] for r in t}
    claims = _claims(report)
    for name, (a, b) in {"seesaw - constant": ("seesaw", "constant"),
                         "seesaw-capped - constant": ("seesaw-capped", "constant"),
                         "seesaw-capped - seesaw": ("seesaw-capped", "seesaw")}.items():
        gaps = [_final(out, a + s) - _final(out, b + s) for s in ("", "-seed7")]
        moved = _final(out, a + "-data") - _final(out, b + "-data")
        _check_comparison(rows[name], gaps, abs(moved - gaps[0]), "worse", "better")
    v = _check_comparison(rows["Spearman rho(train loss, B_simple), constant batch"],
                          [rho("constant"), rho("constant-seed7")], abs(rho("constant-data") - rho("constant")),
                          "positive: B_simple falls with the loss", "negative: B_simple grows as the loss falls",
                          bounds=(-1.0, 1.0))
    assert claims["B_simple grows as the training loss falls (McCandlish et al. 2018)"] == _status(
        v, "negative: B_simple grows as the loss falls", "positive: B_simple falls with the loss")
    assert claims["Seesaw capped at B_simple ends below constant batch"] == _status(
        rows["seesaw-capped - constant"]["verdict"], "better", "worse")
    # the B_simple checkpoints are the first seed's constant arm
    checkpoints = next(t for t in tables if t and "point" in t[0])
    train, _ = load_jsonl(out / "runs" / "constant" / "metrics.jsonl")
    assert float(checkpoints[-1]["B_simple"]) == pytest.approx(train[-1]["noise_scale"], abs=0.051)
    assert_png(out / "noise_scale.png")


@pytest.fixture(scope="module")
def bert_lans_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "bert-lans")


def test_bert_lans_smoke_two_phases_floor_and_downstream(bert_lans_smoke, one_thread):
    """Each arm is the two-phase recipe with only the optimizer (and AdamW's LR scale) changed; the
    report's losses are the runs' last validation records, its per-phase losses the mean of the
    records at each phase's end; every pair's loss, fine-tuned and probe gaps, their noise floor (the
    seed-1337 arms pretrained again with another data order) and verdicts are recomputed from the
    runs and the per-arm downstream accuracies; and --resume --jobs 2 gives the same report, running
    again only the fine-tuning whose inputs changed or whose outcome is missing."""
    from largebatch.experiments import bert_lans

    out = bert_lans_smoke
    report = (out / "report.md").read_text()
    means, pairs, floors, every = parse_tables(report)
    lrs = bert_lans.recipe_lrs()
    optimizers = ("lans", "lamb", "adamw")
    names = [f"{o}{s}" for s in ("", "-seed7", "-data") for o in optimizers]
    assert [row["arm"] for row in every] == names
    value: dict[str, dict[str, float]] = {"val loss": {}, "fine-tuned accuracy": {}, "probe accuracy": {}}
    phase_ends: dict[str, list[list[float]]] = {o: [] for o in optimizers}
    for row in every:
        name = row["arm"]
        run_dir = out / "runs" / name
        cfg = (run_dir / "config.toml").read_text()
        assert f'name = "{name.split("-")[0]}"' in cfg
        train, val = load_jsonl(run_dir / "metrics.jsonl")
        assert {r["phase"] for r in train} == {0, 1}
        assert {r["seq_len"] for r in train} == {16, 32}
        assert row["final val loss"] == fmt_loss(val[-1]["val_loss"])
        assert row[ESCAPE_HEADER] == _expected_escape(out, name)
        scale = bert_lans.ADAMW_LR_SCALE if name.startswith("adamw") else 1.0
        peak = max(r["lr"] for r in train if r["phase"] == 0)
        assert peak <= lrs[0] * scale * (1 + 1e-9) and peak > 0.5 * lrs[0] * scale
        if not name.endswith("-data"):
            summary = json.loads((run_dir / "summary.json").read_text())
            phase_ends[name.split("-")[0]].append(summary["phase_val_losses"])
        accuracies = [float(a) for a in row["downstream accuracy per seed"].split(", ")]
        assert len(accuracies) == 2 and all(0 <= a <= 1 for a in accuracies)
        assert 0 <= float(row["probe accuracy"]) <= 1
        value["val loss"][name] = val[-1]["val_loss"]
        value["fine-tuned accuracy"][name] = sum(accuracies) / 2
        value["probe accuracy"][name] = float(row["probe accuracy"])
    for o in optimizers:
        mean_row = next(r for r in means if r["optimizer"] == o)
        assert mean_row["val loss at each phase's end"] == " / ".join(
            fmt_loss(sum(p[i] for p in phase_ends[o]) / 2) for i in range(2))
    claims = _claims(report)
    expected_claims = {}
    rows = iter(pairs)
    for a, b in (("lans", "lamb"), ("lans", "adamw"), ("lamb", "adamw")):
        for measure in ("val loss", "fine-tuned accuracy", "probe accuracy"):
            row = next(rows)
            assert row["comparison"] == f"{a} - {b}: {measure}"
            floor_row = next(r for r in floors if r["comparison"] == row["comparison"])
            v = value[measure]
            gaps = [v[a + s] - v[b + s] for s in ("", "-seed7")]
            floor = abs((v[a + "-data"] - v[b + "-data"]) - gaps[0])
            tol = 5.1e-5 if measure == "val loss" else 2.1e-4  # accuracies re-read from the report
            assert float(floor_row["noise floor"]) == pytest.approx(floor, abs=tol)
            higher, lower = (f"{a} worse", f"{a} better") if measure == "val loss" else (f"{a} better",
                                                                                          f"{a} worse")
            verdict = _check_comparison(row, gaps, floor, higher, lower, tol)
            expected_claims[(a, b, measure)] = _status(verdict, f"{a} better", f"{a} worse")
    assert claims == {
        "LANS ends below LAMB in masked-LM loss at equal tokens (Zheng et al. 2020)":
            expected_claims[("lans", "lamb", "val loss")],
        "LANS's encoder fine-tunes better downstream than LAMB's":
            expected_claims[("lans", "lamb", "fine-tuned accuracy")],
        "LANS's encoder probes better downstream than LAMB's": expected_claims[("lans", "lamb", "probe accuracy")],
        "LANS ends below AdamW (AdamW at 0.1x the LR, not tuned)": expected_claims[("lans", "adamw", "val loss")]}
    assert "Downstream from random init (scratch)" in report
    assert_png(out / "val_loss.png")

    # --resume keeps the arms and each fine-tuning outcome whose inputs are unchanged; the rest run
    # again, split over two worker processes: the same report
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "downstream").glob("*.json")}
    assert len(kept) == 2 * len(names) + 2  # 2 fine-tuning seeds per arm and for scratch
    (out / "downstream" / "lamb-seed1000.json").unlink()
    (out / "downstream" / "scratch-seed1001.json").unlink()
    summary = out / "runs" / "adamw-seed7" / "summary.json"  # as if the arm had been trained again
    summary.write_text(summary.read_text() + "\n")
    assert cli.main(["bert-lans", "--smoke", "--out", str(out), "--resume", "--jobs", "2"]) == 0
    redone = {"lamb-seed1000.json", "scratch-seed1001.json", "adamw-seed7-seed1000.json",
              "adamw-seed7-seed1001.json"}
    after = {p.name: p.stat().st_mtime_ns for p in (out / "downstream").glob("*.json")}
    assert after.keys() == kept.keys()
    assert {name for name in kept if after[name] != kept[name]} == redone
    again = (out / "report.md").read_text()
    assert parse_tables(again) == parse_tables(report)
    assert [line for line in again.splitlines() if "scratch" in line] == \
        [line for line in report.splitlines() if "scratch" in line]


def _all_verdicts(report: str) -> list[str]:
    """Every verdict cell of a report's tables and every claim's status."""
    cells = [r["verdict"] for t in parse_tables(report) for r in t if "verdict" in r]
    return cells + list(_claims(report).values())


def test_optimizers_noise_scale_and_bert_lans_verdicts_do_not_change_with_the_thread_count(
        tmp_path_factory, optimizers_smoke, noise_scale_smoke, bert_lans_smoke):
    """Each verdict and claim status is the same with the arms at 1 and at 2 torch threads. These
    smoke arms are not bit for bit the same at 2 threads (measured): the optimizers
    arms at micro-batch 16-32 and the noise-scale arms' B_simple move in the 7th-8th digit, and the
    losses follow a few steps later; the verdicts do not move."""
    smallest = {"optimizers": 29, "noise-scale": 8, "bert-lans": 9 + 4}
    for name, one in (("optimizers", optimizers_smoke), ("noise-scale", noise_scale_smoke),
                      ("bert-lans", bert_lans_smoke)):
        two = _smoke(tmp_path_factory, name, threads=2)
        assert "Every arm ran with 2 torch thread(s)." in (two / "report.md").read_text()
        verdicts = [_all_verdicts((out / "report.md").read_text()) for out in (one, two)]
        assert len(verdicts[0]) >= smallest[name] and verdicts[0] == verdicts[1], name


def test_floor_claims_and_infinite_floors():
    from largebatch.experiments import floor

    assert floor.claim("better than adamw", "better than adamw", "worse than adamw") == floor.AGREES
    assert floor.claim("worse than adamw", "better than adamw", "worse than adamw") == floor.CONTRADICTS
    for v in ("interval contains 0: no difference established", "one seed: no interval", "no finite gap",
              "within the noise floor 0.1000: no difference established"):
        assert floor.claim(v, "better", "worse") == floor.UNRESOLVED
    assert floor.Floor("a", 0.1, {"data": 0.3, "init": 0.05}).floor == pytest.approx(0.2)
    assert floor.threads_sentence(1, ("threads", "data")) == \
        "Every arm ran with 1 torch thread(s), except the thread-count floor arms, which ran with 2."
    assert floor.threads_sentence(2, ("data",)) == "Every arm ran with 2 torch thread(s)."
    assert floor.Floor("a", 0.1, {"data": math.inf}).floor == math.inf  # an arm diverged under it
    gaps = floor.compare("x", lambda rs: rs[1] - rs[0], [[1.0, 1.5], [1.0, 1.52]], {"data": [2.0, 2.4]},
                         "worse", "better")
    assert gaps.gaps.gaps == [0.5, pytest.approx(0.52)] and gaps.floor.floor == pytest.approx(0.1)
    assert gaps.verdict == _expected_verdict([0.5, 0.52], 0.1, "worse", "better") == "worse"
    above = floor.compare("x", lambda rs: rs[1] - rs[0], [[1.0, 1.5], [1.0, 1.52]], {"data": [2.0, 3.2]},
                          "worse", "better")  # the same interval, a floor of 0.7 above its mean 0.51
    assert above.verdict == "within the noise floor 0.7000: no difference established"
    assert floor.compare("x", lambda rs: rs[1] - rs[0], [[1.0, 1.5]], {}, "worse", "better").verdict == \
        "one seed: no interval"


def test_a_diverged_seed_or_the_same_gap_at_every_seed_establishes_nothing():
    """A comparison whose arm diverged at one seed (an infinite gap) was judged on the other seeds
    while its row counted them all: 'better' over 5 seeds from 4, and a claim 'agrees'. And 'the same
    gap at every seed' was read from the interval's width, which t = 12.7 widens past SAME_GAP at 2
    seeds: gaps 5e-13 apart were 'worse' here and 'the same' in fine-tuning's verdicts."""
    from largebatch.experiments import floor
    from largebatch.stats import SAME_GAP

    diff = lambda rs: rs[1] - rs[0]  # noqa: E731
    diverged = floor.compare("x", diff, [[1.0, 0.9], [1.0, 0.89], [1.0, math.inf], [1.0, 0.88], [1.0, 0.87]],
                             {}, "worse", "better")
    assert diverged.gaps.nonfinite == 1 and len(diverged.gaps.finite) == 4
    assert _expected_verdict(diverged.gaps.finite, 0.0, "worse", "better") == "better"  # on the four alone
    assert diverged.verdict == ("a non-finite value at 1 seed(s) (a run diverged, or the statistic is undefined): "
                                "no difference established")
    assert floor.claim(diverged.verdict, "better", "worse") == floor.UNRESOLVED
    g = diverged.gaps
    assert floor.claim_verdict(g.mean, g.ci95, 0.0, "same", values=g.finite, nonfinite=g.nonfinite) == \
        "not resolvable at this scale (a non-finite value at 1 seed(s) (a run diverged, or the statistic is undefined))"
    same = floor.compare("x", diff, [[1.0, 1.25], [1.0, 1.25 + 5e-13]], {}, "worse", "better")
    low, high = same.gaps.ci95
    assert high - low > SAME_GAP  # the interval is wider than the values' spread
    assert same.verdict == "the same gap at every seed (sd 0): no interval, no difference established"
    g = same.gaps
    assert floor.claim_verdict(g.mean, g.ci95, 0.0, "worse", values=g.finite) == \
        "not resolvable at this scale (the same gap at every seed: sd 0, no interval)"


def test_noise_scale_claims_of_runs_that_never_left_the_plateau_are_not_resolvable():
    """noise-scale judged Seesaw against constant batch when both runs of every seed ended on the
    unigram plateau ('agrees', beside 'never leave the unigram plateau: 9 of 9'), where seesaw and
    optimizers call such a gap not resolvable: it measures when each run would have escaped."""
    from largebatch.experiments import floor, noise_scale
    from largebatch.experiments.runner import Arm, ArmResult

    def result(name: str, loss: float, unigram: float = 5.2) -> ArmResult:
        val = [{"step": 0, "tokens": 0, "val_loss": 6.2}, {"step": 10, "tokens": 2000, "val_loss": loss}]
        train = [{"step": s, "tokens": 200 * s, "batch_size": 8, "loss": 6 - 0.01 * s, "noise_scale": 5.0 + s}
                 for s in range(1, 11)]
        return ArmResult(Arm(name, {}), Path("."), {"unigram_val_loss": unigram}, train, val, 1.0)

    def claims(offset: float) -> dict[str, str]:  # losses at unigram 5.2 - offset: on it for offset < 0.25
        per_seed = [[result(f"{arm}{seed}", 5.2 - offset + loss + 0.003 * k * (1 + i))
                     for i, (arm, loss) in enumerate((("constant", 0.1), ("seesaw", 0.0), ("seesaw-capped", 0.01)))]
                    for k, seed in enumerate(("", "-seed7", "-seed11"))]
        comparisons = [floor.compare(name, lambda rs, i=i, j=j: rs[i].final_val_loss - rs[j].final_val_loss,
                                     per_seed, {}, "worse", "better") for name, i, j in noise_scale.COMPARISONS]
        rho = floor.compare(noise_scale.RHO, lambda rs: noise_scale.loss_noise_rho(rs[0]), per_seed, {},
                            "positive", "negative", bounds=(-1.0, 1.0))
        return _claims(noise_scale.findings(comparisons, rho, per_seed))

    seesaw = "Seesaw r=1/2 ends below constant batch at equal tokens, with fewer steps"
    assert claims(1.0)[seesaw] == floor.AGREES  # every run off the plateau: the interval decides
    assert claims(0.0)[seesaw] == floor.UNRESOLVED  # the same gaps, every run on it
