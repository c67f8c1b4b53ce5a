"""A batch policy and a corpus declared in one place: registered here (in this file only), each is
accepted by the config, listed by --help-config and used by the real trainer -- every step's batch
checked against the policy's definition, the documents against the loader's."""

from __future__ import annotations

import importlib
import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from largebatch.data.corpus import CORPORA, Document, load_documents, register_corpus
from largebatch.schedules import ScheduleConfig
from largebatch.schedules.batch import PiecewiseBatch
from largebatch.schedules.config import BATCH_POLICIES, register_batch_policy
from largebatch.train.cli import main
from largebatch.train.config import load_config
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError
from test_train import tiny_overrides

POLICY, CORPUS = "double-at-half", "stdlib-docs"
MODULES = ("argparse", "json", "typing", "collections", "difflib", "inspect", "subprocess", "unittest", "heapq",
           "pdb", "doctest", "csv", "ftplib", "smtplib")


def _stdlib_docs() -> list[Document]:
    """Real English prose: the docstrings of some standard-library modules, one document each."""
    return [Document(f"stdlib/{m}", importlib.import_module(m).__doc__.strip()) for m in MODULES]


@pytest.fixture
def registered():
    register_batch_policy(POLICY, lambda c, lr, total, sizes: PiecewiseBatch(
        lr, [(0, c.batch_size), (total // 2, 2 * c.batch_size)], **sizes),
        help="batch_size, doubled from half the budget on (a test's own)")
    register_corpus(CORPUS, _stdlib_docs, help="standard-library module docstrings (a test's own)")
    yield
    BATCH_POLICIES.pop(POLICY)
    CORPORA.pop(CORPUS)


def test_registered_names_are_accepted_and_listed(registered, capsys):
    cfg = load_config(None, {"schedule.batch_policy": POLICY, "data.corpus": CORPUS})
    assert (cfg.schedule.batch_policy, cfg.data.corpus) == (POLICY, CORPUS)
    assert [d.name for d in load_documents(CORPUS)] == [f"stdlib/{m}" for m in MODULES]
    with pytest.raises(ConfigError, match=f"did you mean '{POLICY}'"):
        load_config(None, {"schedule.batch_policy": "double-at-hlf"})
    # a milestone-only field is refused for it, naming the policies it applies to
    refused = ("schedule.max_batch_size = 64: only applies to batch_policy seesaw | seesaw-family | smith, "
               f"not '{POLICY}'")
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_config(None, {"schedule.batch_policy": POLICY, "schedule.max_batch_size": 64})
    assert main(["--help-config"]) == 0
    text = capsys.readouterr().out
    assert f"'smith' | '{POLICY}'" in text and f"{POLICY}: batch_size, doubled from half the budget" in text
    assert f"'shakespeare+bible' | '{CORPUS}' | str" in text and f"{CORPUS}: standard-library module" in text


def test_unregistered_they_are_refused():
    assert POLICY not in BATCH_POLICIES and CORPUS not in CORPORA
    with pytest.raises(ValueError, match=f"batch_policy = '{POLICY}': must be one of 'constant'"):
        ScheduleConfig(batch_policy=POLICY).build(10_000, 8)
    with pytest.raises(ValueError, match=f"corpus '{CORPUS}' does not exist: .* one of shakespeare, bible"):
        load_documents(CORPUS)


def test_the_trainer_trains_with_them(registered, tmp_path, capsys):
    """`largebatch train --schedule.batch_policy=double-at-half --data.corpus=stdlib-docs`: each
    step's batch is 8 sequences before half the budget and 16 from there, by the definition."""
    out, total, seq = tmp_path / "run", 32 * 8 * 12, 32
    o = tiny_overrides(tmp_path / "cache", out, **{
        "schedule.batch_policy": POLICY, "data.corpus": CORPUS, "data.vocab_size": 300,
        "run.total_tokens": total, "run.eval_tokens": 32 * 4, "run.eval_every_tokens": total})
    assert main([f"--{k}={json.dumps(v)}" for k, v in o.items()]) == 0, capsys.readouterr().err
    steps = [r for r in read_metrics(out) if r["kind"] == "train"]
    before = 0
    for r in steps:
        assert r["batch_size"] == (8 if before < total // 2 else 16), (before, r)
        before += r["batch_size"] * seq
    assert before == total and {r["batch_size"] for r in steps} == {8, 16}
    # the validation split is whole documents of the loader's: decoded, it holds their text
    (entry,) = (tmp_path / "cache").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["corpus"] == CORPUS and meta["val_documents"]
    texts = {d.name: d.text for d in _stdlib_docs()}
    tokenizer = Tokenizer.from_file(str(entry / "tokenizer.json"))
    val_text = tokenizer.decode(np.fromfile(entry / "val.bin", dtype=meta["dtype"]).tolist())
    for name in meta["val_documents"]:
        assert " ".join(texts[name].split()[:40]) in " ".join(val_text.split()), name
