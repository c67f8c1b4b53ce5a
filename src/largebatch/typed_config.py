"""Typed configuration: dataclasses loaded from TOML, overridable from the command line.

A leaf module (standard library only), so every component's config -- and any user's -- can use it.

Every component owns its config dataclass (``ModelConfig`` in ``largebatch.models``, ``DataConfig`` in
``largebatch.data``, ``ScheduleConfig`` in ``largebatch.schedules``); the trainer only nests them. A
field's documentation is the docstring right under it (torchtitan style); :func:`field_docs` reads
it back from the source so ``largebatch train --help-config`` prints the same text.

Rules that keep a run reproducible and mistakes loud:

* unknown keys are rejected with a did-you-mean suggestion (``ConfigError``), never ignored;
* values are checked against the field's annotation (``int``, ``float``, ``bool``, ``str``,
  ``Optional``, ``Literal``, ``list``/``tuple``); ``1`` is accepted for a float, ``"1"`` is not,
  nor ``inf`` or ``nan``;
* ``--section.field=value`` overrides parse ``value`` as a TOML value (``--run.seed=3``,
  ``--optim.betas=[0.9,0.98]``), falling back to a bare string (``--optim.name=lans``); a list of
  names may be given comma-separated (``--run.recompute=full,full,selective,selective``).

Conventions every config dataclass follows (docs/architecture.md):

* a closed set of names is a ``Literal[...]`` (checked here, listed by ``--help-config``; a
  dataclass built from Python checks it, and every field's type, with :func:`check_fields`); an open set -- a registry
  that grows with ``register_*`` -- is ``field(metadata={"choices": REGISTRY})``;
* "off" (or "derive it") is ``None`` and nothing else: in TOML the key is omitted, on the command line
  ``--section.field=none``. A 0 given where 0 used to mean off is refused by :func:`check_off`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import numbers
import re
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: the key, the value and the fix."""


# ----------------------------------------------------------------------------------------------
# field documentation


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written directly under each field of dataclass ``cls`` (empty if none)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


# ----------------------------------------------------------------------------------------------
# type checking of values


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if origin in (list, tuple) and typing.get_args(tp):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if _none_spelling(value, tp):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    if origin is typing.Literal:
        return _choice(value, typing.get_args(tp), key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: expected a table, e.g. {{ name = value }}")
        return dict(value)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str) and _holds_names(tp):  # 'full,selective' from a command line
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list, e.g. [1, 2]")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key} = {value!r}: expected {len(args)} values")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)  # a numpy integer (a config built from Python)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)  # 1e9 tokens written as a float is still a whole number
        if isinstance(value, float) and value.is_integer():
            raise ConfigError(f"{key} = {value!r}: a float above 2**53 (~9.0e15) is not an exact whole "
                              "number; write its digits")
        raise ConfigError(f"{key} = {value!r}: expected a whole number")
    if tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML reads inf and nan; no setting means either
                raise ConfigError(f"{key} = {value!r}: expected a finite number")
            return float(value)
        raise ConfigError(f"{key} = {value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r}: expected a string")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table of settings, got {value!r}")
        return from_dict(tp, value, prefix=key)
    return value


def _holds_names(tp: Any) -> bool:
    """A list or tuple of strings (or of a Literal's names)."""
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    return bool(args) and all(a is str or typing.get_origin(a) is typing.Literal for a in args)


def check_fields(obj: Any, prefix: str) -> None:
    """Every field of dataclass ``obj`` holds a value of its annotated type, as :func:`from_dict`
    requires of a config file (a ``Literal`` one of its names, also inside Optional, list and tuple;
    a registry field one of the registry's names; a ``parse`` field's string read by it); raise
    ConfigError naming ``prefix.field`` otherwise. For configs built from Python, which from_dict does
    not see: ``RunConfig(total_tokens="1e6")`` becomes 1,000,000 as in TOML, a numpy integer an int,
    and ``RunConfig(total_tokens=[1])`` an error naming run.total_tokens instead of a TypeError from
    a comparison. A field holding a dataclass (a nested config) is left to its own check."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp, key = getattr(obj, f.name), hints[f.name], f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            continue
        parse = f.metadata.get("parse")
        if parse is not None and isinstance(value, str) and not _none_spelling(value, tp):
            try:
                value = parse(value)
            except ValueError as exc:
                raise ConfigError(f"{key} = {value!r}: {exc}") from None
        checked = _coerce(value, tp, key)
        _check_literal(checked, tp, key)
        if "choices" in f.metadata:
            checked = _choice(checked, f.metadata["choices"], key)
        if checked is not getattr(obj, f.name):
            object.__setattr__(obj, f.name, checked)  # (frozen dataclasses too)


def _check_literal(value: Any, tp: Any, key: str) -> None:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        _choice(value, typing.get_args(tp), key)
    elif origin in (typing.Union, types.UnionType) and value is not None:
        literal = [a for a in typing.get_args(tp) if typing.get_origin(a) is typing.Literal]
        if literal and isinstance(value, str):
            _choice(value, typing.get_args(literal[0]), key)
    elif origin in (list, tuple) and isinstance(value, (list, tuple)):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        for i, v in enumerate(value):
            _check_literal(v, item, f"{key}[{i}]")


OFF_FIX = "omit it or give none to turn it off"


def check_off(key: str, value: Any) -> None:
    """A positive setting whose off is None: None passes; 0 (the old spelling of off) and negative
    values raise ValueError naming ``key``, the value and the fix (from_dict names a nested key
    as the config writes it)."""
    if value is None:
        return
    if value == 0:
        raise ValueError(f"{key} = 0: 0 does not mean off; {OFF_FIX}")
    if value < 0:
        raise ValueError(f"{key} = {value!r}: must be > 0, or {OFF_FIX}")


def _choice(value: Any, choices: Any, key: str) -> Any:
    """``value`` if it is one of ``choices`` (a Literal's arguments, or a registry's names)."""
    if value in choices:
        return value
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1) or \
        [str(c) for c in choices if str(c).lower() == str(value).lower()]  # (BF16)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if not close and isinstance(choices, dict):  # a registry: the name may be an extension's
        hint = ("; a name registered by an extension module (register_*) exists only in a process that "
                "imports that module first: run the command through the script that registers it")
    raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(map(repr, choices))}{hint}")


# ----------------------------------------------------------------------------------------------
# building dataclasses from dicts


def _none_spelling(value: Any, tp: Any) -> bool:
    """Whether ``value`` is "none" / "null" (any case) for a field whose type admits None."""
    return isinstance(value, str) and value.lower() in ("none", "null") and type(None) in typing.get_args(tp)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (nested) dict, rejecting unknown keys and wrong types.

    A field declared ``field(metadata={"choices": REGISTRY})`` takes one of the registry's names,
    read when the config is loaded, so a name registered later is accepted (and listed by
    :func:`describe_fields`); ``metadata={"names": REGISTRY}`` lists them without restricting the
    value to them (``data.corpus``: a name or a path); ``metadata={"refused": {value: reason}}``
    refuses a value users reach for (compared lower-cased) with its reason and fix;
    ``metadata={"parse": function}`` reads a string value in a short form the field documents
    (``schedule.ratio = "1/1.1"``; a ValueError it raises names the field). The dataclass's
    own ``__post_init__`` validation runs too; a ValueError it raises is re-raised as ConfigError
    naming the field as the config writes it (``named_as_written``).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            where = f"section [{prefix}]" if prefix else "the top level"
            raise ConfigError(f"unknown key '{full}' in {where}.{hint} "
                              f"Valid keys: {', '.join(sorted(fields))}.")
        refused = fields[key].metadata.get("refused", {})
        if isinstance(value, str) and value.lower() in refused:  # a known value with its reason
            raise ConfigError(f"{full} = {value!r}: {refused[value.lower()]}")
        parse = fields[key].metadata.get("parse")
        if parse is not None and isinstance(value, str) and not _none_spelling(value, hints[key]):  # '1/1.1'
            try:
                value = parse(value)
            except ValueError as exc:
                raise ConfigError(f"{full} = {value!r}: {exc}") from None
        kwargs[key] = _coerce(value, hints[key], full)
        if "choices" in fields[key].metadata:
            kwargs[key] = _choice(kwargs[key], fields[key].metadata["choices"], full)
    required = [name for name, f in fields.items() if name not in kwargs and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if required:  # (else the dataclass's own "__init__() missing 2 required positional arguments")
        where = prefix or "the top level"
        raise ConfigError(f"{where} needs {', '.join(repr(n) for n in required)} (no default): set "
                          f"{' and '.join(f'{prefix}.{n}' if prefix else n for n in required)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(named_as_written(str(exc), cls, prefix, fields)) from exc


def named_as_written(message: str, cls: type, prefix: str, fields: Any) -> str:
    """A dataclass's validation message with its fields named once, as the config writes them:
    ``ModelConfig.n_head=3`` -> ``model.n_head=3``; ``micro_batch = 0`` -> ``phases[1].micro_batch
    = 0``; ``run.device = 'tpu'`` (already named so) stays; any other message gets ``[prefix] ``."""
    if not prefix:
        return message
    message = message.replace(f"{cls.__name__}.", f"{prefix}.")
    if message.startswith(f"{prefix}."):
        return message
    first = re.match(r"\w+", message)
    if first and first.group() in fields:
        return f"{prefix}.{message}"
    return f"[{prefix}] {message}"


def to_dict(obj: Any) -> Any:
    """Plain dict/list/scalar view of a (nested) dataclass, suitable for TOML/JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``key = "a.b.c"``; a number picks an entry of an array of tables
    (``phases.1.total_tokens``), which must exist."""
    *parents, leaf = key.split(".")
    node: Any = tree
    for i, part in enumerate(parents):
        if isinstance(node, list):
            node = _list_entry(node, part, ".".join(parents[:i]), key)
            continue
        # an array of tables the tree lacks ("phases.0.seq_len" with no [[phases]]): no entry to pick
        child = node.setdefault(part, [] if parents[i + 1:i + 2] and parents[i + 1].isdigit() else {})
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"'{key}': '{part}' is a value, not a section")
        node = child
    if isinstance(node, list):
        raise ConfigError(f"'{key}': '{'.'.join(parents)}' is an array of tables; name an entry and a field, "
                          f"e.g. {'.'.join(parents)}.0.{leaf}")
    node[leaf] = value


def _list_entry(node: list, part: str, name: str, key: str) -> Any:
    if not node:
        raise ConfigError(f"'{key}': the config declares no '{name}'; declare them in the config file "
                          f"([[{name}]] tables), then a command line can change their fields")
    if not part.isdigit() or int(part) >= len(node) or not isinstance(node[int(part)], dict):
        raise ConfigError(f"'{key}': '{name}' has {len(node)} entries; pick one by number, 0 to "
                          f"{len(node) - 1}, and declare new ones in the config file")
    return node[int(part)]


# ----------------------------------------------------------------------------------------------
# TOML files and command-line overrides


def parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``['--run.seed=3', '--optim.name', 'lans']`` -> ``{'run.seed': 3, 'optim.name': 'lans'}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"--{body} needs a value: --{body}=VALUE")
            key, text = body, args[i + 1]
            i += 1
        out[key.replace("-", "_")] = parse_value(text)
        i += 1
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        expanded = ("" if path.suffix.lower() == ".toml" else " (not a .toml file: where an unquoted glob pattern "
                    "such as --data.corpus data/*.txt was expanded by the shell, its second path is taken as the "
                    "config; quote the pattern)")
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}{expanded}") from exc


# a TOML basic string holds no raw control character (a data.document_separator of "\n\n" written as
# it is made the run's config.toml unreadable, so its --resume failed): each is written escaped
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes and backslashes escaped, and every control character
    (U+0000-U+001F, U+007F), which TOML refuses raw."""
    return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c)
                         for c in text) + '"'


def dump_toml(tree: dict[str, Any]) -> str:
    """Minimal TOML writer for the resolved config (scalars, lists, inline tables, one level of tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return toml_string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table (one of [[phases]] and its overrides; data.mixture's paths)
            return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items() if x is not None) + "}"
        raise TypeError(f"cannot write {v!r} as TOML")

    def key(k: str) -> str:  # a bare key, or a quoted one (a path: "corpora/web.jsonl" has / and .)
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else value(k)

    lines, tables = [], []
    for k, v in tree.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif v is not None:
            lines.append(f"{k} = {value(v)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def field_kind(f: dataclasses.Field, tp: Any) -> str:
    """What a field takes, as help shows it: 'int | none', "'fp32' | 'bf16'", a registry's names."""
    choices = f.metadata.get("choices")
    if "names" in f.metadata:  # a registry's names or anything else of the type (a corpus path)
        return f"{' | '.join(map(repr, f.metadata['names']))} | {_type_name(tp)}"
    return " | ".join(map(repr, choices)) if choices is not None else _type_name(tp)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    return f"none ({f.metadata.get('none', 'off')})" if default is None else repr(default)


def describe_fields(cls: type, prefix: str = "") -> str:
    """Help text: every field with its type, default and docstring, nested sections included."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.append(f"\n[{key}]  {docs.get(f.name, '')}".rstrip())
            out.append(describe_fields(tp, prefix=f"{key}."))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if item is not None and dataclasses.is_dataclass(item):  # an array of tables: [[key]]
            out.append(f"\n[[{key}]]  {docs.get(f.name, '')}".rstrip())
            out.append(describe_fields(item, prefix=f"{key}.N."))
            continue
        doc = docs.get(f.name, "")
        choices = f.metadata.get("choices", f.metadata.get("names"))
        out.append(f"  --{key}  ({field_kind(f, tp)}, default {_default_text(f)})")
        if doc:
            out.append(textwrap.indent(textwrap.fill(doc, 92), "      "))
        for name, entry in (choices.items() if isinstance(choices, dict) else ()):
            if getattr(entry, "help", None):  # a registry entry that describes itself
                out.append(textwrap.fill(f"{name}: {entry.help}", 100, initial_indent=" " * 8,
                                         subsequent_indent=" " * 10))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# command lines generated from the dataclasses


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                         aliases: dict[str, tuple[str, ...]] | None = None,
                         types: dict[str, Any] | None = None) -> None:
    """``--prefix.field`` for every field of dataclass ``cls`` (nested sections too, one argument group
    each), with its type, choices, default and docstring as help. The value is kept as text and read
    by :func:`config_overrides` like a config file's value; ``aliases`` adds older spellings of a
    key (``{"schedule.peak_lr": ("--peak-lr",)}``) and ``types`` an argparse type for a key.
    An array of tables (``[[phases]]``) is left to the caller: ``--phases.N.field`` names an entry."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(f"[{prefix[:-1]}]" if prefix else "config fields")
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            add_config_arguments(parser, tp, f"{key}.", aliases, types)
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if item is not None and dataclasses.is_dataclass(item):
            continue  # --phases.N.field: entries exist only in the file
        doc = " ".join(docs.get(f.name, "").split()).replace("%", "%%")
        group.add_argument(f"--{key}", *(aliases or {}).get(key, ()), dest=key, metavar="VALUE",
                           default=argparse.SUPPRESS, type=(types or {}).get(key, str),
                           help=f"({field_kind(f, tp)}, default {_default_text(f)}) {doc}")


def config_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    """The dotted keys :func:`add_config_arguments` declared and the command line gave, read as
    TOML values (a value an alias's ``type`` already converted is kept)."""
    return {k: parse_value(v) if isinstance(v, str) else v for k, v in vars(namespace).items() if "." in k}



def check_registration(function: str, name: Any, registry: dict, callables: dict[str, Any],
                       texts: dict[str, Any]) -> None:
    """The arguments of a ``register_*`` call (a name for a config field's choices), before it is
    accepted: ``name`` is a non-empty string that a command line can carry (``--optim.name=NAME``:
    no whitespace, no ``=``), each of ``callables`` (None allowed for the optional ones, named with a
    trailing ``?``) is callable, each of ``texts`` is a string. ValueError naming ``function``, the
    argument and the fix otherwise. Replacing a registered name is allowed (a variant of a shipped
    entry) but warned of: everything that used the old one (an experiment's baseline) gets the new."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name) or "=" in name:
        raise ValueError(f"{function}(name={name!r}): a name must be a non-empty string without spaces or '=' "
                         f"(it is written as a config value, e.g. 'my-optimizer')")
    for arg, value in callables.items():
        optional = arg.endswith("?")
        if not callable(value) and not (optional and value is None):
            raise ValueError(f"{function}({name!r}): {arg.rstrip('?')}={value!r} must be a function"
                             + (" or None" if optional else ""))
    for arg, value in texts.items():
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{function}({name!r}): {arg}={value!r} must be a non-empty string "
                             "(its line in --help-config)")
    if name in registry:
        import warnings

        warnings.warn(f"{function}({name!r}) replaces the entry already registered under that name", stacklevel=3)
