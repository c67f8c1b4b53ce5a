"""Bad configs end in one clear line that names the key, never a traceback (property-based)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config_fields import train_config_fields
from largebatch.train.cli import main
from largebatch.train.config import TrainConfig, load_config
from largebatch.typed_config import ConfigError

LEAVES = train_config_fields()


def _wrong_value(tp) -> st.SearchStrategy:
    """Values that cannot be of type ``tp`` (a string where a number goes, a list for a scalar...)."""
    args = set(typing.get_args(tp))
    base = {t for t in args if t is not type(None)} or {tp}
    options = [st.lists(st.integers(), min_size=1, max_size=3).map(lambda v: {"x": v})]
    if not base & {str} and typing.get_origin(tp) is not typing.Literal:
        options.append(st.text(alphabet="abcxyz", min_size=1, max_size=6))
    if typing.get_origin(tp) is typing.Literal:
        options.append(st.text(alphabet="qwz", min_size=1, max_size=6))
    if base & {str} and not base & {int, float}:  # (run.profile_steps takes "10-12" or 10; run.time_limit 1)
        options.append(st.integers())
    return st.one_of(options)


@st.composite
def invalid_override(draw):
    if draw(st.booleans()):
        key, tp = draw(st.sampled_from(LEAVES))
        return key, draw(_wrong_value(tp))
    section = draw(st.sampled_from([f.name for f in dataclasses.fields(TrainConfig)]))
    name = draw(st.text(alphabet="abcdefghij_", min_size=3, max_size=12))
    return f"{section}.zz_{name}", 1  # no field starts with zz_


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invalid_override())
def test_random_invalid_config_is_a_clean_error(override):
    key, value = override
    with pytest.raises(ConfigError) as info:
        load_config(None, {key: value})
    assert key.split(".")[0] in str(info.value) or key.split(".")[-1] in str(info.value)


@pytest.mark.parametrize("args, needle", [
    (["--run.total_tokens=-5"], "run.total_tokens"),
    (["--run.micro_batch=3", "--schedule.batch_size=8"], "batch_size"),
    (["--schedule.warmup=1.5"], "warmup"),
    (["--run.recompute=sometimes"], "run.recompute"),
    (["--run.recompute=full,selective,none"], "per-layer"),
    (["--optim.name=adamm"], "did you mean 'adamw'"),
    (["--modle.n_layer=2"], "Did you mean 'model'"),
    (["--run.totl_tokens=5"], "Did you mean 'run.total_tokens'"),
    (["no_such_file.toml"], "neither a file nor a shipped config"),
    (["--resume", "/nonexistent/run"], "no config.toml"),
])
def test_cli_bad_input(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("largebatch train: error:") and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, needle", [
    (["--optim.name=lars", '--optim.adapt=["weight", "bais"]'], "optim.adapt = ['weight', 'bais']"),
    (["--optim.name=lamb", '--optim.adapt=["bias", "bias"]'], "distinct categories"),
    (["--optim.name=adamw", '--optim.adapt=["bias"]'], "AdamW has no trust ratio"),
])
def test_cli_bad_adapt(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_trust_ratio_categories_follow_the_optimizer():
    """LARS adapts every tensor by default (Alg. 1); LAMB/LANS leave biases and norm weights out."""
    from largebatch.models import build_model
    from largebatch.train.optimizer import build_optimizer

    def adapted(overrides):
        cfg = load_config(None, {"model.n_layer": 1, "model.n_embd": 16, "model.n_head": 2,
                                 "model.seq_len": 8, "data.vocab_size": 512, "model.bias": True,
                                 **overrides})
        model = build_model(cfg.model)
        names = {id(p): n for n, p in model.named_parameters()}
        optimizer = build_optimizer(model, cfg.optim)
        flags = {names[id(p)]: g["adapt"] for g in optimizer.param_groups for p in g["params"]}
        assert len(flags) == len(names)  # every parameter once
        return flags

    lars = adapted({"optim.name": "lars"})
    assert all(lars.values())
    for name in ("lamb", "lans"):
        flags = adapted({"optim.name": name})
        norms_and_biases = [n for n in flags if "ln" in n or "norm" in n or n.endswith(".bias")]
        assert norms_and_biases and not any(flags[n] for n in norms_and_biases)
        assert all(v for n, v in flags.items() if n not in norms_and_biases)
    assert all(adapted({"optim.name": "lamb", "optim.adapt": ["weight", "embedding", "bias", "norm"]}).values())
    only_weights = adapted({"optim.name": "lars", "optim.adapt": ["weight"]})
    assert not all(only_weights.values()) and any(only_weights.values())


OFF_FIELDS = ["schedule.max_batch_size", "schedule.noise_scale_multiple", "schedule.reference_batch_size",
              "schedule.alpha", "schedule.beta", "schedule.ramp_start", "schedule.ramp_increment",
              "run.eval_every_tokens", "run.checkpoint_every_tokens", "run.checkpoint_every_seconds",
              "run.max_steps", "run.max_skipped_steps", "run.peak_flops", "optim.grad_clip"]


@pytest.mark.parametrize("key", OFF_FIELDS)
def test_zero_where_none_is_off_is_one_line_naming_the_fix(key, tmp_path, capsys):
    """Off is None (the key omitted, or --key=none); the old 0 is refused, from a file and a flag."""
    assert load_config(None, {key: "none"}).__dict__[key.split(".")[0]].__dict__[key.split(".")[1]] is None
    section, name = key.split(".")
    config = tmp_path / "old.toml"
    config.write_text(f"[{section}]\n{name} = 0\n")
    for args in ([str(config)], [f"--{key}=0"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err == f"largebatch train: error: {key} = 0: 0 does not mean off; omit it or give none to turn it off\n"


def test_recompute_is_a_list_from_toml_or_comma_separated(tmp_path):
    config = tmp_path / "r.toml"
    config.write_text('[model]\nn_layer = 3\n[run]\nrecompute = ["full", "selective", "none"]\n')
    from_file = load_config(config).run.recompute
    from_flag = load_config(None, {"model.n_layer": 3, "run.recompute": "full, selective,none"}).run.recompute
    assert from_file == from_flag == ["full", "selective", "none"]
    with pytest.raises(ConfigError, match=r"recompute\[1\] = 'selctive': .*did you mean 'selective'"):
        load_config(None, {"run.recompute": "full,selctive"})


def test_help_config_lists_literal_choices_and_none_defaults(capsys):
    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "--model.kind  ('gpt' | 'bert', default 'gpt')" in out
    assert "--run.recompute  (list of 'none' | 'selective' | 'op' | 'full', default ['none'])" in out
    assert "--schedule.max_batch_size  (int | none, default none (off))" in out
    assert "--parallel.pp_schedule  ('gpipe' | '1f1b' | 'interleaved-1f1b' | 'interleaved-zb'" in out


def test_help_lists_every_field_with_its_kind_and_default(capsys):
    """`train --help` is generated from the dataclasses: every leaf field, none missing."""
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for key, _ in LEAVES:
        if not key.startswith("phases."):
            assert f"--{key} VALUE" in out, key
    assert "--model.kind VALUE ('gpt' | 'bert', default 'gpt')" in out
    assert "--optim.grad_clip VALUE (float | none, default none (off))" in out


@pytest.mark.parametrize("args, needle", [
    (["--chek"], "unknown option '--chek'; did you mean '--check'?"),
    (["--help-confg"], "did you mean '--help-config'?"),
    (["--run.seed"], "--run.seed: expected one argument"),
])
def test_unknown_or_incomplete_flag_is_one_line(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_a_pattern_the_shell_expanded_is_said_to_need_quotes(tmp_path, capsys, monkeypatch):
    """--data.corpus data/train-*.parquet unquoted reaches the trainer as several paths: the second was
    "unexpected argument ...: overrides look like --section.key=value", no word of the quoting."""
    monkeypatch.chdir(tmp_path)
    for k in range(2):
        (tmp_path / f"train-{k}.txt").write_text("text")
    (tmp_path / "c.toml").write_text("[run]\nseed = 3\n")
    assert main(["c.toml", "--data.corpus", "train-0.txt", "train-1.txt", "--check"]) == 2
    err = capsys.readouterr().err
    assert ("unexpected argument 'train-1.txt': overrides look like --section.key=value (a glob pattern is expanded "
            "by the shell into several paths unless quoted, e.g. --data.corpus 'data/train-*.parquet')") in err, err
    assert main(["c.toml", "--data.corpsu", "train-0.txt", "--check"]) == 2  # a mistyped key's value: not that
    err = capsys.readouterr().err
    assert "data.corpsu" in err and "glob pattern" not in err, err
    assert main(["--data.corpus", "train-0.txt", "train-1.txt", "--check"]) == 2  # (no config: taken as one)
    err = capsys.readouterr().err
    assert "config file 'train-1.txt' is not valid TOML" in err and "quote the pattern" in err, err


def test_flag_spellings_parse_as_a_config_file_does(tmp_path):
    """--key=value, --key value and the same keys in a TOML file load the same config."""
    from largebatch.train.cli import _unknown_options, build_parser
    from largebatch.typed_config import config_overrides

    parser = build_parser(TrainConfig)
    args, unknown = parser.parse_known_args(["--run.seed", "7", "--optim.betas=[0.9, 0.98]",
                                             "--schedule.max_batch_size=none", "--run.recompute=full"])
    flags = load_config(None, {**config_overrides(args), **_unknown_options(parser, unknown)})
    config = tmp_path / "c.toml"
    config.write_text('[run]\nseed = 7\nrecompute = ["full"]\n[optim]\nbetas = [0.9, 0.98]\n')
    assert flags == load_config(config)
    assert flags.run.seed == 7 and flags.optim.betas == (0.9, 0.98) and flags.schedule.max_batch_size is None


def test_configs_built_from_python_are_checked_as_a_config_file_is():
    """``RunConfig(total_tokens="1e6")`` failed with a TypeError from a comparison, naming no field,
    where the same value in TOML is read as 1,000,000; a numpy integer was kept as one; an unknown
    optimizer name passed until the optimizer was built."""
    import numpy as np

    from largebatch.parallel.config import ParallelConfig
    from largebatch.train.config import OptimConfig, RunConfig
    from largebatch.train.phases import PhaseConfig
    assert RunConfig(total_tokens="1e6").total_tokens == 1_000_000 == load_config(
        overrides={"run.total_tokens": "1e6"}).run.total_tokens
    run = RunConfig(micro_batch=np.int64(4), total_tokens=np.int32(4096))
    assert type(run.micro_batch) is int and type(run.total_tokens) is int and run.micro_batch == 4
    assert type(OptimConfig(weight_decay=np.float32(0.5)).weight_decay) is float
    for build, message in [
        (lambda: RunConfig(total_tokens=[1]), r"run.total_tokens = \[1\]: expected a whole number"),
        (lambda: RunConfig(dtype="bf17"),
         r"run.dtype = 'bf17': must be one of 'fp32', 'bf16', 'fp16'; did you mean 'bf16'"),
        (lambda: OptimConfig(name="adam"), r"optim.name = 'adam': must be one of"),
        (lambda: OptimConfig(weight_decay="x"), r"optim.weight_decay = 'x': expected a number"),
        (lambda: ParallelConfig(tp="2"), r"parallel.tp = '2': expected a whole number"),
        (lambda: PhaseConfig(seq_len=64, total_tokens="lots"), r"phase.total_tokens = 'lots'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build()


@pytest.mark.parametrize("override,message", [
    ({"optim.betas": [1.5, -1.0]}, r"optim.betas = \[1.5, -1.0\]: each must lie in \[0, 1\)"),
    ({"optim.betas": [0.9, 1.0]}, r"optim.betas = \[0.9, 1.0\]"),
    ({"optim.eps": 0.0}, r"optim.eps = 0.0: must be > 0"),
    ({"optim.name": "lars", "optim.momentum": 1.5}, r"optim.momentum = 1.5: must lie in \[0, 1\)"),
    ({"optim.name": "lars", "optim.trust_coefficient": 0.0}, r"optim.trust_coefficient = 0.0: must be > 0"),
    ({"run.seed": -1}, r"run.seed = -1: must lie in \[0, 2\*\*32 - 1\]"),
    ({"run.seed": 2**32}, r"run.seed = 4294967296"),
    ({"data.split_seed": -1}, r"data.split_seed=-1 is invalid: use an integer >= 0"),
    ({"parallel.timeout_s": 1e300}, r"parallel.timeout_s = 1e\+300: must be at least 0.001 seconds .*and at most 1e9"),
    # below a millisecond torch's timeout is 0 ms: every wait of every step failed at once
    ({"parallel.step_timeout_s": 1e-4}, r"parallel.step_timeout_s = 0.0001: must be at least 0.001 seconds"),
    ({"run.sample_prompt": ""}, r"run.sample_prompt = '': .*run.sample_tokens = 0"),
    ({"model.init_from": ""}, r"model.init_from='': give hf:PATH.*or none"),
    ({"data.tokenizer_file": ""}, r"data.tokenizer_file='' is invalid"),
])
def test_settings_a_run_would_fail_on_later_are_refused_when_loaded(override, message):
    """Each passed ``--check`` and failed later: the optimizer's ranges once the tokenizer was built,
    naming ``param_groups[0]`` (torch's own words for AdamW), the seeds in numpy ("Seed must be between
    0 and 2**32 - 1", "expected non-negative integer"), the timeout in torch's store (OverflowError),
    an empty prompt after the whole run had trained (a reshape error); an empty init_from or
    tokenizer_file was taken for "off", which is spelt none."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=override)


def test_edge_values_that_are_fine_still_load():
    assert load_config(overrides={"optim.name": "adamw", "optim.eps": 0.0}).optim.eps == 0.0  # torch allows it
    assert load_config(overrides={"run.sample_prompt": "", "run.sample_tokens": 0}).run.sample_prompt == ""
    assert load_config(overrides={"parallel.pp_split": []}).parallel.pp_split == []  # one stage: no split
    assert load_config(overrides={"run.seed": 2**32 - 1, "data.split_seed": 0}).run.seed == 2**32 - 1


@pytest.mark.parametrize("override,message", [
    ({"schedule.batch_policy": "seesaw", "schedule.alpha": 2.0, "schedule.beta": 4.0},
     r"schedule.alpha = 2.0: only batch_policy seesaw-family reads it, and this run's is 'seesaw'"),
    ({"schedule.ramp_start": 8, "schedule.ramp_increment": 8},
     r"schedule.ramp_start = 8: only batch_policy ramp reads it, and this run's is 'constant'"),
    ({"schedule.batch_policy": "seesaw", "schedule.batch_table": [[0, 8]]},
     r"schedule.batch_table = \[\[0, 8\]\]: only batch_policy table reads it"),
    ({"run.total_tokens": 100}, r"run.total_tokens = 100 is less than one optimizer step \(64 sequences x 128"),
])
def test_settings_that_would_be_silently_ignored_are_refused(override, message):
    """alpha and beta under seesaw (seesaw-family meant), a ramp under constant: trained as if absent;
    a budget under one step trained one cut-short step at the warmup's first LR, 0."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"model.seq_len": 128, **override})


def test_phases_budget_and_an_empty_phase_table(tmp_path):
    """run.total_tokens written as 600000 (the default's value) beside [[phases]] was ignored; a bare
    [[phases]] table gave "__init__() missing 2 required positional arguments"."""
    phase = "[[phases]]\nseq_len = 32\ntotal_tokens = 8192\n"
    given = tmp_path / "given.toml"
    given.write_text("[run]\ntotal_tokens = 600000\n" + phase)
    with pytest.raises(ConfigError, match=r"run.total_tokens = 600000 but the phases sum to 8192"):
        load_config(given)
    bare = tmp_path / "bare.toml"
    bare.write_text(phase + "[[phases]]\n")
    with pytest.raises(ConfigError, match=r"^phases\[1\] needs 'seq_len', 'total_tokens' \(no default\): set "
                       r"phases\[1\].seq_len and phases\[1\].total_tokens$"):
        load_config(bare)
    alone = tmp_path / "alone.toml"
    alone.write_text(phase)
    assert load_config(alone).run.total_tokens == 8192
