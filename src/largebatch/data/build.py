"""``build_data``: corpus -> split -> tokenizer -> cached token streams -> packed datasets.

The trained tokenizer and both tokenized splits are cached on disk in one directory keyed on
sha256(train-split content, validation-split content, vocabulary size or tokenizer file content,
TOKENIZER_VERSION), written to a temporary directory and renamed into place (atomic: concurrent
ranks or a kill mid-write never leave a half-written entry). A second build with the same key
memory-maps the cached streams and trains nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist
from tokenizers import Tokenizer

from largebatch import LONG_WAIT_GROUP
from largebatch.arguments import pid_alive

from . import tokenizer as tokenizer_lib
from .config import DataConfig
from .corpus import (
    CORPORA,
    CorpusError,
    Document,
    DocumentSource,
    Fingerprint,
    choose_validation,
    is_token_array_path,
    load_token_array,
    token_array_fingerprint,
)
from .dataset import BERTDataset, GPTDataset, MixtureDataset, PackedDataset
from .sampler import MixtureSampler, mixture_counts

OBJECTIVES = ("causal", "masked")  # a model kind's objective (largebatch.models.registry)


@dataclass
class MixtureSource:
    """One corpus of a data.mixture, for logs and run summaries."""

    corpus: str
    share: float  # of the draws (training samples and the validation slice alike)
    train_documents: int
    val_documents: int
    train_tokens: int
    val_tokens: int

    def describe(self, total_tokens: int | None = None) -> str:
        line = (f"{self.corpus}: {100 * self.share:.3g}% of the samples; train {self.train_documents:,} docs, "
                f"{self.train_tokens:,} tokens | val {self.val_documents:,} docs, {self.val_tokens:,} tokens")
        if total_tokens:  # how often a run of total_tokens goes through this corpus's training split
            line += f"; {self.share * total_tokens / max(self.train_tokens, 1):.2g} epochs over the run"
        return line


@dataclass
class DataStats:
    """What was loaded, per split, for logs and run summaries."""

    corpus: str
    train_documents: int | None  # None for token arrays (no document boundaries)
    val_documents: int | None
    train_tokens: int
    val_tokens: int
    train_samples: int
    val_samples: int
    val_document_names: list[str] = field(default_factory=list)
    split: str = "by document"  # or "by position (token array tail)" / "separate val_corpus"
    cache_path: str | None = None
    cache_hit: bool = False  # True: tokenizer and streams were loaded, nothing was trained
    cache_rebuilt: str | None = None  # why a damaged cache entry was built again, if it was
    content_key: str | None = None  # token arrays: token_array_fingerprint of the files (text: the cache entry)
    val_in_train: list[tuple[str, str]] = field(default_factory=list)
    """(validation document, training document) pairs with the same text (build.val_in_train)."""
    sources: list[MixtureSource] = field(default_factory=list)
    """data.mixture: each corpus's share and sizes (empty for one corpus)."""

    def __str__(self) -> str:
        return self.describe()

    def warnings(self) -> list[str]:
        """What a run should warn of about its data (the trainer logs each at start-up)."""
        if not self.val_in_train:
            return []
        pairs = ", ".join(f"{val} = {train}" for val, train in self.val_in_train[:3])
        more = f" and {len(self.val_in_train) - 3} more" if len(self.val_in_train) > 3 else ""
        fix = ("remove the repeated documents from the mixture's corpora" if self.sources else
               "remove the repeated documents from the corpus (or, with data.val_corpus, keep its files "
               "out of data.corpus)")
        return [f"{len(self.val_in_train)} of the {self.val_documents} validation documents have the text "
                f"of a training document ({pairs}{more}): the validation loss on them measures recall, "
                f"not generalisation; {fix}"]

    def describe(self, total_tokens: int | None = None) -> str:
        """One line (a mixture: one more per corpus, indented; with ``total_tokens``, the epochs a run
        of that many tokens takes of each corpus's training split)."""
        def docs(n):
            return "" if n is None else f"{n} docs, "
        # a named corpus's prefix is dropped ("shakespeare/hamlet": hamlet), but not a combined one's
        # ("bible/john" apart from "shakespeare/john"), nor a directory's subdirectories (d000/doc1)
        short = self.corpus in CORPORA and "+" not in self.corpus and not self.sources
        names = ", ".join(name.split("/", 1)[-1] if short else name for name in self.val_document_names[:6])
        more = " ..." if len(self.val_document_names) > 6 else ""
        return (f"{self.corpus} ({self.split}): train {docs(self.train_documents)}"
                f"{self.train_tokens:,} tokens, {self.train_samples:,} samples | val "
                f"{docs(self.val_documents)}{self.val_tokens:,} tokens, {self.val_samples:,} "
                f"samples" + (f" [{names}{more}]" if names else "")
                + (f"; damaged cache entry rebuilt ({self.cache_rebuilt})" if self.cache_rebuilt else "")
                + "".join(f"\n  {source.describe(total_tokens)}" for source in self.sources))


COUNT_CHUNK = 1 << 22
"""Tokens counted at a time: np.bincount widens its input to int64, so a whole memory-mapped stream
counted at once held 8 bytes per token (7.5 GB for a 900M-token array, at the end of the run)."""


def token_counts(tokens, minlength: int, chunk: int = COUNT_CHUNK) -> np.ndarray:
    """np.bincount of ``tokens`` (int64 counts, at least ``minlength`` of them), a chunk at a time."""
    counts = np.zeros(minlength, dtype=np.int64)
    for start in range(0, len(tokens), chunk):
        part = np.bincount(np.asarray(tokens[start:start + chunk]), minlength=minlength)
        if len(part) > len(counts):
            counts = np.concatenate([counts, np.zeros(len(part) - len(counts), dtype=np.int64)])
        counts[:len(part)] += part
    return counts


@dataclass
class Data:
    """Everything the trainer needs: tokenizer, vocabulary size, the two datasets and stats."""

    tokenizer: Tokenizer | None
    vocab_size: int
    train: PackedDataset | MixtureDataset
    val: PackedDataset | MixtureDataset
    stats: DataStats
    objective: str
    seq_len: int
    special_ids: dict[str, int]

    def unigram_loss(self, targets=None) -> float:
        """Cross-entropy (nats/token) of the validation stream (or of ``targets``: the tokens an
        evaluation predicts) under the train-split unigram distribution, add-one smoothed over the
        vocabulary: the loss of a model that ignores context entirely. A trained model's validation
        loss should be well below it."""
        train_counts = self.train_counts().astype(np.float64)
        log_prob = np.log((train_counts + 1.0) / (train_counts.sum() + self.vocab_size))
        val_counts = self._val_counts(targets)
        return float(-(val_counts * log_prob).sum() / val_counts.sum())

    def _val_counts(self, targets=None) -> np.ndarray:
        """How often each id occurs in the validation split (a mixture's: weighted as its draws are),
        or in ``targets``, as float64."""
        if targets is None:
            return self.val.unigram_counts(self.vocab_size)[:self.vocab_size]
        return token_counts(np.asarray(targets, dtype=np.int64), self.vocab_size).astype(np.float64)

    def unigram_accuracy(self, targets=None) -> float:
        """Share of validation tokens (or of ``targets``) equal to the train split's most frequent
        token: the accuracy of a model that ignores context (the floor a trained model's accuracy
        should clear)."""
        counts = self._val_counts(targets)
        return float(counts[self.train_counts().argmax()] / max(counts.sum(), 1.0))

    def train_counts(self) -> np.ndarray:
        """How often each id occurs in the train stream (counted once, then kept; a mixture's: each
        corpus's frequencies weighted by its share of the draws, as float64 counts)."""
        return self.train.unigram_counts(self.vocab_size)[:self.vocab_size]

    def decode(self, ids) -> str:
        return self.train.decode(ids)


def build_data(cfg: DataConfig, seq_len: int, objective: str = "causal",
               log: Callable[[str], None] | None = None) -> Data:
    """Load, split, tokenize (or reuse the cache) and pack ``cfg.corpus`` for ``objective``: "causal"
    (next-token targets) or "masked" (masked-LM inputs and labels) -- a model kind's objective.
    ``log`` (one line at a time) hears how a first build of a text corpus's cache entry goes: its size,
    the tokenizer's training, and the tokenizing, at most every ``BUILD_LOG_S`` seconds with its rate
    and the time left (a build of a corpus of 500 MB takes ~10 minutes on 2 cores)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"build_data objective={objective!r} is invalid: use one of {OBJECTIVES}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"build_data seq_len={seq_len!r} is invalid: use a positive integer")
    cfg.validate()
    with _rank_zero_first():
        return _build(cfg, seq_len, objective, log or (lambda line: None))


BUILD_WAIT = timedelta(days=7)
"""How long the other ranks wait for rank 0's cold build: a large corpus takes longer than any
collective timeout (``parallel.timeout_s``, 600 s by default) -- ~220 s for 58 MB here."""
_WAIT_GROUPS: dict[int, object] = {}  # id(default group) -> the gloo group the ranks wait in


@contextmanager
def _rank_zero_first():
    """Under torch.distributed, rank 0 builds (trains, writes the cache) while the other ranks
    wait at a barrier, then they build from its cache entry (as Megatron-LM builds its dataset
    index on rank 0). Every rank must call build_data. The barrier is on a gloo group of its own
    whose timeout is ``BUILD_WAIT`` (created collectively on the first call): on the default group a
    build longer than its timeout killed the job. A rank that fails ends the job under torchrun."""
    distributed = dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank() == 0
    group = None
    if distributed:
        key = id(dist.group.WORLD)
        if key not in _WAIT_GROUPS:
            _WAIT_GROUPS[key] = dist.new_group(backend="gloo", timeout=BUILD_WAIT,
                                                group_desc=LONG_WAIT_GROUP)
        group = _WAIT_GROUPS[key]
    try:
        if not leader:
            dist.barrier(group=group)
        yield
    finally:
        if distributed and leader:
            dist.barrier(group=group)


def _build(cfg: DataConfig, seq_len: int, objective: str, log: Callable[[str], None]) -> Data:
    if cfg.mixture:
        return _build_mixture(cfg, seq_len, objective, log)
    if is_token_array_path(cfg.corpus):
        tokenizer, train_tokens, val_tokens, stats = _token_array_streams(cfg)
        vocab_size = tokenizer_lib.id_space(tokenizer) if tokenizer else cfg.vocab_size
        _check_ids_fit(train_tokens, val_tokens, vocab_size, cfg)
    else:
        tokenizer, train_tokens, val_tokens, stats = _text_streams(cfg, log)
        vocab_size = tokenizer_lib.id_space(tokenizer)
    special_ids = tokenizer_lib.special_token_ids(tokenizer) if tokenizer else {}
    train, val = _datasets(cfg, train_tokens, val_tokens, seq_len, objective, tokenizer, vocab_size, special_ids)
    stats.train_samples, stats.val_samples = len(train), len(val)
    return Data(tokenizer, vocab_size, train, val, stats, objective, seq_len, special_ids)


def _datasets(cfg: DataConfig, train_tokens, val_tokens, seq_len: int, objective: str, tokenizer,
              vocab_size: int, special_ids: dict[str, int], source: int | None = None):
    """The packed (train, val) datasets of two streams for ``objective``; ``source``: the position of
    a mixture's corpus, whose sample orders are seeded apart from the other corpora's."""
    seed, split_seed = cfg.seed, cfg.split_seed
    if source is not None:
        seed, split_seed = (int(np.random.SeedSequence([value, source]).generate_state(1, np.uint64)[0])
                            for value in (seed, split_seed))
    common = dict(tokenizer=tokenizer)
    if objective == "causal":
        train = GPTDataset(train_tokens, seq_len, split="train", seed=seed, shuffle=cfg.shuffle, **common)
        val = GPTDataset(val_tokens, seq_len, split="val", seed=split_seed, shuffle=True, **common)
    else:  # masks are seeded by data.seed and the global index (a mixture's too)
        masking = dict(special_ids=special_ids, vocab_size=vocab_size,
                       mlm_probability=cfg.mlm_probability,
                       mask_token_fraction=cfg.mask_token_fraction,
                       random_token_fraction=cfg.random_token_fraction, **common)
        train = BERTDataset(train_tokens, seq_len, split="train", seed=seed,
                            shuffle=cfg.shuffle, mask_seed=cfg.seed, **masking)
        val = BERTDataset(val_tokens, seq_len, split="val", seed=split_seed, shuffle=True,
                          mask_seed=cfg.split_seed, **masking)
    return train, val


def _build_mixture(cfg: DataConfig, seq_len: int, objective: str, log: Callable[[str], None]) -> Data:
    """data.mixture: one packed dataset per corpus and split, drawn as the weights say (MixtureDataset):
    training samples, and the validation slice alike."""
    specials = (tokenizer_lib.special_strings(read_tokenizer_file(cfg)) if cfg.tokenizer_file
                else list(tokenizer_lib.SPECIAL_TOKENS))
    tokenizer, train_streams, val_streams, stats = _mixture_streams(cfg, specials, log)
    vocab_size = tokenizer_lib.id_space(tokenizer)
    special_ids = tokenizer_lib.special_token_ids(tokenizer)
    counts, names = mixture_counts(list(cfg.mixture.values())), list(cfg.mixture)
    pairs = []
    for d, (train_tokens, val_tokens) in enumerate(zip(train_streams, val_streams)):
        try:
            pairs.append(_datasets(cfg, train_tokens, val_tokens, seq_len, objective, tokenizer, vocab_size,
                                   special_ids, source=d))
        except ValueError as exc:  # too few tokens for one sample: name the corpus
            raise CorpusError(f"data.mixture's corpus {names[d]!r}: {exc} (in a mixture each corpus is split "
                              "by data.val_fraction and data.document_separator alone)") from None
    mixture = MixtureSampler(counts)  # (one draw order for both splits: a period of up to 10^6 positions)
    train = MixtureDataset([t for t, _ in pairs], mixture, names)
    val = MixtureDataset([v for _, v in pairs], mixture, names)
    stats.train_samples, stats.val_samples = (sum(len(source) for source in split.sources) for split in (train, val))
    return Data(tokenizer, vocab_size, train, val, stats, objective, seq_len, special_ids)


# ---------------------------------------------------------------------------------------------
# text corpora: split by document, tokenizer + streams cached

@dataclass
class _TextSplit:
    """One split of a text corpus as a start needs it, its text left on the disk: its documents'
    names and characters; ``documents()`` reads them again, one file at a time (DocumentSource)."""

    documents: Callable[[], Iterable[Document]]
    names: list[str]
    chars: int
    key: str
    """The content key (corpus.fingerprint) of the text the start read: a build that reads other text
    (the corpus changed meanwhile) keeps no entry (_Reread)."""


class _Reread:
    """A split's texts read again for a build, each document fed to a fingerprint on the way: ``check``
    then says whether they are the texts the entry's key was made from. A file edited, added or
    removed between the start's read and the build's would otherwise leave an entry under the old
    text's key holding the new text, which every later start on the old text takes as a hit."""

    def __init__(self, split: _TextSplit, name: str):
        self.split, self.name, self._key = split, name, Fingerprint()

    def texts(self) -> Iterator[str]:
        for doc in self.split.documents():
            self._key.add(doc)
            yield doc.text

    def check(self, what: str) -> None:
        if self._key.hexdigest() != self.split.key:
            raise CorpusError(f"the corpus changed while its cache entry was built: the {self.name} split "
                              f"read for {what} is not the text the run started from (a file edited, added "
                              "or removed meanwhile); no entry was kept. Run again once the corpus stays as "
                              "it is")


def _survey(documents: Iterable[Document], specials: list[str],
            key: Fingerprint | None = None) -> tuple[list[str], array, bool, list[bytes]]:
    """One pass over ``documents``, keeping no text: (names, characters of each, whether any text writes
    one of ``specials``, and -- with ``key``, their split's content key, fed every document -- a 16-byte
    digest of each text; val_in_train compares the digests)."""
    names, chars, special, digests = [], array("q"), False, []
    for doc in documents:
        names.append(doc.name)
        chars.append(len(doc.text))
        special = special or any(string in doc.text for string in specials)
        if key is not None:
            digests.append(_digest(key.add(doc)))
    return names, chars, special, digests


def _digest(text: bytes) -> bytes:
    return hashlib.blake2b(text, digest_size=16).digest()


def _text_streams(cfg: DataConfig, log: Callable[[str], None] = lambda line: None):
    """The tokenizer and both token streams of a text corpus, from its cache entry (built first on a
    miss). The corpus is read one file at a time, more than once (DocumentSource): its names, sizes
    and content key, then -- on a miss -- the tokenizer's training and the streams; a start never
    holds the corpus's text (a cache hit of a 1.2 GB corpus held ~1.4x its size as Python strings)."""
    if cfg.tokenizer_file:
        specials = tokenizer_lib.special_strings(read_tokenizer_file(cfg))
    else:
        specials = list(tokenizer_lib.SPECIAL_TOKENS)
    keys = {"train": Fingerprint(), "val": Fingerprint()}
    if cfg.val_corpus is not None:
        if is_token_array_path(cfg.val_corpus):
            raise CorpusError(f"DataConfig.val_corpus={cfg.val_corpus!r} is a token array but "
                              f"corpus={cfg.corpus!r} is text: give both as text or both as arrays")
        sources = {"train": DocumentSource(cfg.corpus, cfg.document_separator, cfg.text_field),
                   "val": DocumentSource(cfg.val_corpus, cfg.document_separator, cfg.text_field)}
        surveys = {split: _survey(sources[split], specials, keys[split]) for split in sources}  # one pass each
        splits = {split: _TextSplit(sources[split].__iter__, surveys[split][0], sum(surveys[split][1]),
                                    keys[split].hexdigest()) for split in sources}
        special = surveys["train"][2] or surveys["val"][2]
        pairs = [(name, digest, split) for split in ("train", "val") for name, digest in
                 zip(surveys[split][0], surveys[split][3])]
        split = "separate val_corpus"
    else:
        splits, pairs, special = _split_by_document(cfg.corpus, cfg, specials, keys, log)
        split = "by document"
    key_parts = {"train": keys["train"].hexdigest(), "val": keys["val"].hexdigest()}
    entry, cache_hit, damage, tokenizer, streams = _read_entry_of(
        key_parts, special, cfg, [("train", splits["train"]), ("val", splits["val"])], log)
    train_tokens, val_tokens = streams["train"], streams["val"]
    stats = DataStats(cfg.corpus, len(splits["train"].names), len(splits["val"].names), len(train_tokens),
                      len(val_tokens), 0, 0, list(splits["val"].names), split, str(entry),
                      cache_hit, damage, val_in_train=val_in_train(pairs))
    return tokenizer, train_tokens, val_tokens, stats


def _split_by_document(spec: str, cfg: DataConfig, specials: list[str], keys: dict[str, Fingerprint],
                       log: Callable[[str], None]) -> tuple[dict[str, _TextSplit], list, bool]:
    """The corpus ``spec`` split by document (cfg.val_fraction, val_documents, split_seed): its two
    splits, (name, digest, split) of every document (val_in_train) and whether any text writes one
    of ``specials``; ``keys`` (train, val) are fed the documents' texts."""
    source = DocumentSource(spec, cfg.document_separator, cfg.text_field)
    names, chars, special, _ = _survey(source, specials)
    chosen = choose_validation(names, chars, cfg.val_fraction, cfg.val_documents, cfg.split_seed,
                               source=source, log=log)
    # the content keys: a second pass, the split being known
    seen, digests = [], []
    for doc in source:
        seen.append(doc.name)
        digests.append(_digest(keys["val" if doc.name in chosen else "train"].add(doc)))
    if seen != names:  # the split was chosen from another list of documents
        raise CorpusError(f"the corpus {spec!r} changed while it was read (its documents were "
                          f"{len(names):,}, then {len(seen):,}{_first_change(names, seen)}): run again once "
                          "it stays as it is")

    def documents(of_val: bool) -> Callable[[], Iterable[Document]]:
        return lambda: (doc for doc in source if (doc.name in chosen) == of_val)

    splits = {split: _TextSplit(documents(split == "val"), [n for n in names if (n in chosen) == (split == "val")],
                                sum(c for n, c in zip(names, chars) if (n in chosen) == (split == "val")),
                                keys[split].hexdigest()) for split in ("train", "val")}
    pairs = [(name, digest, "val" if name in chosen else "train") for name, digest in zip(names, digests)]
    return splits, pairs, special


def _mixture_streams(cfg: DataConfig, specials: list[str], log: Callable[[str], None]):
    """data.mixture: each corpus split by document on its own, one tokenizer trained on all their
    training splits, and two streams per corpus, in one cache entry keyed on every corpus's content
    in the mixture's order (not on the weights: the streams do not depend on them)."""
    specs = list(cfg.mixture)
    parts, pairs, special, streams = [], [], False, []
    for d, spec in enumerate(specs):
        keys = {"train": Fingerprint(), "val": Fingerprint()}
        try:
            splits, source_pairs, source_special = _split_by_document(spec, cfg, specials, keys, log)
        except CorpusError as exc:  # (a mixture splits each corpus by val_fraction alone)
            raise CorpusError(f"data.mixture's corpus {spec!r}: {exc} (in a mixture each corpus is split by "
                              "data.val_fraction and data.document_separator alone)") from None
        parts.append({"corpus": spec, "train": keys["train"].hexdigest(), "val": keys["val"].hexdigest()})
        pairs += [(source_document(spec, name), digest, split) for name, digest, split in source_pairs]
        special = special or source_special
        streams += [(f"train.{d}", splits["train"]), (f"val.{d}", splits["val"])]
    entry, cache_hit, damage, tokenizer, tokens = _read_entry_of({"mixture": parts}, special, cfg, streams, log)
    counts = mixture_counts(list(cfg.mixture.values()))
    sources = [MixtureSource(spec, float(c) / sum(counts), len(streams[2 * d][1].names),
                             len(streams[2 * d + 1][1].names), len(tokens[f"train.{d}"]), len(tokens[f"val.{d}"]))
               for d, (spec, c) in enumerate(zip(specs, counts))]
    val_names = [source_document(spec, name) for d, spec in enumerate(specs) for name in streams[2 * d + 1][1].names]
    stats = DataStats(mixture_label(cfg.mixture), sum(s.train_documents for s in sources),
                      sum(s.val_documents for s in sources), sum(s.train_tokens for s in sources),
                      sum(s.val_tokens for s in sources), 0, 0, val_names, "by document, per corpus", str(entry),
                      cache_hit, damage, val_in_train=val_in_train(pairs), sources=sources)
    train = [tokens[f"train.{d}"] for d in range(len(specs))]
    val = [tokens[f"val.{d}"] for d in range(len(specs))]
    return tokenizer, train, val, stats


def source_document(spec: str, name: str) -> str:
    """A mixture's document name: its corpus's name for it, under the corpus (a named corpus's
    names already are: "shakespeare/hamlet"; a file's "web.jsonl/web:12")."""
    return name if name.startswith(f"{spec}/") else f"{spec}/{name}"


def mixture_label(mixture: dict[str, float]) -> str:
    """``mixture(shakespeare 75%, bible 25%)``: the corpora and the shares of the draws they get."""
    counts = mixture_counts(list(mixture.values()))
    return "mixture(" + ", ".join(f"{spec} {100 * c / sum(counts):.3g}%" for spec, c in zip(mixture, counts)) + ")"


def _entry_of(key_parts: dict, special: bool, cfg: DataConfig, streams: list[tuple[str, _TextSplit]],
              log: Callable[[str], None]) -> tuple[Path, bool, str | None]:
    """The cache entry of ``streams`` (name, split) keyed on ``key_parts`` (the splits' content keys)
    and the tokenizer's settings, made whole: (its path, whether it was there, its damage if rebuilt)."""
    key_parts = {**key_parts, "version": tokenizer_lib.TOKENIZER_VERSION}
    if cfg.tokenizer_file:  # encoded without the file's truncation and padding (entries before: with)
        key_parts["tokenizer_file"] = hashlib.sha256(_read_tokenizer_bytes(cfg)).hexdigest()
        key_parts["encoding"] = "plain"
    else:
        key_parts["vocab_size"] = cfg.vocab_size
    if special:
        # written as text (tokenizer.encode_texts); entries before matched them as the tokens. A
        # corpus without such strings keeps its key: its streams are the same either way.
        key_parts["special_text"] = "literal"
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:20]
    entry = Path(cfg.cache_dir).expanduser() / key
    cache_hit, damage = _ensure_entry(entry, cfg, streams, log)
    return entry, cache_hit, damage


def _read_entry_of(key_parts: dict, special: bool, cfg: DataConfig, streams: list[tuple[str, _TextSplit]],
                   log: Callable[[str], None]):
    """``_entry_of``, then the entry read: (path, hit, damage, tokenizer, streams). An entry removed
    between the two (``largebatch data cache --remove`` at that moment) is built again, not a failure."""
    for attempt in range(3):
        entry, cache_hit, damage = _entry_of(key_parts, special, cfg, streams, log)
        try:
            return (entry, cache_hit, damage, *_read_cache_entry(entry))
        except FileNotFoundError:
            if attempt == 2:
                raise


def _first_change(before: list[str], after: list[str]) -> str:
    """'; first difference: X' between two lists of document names (empty when none is found)."""
    were, are = set(before), set(after)
    gone = next((name for name in before if name not in are), None)
    new = next((name for name in after if name not in were), None)
    return f"; {gone!r} gone" if gone else f"; {new!r} new" if new else ""


def val_in_train(documents: Iterable[tuple[str, bytes, str]]) -> list[tuple[str, str]]:
    """(validation document, training document with the same text) for every validation document
    whose text is also a training document's, from (name, digest of its text, split) in corpus
    order: a corpus with repeated records (web dumps often have them) or a val_corpus that lies
    inside the corpus. The split is by name, so nothing else keeps such text out of training; its
    validation loss measures recall."""
    documents = list(documents)
    first = {}
    for name, digest, split in documents:
        if split == "train":
            first.setdefault(digest, name)
    return [(name, first[digest]) for name, digest, split in documents if split == "val" and digest in first]


def _ensure_entry(entry: Path, cfg: DataConfig, streams: list[tuple[str, _TextSplit]],
                  log: Callable[[str], None] = lambda line: None) -> tuple[bool, str | None]:
    """Make ``entry`` hold the tokenizer and the streams: (whether it was there whole already, what
    was wrong with it when a damaged one was set aside and built again). A cache that cannot be
    written is one CorpusError naming data.cache_dir."""
    cache_hit = (entry / "meta.json").is_file()
    damage = entry_damage(entry) if cache_hit or entry.is_dir() else None  # (a directory without meta.json too)
    if damage is not None:  # (a partial copy, a disk error): set aside atomically, then built again
        aside = entry.parent / f".{entry.name}.damaged-{os.getpid()}"
        try:
            os.rename(entry, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:  # another process set it aside first, or the cache is read-only
            if entry_damage(entry) is not None and (entry / "meta.json").is_file():
                raise CorpusError(f"data cache entry {entry} is damaged ({damage}) and cannot be removed "
                                  "here: delete it, or set data.cache_dir to a writable directory") from None
        cache_hit = False
    if cache_hit:  # what killed builds of this entry left (each as large as the streams) goes on hits too
        try:
            remove_dead_staging(entry)
            os.utime(entry / "meta.json")  # its last use (`largebatch data cache --unused-days` reads it)
        except OSError:  # a read-only cache: left as it is
            pass
    if not cache_hit and not (entry / "meta.json").is_file():
        try:
            _write_cache_entry(entry, cfg, streams, log)
        except OSError as exc:  # a full disk, a read-only directory, a cache_dir that is a file
            where = Path(cfg.cache_dir).expanduser()
            if where.exists() and not where.is_dir():
                raise CorpusError(f"data.cache_dir={cfg.cache_dir!r} is a file, not a directory: set "
                                  "data.cache_dir to a directory (it is created if missing)") from None
            reason = exc.strerror or str(exc)
            raise CorpusError(f"could not write the data cache entry {entry}: {reason}"
                              + (f" ({exc.filename})" if exc.filename else "")
                              + f"; free space there, or set data.cache_dir (now {cfg.cache_dir!r}) to a "
                              "writable directory") from None
    return cache_hit, damage


def entry_damage(entry: Path) -> str | None:
    """What is wrong with the cache entry ``entry``, or None: its meta.json or tokenizer.json does
    not read, or a stream file is missing or not the size meta.json records (entries written before
    the counts were recorded: a whole, non-zero number of tokens). Sizes only: a start never reads
    the streams."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        try:
            Tokenizer.from_file(str(entry / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 -- tokenizers' bare Exception names no file
            raise ValueError(f"tokenizer.json: {exc}") from None
        itemsize = np.dtype(meta["dtype"]).itemsize
        names = list(meta.get("tokens", {})) or ["train", "val"]  # (a mixture's: train.0, val.0, ...)
        sizes = {split: (entry / f"{split}.bin").stat().st_size for split in names}
    except Exception as exc:  # noqa: BLE001 -- OSError, JSON errors, tokenizers' bare Exception
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    for split, size in sizes.items():
        tokens = meta.get("tokens", {}).get(split)
        if tokens is not None and size != tokens * itemsize:
            return f"{split}.bin holds {size // itemsize:,} tokens, meta.json records {tokens:,}"
        if tokens is None and (size == 0 or size % itemsize):
            return f"{split}.bin is {size:,} bytes, not a whole number of {meta['dtype']} tokens"
    return None


BUILD_LOG_S = 30.0
"""Seconds between two lines on a cache entry's tokenizing (build_data's ``log``)."""


class _BuildProgress:
    """build_data's lines on one split's tokenizing: done, rate and time left, at most every
    BUILD_LOG_S seconds (a small corpus's build says nothing of it)."""

    def __init__(self, log: Callable[[str], None], split: str, total_chars: int):
        self.log, self.split, self.total = log, split, max(total_chars, 1)
        self.start = self.last = time.monotonic()

    def __call__(self, chars: int) -> None:
        now = time.monotonic()
        if now - self.last < BUILD_LOG_S or chars >= self.total:
            return
        self.last = now
        rate = chars / max(now - self.start, 1e-9)
        left = _duration((self.total - chars) / rate)
        self.log(f"data: tokenizing the {self.split} split: {chars / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
                 f"({100 * chars / self.total:.0f}%), {rate / 1e6:.2f} MB/s, ~{left} left")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _write_cache_entry(entry: Path, cfg: DataConfig, streams: list[tuple[str, _TextSplit]],
                       log: Callable[[str], None] = lambda line: None) -> None:
    """Train the tokenizer on the training streams (``train`` or ``train.D``) and write each stream
    of ``streams`` (name, split) as NAME.bin, in a staging directory renamed into place."""
    # the staging directory first: a cache that cannot be written fails before a tokenizer is trained
    entry.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(entry)
    # os.mkdir applies the umask (mkdtemp's 0700 would keep a shared cache from its other users)
    staging = entry.parent / f".{entry.name}.tmp-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        # written whole, then renamed in: a kill between creating and filling the note would
        # leave an empty one, read as "no owner note" (kept an hour) rather than "writer gone"
        note = staging / f"{_OWNER}.part"
        note.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        os.rename(note, staging / _OWNER)
        started = time.monotonic()
        chars = {split: docs.chars for split, docs in streams}  # MB for ASCII text
        trains = [(split, docs) for split, docs in streams if split.split(".")[0] == "train"]
        vals = [docs for split, docs in streams if split.split(".")[0] == "val"]
        log(f"data: a first build of the cache entry {entry} ({sum(len(d.names) for _, d in trains):,} train "
            f"documents, {sum(d.chars for _, d in trains) / 1e6:,.1f} MB of text; "
            f"{sum(len(d.names) for d in vals):,} validation, {sum(d.chars for d in vals) / 1e6:,.1f} MB): "
            "later starts read it")
        if cfg.tokenizer_file:
            tokenizer = read_tokenizer_file(cfg)
        else:  # trained on the TRAINING split only: validation text must stay unseen
            log(f"data: training a byte-level BPE tokenizer of {cfg.vocab_size:,} entries on the train split")
            reads = [_Reread(docs, split) for split, docs in trains]
            tokenizer = tokenizer_lib.train_tokenizer((text for read in reads for text in read.texts()),
                                                      cfg.vocab_size)
            for read in reads:
                read.check("the tokenizer")
            log(f"data: tokenizer trained in {_duration(time.monotonic() - started)}")
        separator = tokenizer_lib.document_separator(tokenizer)
        if separator is None:
            raise CorpusError(tokenizer_lib.no_separator_message("data.tokenizer_file", cfg.tokenizer_file))
        eot_id = separator[1]
        dtype = tokenizer_lib.token_dtype(tokenizer_lib.id_space(tokenizer))
        tokens = {}
        for split, docs in streams:
            read = _Reread(docs, split)
            progress = _BuildProgress(log, split, chars[split])
            tokens[split] = tokenizer_lib.write_documents(tokenizer, read.texts(), eot_id, dtype,
                                                          staging / f"{split}.bin", progress)
            read.check("its token stream")
        tokenizer.save(str(staging / "tokenizer.json"))
        meta = {"dtype": dtype.name, "version": tokenizer_lib.TOKENIZER_VERSION, "tokens": tokens,
                # (a mixture's entry serves any weights: its corpora alone name it)
                "corpus": f"mixture({', '.join(cfg.mixture)})" if cfg.mixture else cfg.corpus,
                "val_documents": [name for docs in vals for name in docs.names]}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        counted = {part: sum(n for split, n in tokens.items() if split.split(".")[0] == part)
                   for part in ("train", "val")}
        log(f"data: cache entry built in {_duration(time.monotonic() - started)} "
            f"({counted['train']:,} train tokens, {counted['val']:,} validation)")
        (staging / _OWNER).unlink()
        try:
            os.rename(staging, entry)  # atomic; fails if another process got there first
        except OSError:
            if not (entry / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_OWNER = ".owner"  # "PID HOST" of the process writing a staging directory
STALE_STAGING_S = 7 * 24 * 3600.0  # a staging directory of another host is taken as dead after this


def remove_dead_staging(entry: Path) -> list[Path]:
    """Remove the staging directories of ``entry`` (``.KEY.tmp-*`` beside it) left by a build that
    was killed (SIGKILL, SIGTERM, the OOM killer or a preemption while it tokenized: its ``finally``
    never ran), which would otherwise stay on the disk for good, each as large as the tokenized
    corpus. A staging directory is dead when its writer's pid no longer runs on this host; one
    written on another host (a shared disk) only once untouched for ``STALE_STAGING_S``; one
    without an owner note (an interrupted start) once untouched for an hour. A damaged entry set
    aside (``.KEY.damaged-PID``) is garbage from the rename on, but a kill during its removal left
    the rest of it: such leftovers go too. Returns the removed."""
    removed = []
    for aside in entry.parent.glob(f".{entry.name}.damaged-*"):
        if aside.is_symlink():
            aside.unlink(missing_ok=True)
        else:
            shutil.rmtree(aside, ignore_errors=True)
        if not os.path.lexists(aside):  # (one that cannot be deleted here is not said to be)
            removed.append(aside)
    host = socket.gethostname()
    for staging in entry.parent.glob(f".{entry.name}.tmp-*"):
        try:
            age = time.time() - staging.stat().st_mtime
            owner = (staging / _OWNER).read_text().split() if (staging / _OWNER).is_file() else []
        except OSError:  # removed meanwhile by another builder
            continue
        if len(owner) == 2 and owner[1] == host and owner[0].isdigit():
            dead = not pid_alive(int(owner[0]))
        elif len(owner) == 2:
            dead = age > STALE_STAGING_S
        else:
            dead = age > 3600.0
        if dead:
            shutil.rmtree(staging, ignore_errors=True)
            if not os.path.lexists(staging):
                removed.append(staging)
    return removed


@dataclass
class CacheEntry:
    """One entry of a data cache directory, as ``largebatch data cache`` lists it."""

    path: Path
    corpus: str  # what it was built from (meta.json; a mixture's: its corpora)
    tokens: dict[str, int]  # per stream (train, val; a mixture's train.D, val.D)
    bytes: int  # on disk
    built: float  # Unix time its tokenizer was written
    used: float  # Unix time of its last use by a start (its build, if none since)
    damage: str | None  # what is wrong with it (entry_damage), None if whole


def cache_entries(cache_dir: str | Path) -> list[CacheEntry]:
    """The entries of the data cache ``cache_dir``, by key: its directories named by a key (ENTRY_KEY),
    with or without their meta.json (without: damaged). Anything else there is another tool's, and left
    alone. An entry that goes while it is listed (a removal, a start setting it aside) is not listed."""
    root, entries = Path(cache_dir).expanduser(), []
    if not root.is_dir():
        return entries
    for path in sorted(root.iterdir()):
        if not re.fullmatch(ENTRY_KEY, path.name) or not path.is_dir():
            continue
        try:
            meta_file = path / "meta.json"
            # its last use: a start sets meta.json's time where it may (not the access time: a listing
            # reads the file too)
            used = meta_file.stat().st_mtime if meta_file.is_file() else path.stat().st_mtime
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                meta = {}
            built = (path / "tokenizer.json").stat().st_mtime if (path / "tokenizer.json").is_file() else used
            entries.append(CacheEntry(path, str(meta.get("corpus", "?")), dict(meta.get("tokens", {})),
                                      tree_bytes(path), built, used, entry_damage(path)))
        except FileNotFoundError:
            continue
    return entries


ENTRY_KEY = r"[0-9a-f]{20}"
"""A cache entry (one corpus's or a mixture's) is named by 20 hex digits of its key (_entry_of): a
directory so named without a meta.json is an entry copied or built in part (damaged)."""
LEFTOVER = r"\.[0-9a-f]{20}\.(tmp|damaged)-.+"
"""A build's staging directory (``.KEY.tmp-*``) or an entry set aside for removal (``.KEY.damaged-*``)."""


def cache_leftovers(cache_dir: str | Path) -> list[Path]:
    """What builds left beside the entries: staging directories (``.KEY.tmp-*``: a build under way, or
    one that was killed) and entries set aside for removal (``.KEY.damaged-*``)."""
    root = Path(cache_dir).expanduser()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if re.fullmatch(LEFTOVER, p.name))


def remove_cache_entry(entry: Path) -> None:
    """Remove ``entry``: renamed aside first (atomic: a start that looks for it then builds it again
    rather than reading half of it), then deleted. A run that has its streams open keeps reading them
    (POSIX keeps an open file until it is closed)."""
    if not entry.is_symlink() and not os.access(entry, os.W_OK | os.X_OK):  # its files could not be deleted:
        raise PermissionError(errno.EACCES, "its files cannot be deleted here (the directory is not "  # left in
                              "writable)", str(entry))  # service, not set aside
    aside = entry.parent / f".{entry.name}.damaged-{os.getpid()}"
    os.rename(entry, aside)
    if aside.is_symlink():  # an entry linked in from elsewhere: the link goes, what it names stays
        aside.unlink()
        return

    def gone_meanwhile(function, path, exc_info):  # another process removing the set-aside one too
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(aside, onerror=gone_meanwhile)
    if os.path.lexists(aside):
        raise OSError(errno.ENOTEMPTY, "set aside but not wholly deleted", str(aside))


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _read_cache_entry(entry: Path) -> tuple[Tokenizer, dict[str, np.ndarray]]:
    """The entry's tokenizer and its streams by name (train, val; a mixture's train.D, val.D),
    memory-mapped."""
    meta = json.loads((entry / "meta.json").read_text())
    # (read as text: a file removed meanwhile is a FileNotFoundError, which _read_entry_of retries;
    # tokenizers' own reader raises a bare Exception)
    tokenizer = Tokenizer.from_str((entry / "tokenizer.json").read_text(encoding="utf-8"))
    names = list(meta.get("tokens", {})) or ["train", "val"]
    return tokenizer, {name: np.memmap(entry / f"{name}.bin", dtype=meta["dtype"], mode="r") for name in names}


TOKENIZER_NAME = "tokenizer.json"


def tokenizer_path(value: str, field: str = "data.tokenizer_file") -> Path:
    """The tokenizer.json that the value of ``field`` names: the file, or the one inside a directory
    (as ``save_pretrained`` of HF transformers writes it); CorpusError naming the field otherwise."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / TOKENIZER_NAME).is_file():
            raise CorpusError(f"{field}={value!r} is a directory without a {TOKENIZER_NAME}: pass a "
                              f"tokenizer.json saved by HF tokenizers (or a directory holding one, as "
                              f"save_pretrained writes it), or None to train one")
        return path / TOKENIZER_NAME
    if not path.is_file():
        raise CorpusError(f"{field}={value!r} does not exist: pass a tokenizer.json saved by HF "
                          f"tokenizers (or a directory holding one), or None to train one")
    return path


def _read_tokenizer_bytes(cfg: DataConfig) -> bytes:
    return tokenizer_path(cfg.tokenizer_file).read_bytes()


def read_tokenizer_file(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of ``cfg.tokenizer_file``; CorpusError naming the field if it is not one."""
    try:
        return tokenizer_lib.plain(Tokenizer.from_str(_read_tokenizer_bytes(cfg).decode("utf-8")))
    except CorpusError:
        raise
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception (or a decode error)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorpusError(f"data.tokenizer_file = {cfg.tokenizer_file!r} is not a tokenizer.json "
                          f"({reason}): pass one saved by HF tokenizers, or None to train one") from None


# ---------------------------------------------------------------------------------------------
# pre-tokenized corpora: no documents, so split by position unless val_corpus is given

def _token_array_streams(cfg: DataConfig):
    tokenizer = read_tokenizer_file(cfg) if cfg.tokenizer_file else None
    check_bin_width(cfg, tokenizer_lib.id_space(tokenizer) if tokenizer else cfg.vocab_size)
    tokens = load_token_array(cfg.corpus, cfg.bin_dtype)
    if cfg.val_corpus is not None:
        if not is_token_array_path(cfg.val_corpus):
            raise CorpusError(f"DataConfig.val_corpus={cfg.val_corpus!r} is not a .npy/.bin token "
                              f"array but corpus={cfg.corpus!r} is: give both as arrays")
        train_tokens, val_tokens = tokens, load_token_array(cfg.val_corpus, cfg.bin_dtype)
        split = "separate val_corpus"
    else:
        num_val = math.ceil(len(tokens) * cfg.val_fraction)
        if num_val >= len(tokens):
            raise CorpusError(f"token array {cfg.corpus!r} has {len(tokens)} tokens, too few to "
                              f"split: use a larger array or DataConfig.val_corpus")
        train_tokens, val_tokens = tokens[:-num_val], tokens[-num_val:]
        split = "by position: last val_fraction of tokens"
    files = [cfg.corpus] + ([cfg.val_corpus] if cfg.val_corpus is not None else [])
    read_as = json.dumps({"dtypes": [str(train_tokens.dtype), str(val_tokens.dtype)],
                          "val_fraction": None if cfg.val_corpus is not None else cfg.val_fraction})
    stats = DataStats(cfg.corpus, None, None, len(train_tokens), len(val_tokens), 0, 0,
                      split=split, content_key="tokens-" + token_array_fingerprint(files, read_as)[:20])
    return tokenizer, train_tokens, val_tokens, stats


def check_bin_width(cfg: DataConfig, vocab_size: int) -> None:
    """CorpusError naming data.bin_dtype when a raw .bin corpus is read as uint16 but the vocabulary
    (``vocab_size``: the tokenizer file's ids, or data.vocab_size) has ids a uint16 cannot hold."""
    bins = [spec for spec in (cfg.corpus, cfg.val_corpus)
            if spec and is_token_array_path(spec) and Path(spec).suffix.lower() == ".bin"]
    if bins and cfg.bin_dtype == "uint16" and vocab_size > 2**16:
        source = (f"data.tokenizer_file={cfg.tokenizer_file!r}" if cfg.tokenizer_file
                  else f"data.vocab_size={cfg.vocab_size}")
        raise CorpusError(f"data.bin_dtype='uint16' cannot hold the ids of {source} ({vocab_size:,} ids, more "
                          f"than 65,536), so {bins[0]!r} would be read as 16-bit halves: set "
                          "data.bin_dtype='uint32' (a stream of those ids is uint32)")


def _check_ids_fit(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int,
                   cfg: DataConfig) -> None:
    where = {"train": cfg.corpus, "val": cfg.val_corpus or cfg.corpus}
    for split, tokens in (("train", train_tokens), ("val", val_tokens)):
        smallest = int(tokens.min())
        if smallest < 0:
            raise CorpusError(f"token array {where[split]!r} holds the id {smallest}: token ids must be >= 0; "
                              "re-create the array from a tokenizer's ids")
    largest = max(int(train_tokens.max()), int(val_tokens.max()))
    if largest >= vocab_size:
        fix = (f"give a tokenizer_file whose ids reach {largest}" if cfg.tokenizer_file
               else f"set DataConfig.vocab_size > {largest}, or a matching tokenizer_file")
        raise CorpusError(f"token array {cfg.corpus!r} holds ids up to {largest} but the vocabulary has "
                          f"{vocab_size} ids: {fix}")
