"""DataConfig: every knob of the data pipeline, documented under the field and validated.

A bad value raises ``ValueError`` naming the field, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from largebatch.data.corpus import CORPORA, is_token_array_path

BinDtype = Literal["uint16", "uint32"]
BIN_DTYPES = get_args(BinDtype)
DEFAULT_CORPUS = "shakespeare"
MIN_VOCAB_SIZE = 300  # 256 byte symbols + the special tokens + a few merges


@dataclass
class DataConfig:
    corpus: str = field(default=DEFAULT_CORPUS, metadata={"names": CORPORA})
    """What to train on. A named corpus (below; add one with largebatch.data.corpus.register_corpus)
    or a path: a UTF-8 text file, a JSON Lines file (one document per record, its text under
    ``text_field``), a Parquet or Arrow file (one document per row, its text in the column
    ``text_field``; needs ``pyarrow``), a directory of such files (one document per text file,
    searched recursively, hidden files skipped; a ``Dataset.save_to_disk`` directory too), a glob
    pattern of such files (``data/train-*.parquet``, one split of a Hub dataset; ``**`` spans
    directories; documents named from its leading directories without a glob character), text and
    JSON Lines files possibly compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with the ``zstandard``
    package), or a pre-tokenized array of token ids (``.npy``, or raw ``.bin`` of ``bin_dtype``)."""

    mixture: dict[str, float] | None = None
    """Train on several corpora at once, each drawn in proportion to its weight: a table from a
    corpus (any text kind ``corpus`` takes: a named corpus, a file, a directory, a glob pattern) to
    its weight, e.g. ``{shakespeare = 3, bible = 1}`` (75% and 25% of the samples; the weights need
    not sum to 1). Each corpus is split by document on its own (``val_fraction``), the tokenizer is
    trained on all their training splits, and a step's samples come from the corpora in these
    shares, spread evenly along the sample order (largebatch.data.sampler.MixtureSampler); a corpus
    whose share outruns its size repeats (the run's header gives each one's epochs). The validation
    slice is drawn in the same shares. With a mixture, ``corpus`` is not read (leave it unset);
    ``val_corpus``, ``val_documents`` and token arrays are refused."""

    val_corpus: str | None = None
    """Optional separate validation corpus (same kinds of path as ``corpus``). When given, all of
    ``corpus`` is training data and ``val_fraction`` / ``val_documents`` are ignored. The only way
    to get a validation split of a token array that is not a tail-by-position split."""

    val_fraction: float = 0.1
    """Share of the corpus's characters (text) or tokens (token arrays) held out for validation.
    Text corpora are split BY DOCUMENT: whole documents, drawn in a ``split_seed`` order, go to
    validation until at least this share of characters is reached (at least one document on each
    side): the document that crosses the line goes whole, so a long one can make the split far
    larger, and a build's log says so when it holds more than twice this share. Token arrays have
    no document boundaries, so their last ``val_fraction`` of tokens is the validation split (pass
    ``val_corpus`` instead to avoid that)."""

    val_documents: tuple[str, ...] = ()
    """Explicit validation documents by name (e.g. ``("hamlet", "genesis")``; names are the file
    stem for user directories). Overrides ``val_fraction``. Unknown names are an error."""

    split_seed: int = 1234
    """Seed of the document split, kept apart from ``seed`` so that runs with different training
    seeds validate on the same documents."""

    document_separator: str | None = None
    """If set, every text file (and JSON record) is further cut into documents at this string (e.g. "\\n\\n\\n"),
    so that a single file can still be split by document. Each part is stripped of leading and
    trailing whitespace (indentation and newlines at its ends are lost) and whitespace-only parts
    are dropped; the documents are named ``<file stem>#<k>`` (a JSON record's
    ``<file stem>:<line>#<k>``), ``k`` counting the parts kept. The string is matched as it is: a
    file with Windows line ends ("\\r\\n") needs "\\r\\n\\r\\n", not "\\n\\n", to be cut at its blank
    lines. Registered corpora are not cut."""

    text_field: str = "text"
    """JSON Lines corpora (``.jsonl``, ``.ndjson``, ``.json``; ``datasets``' ``Dataset.to_json``
    writes them): the field of each record that holds its text; Parquet and Arrow corpora: the
    column. Each record or row is one document, named ``<file stem>:<line>`` (``<file stem>:<row>``
    for a row, from 0); records whose text is empty or whitespace only are skipped (a Parquet or
    Arrow row whose text is null too; a JSON null is an error)."""

    vocab_size: int = 8192
    """Size of the byte-level BPE vocabulary trained on the training split (special tokens
    included; at least 300). For token arrays without ``tokenizer_file`` it is the model's vocabulary
    size and must exceed the largest token id (any size from 1: nothing is trained)."""

    tokenizer_file: str | None = None
    """Optional ``tokenizer.json`` (HF tokenizers), or a directory holding one (as ``save_pretrained``
    writes it), to use instead of training one. Required for ``decode`` and for BERT masking on
    pre-tokenized arrays; its vocabulary size (largest id + 1, added tokens included) then replaces
    ``vocab_size``."""

    bin_dtype: BinDtype = "uint16"
    """Element type of raw ``.bin`` token files ("uint16" as in nanoGPT, or "uint32"). "uint16" with
    a vocabulary past 65,536 ids, or with a file that is 0 at every other position (a uint32 file),
    is refused."""

    cache_dir: str = ".cache/largebatch"
    """Where the trained tokenizer and the tokenized, memory-mapped splits are cached. A relative
    path is taken relative to the CURRENT WORKING DIRECTORY. Entries are keyed on the corpus
    content fingerprint, the split, the vocabulary size and the tokenizer version, so a changed
    corpus or vocabulary never reuses a stale cache."""

    seed: int = 0
    """Seed of the training sample order (one permutation per epoch) and of BERT masking. The
    order depends only on (seed, global sample index), never on the batch schedule."""

    shuffle: bool = True
    """Shuffle the packed training samples each epoch. False: samples in corpus order."""

    mlm_probability: float = 0.15
    """BERT: share of non-special tokens selected for prediction (Devlin et al. 2019, Sec. 3.1)."""

    mask_token_fraction: float = 0.8
    """BERT: share of the selected tokens replaced by [MASK] (Devlin et al. 2019: 80%)."""

    random_token_fraction: float = 0.1
    """BERT: share of the selected tokens replaced by a random non-special token (10%); the rest
    (10%) are left unchanged but still predicted."""

    def __post_init__(self) -> None:
        if isinstance(self.val_documents, (list, str)):
            names = [self.val_documents] if isinstance(self.val_documents, str) else self.val_documents
            self.val_documents = tuple(names)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and the fix for any invalid field."""
        _check(isinstance(self.corpus, str) and self.corpus.strip() != "", "corpus", self.corpus,
               f"use one of {', '.join(CORPORA)} or a path to a text file, directory, .npy or .bin")
        if self.mixture is not None:
            self._check_mixture()
        _check(self.val_corpus is None or (isinstance(self.val_corpus, str) and self.val_corpus),
               "val_corpus", self.val_corpus, "use None or a path like the ones corpus accepts")
        _check(_is_number(self.val_fraction) and 0.0 < self.val_fraction < 1.0, "val_fraction",
               self.val_fraction, "use a number strictly between 0 and 1, e.g. 0.1")
        _check(isinstance(self.val_documents, tuple) and
               all(isinstance(n, str) and n for n in self.val_documents), "val_documents",
               self.val_documents, "use a tuple of document names, e.g. ('hamlet',)")
        _check(_is_int(self.split_seed) and 0 <= self.split_seed < 2**128, "split_seed", self.split_seed,
               "use an integer >= 0 (numpy's generator takes no negative seed)")
        _check(self.document_separator is None or
               (isinstance(self.document_separator, str) and self.document_separator),
               "document_separator", self.document_separator, 'use None or a non-empty string')
        _check(isinstance(self.text_field, str) and self.text_field != "", "text_field", self.text_field,
               'use the name of the JSON field that holds the text, e.g. "text"')
        # the 300 floor is a trained tokenizer's; a token array without one trains none (its vocabulary
        # is only the ids' range), and a tokenizer_file's size replaces vocab_size
        array = self.mixture is None and self.tokenizer_file is None and isinstance(self.corpus, str) \
            and is_token_array_path(self.corpus)
        trained = self.tokenizer_file is None and not array
        _check(_is_int(self.vocab_size) and (MIN_VOCAB_SIZE if trained else 1) <= self.vocab_size < 2**32,
               "vocab_size", self.vocab_size, "use an integer above the token array's largest id" if array else
               f"use an integer >= {MIN_VOCAB_SIZE} (a tokenizer trained on the text has 256 byte symbols and "
               "the special tokens), e.g. 8192" if trained else "use a positive integer (tokenizer_file's size "
               "replaces it)")
        _check(self.tokenizer_file is None or (isinstance(self.tokenizer_file, str) and self.tokenizer_file),
               "tokenizer_file", self.tokenizer_file, "use None (the default: a BPE trained on the corpus) or a "
               "path to a tokenizer.json")
        _check(self.bin_dtype in BIN_DTYPES, "bin_dtype", self.bin_dtype, f"use one of {BIN_DTYPES}")
        _check(isinstance(self.cache_dir, str) and self.cache_dir, "cache_dir", self.cache_dir,
               'use a directory path, e.g. ".cache/largebatch"')
        _check(_is_int(self.seed) and self.seed >= 0, "seed", self.seed, "use an integer >= 0")
        _check(isinstance(self.shuffle, bool), "shuffle", self.shuffle, "use true or false")
        _check(_is_number(self.mlm_probability) and 0.0 < self.mlm_probability < 1.0,
               "mlm_probability", self.mlm_probability, "use a number in (0, 1), e.g. 0.15")
        for name in ("mask_token_fraction", "random_token_fraction"):
            value = getattr(self, name)
            _check(_is_number(value) and 0.0 <= value <= 1.0, name, value,
                   "use a number in [0, 1] (0.8 and 0.1 in Devlin et al. 2019)")
        total = self.mask_token_fraction + self.random_token_fraction
        if total > 1.0:  # either field may be the one set: name both
            raise ValueError(f"DataConfig.mask_token_fraction={self.mask_token_fraction!r} and "
                             f"DataConfig.random_token_fraction={self.random_token_fraction!r} are "
                             f"invalid: the two sum to {total:.3g}; make them sum to at most 1 (the "
                             "rest stay unchanged)")


    def _check_mixture(self) -> None:
        from .sampler import mixture_counts

        example = "e.g. {shakespeare = 3, bible = 1}"
        _check(isinstance(self.mixture, dict) and len(self.mixture) >= 2, "mixture", self.mixture,
               f"give two or more corpora with their weights, {example} (one corpus: set corpus)")
        for spec, weight in self.mixture.items():
            _check(isinstance(spec, str) and spec.strip() != "", "mixture", self.mixture,
                   f"name each corpus as corpus does, {example}")
            _check(_is_number(weight) and weight > 0 and weight != float("inf"), "mixture", self.mixture,
                   f"give {spec!r} a positive weight, {example}")
            if is_token_array_path(spec):
                raise ValueError(f"DataConfig.mixture={self.mixture!r} is invalid: {spec!r} is a token array; a "
                                 "mixture takes text corpora (one tokenizer is trained on them all)")
        try:
            mixture_counts(list(self.mixture.values()))
        except ValueError as exc:
            raise ValueError(f"DataConfig.mixture={self.mixture!r} is invalid: {exc}") from None
        if self.corpus != DEFAULT_CORPUS:
            raise ValueError(f"DataConfig.corpus={self.corpus!r} and DataConfig.mixture are both set: the "
                             "mixture names the corpora; leave corpus unset (or put it in the mixture)")
        for name in ("val_corpus", "val_documents"):
            if getattr(self, name):
                raise ValueError(f"DataConfig.{name}={getattr(self, name)!r} is invalid with a mixture: each "
                                 "corpus of the mixture is split by document on its own (val_fraction); "
                                 f"leave {name} unset")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, value, fix: str) -> None:
    if not ok:
        raise ValueError(f"DataConfig.{name}={value!r} is invalid: {fix}")
