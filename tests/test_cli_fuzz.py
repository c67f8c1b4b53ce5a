"""A property-based fuzz of the command line of the commands (train, schedule, memory, experiment,
finetune, export): generated flags and values -- numbers including inf, nan, negative and huge ones,
strings, unknown keys, missing values, paths that are files, missing or not writable -- end either
in success or in ONE line on stderr with exit code 2. Never a traceback, never an exception.

train and experiment run with --check (validate, then exit) so no example trains: every check runs
before any work starts, which is what this fuzzes. schedule and memory run for real, and so does
export, given now and then a real trained run directory (the tiny reference run)."""

from __future__ import annotations

import contextlib
import io
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config_fields import train_config_fields
from largebatch.cli import main as cli_main
from largebatch.experiments.cli import EXPERIMENTS
from largebatch.finetune import build_parser as finetune_parser
from largebatch.memory.cli import build_parser as memory_parser
from largebatch.schedules.cli import build_parser as schedule_parser


def _flags(parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def _plausible(tp) -> st.SearchStrategy:
    """A value of about the right kind for a config field or a flag: the deep paths get reached."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal or (isinstance(tp, (list, tuple)) and tp):
        return st.sampled_from([str(c) for c in (typing.get_args(tp) or tp)])
    if args and typing.get_origin(tp) is not typing.Literal:
        return st.one_of([_plausible(a) for a in args])
    if tp is bool:
        return st.sampled_from(["true", "false"])
    if tp is int:
        return st.one_of(st.integers(0, 64).map(str), st.sampled_from(["1e3", "1e5", "100000000"]))
    if tp is float:
        return st.sampled_from(["0", "0.1", "0.5", "1", "3e-4", "1e6", "1e300"])
    return WORDS


ACTIONS = {s: a for parser in (schedule_parser(), memory_parser(), finetune_parser()) for a in parser._actions
           for s in a.option_strings}
NUMBERS = st.one_of(
    st.integers(-10, 10_000).map(str),
    st.sampled_from(["inf", "-inf", "nan", "1e300", "-1e300", "1e-300", "0", "-0", "1e8", "2**31",
                     "9" * 30, "1/0", "1/1.1", "0.5", "-1", "1e6", "300M", "1.5B", "0x10", "1_000"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
WORDS = st.one_of(st.text(alphabet="abcxyz-_.:/{}[],= ", min_size=0, max_size=8),
                  st.sampled_from(["auto", "cpu", "cuda", "tpu", "gpt", "bert", "lamb", "lans", "lars",
                                   "adamw", "seesaw", "cosine", "wsd", "true", "false", "none",
                                   "[1, 2]", "[0.9, 0.98]", '"quoted"', "{time}", "{foo}", "[weight"]))


def _paths(tmp: str) -> st.SearchStrategy:
    return st.sampled_from([f"{tmp}/{name}" for name in (
        "out", "out.png", "file", "file/x.png", "missing/dir/x.png", "bad.json", "bad.toml",
        "x.txt", "")])


def _value(tmp: str) -> st.SearchStrategy:
    return st.one_of(NUMBERS, WORDS, _paths(tmp))


@st.composite
def argv(draw, tmp: str, run_dir: str):
    command = draw(st.sampled_from(["train", "schedule", "memory", "experiment", "finetune", "export"]))
    if command == "train":
        fields = dict(train_config_fields())
        flags = [f"--{k}" for k in fields] + ["--run.zz_unknown", "--modle.n_layer", "--resume"]
        args = draw(st.lists(st.sampled_from(["gpt-demo", "bert-demo", "nope.toml", f"{tmp}/bad.toml"]),
                             max_size=1))
        # --check: validate everything, train nothing
        args.append("--check")
        for flag in draw(st.lists(st.sampled_from(flags), max_size=4)):
            tp = fields.get(flag[2:], str)
            value = draw(_plausible(tp) if draw(st.booleans()) else _value(tmp))
            if flag != "--resume" and draw(st.booleans()):
                args.append(f"{flag}={value}")
            else:
                args += [flag, value]
        if draw(st.integers(0, 9)) == 0:  # now and then a value is missing
            args.append(draw(st.sampled_from(flags)))
    elif command == "export":  # mostly RUN_DIR OUT --format hf and a few options, so the real paths run
        fresh = st.sampled_from([f"{tmp}/export-{n}" for n in range(3)])
        run = draw(st.sampled_from([run_dir] * 3 + [tmp, f"{tmp}/file", f"{tmp}/missing", ""]))
        out = draw(st.one_of(fresh, _paths(tmp), st.just(tmp), st.just(run_dir)))
        args = [run, out, "--format", draw(st.sampled_from(["hf"] * 6 + ["gguf", ""]))]
        if not draw(st.integers(0, 5)):  # now and then a skeleton that is not quite there
            del args[draw(st.integers(0, len(args) - 1))]
        for flag in draw(st.lists(st.sampled_from(["--force", "--no-verify", "--tokenizer"] * 3
                                                   + ["--zz-unknown"]), max_size=2)):
            value = draw(st.one_of(_paths(tmp), st.just(f"{run_dir}/tokenizer.json"), WORDS))
            if flag in ("--force", "--no-verify"):
                args += [flag] if draw(st.integers(0, 9)) else [f"{flag}={value}"]
            elif draw(st.integers(0, 9)):
                args += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
            else:  # its value missing
                args.append(flag)
    else:
        if command == "schedule":
            flags = _flags(schedule_parser()) + ["--zz-unknown"]
            args = ["--total-tokens", draw(NUMBERS), "--seq-len", draw(NUMBERS)]
        elif command == "memory":
            flags = _flags(memory_parser()) + ["--zz-unknown"]
            args = []
        elif command == "finetune":  # no run directory here: every path ends in a one-line error
            flags = _flags(finetune_parser()) + ["--zz-unknown"]
            args = [draw(_paths(tmp))]
        else:
            flags = ["--quick", "--smoke", "--out", "--jobs", "--resume", "--seeds", "--zz-unknown"]
            args = [draw(st.sampled_from(EXPERIMENTS + ("all", "bogus"))), "--check"]
        for flag in draw(st.lists(st.sampled_from(flags), max_size=4)):
            args.append(flag)
            action = ACTIONS.get(flag)
            if action is not None and action.nargs == 0 and draw(st.integers(0, 4)):
                continue  # a switch, mostly given alone
            if draw(st.integers(0, 9)):  # now and then the value is missing
                plausible = _plausible(action.choices if action is not None and action.choices
                                       else {int: int, None: float}.get(getattr(action, "type", None), float))
                args.append(draw(plausible if draw(st.booleans()) else _value(tmp)))
    if command == "schedule" and "--plot" in args:  # plotting is real work: rarely, small budgets
        args += ["--total-tokens", "1e5", "--seq-len", "64"]
    if command == "schedule" and "--batch-policy" in args:
        args += ["--total-tokens", "1e6"]
    return [command, *args]


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "file").write_text("a file, not a directory")
    (tmp / "bad.json").write_text("{not json")
    (tmp / "bad.toml").write_text("[model\nn_layer = ")
    return tmp


def test_cli_fuzz_success_or_one_line_error(fuzz_dir, reference_run, monkeypatch):
    monkeypatch.chdir(fuzz_dir)  # default run and report directories (never created: --check)
    tmp = str(fuzz_dir)

    @settings(max_examples=360, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(argv(tmp, str(reference_run[1])))
    def check(args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(list(args))
            except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
                code = exc.code
        out, err = out.getvalue(), err.getvalue()
        assert "Traceback" not in out + err, (args, out, err)
        if code == 0:
            return
        if code == 1 and args[0] == "memory":  # a real answer: nothing fits that budget
            assert "Nothing fits" in out, (args, out, err)
            return
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "error" in lines[0], (args, code, out, err)

    check()
