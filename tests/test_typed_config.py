"""TOML <-> dataclass machinery: unknown keys rejected, types checked, docs under fields."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import Literal

import pytest

from largebatch.typed_config import (
    ConfigError,
    describe_fields,
    dump_toml,
    field_docs,
    from_dict,
    parse_overrides,
    parse_value,
    to_dict,
)


@dataclass
class Inner:
    lr: float = 1e-3
    """Peak learning rate."""
    name: Literal["lamb", "lans"] = "lamb"
    """Which optimizer."""
    betas: tuple[float, float] = (0.9, 0.999)
    clip: float | None = None

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr = {self.lr}: must be > 0")


@dataclass
class Outer:
    steps: int = 10
    """How many steps."""
    inner: Inner = field(default_factory=Inner)


def test_roundtrip_and_coercion():
    cfg = from_dict(Outer, {"steps": 2e3, "inner": {"lr": 1, "betas": [0.8, 0.9], "clip": 1.0}})
    assert cfg.steps == 2000 and isinstance(cfg.steps, int)
    assert cfg.inner.lr == 1.0 and cfg.inner.betas == (0.8, 0.9)
    assert from_dict(Outer, to_dict(cfg)) == cfg
    assert from_dict(Outer, tomllib.loads(dump_toml(to_dict(cfg)))) == cfg


@pytest.mark.parametrize("tree, message", [
    ({"stpes": 3}, "unknown key 'stpes'.*Did you mean 'steps'"),
    ({"inner": {"lrr": 1.0}}, "unknown key 'inner.lrr'.*Did you mean 'inner.lr'"),
    ({"steps": "ten"}, "steps = 'ten': expected a whole number"),
    ({"steps": 2.5}, "expected a whole number"),
    ({"inner": {"name": "lams"}}, "inner.name = 'lams'.*did you mean 'lans'"),
    ({"inner": {"betas": [0.9]}}, "expected 2 values"),
    ({"inner": {"lr": -1.0}}, r"inner\.lr = -1.0: must be > 0"),
    ({"inner": 3}, r"\[inner\] must be a table"),
    ({"inner": {"clip": "x"}}, "inner.clip = 'x'"),
])
def test_bad_input_names_key_and_fix(tree, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, tree)


def test_overrides_parse_toml_values():
    assert parse_overrides(["--a.b=3", "--a.c", "lans", "--a.d=[1,2]", "--a.e=true"]) == {
        "a.b": 3, "a.c": "lans", "a.d": [1, 2], "a.e": True}
    assert parse_value("1e6") == 1e6 and parse_value("hello world") == "hello world"
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["stray"])


def test_field_docs_and_help_text():
    assert field_docs(Inner)["lr"] == "Peak learning rate."
    text = describe_fields(Outer)
    assert "--steps  (int, default 10)" in text and "How many steps." in text
    assert "--inner.name  ('lamb' | 'lans', default 'lamb')" in text


def test_a_refused_value_gives_its_reason_and_a_choice_in_other_case_is_suggested():
    """torch's spellings of a dtype ("half", "float16", "bfloat16") are refused naming the config's own,
    and a choice in another case ("BF16") gets a suggestion."""
    from largebatch.train.config import TrainConfig

    for value, ours in (("Half", "fp16"), ("float16", "fp16"), ("bfloat16", "bf16"), ("float32", "fp32")):
        with pytest.raises(ConfigError, match=rf"^run.dtype = '{value}': write '{ours}'"):
            from_dict(TrainConfig, {"run": {"dtype": value}})
    with pytest.raises(ConfigError, match=r"run.dtype = 'BF16': must be one of 'fp32', 'bf16', 'fp16'; did you mean "
                                          r"'bf16'\?"):
        from_dict(TrainConfig, {"run": {"dtype": "BF16"}})
    assert from_dict(TrainConfig, {"run": {"dtype": "bf16"}}).run.dtype == "bf16"
    assert from_dict(TrainConfig, {"run": {"dtype": "fp16"}}).run.dtype == "fp16"


def test_an_array_of_tables_the_config_lacks_is_named_on_the_command_line():
    """``--phases.0.seq_len=64`` on a config without [[phases]] made a table 'phases' = {'0': ...} and
    was refused as "expected a list, e.g. [1, 2]"; it names the array and where to declare it, and
    an index past the declared entries names the count."""
    from largebatch.typed_config import set_dotted

    with pytest.raises(ConfigError, match=r"'phases.0.seq_len': the config declares no 'phases'; declare "
                                          r"them in the config file \(\[\[phases\]\] tables\)"):
        set_dotted({"model": {}}, "phases.0.seq_len", 64)
    tree = {"phases": [{"seq_len": 128}]}
    set_dotted(tree, "phases.0.seq_len", 64)
    assert tree == {"phases": [{"seq_len": 64}]}
    with pytest.raises(ConfigError, match="'phases' has 1 entries; pick one by number, 0 to 0"):
        set_dotted(tree, "phases.1.seq_len", 64)
    set_dotted(tree, "model.n_layer", 2)  # a table the tree lacks is still made
    assert tree["model"] == {"n_layer": 2}


def test_a_phases_schedule_key_merges_and_a_table_value_replaces_as_the_help_says(capsys):
    """bert-lans-demo's second phase overrides batch_size and peak_lr: one key set on the command
    line keeps the other, a table value replaces both (as a TOML value would); `train --help` says so."""
    from largebatch.train.cli import main, resolve_config
    from largebatch.train.config import load_config
    from largebatch.typed_config import parse_overrides

    def phase_schedule(*args):
        return load_config(resolve_config("bert-lans-demo"), parse_overrides(list(args))).phases[1].schedule

    assert phase_schedule() == {"batch_size": 16, "peak_lr": 7e-3}
    assert phase_schedule("--phases.1.schedule.peak_lr=3e-3") == {"batch_size": 16, "peak_lr": 3e-3}
    assert phase_schedule("--phases.1.schedule={peak_lr=3e-3}") == {"peak_lr": 3e-3}
    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--phases.1.schedule.peak_lr=3e-3 sets one key" in help_text
    assert "--phases.1.schedule={peak_lr=3e-3} replaces them all" in help_text


def test_every_string_a_config_holds_round_trips_through_the_written_toml():
    """A run's config.toml is read back on --resume: a data.document_separator of "\\n\\n" was written
    raw into a TOML string, which TOML refuses, so such a run could not resume. Every character from
    U+0000 to U+00FF (and a few beyond), in values, lists, inline tables and keys, reads back as it was."""
    text = "".join(map(chr, range(256))) + "\u2028\U0001f600\\\"'"
    tree = {"a": text, "table": {"b": [text, "x"], "c": {text: text}}}
    assert tomllib.loads(dump_toml(tree)) == tree
