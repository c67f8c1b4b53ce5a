"""The ``largebatch`` command: a thin dispatcher to the subcommand each package owns.

Each subcommand lives next to the code it drives and exposes ``main(argv: list[str]) -> int``;
it is imported only when called, so ``largebatch schedule`` never pays for the trainer's imports.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import os
import signal
import sys

from largebatch import TorchTooOld, __version__
from largebatch.arguments import TRAIN_EXTRA, name_max
from largebatch.signals import exit_code, raise_on_signals

# name -> (module that owns it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("largebatch.train.cli", "pretrain GPT or BERT (the main job)"),
    "schedule": ("largebatch.schedules.cli", "print and plot a LR / batch-size schedule"),
    "memory": ("largebatch.memory.cli", "activation-memory table and recomputation planner"),
    "experiment": ("largebatch.experiments.cli", "reproduce a paper's claim at small scale"),
    "export": ("largebatch.export", "write a trained run as a transformers model (--format hf)"),
    "generate": ("largebatch.generate", "sample text from a trained GPT run (a KV cache; the run's tokenizer)"),
    "perplexity": ("largebatch.perplexity", "score a text with a trained GPT run: loss, perplexity, bits per byte"),
    "fill-mask": ("largebatch.fill_mask", "fill in a text's masked tokens with a trained BERT run: top tokens"),
    "finetune": ("largebatch.finetune", "fine-tune a run on a downstream task: pretrained vs scratch accuracy"),
    "data": ("largebatch.train.data_cli", "build a run's tokenized data ahead of it; list and clean the data cache"),
}




def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: largebatch COMMAND [options]   (largebatch COMMAND --help for its options)", ""]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"largebatch {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"largebatch: unknown command '{name}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    # a stop signal from here on raises (largebatch.signals): one line, not a silent end (SIGTERM
    # while torch imports, ~3 s) or a KeyboardInterrupt traceback; each command's own handling takes over
    entered = False
    try:
        with raise_on_signals():
            entered = True
            try:
                module = _load(name)
            except KeyboardInterrupt as exc:  # while the command's modules (torch among them) import
                return _stopped(name, exc, "while starting; nothing was written")
            if isinstance(module, int):  # could not be loaded: said why
                return module
            try:
                return _run(name, module, rest)
            except KeyboardInterrupt as exc:  # a command that does not handle stop signals itself
                return _stopped(name, exc)
    except KeyboardInterrupt as exc:  # while the handlers were put in (the first is live before the last) or back
        return _stopped(name, exc, "" if entered else "while starting; nothing was written")


def _stopped(name: str, exc: KeyboardInterrupt, when: str = "") -> int:
    signum = getattr(exc, "signum", signal.SIGINT)
    print(f"largebatch {name}: stopped by {signal.Signals(signum).name}{' ' + when if when else ''}",
          file=sys.stderr)
    return exit_code(signum)


def _load(name: str):
    """The module of command ``name``, or the exit code when it cannot be imported (said why)."""
    module_name, _ = COMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except TorchTooOld as exc:
        print(f"largebatch {name}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("largebatch"):
            print(f"largebatch: '{name}' is not available in this build ({exc.name} missing).",
                  file=sys.stderr)
            return 2
        if _missing_extra(name, exc):
            return 2
        raise


def _run(name: str, module, rest: list[str]) -> int:
    try:
        return int(module.main(rest) or 0)
    except TorchTooOld as exc:  # a command that imports the trainer when it runs
        print(f"largebatch {name}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a command that imports a [train] package only when it runs
        if _missing_extra(name, exc):  # (experiment's data, schedule's --plot)
            return 2
        raise
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        # Python 3.11's Path.exists() and is_dir() raise it rather than say False: wherever a command
        # first looks at such a path (a run directory, a corpus, a config), one line, not a traceback
        print(f"largebatch {name}: error: {exc.filename!r}: a name in this path is too long for its "
              f"filesystem (at most {name_max(os.fspath(exc.filename or '.'))} bytes a name): shorten it",
              file=sys.stderr)
        return 2


def _missing_extra(name: str, exc: ModuleNotFoundError) -> bool:
    """Say which extra brings the package ``exc`` names, when it is a [train] one; True if said."""
    package = (exc.name or "").split(".")[0]
    if package not in TRAIN_EXTRA:
        return False
    print(f"largebatch: '{name}' needs the package {package!r}, part of the [train] "
          "extra: pip install 'largebatch[train]'", file=sys.stderr)
    return True


def console() -> None:
    """The ``largebatch`` program (its console script and ``python -m largebatch``): ``main`` on
    the command line, then exit with its code. A process that joined a process group (a torchrun
    worker) exits through ``largebatch.parallel.mesh.end_process``, without the interpreter's
    teardown, at which torch's backend threads can abort a rank whose run has finished. Output
    piped into a reader that stops early (``largebatch train --help-config | head``) ends the
    program quietly with 141, as a shell reports a process that SIGPIPE ended, not with a
    BrokenPipeError traceback."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush must not raise again)
        code = 128 + signal.SIGPIPE
    mesh = sys.modules.get("largebatch.parallel.mesh")  # imported only by the commands that use it
    sys.exit(code if mesh is None else mesh.end_process(code))


if __name__ == "__main__":
    console()
