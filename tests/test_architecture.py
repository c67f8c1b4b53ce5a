"""Import direction: a component imports only itself and the layers below it (docs/architecture.md).

Every module under src/largebatch is parsed with ``ast`` -- top-level, function-level and
relative imports alike -- so a lazy import cannot hide a layer reaching up. Components in the same
layer are independent of each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "largebatch"

# Lowest first. The one place the layering is written down; docs/architecture.md explains it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("largebatch", "arguments", "typed_config", "stats", "signals"),  # utilities: standard library only
    ("models", "optim", "schedules", "data"),  # the library parts, independent of each other
    ("memory",),  # the activation-memory model reads models' configs
    ("parallel",),  # data / tensor / sequence / pipeline plans over models, optim and memory
    ("checkpoint",),  # local .pt and distributed DCP formats (DCP reshards parallel's modules)
    ("train",),  # the trainer: config, loop, metrics, run directories
    ("integrations",),  # bridges to other libraries
    ("export",),  # a run -> another library's format (integrations' writers)
    ("finetune", "generate", "perplexity", "fill_mask"),  # a run downstream; text from a run; a text's score;
    # a BERT run's masked tokens
    ("experiments",),  # paper reproductions (the bert-lans one fine-tunes its runs)
    ("cli",),  # the dispatcher
    ("__main__",),  # python -m largebatch
)
LAYER = {component: level for level, names in enumerate(LAYERS) for component in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def component(module: str) -> str:
    """largebatch.train.loop -> 'train'; largebatch.cli -> 'cli'; largebatch -> 'largebatch'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every largebatch import in ``source``, at any depth."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PACKAGE:  # `from largebatch import optim` imports the component optim
                found += [(node.lineno, f"{PACKAGE}.{alias.name}" if alias.name in LAYER else PACKAGE)
                          for alias in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What ``module`` (given its source) imports against the layering, one line each."""
    own = component(module)
    if own not in LAYER:
        return [f"{module}: component {own!r} is in no layer; add it to LAYERS"]
    out = []
    for line, target in imported_modules(source, module, is_package):
        other = component(target)
        if other == own:
            continue
        if other not in LAYER:
            out.append(f"{module}:{line} imports {target}: component {other!r} is in no layer")
        elif LAYER[other] >= LAYER[own]:
            relation = "a sibling" if LAYER[other] == LAYER[own] else "a higher layer"
            out.append(f"{module}:{line} imports {target} ({relation}: {other} is layer {LAYER[other]}, "
                       f"{own} is layer {LAYER[own]})")
    return out


def test_every_module_imports_only_lower_layers():
    modules = sorted((SRC / PACKAGE).rglob("*.py"))
    assert len(modules) > 50  # the walk found the package
    problems = [v for path in modules
                for v in violations(path.read_text(), module_name(path), path.name == "__init__.py")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source, expected", [
    # a library part reaching up into the trainer, at module level
    ("largebatch.optim.fake", "from largebatch.train.loop import Trainer\n", "a higher layer: train"),
    # the same from inside a function (a lazy import is still an import)
    ("largebatch.schedules.fake", "def f():\n    import largebatch.experiments.runner\n",
     "a higher layer: experiments"),
    # a relative import that climbs out of the package
    ("largebatch.checkpoint.fake", "from ..train.config import TrainConfig\n", "a higher layer: train"),
    # siblings stay independent
    ("largebatch.models.fake", "from largebatch.data import build_data\n", "a sibling: data"),
    # `from largebatch import <component>`
    ("largebatch.memory.fake", "from largebatch import cli\n", "a higher layer: cli"),
])
def test_a_violation_is_reported(module, source, expected):
    found = violations(source, module)
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_and_unknown_components():
    assert violations("from largebatch.models import GPT\nfrom . import files\n"
                      "from largebatch.typed_config import to_dict\n", "largebatch.checkpoint.fake") == []
    assert violations("from .core import trust_ratio\n", "largebatch.optim", is_package=True) == []
    assert violations("from largebatch import __version__\n", "largebatch.cli") == []
    found = violations("import os\n", "largebatch.newpart.fake")
    assert len(found) == 1 and "in no layer" in found[0], found
