"""The ``largebatch`` command: a thin dispatcher to the subcommand each package owns.

Each subcommand lives next to the code it drives and exposes ``main(argv: list[str]) -> int``;
it is imported only when called, so ``largebatch schedule`` never pays for the trainer's imports.
"""

from __future__ import annotations

import difflib
import importlib
import os
import signal
import sys

from largebatch import TorchTooOld, __version__
from largebatch.arguments import TRAIN_EXTRA

# name -> (module that owns it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("largebatch.train.cli", "pretrain GPT or BERT (the main job)"),
    "schedule": ("largebatch.schedules.cli", "print and plot a LR / batch-size schedule"),
    "memory": ("largebatch.memory.cli", "activation-memory table and recomputation planner"),
    "experiment": ("largebatch.experiments.cli", "reproduce a paper's claim at small scale"),
    "export": ("largebatch.export", "write a trained run as a transformers model (--format hf)"),
    "finetune": ("largebatch.finetune", "fine-tune a run on a downstream task: pretrained vs scratch accuracy"),
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
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
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
    try:
        return int(module.main(rest) or 0)
    except TorchTooOld as exc:  # a command that imports the trainer when it runs
        print(f"largebatch {name}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a command that imports a [train] package only when it runs
        if _missing_extra(name, exc):  # (experiment's data, schedule's --plot)
            return 2
        raise


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
