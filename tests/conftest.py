"""Shared test setup: deterministic, single-threaded-friendly torch on a 2-core CPU."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from seed 0 and leaves the thread count as it found it (training results
    depend on it: a test that ran later with another count would not reproduce a reference run)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The uninterrupted tiny GPT run of tests/test_train.py (cache dir, run dir, summary): the
    reference every stopped-and-continued run is compared with, shared by the test modules."""
    from test_train import _run, tiny_overrides

    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("runs") / "reference"
    summary = _run(tiny_overrides(cache, out, **{"run.plots": True}))  # its PNGs are checked
    return cache, out, summary


@pytest.fixture(scope="session")
def tiny_data_cache(tmp_path_factory):
    """One data cache for the modules that train tiny runs on Shakespeare (entries are keyed on their
    content, so sharing changes no result; it saves a tokenizer training and encoding per module)."""
    return tmp_path_factory.mktemp("tiny-data-cache")
