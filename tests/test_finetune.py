"""`largebatch finetune`: downstream tasks that hold out whole documents, the paired interval, and
a real tiny BERT run fine-tuned against the same model from scratch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from largebatch.cli import main as cli_main
from largebatch.data.corpus import bible_documents, shakespeare_documents
from largebatch.data.tasks import FOLIO, TaskError, build_task, document_folds
from largebatch.data.tokenizer import train_tokenizer
from largebatch.stats import T_975, ci95
from largebatch.train.config import load_config
from test_export import tiny, train


@pytest.fixture(scope="module")
def tokenizer():
    docs = shakespeare_documents() + bible_documents()
    return train_tokenizer([d.text[:20_000] for d in docs], 600)  # byte-level BPE, ~3 s


def test_folio_classes_are_the_first_folio_catalogue():
    """The 1623 Folio prints 14 comedies, 10 histories and 12 tragedies (36 plays); every one of them is
    in the corpus, and none is listed twice."""
    assert {c: len(p) for c, p in FOLIO.items()} == {"comedy": 14, "history": 10, "tragedy": 12}
    plays = [p for ps in FOLIO.values() for p in ps]
    names = {d.name.split("/", 1)[1] for d in shakespeare_documents()}
    assert len(set(plays)) == 36 and set(plays) <= names
    assert "pericles" in names - set(plays)  # not in the Folio


@pytest.mark.parametrize("task", ["folio-genre", "bible-division"])
def test_tasks_hold_out_whole_documents_and_cut_real_windows(task, tokenizer):
    data = build_task(task, tokenizer, passage_len=64, passages_per_document=5, test_fraction=0.2, seed=3)
    assert not set(data.train_documents) & set(data.test_documents)
    for labels in (data.train_labels, data.test_labels):  # every class on both sides
        assert set(labels.tolist()) == set(range(len(data.classes)))
    assert data.train_ids.shape[1] == data.test_ids.shape[1] == 64
    assert len(data.train_ids) == len(data.train_labels) and len(data.test_ids) == len(data.test_labels)
    # every passage is real text of the document it is attributed to (byte-level BPE decodes losslessly)
    docs = {d.name: d.text for d in shakespeare_documents() + bible_documents()}
    for ids, source in [*zip(data.train_ids, data.train_sources), *zip(data.test_ids, data.test_sources)]:
        assert tokenizer.decode(ids.tolist()) in docs[source]
    assert max(data.train_sources.count(n) for n in data.train_documents) == 5
    # a different split seed holds out different documents
    other = build_task(task, tokenizer, passage_len=64, passages_per_document=5, test_fraction=0.2, seed=4)
    assert other.test_documents != data.test_documents


def test_document_folds_test_every_passage_once_on_unseen_documents(tokenizer):
    data = build_task("bible-division", tokenizer, passage_len=16, passages_per_document=2, seed=1)
    folds = document_folds(data, 5)
    everything = sorted(zip(data.train_sources + data.test_sources,
                            map(tuple, np.concatenate([data.train_ids, data.test_ids]).tolist())))
    tested = sorted((s, tuple(ids)) for f in folds for s, ids in zip(f.test_sources, f.test_ids.tolist()))
    assert tested == everything  # every passage tested exactly once
    for f in folds:
        assert not set(f.train_documents) & set(f.test_documents)
        assert len(f.train_ids) + len(f.test_ids) == len(everything)
        assert set(f.test_labels.tolist()) == set(range(6))  # law has 5 books: one per fold
    for bad in (1, True):
        with pytest.raises(TaskError, match=f"folds = {bad!r}"):
            document_folds(data, bad)
    label_of = dict(zip(data.train_sources + data.test_sources, np.concatenate([data.train_labels,
                                                                                  data.test_labels]).tolist()))
    largest = max(list(label_of.values()).count(c) for c in range(6))  # books long enough for a passage
    with pytest.raises(TaskError, match=f"from 2 to {largest} "):
        document_folds(data, largest + 1)


def test_linear_probe_reaches_the_optimum_of_its_objective(bert_run):
    """The probe's weights satisfy the optimality condition of l2-penalised multinomial logistic
    regression, written here in numpy float64: Z^T (softmax(ZW + b) - Y) / n + 2 l2 W = 0 and
    mean(softmax(ZW + b) - Y) = 0, on real features of the trained encoder."""
    from largebatch.export import load_run
    from largebatch.finetune import linear_probe, pooled_features

    loaded = load_run(str(bert_run))
    encoder = loaded.model
    data = build_task("bible-division", loaded.tokenizer, passage_len=32, passages_per_document=3, seed=0)
    x, xt = pooled_features(encoder, data.train_ids), pooled_features(encoder, data.test_ids)
    predictions, fit = linear_probe(x, data.train_labels, xt, l2=0.01)
    z, w, b = fit["z"].numpy(), fit["w"].numpy(), fit["b"].numpy()
    logits = z @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.eye(w.shape[1])[data.train_labels]
    assert np.abs(z.T @ (p - y) / len(z) + 2 * 0.01 * w).max() < 1e-6
    assert np.abs((p - y).mean(0)).max() < 1e-6
    assert np.abs(z.mean(0)).max() < 1e-9 and np.allclose(z.std(0, ddof=1), 1, atol=1e-4)
    assert predictions.shape == (len(data.test_ids),)


def _t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t from its density, integrated in float64 (Simpson, bisection)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf_above_zero(t, n=4000):
        h = t / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_above_zero(mid) < 0.475 else (lo, mid)
    return lo


def test_interval_matches_students_t_from_its_density():
    for df, t in T_975.items():
        assert t == pytest.approx(_t_quantile_975(df), abs=1.5e-3)
    values = [0.61, 0.55, 0.70, 0.64]
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    half = _t_quantile_975(3) * sd / 2
    lo, hi = ci95(values)
    assert (lo, hi) == pytest.approx((mean - half, mean + half), rel=2e-4)
    assert ci95([0.5]) is None


def test_an_arms_accuracy_interval_stays_in_zero_one():
    """Two seeds' accuracies 0.4286 and 0.2857 (6 and 4 of 14) give a t interval of about
    [-0.55, 1.26]: an accuracy lies in [0, 1], so it is clipped there; equal accuracies (sd 0) and
    one seed give none, as the gap does."""
    from largebatch.finetune import _accuracy_ci

    values = [6 / 14, 4 / 14]
    mean, half = sum(values) / 2, _t_quantile_975(1) * abs(values[0] - values[1]) / 2  # sd/sqrt(2) = |d|/2
    assert mean - half < 0 and mean + half > 1
    assert _accuracy_ci(values) == (0.0, 1.0)
    inside = [0.50, 0.55, 0.60]
    n_mean, n_half = 0.55, _t_quantile_975(2) * 0.05 / math.sqrt(3)
    assert _accuracy_ci(inside) == pytest.approx((n_mean - n_half, n_mean + n_half), rel=2e-4)
    assert _accuracy_ci([5 / 14] * 3) is None and _accuracy_ci([0.5]) is None


def test_verdict_needs_gaps_that_differ_between_seeds():
    """The paired t interval over the seeds' gaps, recomputed here from the t density; gaps equal at
    every seed (sd 0) give no interval and no verdict of help or harm, however far from 0. The
    last pair is one count out of 14 at both seeds, equal up to float rounding."""
    from largebatch.finetune import _verdict

    for gaps in ([-1 / 14] * 2, [0.25] * 3, [4 / 14 - 5 / 14, 5 / 14 - 6 / 14]):
        ci, verdict = _verdict(gaps)
        assert ci is None, (gaps, ci)
        assert verdict.startswith("no difference established") and "sd 0" in verdict, verdict
    for gaps, expect in (([0.10, 0.14, 0.12], "pretraining helped"), ([-0.10, -0.14, -0.12], "pretraining hurt"),
                         ([0.10, -0.02, 0.05], "no difference established")):
        n = len(gaps)
        mean = sum(gaps) / n
        half = _t_quantile_975(n - 1) * math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1)) / math.sqrt(n)
        ci, verdict = _verdict(gaps)
        assert ci == pytest.approx((mean - half, mean + half), rel=2e-4)
        assert verdict == expect and (mean - half > 0 or mean + half < 0) == (expect != "no difference established")


@pytest.fixture(scope="module")
def bert_run(tiny_data_cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "bert"
    return train(tiny(tiny_data_cache, run, **{"model.kind": "bert", "model.seq_len": 64, "model.dropout": 0.0,
                                     "optim.name": "lans", "schedule.lr_schedule": "lans"}))


def test_finetune_compares_pretrained_and_scratch_on_held_out_documents(bert_run, capsys):
    code = cli_main(["finetune", str(bert_run), "--seeds", "2", "--epochs", "2", "--passages-per-document", "3",
                     "--passage-len", "32", "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((bert_run / "finetune" / "folio-genre.json").read_text())
    assert (bert_run / "finetune" / "folio-genre.md").read_text() in out
    n_test = len(report["test_documents"]) * 3
    for arm in ("pretrained", "scratch"):
        for r in report["arms"][arm]:
            assert r["test_accuracy"] * n_test == pytest.approx(round(r["test_accuracy"] * n_test))
    acc = {arm: [r["test_accuracy"] for r in report["arms"][arm]] for arm in ("pretrained", "scratch")}
    assert report["gap"]["per_seed"] == pytest.approx([p - s for p, s in zip(acc["pretrained"], acc["scratch"])])
    assert report["gap"]["ci95"] == pytest.approx(list(ci95(report["gap"]["per_seed"])))
    # the arms differ only in the encoder's start: had the checkpoint not been loaded, the first
    # epoch's losses of a seed would be identical
    for p, s in zip(report["arms"]["pretrained"], report["arms"]["scratch"]):
        assert p["first_epoch_loss"] != s["first_epoch_loss"]
    assert not set(report["train_documents"]) & set(report["test_documents"])
    assert report["verdict"] in out and np.isfinite(report["gap"]["mean"])
    assert report["partial"] is None and report["trained_tokens"] > 0  # a finished run


def test_a_run_stopped_before_its_budget_is_judged_with_a_note(tiny_data_cache, tmp_path, capsys):
    """The newest checkpoint of a stopped run is a partly trained model: said on the console and
    in the report, with the tokens it had trained on and its budget. The report's command is one a
    shell runs again (it was joined with spaces: a run directory with a space or a quote broke it)."""
    import shlex

    stopped = train(tiny(tiny_data_cache, tmp_path / "a stopped run's", **{
        "model.kind": "bert", "model.seq_len": 64, "run.max_steps": 2}))
    argv = ["finetune", str(stopped), "--seeds", "2", "--epochs", "1", "--passages-per-document", "3",
            "--passage-len", "32"]
    code = cli_main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((stopped / "finetune" / "folio-genre.json").read_text())
    budget = load_config(stopped / "config.toml").run.total_tokens  # (the tiny run has no phases)
    assert 0 < report["trained_tokens"] < budget
    note = f"the newest readable checkpoint is at {report['trained_tokens']:,} of the run's {budget:,} tokens"
    assert f"note: {note}" in out and note in (stopped / "finetune" / "folio-genre.md").read_text()
    assert f"Command: `{shlex.join(['largebatch', *argv])}`" in out


def test_the_default_passage_stays_within_the_positions_the_phases_trained(tiny_data_cache, tmp_path, capsys):
    """A two-phase BERT recipe (seq 32, then 64) stopped in its first phase has never trained
    positions 32-63: the default passage was min(128, model.seq_len) = 64, half of it on untrained
    positions; it is now the 32 the run reached, and a longer --passage-len gets a note."""
    from largebatch.export import trained_positions
    from largebatch.finetune import Settings, check_settings
    from largebatch.train.loop import Trainer

    phases = [{"seq_len": 32, "total_tokens": 32 * 8 * 6}, {"seq_len": 64, "total_tokens": 64 * 8 * 3}]
    config = tmp_path / "phases.toml"
    config.write_text("".join(f"[[phases]]\nseq_len = {p['seq_len']}\ntotal_tokens = {p['total_tokens']}\n\n"
                              for p in phases))
    overrides = tiny(tiny_data_cache, tmp_path / "stopped", **{
        "model.kind": "bert", "model.seq_len": 64, "model.norm_position": "post", "run.max_steps": 2,
        "run.total_tokens": 32 * 8 * 6 + 64 * 8 * 3})  # post-LN: it exports below
    Trainer(load_config(config, overrides), overrides["run.out_dir"], log=lambda *_: None).fit()
    stopped = tmp_path / "stopped"
    code = cli_main(["finetune", str(stopped), "--seeds", "2", "--epochs", "1", "--passages-per-document", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads((stopped / "finetune" / "folio-genre.json").read_text())["settings"]["passage_len"] == 32
    assert "passages of 32 tokens" in out and "untrained" not in out
    code = cli_main(["finetune", str(stopped), "--seeds", "2", "--epochs", "1", "--passages-per-document", "2",
                     "--passage-len", "48"])
    assert code == 0 and "note: --passage-len 48 is longer than the 32 tokens the run's phases trained so far" \
        in capsys.readouterr().out

    # the export of that run: its tokenizer truncates at the 32 trained positions, which it says
    out = tmp_path / "hf"
    assert cli_main(["export", str(stopped), str(out), "--format", "hf", "--no-verify"]) == 0
    assert ("note: the run has trained positions 0-31 only (it stopped in a phase at seq_len 32); the "
            "tokenizer's model_max_length is 32") in capsys.readouterr().err
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 32
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64

    class Loaded:  # a run past its phase switch, one without phases, one whose positions were imported
        def __init__(self, config, tokens):
            self.config, self.tokens = config, tokens

    assert trained_positions(Loaded({"phases": phases}, 32 * 8 * 6 + 64 * 8)) == 64
    assert trained_positions(Loaded({"phases": phases}, 32 * 8 * 6)) == 32  # at the switch: not begun
    assert trained_positions(Loaded({}, 100)) is None
    assert trained_positions(Loaded({"phases": phases, "model": {"init_from": "hf:/x"}}, 8)) is None
    assert check_settings(Settings(), 512, None).passage_len == 128
    assert check_settings(Settings(), 512, 32).passage_len == 32


def test_finetune_reports_no_verdict_when_every_seed_gives_the_same_gap(bert_run, tmp_path, monkeypatch, capsys):
    """Deterministic fine-tuning that moves the same number of test passages at every seed: the
    report states the gap and that it has no interval, and does not call it pretraining hurting."""
    import shutil

    import largebatch.finetune as ft

    run = tmp_path / "run"
    shutil.copytree(bert_run, run)
    calls = []

    def arm(encoder, data, s, seed):  # pretrained, then scratch, at each seed: 4 and 5 of 14 right
        calls.append(seed)
        right = 4 + (len(calls) + 1) % 2
        return {"test_accuracy": right / 14, "first_epoch_loss": 1.0, "last_epoch_loss": 0.5}

    monkeypatch.setattr(ft, "finetune_arm", arm)
    monkeypatch.setattr(ft, "probe_accuracy", lambda encoder, splits, l2: 0.5)
    code = cli_main(["finetune", str(run), "--seeds", "3", "--passages-per-document", "2", "--passage-len", "32"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((run / "finetune" / "folio-genre.json").read_text())
    assert report["gap"]["per_seed"] == pytest.approx([4 / 14 - 5 / 14] * 3)
    assert report["gap"]["ci95"] is None and report["probe"]["gap"]["ci95"] is None
    for verdict in (report["verdict"], report["probe"]["verdict"]):
        assert verdict.startswith("no difference established") and "sd 0" in verdict
    assert "pretraining hurt" not in out and "-0.0714 at all 3 seeds" in out and "95% CI n/a (sd 0)" in out


def test_finetune_cross_validates_by_document_and_probes(bert_run, capsys):
    code = cli_main(["finetune", str(bert_run), "--task", "bible-division", "--seeds", "2", "--epochs", "1",
                     "--passages-per-document", "2", "--passage-len", "32", "--folds", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((bert_run / "finetune" / "bible-division.json").read_text())
    from largebatch.export import load_run
    task = build_task("bible-division", load_run(str(bert_run)).tokenizer, passage_len=32, passages_per_document=2)
    n = report["test_passages"]
    assert n == len(task.train_ids) + len(task.test_ids)  # every passage of every book is tested once
    for r in report["arms"]["pretrained"] + report["arms"]["scratch"]:
        assert r["test_accuracy"] * n == pytest.approx(round(r["test_accuracy"] * n))
    probe = report["probe"]
    for a in [probe["pretrained"], *probe["scratch"]]:
        assert a * n == pytest.approx(round(a * n))
    assert probe["gap"]["per_seed"] == pytest.approx([probe["pretrained"] - s for s in probe["scratch"]])
    assert probe["scratch"][0] != probe["scratch"][1]  # a random init per seed
    assert "3-fold cross-validation by document" in out and probe["verdict"] in out
    assert f"{n} passages in 3 folds of whole documents of 32 tokens" in out  # not one split's counts
    seed_lines = [line for line in out.splitlines() if line.startswith("  seed ")]
    assert len(seed_lines) == 4 and all("over its one epoch" in line and "->" not in line for line in seed_lines)


@pytest.mark.parametrize("args, names", [
    (["--seeds", "1"], "--seeds 1"),
    (["--passage-len", "999"], "--passage-len 999"),
    (["--task", "squad"], "--task 'squad'"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--epochs", "x"], "--epochs"),
    (["--bogus", "1"], "--bogus"),
    (["--folds", "0"], "--folds 0"),
    (["--probe-l2", "0"], "--probe-l2 0.0"),
    (["--folds", "100", "--passages-per-document", "2", "--passage-len", "32"], "--folds 100: must be"),
])
def test_bad_input_gives_one_line_errors(args, names, bert_run, capsys):
    assert cli_main(["finetune", str(bert_run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err


def test_missing_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    assert cli_main(["finetune", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "RUN_DIR" in err
    monkeypatch.chdir(tmp_path)  # an empty RUN_DIR is not the working directory ('.')
    assert cli_main(["finetune", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "RUN_DIR is '': pass a run directory" in err, err


@pytest.mark.parametrize("where", ["finetune", "finetune/folio-genre.json"])
def test_a_report_path_that_cannot_be_written_is_refused_before_fine_tuning(where, bert_run, tmp_path,
                                                                             monkeypatch, capsys):
    import shutil

    import largebatch.finetune as ft

    run = tmp_path / "run"
    shutil.copytree(bert_run, run, ignore=shutil.ignore_patterns("finetune"))
    blocker = run / where
    if where == "finetune":
        blocker.write_text("")
    else:
        blocker.mkdir(parents=True)
    monkeypatch.setattr(ft, "compare", lambda *a, **k: pytest.fail("fine-tuning started"))
    assert cli_main(["finetune", str(run), "--seeds", "2", "--epochs", "1", "--passages-per-document", "2",
                     "--passage-len", "32"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and repr(str(blocker)) in err and "move or delete" in err, err
    assert "fine-tuning" not in captured.out


def test_a_transformers_directory_is_named_with_what_to_pass_instead(tmp_path, capsys):
    """An export (config.json and weights, no config.toml or checkpoints/) is not a run directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = tmp_path / "hf"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(hf)
    capsys.readouterr()  # transformers' progress bar
    assert cli_main(["finetune", str(hf)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"RUN_DIR {str(hf)!r} is a transformers directory" in err and "exported from" in err, err
    assert f"--model.init_from=hf:{hf}" in err and "train it (or resume it)" not in err, err


def test_checkpoint_judges_an_earlier_checkpoint_in_its_own_report(tiny_data_cache, tmp_path, capsys):
    """`finetune --checkpoint STEP` fine-tunes that checkpoint and writes TASK@step_NNNNNNNN.md beside
    the newest one's report; a step the run does not keep is a one-line error before any work."""
    run = train(tiny(tiny_data_cache, tmp_path / "bert", **{
        "model.kind": "bert", "model.seq_len": 64, "run.checkpoint_every_tokens": 4 * 8 * 64}))
    steps = sorted(int(p.name[5:13]) for p in (run / "checkpoints").iterdir())
    assert len(steps) == 2, steps
    args = ["--seeds", "2", "--epochs", "1", "--passages-per-document", "3", "--passage-len", "32"]
    assert cli_main(["finetune", str(run), "--checkpoint", "999", *args]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint 999: no checkpoint at step 999" in err and f"steps {steps[0]}, {steps[1]}" in err
    assert cli_main(["finetune", str(run), "--checkpoint", str(steps[0]), *args]) == 0
    printed = capsys.readouterr().out
    name = f"step_{steps[0]:08d}"
    assert f"fine-tuning {run / 'checkpoints' / name}.pt (step {steps[0]})" in printed
    assert "this judges a partly trained model, the one --checkpoint chose" in printed
    report = json.loads((run / "finetune" / f"folio-genre@{name}.json").read_text())
    assert report["step"] == steps[0] and report["checkpoint"].endswith(f"{name}.pt")
    assert (run / "finetune" / f"folio-genre@{name}.md").is_file()
    assert not (run / "finetune" / "folio-genre.json").exists()
