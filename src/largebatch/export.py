"""``largebatch export RUN_DIR OUT --format hf``: a trained run as a model other tools load.

    largebatch export runs/20261130-101500-gpt hf-gpt --format hf
    largebatch export runs/bert-post hf-bert --format hf --force     # replace an existing OUT

Reads the newest intact checkpoint of RUN_DIR (a single-process ``step_*.pt`` or a distributed
``step_*.dcp``, loaded into one process), or the one ``--checkpoint`` names, rebuilds the model
from the config stored in that checkpoint, recovers the run's tokenizer (RUN_DIR/tokenizer.json,
which the trainer keeps), and writes OUT in the chosen format. ``--format hf`` writes a
transformers directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json):
``AutoModelForCausalLM`` (GPT runs) or ``AutoModelForMaskedLM`` (BERT runs with
``model.norm_position="post"``) and ``AutoTokenizer`` load it offline. Before OUT is put in place
the written directory is loaded back with those Auto classes and its logits are compared with
largebatch's on a sentence; a difference above the tolerance is an error (``--no-verify`` skips
it). See docs/models.md, "Exporting to transformers".

Options:
  --format hf          the output format (hf is the only one)
  --force              replace OUT if it exists and is not empty
  --tokenizer PATH     the run's tokenizer.json when the run cannot give it (a run on a pre-tokenized
                       array without data.tokenizer_file); refused when it differs from the copy
                       the run keeps (RUN_DIR/tokenizer.json)
  --checkpoint STEP    export the run's checkpoint at optimizer step STEP (or give its name,
                       step_00000100.pt, or its path) instead of the newest; the run keeps the newest
                       run.keep_checkpoints of them
  --hf-model-type T    the transformers model_type to write, over the run's model.hf_model_type: gpt2,
                       llama, mistral, ministral, qwen2, qwen3, olmo2 or olmo3 (GPT; by default the one
                       computing the run's blocks), bert, roberta, xlm-roberta or camembert (post-LN BERT)
  --ema                export the run's weight average (run.ema_decay) instead of its weights; an
                       error when the checkpoint holds none
  --no-verify          skip loading OUT back and comparing logits
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from largebatch.arguments import pid_alive
from largebatch.integrations import ExportError

FORMATS = ("hf",)


@dataclass
class LoadedRun:
    """A run's model (eval mode, fp32, on CPU) with the checkpoint and tokenizer it came from."""

    model: Any  # largebatch.models.GPT | BERT
    checkpoint: Path
    step: int
    tokenizer: Any | None  # tokenizers.Tokenizer
    config: dict[str, Any]  # the run's TrainConfig as a dict (from the checkpoint)
    tokens: int | None = None  # tokens the run had trained on at that checkpoint (None: not recorded)
    chosen: bool = False  # named by the caller (--checkpoint), not the newest readable one
    ema: bool = False  # the model holds the checkpoint's weight average (run.ema_decay), not its weights
    at_target: bool = False  # the run ended at run.target_val_loss (run.stop_at_target): finished, not stopped
    val_documents: list[str] | None = None  # the names of the run's validation documents (None: not recorded)


def stopped_early(loaded: LoadedRun) -> str | None:
    """"the newest readable checkpoint is at N of the run's B tokens" for a checkpoint before the end
    of the run's token budget (a stopped run's newest, a live run's, or the one before an unreadable
    final checkpoint; "checkpoint step_... is at" for one chosen with --checkpoint), else None."""
    run = loaded.config.get("run", {})
    phases = loaded.config.get("phases") or []
    budget = sum(p.get("total_tokens", 0) for p in phases) if phases else run.get("total_tokens")
    if loaded.tokens is None or not budget or loaded.tokens >= budget or loaded.at_target:
        return None
    which = f"checkpoint {loaded.checkpoint.name}" if loaded.chosen else "the newest readable checkpoint"
    return f"{which} is at {loaded.tokens:,} of the run's {int(budget):,} tokens"


def partial_note(loaded: LoadedRun, verb: str) -> str | None:
    """The note for a partly trained checkpoint (``stopped_early``) with what to do about it; ``verb``
    is what the command does with it ("exports", "judges")."""
    stopped = stopped_early(loaded)
    if stopped is None:
        return None
    if loaded.chosen:
        return f"{stopped}: this {verb} a partly trained model, the one --checkpoint chose"
    return (f"{stopped}: this {verb} a partly trained model (continue it with `largebatch train "
            "--resume` for the finished one)")


def trained_positions(loaded) -> int | None:
    """The longest sequence the run's checkpoint trained at: the longest seq_len among the phases it
    had begun (a two-phase BERT recipe stopped in its short phase has never trained the later
    positions), None when every position was trained (no phases, or positions imported with
    ``model.init_from``)."""
    phases = loaded.config.get("phases") or []
    if not phases or loaded.config.get("model", {}).get("init_from") or loaded.tokens is None:
        return None
    start, reached = 0, []
    for phase in phases:
        if start < loaded.tokens or not reached:
            reached.append(int(phase["seq_len"]))
        start += int(phase.get("total_tokens", 0))
    return max(reached)


def check_run_dir_given(run_dir: str | Path) -> None:
    """ExportError for an empty RUN_DIR argument ('' would be read as the working directory)."""
    if isinstance(run_dir, str) and not run_dir.strip():
        raise ExportError(f"RUN_DIR is {run_dir!r}: pass a run directory written by `largebatch train` "
                          "(it holds config.toml and checkpoints/)")


def choose_checkpoint(run_dir: Path, which: str | int, candidates: list[Path]) -> Path:
    """The checkpoint of ``run_dir`` that ``which`` names: an optimizer step (``100``), a checkpoint's
    name (``step_00000100.pt``) or its path. ExportError naming the steps the run keeps otherwise."""
    from largebatch.checkpoint.files import checkpoint_dir, checkpoint_step

    text = str(which).strip()
    if not text:
        raise ExportError("--checkpoint is empty: give a step number (e.g. --checkpoint 1000), a "
                          "checkpoint's name or its path, or leave --checkpoint out for the newest")
    kept = ", ".join(str(checkpoint_step(p)) for p in candidates) or "none"
    fix = (f"RUN_DIR {str(run_dir)!r} keeps checkpoints at steps {kept} (run.keep_checkpoints keeps "
           "the newest ones): pass one of those, or leave --checkpoint out for the newest")
    if text.isdigit():
        found = [p for p in candidates if checkpoint_step(p) == int(text)]
        if not found:
            raise ExportError(f"--checkpoint {text}: no checkpoint at step {int(text)}; {fix}")
        return found[-1]
    path = Path(text)
    if not path.exists() and not path.is_absolute():
        path = checkpoint_dir(run_dir) / text
    kept_paths = {p.resolve(): p for p in candidates}
    if path.exists() and path.resolve() in kept_paths:
        return kept_paths[path.resolve()]
    why = ("is not one of this run's checkpoints" if path.exists() else "does not exist")
    raise ExportError(f"--checkpoint {text!r} {why}: give a step number or a checkpoint of RUN_DIR's "
                      f"checkpoints/ (step_NNNNNNNN.pt or .dcp); {fix}")


def weights_label(result: dict) -> str:
    """"step N (step_0000000N.pt[, weight average])": the weights a command's ``result`` (its ``step``,
    ``checkpoint`` and ``ema``) came from, for its closing line."""
    return (f"step {result['step']} ({Path(result['checkpoint']).name}"
            f"{', weight average' if result['ema'] else ''})")


def command_device(name: str):
    """The torch device a command's ``--device NAME`` names (cpu, cuda or cuda:N), or an ExportError
    saying why not."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ExportError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {name}: this torch sees no CUDA device; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ExportError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        raise ExportError(f"--device {name!r}: use cpu, cuda or cuda:N")
    return device


def open_run(run_dir: str | Path, device: str = "cpu", tokenizer_file: str | Path | None = None,
             checkpoint: str | int | None = None, ema: bool = False, log=print):
    """What a command reading a run's checkpoint starts with (generate, perplexity, fill-mask): RUN_DIR
    given (not empty), then --device, then the run loaded (``load_run``: the directory and its
    checkpoints checked). Returns (the LoadedRun, the torch device)."""
    check_run_dir_given(run_dir)
    dev = command_device(device)
    return load_run(run_dir, tokenizer_file, log=log, checkpoint=checkpoint, ema=ema), dev


def load_run(run_dir: str | Path, tokenizer_file: str | Path | None = None,
             log=print, checkpoint: str | int | None = None, ema: bool = False) -> LoadedRun:
    """The newest intact checkpoint of ``run_dir`` (or the one ``checkpoint`` names: a step, a name or
    a path, see ``choose_checkpoint``) loaded into a largebatch model on CPU; with ``ema``, the
    weight average it keeps (run.ema_decay) in place of its weights (ExportError when it has none).

    A checkpoint that cannot be read (a damaged file, a ``.dcp`` without its metadata or with a
    damaged shard) is skipped with a note, and the next older one is used; a chosen one that
    cannot be read is an error.
    """
    from largebatch.checkpoint import list_checkpoints
    from largebatch.train.rundir import TOKENIZER_NAME

    check_run_dir_given(run_dir)
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {str(run_dir)!r} is not a directory: pass a run directory "
                          "written by `largebatch train` (it holds config.toml and checkpoints/)")
    candidates = list_checkpoints(run_dir, kinds=(".pt", ".dcp"))
    if not candidates and (run_dir / "config.json").is_file() and not (run_dir / "config.toml").is_file():
        raise ExportError(f"RUN_DIR {str(run_dir)!r} is a transformers directory (config.json, as "
                          "`largebatch export` writes), not a run: pass the run directory it was "
                          "exported from (config.toml and checkpoints/), or train a run from it with "
                          f"--model.init_from=hf:{run_dir} and pass that run's directory")
    if not candidates:
        raise ExportError(f"RUN_DIR {str(run_dir)!r} has no checkpoint in "
                          f"{run_dir / 'checkpoints'}: train it (or resume it) to the end first")
    chosen = None if checkpoint is None else choose_checkpoint(run_dir, checkpoint, candidates)
    tokenizer = None  # read first where it needs no config: a bad file fails before the model loads
    if tokenizer_file is not None or (run_dir / TOKENIZER_NAME).is_file():
        tokenizer = run_tokenizer({}, tokenizer_file, run_dir)
    if chosen is not None:
        try:
            model, extra = _load_checkpoint(chosen, ema)
        except ExportError:
            raise
        except Exception as exc:  # noqa: BLE001 -- damaged in any way (see below)
            if not chosen.exists():
                raise ExportError(f"--checkpoint {str(checkpoint)!r}: {chosen} was deleted while it was "
                                  "read (retention of a run still training): choose a newer one") from None
            raise ExportError(f"--checkpoint {str(checkpoint)!r}: {chosen} cannot be read "
                              f"({(str(exc).splitlines() or [type(exc).__name__])[0]}): choose another "
                              "checkpoint, or leave --checkpoint out for the newest readable one") from None
        return _loaded(run_dir, chosen, model, extra, tokenizer, tokenizer_file, chosen=True, ema=ema, log=log)
    problems, tried = [], set()
    for _ in range(5):  # a run still training saves and deletes checkpoints (retention) meanwhile
        for path in reversed(candidates):
            if path in tried or not path.exists():
                continue
            tried.add(path)
            try:
                model, extra = _load_checkpoint(path, ema)
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001 -- damaged in any way: fall back to the previous
                # (a damaged .pt or .dcp shard is a CheckpointError, a RuntimeError; unpickling garbage
                # raises about anything)
                if not path.exists():  # deleted while it was read: not damaged; the list is read again
                    continue
                problems.append(f"{path.name}: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
                log(f"note: skipping unreadable checkpoint {path} ({problems[-1]})")
                continue
            return _loaded(run_dir, path, model, extra, tokenizer, tokenizer_file, ema=ema, log=log)
        candidates = list_checkpoints(run_dir, kinds=(".pt", ".dcp"))
        if set(candidates) <= tried:
            break
    raise ExportError(f"RUN_DIR {str(run_dir)!r}: no checkpoint could be read ({'; '.join(problems)})")


def _loaded(run_dir: Path, path: Path, model, extra: dict, tokenizer, tokenizer_file, chosen: bool = False,
            ema: bool = False, log=print):
    from largebatch.checkpoint.files import checkpoint_step

    step = int(extra.get("progress", {}).get("step", checkpoint_step(path)))
    if tokenizer is None:
        tokenizer = run_tokenizer(extra["config"], tokenizer_file, run_dir)
    elif tokenizer_file is not None:
        check_given_tokenizer(tokenizer, tokenizer_file, extra["config"], run_dir, log)
    tokens = extra.get("progress", {}).get("tokens")
    at_target = bool(extra["config"].get("run", {}).get("stop_at_target") and extra.get("progress", {}).get("target"))
    if not at_target and extra.get("progress", {}).get("target"):  # turned on when the run ended: its summary says
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            at_target = summary.get("stopped_at_target") is True and summary.get("steps") == step
        except (OSError, ValueError, AttributeError):
            pass
    val_documents = extra.get("val_documents")
    return LoadedRun(model, path, step, tokenizer, extra["config"], None if tokens is None else int(tokens),
                     chosen=chosen, ema=ema, at_target=at_target,
                     val_documents=None if val_documents is None else list(val_documents))


def _load_checkpoint(path: Path, ema: bool = False):
    import torch

    from largebatch.models import ModelConfig, build_model
    from largebatch.typed_config import from_dict

    if path.suffix == ".dcp":
        from largebatch.checkpoint.files import read_torch_file

        extra = read_torch_file(path / "extra.pt")
    else:
        from largebatch.checkpoint import load_checkpoint

        extra = load_checkpoint(path)
    if "config" not in extra or "model" not in extra["config"]:
        raise ExportError(f"checkpoint {path} holds no run config: it was not written by "
                          "`largebatch train`")
    model = build_model(from_dict(ModelConfig, extra["config"]["model"]))  # eval(): no dropout
    if ema and not extra.get("ema"):
        raise ExportError(f"--ema: checkpoint {path} holds no weight average (its run had run.ema_decay "
                          "off): leave --ema out for its weights, or continue the run with "
                          "--run.ema_decay=0.999 (say) and use a later checkpoint")
    average: dict[str, torch.Tensor] = {}  # the average by parameter name (the optimizer's: trainable ones)
    if path.suffix == ".dcp":  # DCP loads into a plain state dict in one process
        from largebatch.checkpoint.distributed import load_distributed
        from largebatch.parallel.mesh import ParallelState

        template = {}
        if ema:
            import torch.distributed.checkpoint as dcp

            keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            template = {"ema": {name: torch.empty_like(p) for name, p in model.named_parameters()
                                if f"ema.{name}" in keys}}
        load_distributed(path, model, None, ParallelState(), tensors=template)
        average = template.get("ema", {})
    else:
        state = {k.replace("_orig_mod.", ""): v for k, v in extra["model"].items()}
        model.load_state_dict(state, strict=True)
        average = {k.replace("_orig_mod.", ""): v for k, v in (extra.get("ema_tensors") or {}).items()}
    if ema:
        missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in average]
        if missing:
            raise ExportError(f"--ema: checkpoint {path} has no weight average of {missing[0]!r} ({len(missing)} "
                              "trainable parameter(s) without one): it is damaged, or was not written by "
                              "`largebatch train`")
        with torch.no_grad():  # (tied parameters are listed once: both names follow; frozen ones keep theirs)
            for name, p in model.named_parameters():
                if name in average:
                    p.copy_(average[name])
    return model.float().eval(), extra


def run_tokenizer(config: dict[str, Any], tokenizer_file: str | Path | None = None,
                  run_dir: str | Path | None = None):
    """The tokenizer a run trained with: ``tokenizer_file`` if given (refused when the run keeps its
    own copy and the two vocabularies differ), else the copy the trainer keeps in
    ``RUN_DIR/tokenizer.json``, else the run's ``data.tokenizer_file``, else the one
    trained on its corpus (read from the data cache, or trained again -- deterministic -- when the
    cache is gone: runs from before the trainer kept its copy)."""
    from largebatch.train.rundir import TOKENIZER_NAME

    if tokenizer_file is not None:
        path = Path(tokenizer_file).expanduser()
        if not path.is_file():
            state = "is not a file" if path.exists() else "does not exist"
            raise ExportError(f"--tokenizer {str(tokenizer_file)!r} {state}: pass a "
                              "tokenizer.json saved by HF tokenizers")
        given = _read_tokenizer(path, f"--tokenizer {str(tokenizer_file)!r}",
                                "pass a tokenizer.json saved by HF tokenizers (Tokenizer.save)")
        kept = None if run_dir is None else Path(run_dir) / TOKENIZER_NAME
        if kept is not None and kept.is_file():  # the run's own copy: another vocabulary is refused
            _same_vocabulary(given, tokenizer_file, kept, f"the run's tokenizer {str(kept)!r}", str(kept))
        return given
    if run_dir is not None and (Path(run_dir) / TOKENIZER_NAME).is_file():
        path = Path(run_dir) / TOKENIZER_NAME
        return _read_tokenizer(path, f"the run's tokenizer {str(path)!r}",
                               "pass --tokenizer PATH to a copy of the tokenizer.json the run used")
    from largebatch.data import DataConfig, build_data
    from largebatch.data.corpus import is_token_array_path
    from largebatch.models.registry import model_spec
    from largebatch.typed_config import from_dict

    data_cfg = from_dict(DataConfig, config.get("data", {}))
    if data_cfg.tokenizer_file:
        path = Path(data_cfg.tokenizer_file).expanduser()
        if not path.is_file():
            raise ExportError(f"the run's data.tokenizer_file={data_cfg.tokenizer_file!r} no "
                              "longer exists: pass --tokenizer PATH to the same tokenizer.json")
        return _read_tokenizer(path, f"the run's data.tokenizer_file={data_cfg.tokenizer_file!r}",
                               "pass --tokenizer PATH to an intact copy of it")
    if is_token_array_path(data_cfg.corpus):
        raise ExportError(f"the run trained on the token array data.corpus={data_cfg.corpus!r} "
                          "without data.tokenizer_file: pass --tokenizer PATH to the "
                          "tokenizer.json that produced it")
    model = config["model"]
    try:
        objective = model_spec(model["kind"]).objective
        return build_data(data_cfg, seq_len=int(model["seq_len"]), objective=objective).tokenizer
    except (OSError, ValueError) as exc:  # CorpusError is a ValueError: the corpus moved or changed
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        corpus = f"data.mixture={data_cfg.mixture!r}" if data_cfg.mixture else f"data.corpus={data_cfg.corpus!r}"
        raise ExportError(f"cannot rebuild the run's tokenizer from {corpus} "
                          f"({first}): pass --tokenizer PATH to the tokenizer.json it used") from exc


def check_given_tokenizer(given, tokenizer_file: str | Path, config: dict[str, Any], run_dir: str | Path,
                          log=print) -> None:
    """``--tokenizer`` for a run that keeps no ``tokenizer.json`` (one kept copy is compared in
    ``run_tokenizer``): refused when the run's ``data.tokenizer_file`` still exists and holds another
    vocabulary; otherwise nothing is left to compare it with, and a note says it is taken unchecked
    (a vocabulary of the same size would give other tokens without an error)."""
    from largebatch.train.rundir import TOKENIZER_NAME

    if (Path(run_dir) / TOKENIZER_NAME).is_file():
        return
    recorded = config.get("data", {}).get("tokenizer_file")
    path = None if not recorded else Path(recorded).expanduser()
    if path is not None and path.is_file():
        _same_vocabulary(given, tokenizer_file, path, f"the run's data.tokenizer_file={recorded!r}",
                         f"its data.tokenizer_file={recorded!r}")
        return
    log(f"note: --tokenizer {str(tokenizer_file)!r} is taken as the run's tokenizer unchecked: {run_dir} keeps no "
        f"{TOKENIZER_NAME} to compare it with (the trainer writes one; this run predates it or lost it), and a "
        "vocabulary of the same size but other tokens would give wrong text without an error")


def _same_vocabulary(given, tokenizer_file: str | Path, path: Path, what: str, named: str) -> None:
    """``--tokenizer``'s vocabulary against the one at ``path`` (what the run trained with; ``what``
    names it in a read error, ``named`` in the refusal): another vocabulary is refused."""
    theirs = _read_tokenizer(path, what, "pass --tokenizer PATH")
    if given.get_vocab() != theirs.get_vocab():
        raise ExportError(f"--tokenizer {str(tokenizer_file)!r} is not the vocabulary this run trained with "
                          f"({named}, {theirs.get_vocab_size():,} tokens; this one {given.get_vocab_size():,}): "
                          "the model's ids index that one. Leave --tokenizer out to use it")


def _read_tokenizer(path: Path, what: str, fix: str):
    """``tokenizers.Tokenizer.from_file``, whose bare ``Exception`` on a file that is not a
    tokenizers JSON (or a damaged one) becomes one line naming ``what`` and the ``fix``."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"{what} is not a readable tokenizers file ({first}): {fix}") from None


def _usage() -> str:
    return (__doc__ or "").strip() + "\n"


def _fail(message: str, code: int = 2) -> int:
    print(f"largebatch export: error: {message}", file=sys.stderr)
    return code


def _parse(argv: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"format": None, "force": False, "tokenizer": None, "verify": True,
                            "checkpoint": None, "hf-model-type": None, "ema": False}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg[2:].split("=", 1)
            if name in ("force", "no-verify", "ema"):
                raise ExportError(f"--{name} takes no value: write --{name} alone")
        elif arg in ("--format", "--tokenizer", "--checkpoint", "--hf-model-type"):
            if i + 1 >= len(argv):
                example = {"--format": "hf", "--tokenizer": "PATH/tokenizer.json", "--checkpoint": "1000",
                           "--hf-model-type": "roberta"}[arg]
                raise ExportError(f"{arg} needs a value, e.g. {arg} {example}")
            name, value = arg[2:], argv[i + 1]
            i += 1
        elif arg == "--force":
            name, value = "force", True
        elif arg == "--no-verify":
            name, value = "verify", False
        elif arg == "--ema":
            name, value = "ema", True
        elif arg.startswith("-"):
            raise ExportError(f"unknown option {arg!r}: use --format, --force, --tokenizer, "
                              "--checkpoint, --hf-model-type, --ema or --no-verify (largebatch export --help)")
        else:
            positional.append(arg)
            i += 1
            continue
        if name not in ("format", "tokenizer", "checkpoint", "hf-model-type", "force", "verify", "ema"):
            raise ExportError(f"unknown option '--{name}': use --format, --force, --tokenizer, "
                              "--checkpoint, --hf-model-type, --ema or --no-verify (largebatch export --help)")
        opts[name] = value
        i += 1
    if len(positional) != 2:
        raise ExportError(f"expected RUN_DIR and OUT, got {len(positional)} argument(s) "
                          f"{positional}: largebatch export RUN_DIR OUT --format hf")
    opts["run_dir"], opts["out"] = positional
    if opts["format"] is None:
        raise ExportError("--format is required: --format hf")
    if opts["format"] not in FORMATS:
        raise ExportError(f"--format {opts['format']!r} is unknown: use one of {', '.join(FORMATS)}")
    return opts


def export(run_dir: str | Path, out: str | Path, format: str = "hf", force: bool = False,
           tokenizer_file: str | Path | None = None, verify: bool = True, log=print,
           checkpoint: str | int | None = None, hf_model_type: str | None = None,
           ema: bool = False) -> dict[str, Any]:
    """Export the newest checkpoint of ``run_dir`` (or the one ``checkpoint`` names) to ``out``, as
    the transformers ``hf_model_type`` when given (else the run's model.hf_model_type); with ``ema``,
    its weight average (run.ema_decay) instead of its weights. Returns what was written.

    ``out`` is written in a temporary sibling directory and renamed into place, so a failed export
    never leaves a half-written OUT (with ``force`` an existing OUT is replaced only then).
    """
    if format not in FORMATS:
        raise ExportError(f"format {format!r} is unknown: use one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    if out.is_symlink() and out.is_dir():  # a link to a directory ("latest -> run-7"): written through
        out = out.resolve()
    elif out.is_symlink():  # (it failed at the end, after the whole export, or as a RuntimeError)
        target = os.readlink(out)
        raise ExportError(f"OUT {str(out)!r} is a symbolic link to {target!r}, which is "
                          f"{'a file' if out.exists() else 'missing or a loop of links'}: pick a directory "
                          "path, or make the link point to a directory")
    run_path = Path(run_dir).expanduser().resolve()
    if out.resolve() == run_path or out.resolve() in run_path.parents:
        raise ExportError(f"OUT {str(out)!r} is RUN_DIR or holds it: replacing it would delete the "
                          "run; pick a path outside the run directory")
    cwd = Path.cwd().resolve()
    if out.is_dir() and (out.resolve() == cwd or out.resolve() in cwd.parents):
        raise ExportError(f"OUT {str(out)!r} is the working directory or holds it: the export replaces "
                          "OUT as a whole; pick a new directory path, e.g. hf-model")
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT {str(out)!r} exists and is a file: pick a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"OUT {str(out)!r} exists and is not empty: pick another path, or pass "
                          "--force to replace it")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # checked before the (long) checkpoint load
        raise ExportError(f"OUT {str(out)!r} cannot be created: {str(blocked)!r} is a file, not a "
                          "directory; pick an OUT path whose parents are directories")
    if hf_model_type is not None:
        from largebatch.models.config import HF_MODEL_TYPES

        known = sorted({t for types in HF_MODEL_TYPES.values() for t in types})
        if hf_model_type not in known:
            raise ExportError(f"--hf-model-type {hf_model_type!r} is unknown: use one of {', '.join(known)}")
    loaded = load_run(run_dir, tokenizer_file, log=log, checkpoint=checkpoint, ema=ema)
    if hf_model_type is not None:  # the function is the same: only what the export writes changes
        from largebatch.models.config import hf_model_type_problem

        loaded.model.config = loaded.model.config.replace(hf_model_type=hf_model_type)
        if (problem := hf_model_type_problem(loaded.model.config, "--hf-model-type", fixed=True)) is not None:
            raise ExportError(problem)
    if (partial := partial_note(loaded, "exports")) is not None:
        log(f"note: {partial}")
    if loaded.model.config.document_mask:
        log(f"note: the run attended within documents (model.document_mask); transformers' model attends across "
            f"a separator (id {loaded.model.config.separator_id}) inside one input (its generate() too), so give "
            "it one document per input to compute what the run computed")
    seq_len = loaded.model.config.seq_len
    trained = trained_positions(loaded)
    trained = trained if trained is not None and trained < seq_len else None  # None: every position
    if trained is not None:
        log(f"note: the run has trained positions 0-{trained - 1} only (it stopped in a phase at seq_len "
            f"{trained}); the tokenizer's model_max_length is {trained}, so truncation=True cuts there "
            f"(config.json keeps max_position_embeddings={seq_len}, the size of the position table)")
    from largebatch.integrations.hf_export import save_hf, verify_hf

    host = socket.gethostname()
    staging = out.parent / f".{out.name}.export-{host}-{os.getpid()}"  # mkdir: the umask's permissions
    old = out.parent / f".{out.name}.export-{host}-old-{os.getpid()}"  # an OUT replaced, until the new is in
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for left in out.parent.glob(glob.escape(f".{out.name}.export-{host}-") + "*"):  # killed exports' here
            pid = left.name.rsplit("-", 1)[1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)  # an OUT this process replaced, its deletion stopped
        staging.mkdir()
    except OSError as exc:  # a read-only or permission-denied parent
        raise ExportError(f"OUT {str(out)!r} cannot be created ({exc.strerror or exc}: "
                          f"{exc.filename}): pick a writable directory path") from None
    aside = None  # an OUT being replaced, renamed out of the way until the new one is in place
    try:
        info = save_hf(loaded.model, loaded.tokenizer, staging, max_length=trained)
        if verify:
            info["max_abs_diff"] = verify_hf(loaded.model, loaded.tokenizer, staging)
        readable_as_made(staging)
        if out.is_dir():  # replaced: the new OUT keeps the old one's permissions and group
            keep_directory_access(staging, out.stat())
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif out.exists():  # written by someone else since the check at the start (another export)
            if not force:
                raise ExportError(f"OUT {str(out)!r} was written while this export ran (another export "
                                  "into it?): pick another path, or pass --force to replace it")
            # renamed aside, not deleted first: a stop (Ctrl-C) while a large OUT was deleted left
            # neither the old export nor the new one
            aside = old
            out.rename(aside)
        staging.rename(out)
    finally:
        if aside is not None:
            if not out.exists():  # stopped between the two renames: the old OUT goes back
                aside.rename(out)
            elif aside.is_dir():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                aside.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    info.update(checkpoint=str(loaded.checkpoint), step=loaded.step, out=str(out), ema=ema)
    return info


def readable_as_made(directory: Path) -> None:
    """Give every file in ``directory`` the permissions a file made there gets (the directory's, made
    by mkdir under the umask, without the execute bits): transformers writes model.safetensors
    through a private temporary file (mode 0600), so another user or a serving container running
    under another uid could read the config and the tokenizer but not the weights."""
    mode = directory.stat().st_mode & 0o666
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def keep_directory_access(directory: Path, old: os.stat_result) -> None:
    """Give ``directory`` (about to replace a directory whose stat is ``old``) that directory's mode
    (a group-shared 2770 stays 2770, setgid included) and group, and its files that group, as files
    made inside the old one would have had under its setgid bit. A group this user may not give
    (not a member) is left as made."""
    for path in [directory, *directory.rglob("*")]:
        if path.stat().st_gid != old.st_gid:
            try:
                os.chown(path, -1, old.st_gid)
            except PermissionError:
                break
    directory.chmod(stat.S_IMODE(old.st_mode))


# the package a format needs -> the extra that brings it
EXTRA_OF = {"transformers": "hf", "safetensors": "hf", "tokenizers": "train"}


def _quiet_transformers() -> None:
    """Fail now if transformers is missing (before reading a checkpoint); no per-file progress
    bars from its save / load on the command line."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return 0
    if not argv:  # as argparse does: one line on stderr, exit 2
        return _fail("RUN_DIR and OUT are required: largebatch export RUN_DIR OUT --format hf "
                     "(--help for the options)")
    try:
        opts = _parse(argv)
        _quiet_transformers()
        info = export(opts["run_dir"], opts["out"], opts["format"], force=opts["force"],
                      tokenizer_file=opts["tokenizer"], verify=opts["verify"], checkpoint=opts["checkpoint"],
                      hf_model_type=opts["hf-model-type"], ema=opts["ema"],
                      log=lambda m: print(m, file=sys.stderr))
    except ExportError as exc:
        return _fail(str(exc))
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package in EXTRA_OF:
            extra = EXTRA_OF[package]
            return _fail(f"export --format hf needs {package!r}, part of the [{extra}] extra: "
                         f"pip install 'largebatch[{extra}]'")
        raise
    checked = (f"; logits match largebatch's to {info['max_abs_diff']:.1e}"
               if "max_abs_diff" in info else "")
    print(f"exported {info['checkpoint']} (step {info['step']}{', its weight average' if info['ema'] else ''}) "
          f"as {info['architecture']} to "
          f"{info['out']}{checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
