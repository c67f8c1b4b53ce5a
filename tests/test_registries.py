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


def test_a_registration_is_checked_when_it_is_made():
    """register_* accepted anything: a name with a space, a builder that is a string, fields given as
    one string (--help-config then read "reads b, e, t, a, s"), a typo in adapt_default, a negative
    state size (the memory check then went wrong), and replaced a shipped entry without a word."""
    import warnings

    from largebatch.models import register_model
    from largebatch.schedules.config import register_lr_schedule
    from largebatch.train.optimizer import OPTIMIZERS, register_optimizer

    def ok(groups, cfg):
        return None

    cases = [
        (lambda: register_optimizer("my opt", ok, summary="x", fields=(), adapt_default=None, state_bytes=4),
         "register_optimizer(name='my opt'): a name must be a non-empty string without spaces"),
        (lambda: register_optimizer("x", "SGD", summary="x", fields=(), adapt_default=None, state_bytes=4),
         "register_optimizer('x'): build='SGD' must be a function"),
        (lambda: register_optimizer("x", ok, summary="x", fields="betas", adapt_default=None, state_bytes=4),
         "fields='betas' must be a tuple of [optim] field names"),
        (lambda: register_optimizer("x", ok, summary="x", fields=(), adapt_default=("weights",), state_bytes=4),
         "adapt_default=('weights',) must be None (no trust ratio) or a tuple of the parameter categories"),
        (lambda: register_optimizer("x", ok, summary="x", fields=(), adapt_default=None, state_bytes=-100),
         "state_bytes=-100 must be a whole number >= 0"),
        (lambda: register_optimizer("x", ok, summary="x", fields=(), adapt_default=None, state_bytes="4"),
         "state_bytes='4' must be a whole number >= 0"),
        (lambda: register_batch_policy("x", 3, help="y"), "register_batch_policy('x'): build=3 must be a function"),
        (lambda: register_lr_schedule("", ok, help="y"), "register_lr_schedule(name=''): a name must be"),
        (lambda: register_corpus("x", _stdlib_docs, help=None), "register_corpus('x'): help=None must be a "
                                                                "non-empty string"),
        (lambda: register_corpus("x", _stdlib_docs, help="y", check="no"), "check='no' must be a function or None"),
        (lambda: register_model("x=y", build=ok, objective="causal", help="y"), "a name must be a non-empty"),
    ]
    for register, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            register()
    assert "x" not in OPTIMIZERS and "x" not in BATCH_POLICIES and "x" not in CORPORA
    shipped = BATCH_POLICIES["constant"]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register_batch_policy("constant", shipped.build, help=shipped.help)
        assert [str(w.message) for w in caught] == [
            "register_batch_policy('constant') replaces the entry already registered under that name"]
    finally:
        BATCH_POLICIES["constant"] = shipped


class _FloatBatch(PiecewiseBatch):
    def batch_size(self, tokens):
        return float(super().batch_size(tokens))


class _OffBatch(PiecewiseBatch):  # from its second row on, 2 sequences short of its table
    def batch_size(self, tokens):
        batch = super().batch_size(tokens)
        return batch if tokens < self.breakpoints()[-1] else batch - 2


@pytest.mark.parametrize("policy,lr,message", [
    (lambda c, lr, total, sizes: _FloatBatch(lr, [(0, c.batch_size)], **sizes), None,
     "schedule.batch_policy = 'p': _FloatBatch.batch_size(0 tokens) = 8.0: a batch must be a whole multiple of "
     "micro_batch x dp_size = 4 x 1 = 4 sequences"),
    (lambda c, lr, total, sizes: _OffBatch(lr, [(0, c.batch_size), (total // 2, 2 * c.batch_size)], **sizes),
     None, "_OffBatch.batch_size(4,096 tokens) = 14: a batch must be a whole multiple of micro_batch x dp_size"),
    (lambda c, lr, total, sizes: lambda tokens: 8, None,
     "schedule.batch_policy = 'p': its builder (register_batch_policy) returned 'function', not a "
     "largebatch.schedules.JointSchedule"),
    (None, lambda c, peak, total, warmup: lambda tokens: peak,
     "schedule.lr_schedule = 'r': its builder (register_lr_schedule) returned 'function', not a "
     "largebatch.schedules.LRSchedule"),
    (None, "negative", "schedule.lr_schedule = 'r': its schedule gives lr(0 tokens) = -0.001; an LR must be a "
                       "finite number >= 0"),
])
def test_what_a_registered_schedule_returns_is_checked_before_a_run(tmp_path, capsys, policy, lr, message):
    """A batch policy returning 8.0, or a batch that is no multiple of the micro-batch, passed
    `train --check` (the run then crashed on a float, or trained batches of 12 and 5 in micro-batches of
    8); a schedule builder returning a plain function failed with an AttributeError; a negative LR
    was refused mid-run without naming the schedule. `train --check` now names the field."""
    from largebatch.schedules import lr as lr_module
    from largebatch.schedules.config import LR_BUILDERS, register_lr_schedule

    class Negative(lr_module.Constant):
        def __call__(self, tokens):
            return -1e-3

    overrides = tiny_overrides(tmp_path / "cache", tmp_path / "run", **{"run.total_tokens": 8192,
                                                                        "schedule.batch_policy": "constant"})
    if policy is not None:
        register_batch_policy("p", policy, help="a test's own")
        overrides["schedule.batch_policy"] = "p"
    if lr is not None:
        build = (lambda c, peak, total, warmup: Negative(peak, total, warmup)) if lr == "negative" else lr
        register_lr_schedule("r", build, help="a test's own")
        overrides["schedule.lr_schedule"] = "r"
    try:
        assert main([f"--{k}={json.dumps(v)}" for k, v in overrides.items()] + ["--check"]) == 2
        assert message in capsys.readouterr().err
    finally:
        BATCH_POLICIES.pop("p", None)
        LR_BUILDERS.pop("r", None)


@pytest.mark.parametrize("build,message", [
    (lambda groups, cfg: "adam", "its builder (register_optimizer) returned a str, without param_groups, step, "
                                 "zero_grad, state_dict, load_state_dict: return a torch.optim.Optimizer"),
    (lambda groups: None, "its optimizer failed on a small model at building it from the parameter groups: "
                          "TypeError"),
    ("stateless", "its optimizer failed on a small model at state_dict() and a copy's load_state_dict() (what a "
                  "checkpoint does): NotImplementedError"),
])
def test_a_registered_optimizer_is_tried_on_a_small_model_before_a_run(tmp_path, capsys, build, message):
    """A builder with the wrong signature, or one returning something else, passed `train --check`
    and failed in a traceback once the run had started; an optimizer whose state cannot be saved
    trained until its first checkpoint."""
    import torch

    from largebatch.train.optimizer import OPTIMIZERS, register_optimizer

    class Stateless(torch.optim.SGD):
        def state_dict(self):
            raise NotImplementedError("no state")

    if build == "stateless":
        build = lambda groups, cfg: Stateless(groups, lr=0.0)  # noqa: E731
    register_optimizer("probe", build, summary="a test's own", fields=(), adapt_default=None, state_bytes=4)
    overrides = tiny_overrides(tmp_path / "cache", tmp_path / "run", **{"optim.name": "probe"})
    try:
        assert main([f"--{k}={json.dumps(v)}" for k, v in overrides.items()] + ["--check"]) == 2
        err = capsys.readouterr().err
        assert f"optim.name = 'probe': {message}" in err, err
    finally:
        OPTIMIZERS.pop("probe")
    assert not (tmp_path / "run").exists()


def test_what_a_registered_corpus_returns_and_an_unregistered_name_are_named():
    """A corpus whose load() returned strings failed in an AttributeError deep in the split; a run
    naming an extension's optimizer, schedule or corpus, continued by plain `largebatch train`, was
    told only the shipped names, and never that the extension must be imported first."""
    register_corpus("strings", lambda: ["one text", "another"], help="a test's own")
    try:
        with pytest.raises(ValueError, match=re.escape(
                "corpus 'strings': its load() (register_corpus) returned a list holding str; return a list of "
                "largebatch.data.corpus.Document(name, text)")):
            load_documents("strings")
    finally:
        CORPORA.pop("strings")
    extension = "exists only in a process that imports that module first"
    for field, name in (("optim.name", "lion"), ("schedule.lr_schedule", "rsqrt"), ("schedule.batch_policy", "linear")):
        with pytest.raises(ConfigError, match=f"{re.escape(field)} = '{name}': must be one of .*{extension}"):
            load_config(None, {field: name})
    from largebatch.data.corpus import check_corpus

    with pytest.raises(ValueError, match=f"data.corpus = 'wikitext' does not exist: .*{extension}"):
        check_corpus("wikitext", "data.corpus")
    with pytest.raises(ValueError) as typo:  # a path: no word of extensions
        check_corpus("data/wiki.txt", "data.corpus")
    assert extension not in str(typo.value)
