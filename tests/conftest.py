"""Shared test setup: deterministic, single-threaded-friendly torch on a 2-core CPU."""

import os

# Before torch loads its OpenMP runtime: threads that wait at a barrier sleep instead of spinning.
# The two pytest-xdist workers keep both cores busy, and a test at 2 torch threads (the thread-count
# checks) had its spinning threads compete with the other worker's process: the seesaw smoke at 2
# threads beside one busy core took 86 s spinning, 35 s sleeping (31 s spinning on quiet cores).
# The results are bit for bit the same (the policy changes no summation order). The processes the
# tests start inherit it; the experiment runner sets the same for its arm workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test` runs 2 workers) each worker gets its share of the cores, so the
# workers do not oversubscribe them; the tests pass the count on to the processes they start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from seed 0 and leaves the thread count as it found it (training results
    depend on it: a test that ran later with another count would not reproduce a reference run)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and a shared machine does not stall on spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
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


# The modules that take longest here (seconds with `--durations`, 2-core CPU), started first so that
# the two pytest-xdist workers of `make test` (`--dist loadfile`: a module's tests share a worker and
# its module fixtures) finish together instead of one waiting on a long module collected late.
LONGEST_FIRST = ("test_experiments.py", "test_train_distributed.py", "test_pipeline.py",
                 "test_experiments_floor.py", "test_parallel.py", "test_train_cluster.py",
                 "test_meta_init.py", "test_optim_fused.py", "test_train_phases.py", "test_train_budget.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
