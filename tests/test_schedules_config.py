"""ScheduleConfig (the trainer's [schedule] section) and the `largebatch schedule` CLI."""

import argparse
import dataclasses
import math
import re
import subprocess
import sys

import pytest

from largebatch.schedules import (
    WSD,
    ConstantBatch,
    Cosine,
    LinearRamp,
    NoiseScale,
    PiecewiseBatch,
    ScheduleConfig,
    Seesaw,
    SeesawFamily,
    SmithRamp,
    WarmupHoldPolynomial,
)
from largebatch.schedules.cli import main
from largebatch.schedules.lr import scale_lr_for_batch
from largebatch.typed_config import field_docs

TOTAL, SEQ = 10_000_000, 128


def test_every_field_is_documented_under_it():
    docs = field_docs(ScheduleConfig)
    names = [f.name for f in dataclasses.fields(ScheduleConfig)]
    assert sorted(docs) == sorted(names)
    assert all(len(text) > 15 for text in docs.values())


@pytest.mark.parametrize("overrides, kind", [
    ({}, ConstantBatch),
    ({"batch_policy": "ramp", "ramp_start": 16, "ramp_increment": 16}, LinearRamp),
    ({"batch_policy": "table", "batch_table": [[0, 32], [0.5, 64]]}, PiecewiseBatch),
    ({"batch_policy": "seesaw", "ratio": 1 / 1.1}, Seesaw),
    ({"batch_policy": "seesaw-family", "alpha": 1.6, "beta": 1.5}, SeesawFamily),
    ({"batch_policy": "smith", "max_batch_size": 256}, SmithRamp),
    ({"lr_schedule": "wsd", "wsd_shape": "1-sqrt", "batch_policy": "seesaw"}, Seesaw),
    ({"lr_schedule": "lans", "lans_hold": 0.2}, ConstantBatch),
    ({"lr_schedule": "inverse-sqrt"}, ConstantBatch),
])
def test_build_every_policy(overrides, kind):
    config = ScheduleConfig.from_dict(overrides)
    schedule = config.build(TOTAL, SEQ, micro_batch=8, dp_size=2)
    assert isinstance(schedule, kind)
    assert schedule.total_tokens == TOTAL and schedule.batch_size(0) % 16 == 0
    assert schedule.lr(round(0.1 * TOTAL)) == pytest.approx(config.peak_lr, rel=1e-6)
    assert not schedule.uses_noise_scale


def test_adaptive_seesaw_from_config():
    config = ScheduleConfig(batch_policy="seesaw", noise_scale_multiple=2.0, noise_scale_ema=0.9)
    schedule, noise = config.build(TOTAL, SEQ), config.build_noise_scale()
    assert schedule.uses_noise_scale and noise.ema_decay == 0.9
    noise.update(10.0, 1, 1.5, 64)
    schedule.observe_noise_scale(0, noise.b_simple)
    assert schedule.noise_cap_log == [(0, 2.0 * noise.b_simple)]


def test_describe_reports_coupling_phase_table_and_steps():
    config = ScheduleConfig(peak_lr=1e-3, batch_size=1024, reference_batch_size=256,
                            lr_coupling="sqrt", batch_policy="seesaw", ratio=0.5, final_lr=0.1)
    schedule = config.build(TOTAL, SEQ)
    assert schedule.lr_schedule.peak_lr == pytest.approx(2e-3)  # sqrt(1024 / 256) = 2
    text = config.describe(TOTAL, SEQ)
    assert "lr coupling: sqrt (peak_lr 0.001 tuned at batch 256 -> 0.002 at batch 1024)" in text
    assert "milestone 3" in text and "warmup" in text
    base_steps = math.ceil(TOTAL / (1024 * SEQ))
    assert f"{base_steps:,} optimizer steps" in text
    linear = dataclasses.replace(config, lr_coupling="linear")
    assert linear.coupled_peak_lr() == pytest.approx(4e-3)


def test_the_table_policy_couples_the_lr_at_its_own_batch_not_the_unread_batch_size():
    """batch_policy 'table' never reads batch_size, yet the LR coupling and the base compared with
    did: a table of batches 8 and 16 tuned at 8 trained at 8x the tuned peak (batch_size 64)."""
    config = ScheduleConfig(peak_lr=3e-4, batch_size=64, batch_policy="table", batch_table=[[0, 8], [0.5, 16]],
                            lr_coupling="linear", reference_batch_size=8)
    assert config.build(TOTAL, SEQ).lr_schedule.peak_lr == pytest.approx(3e-4, rel=1e-12)  # 8 / 8
    text = config.describe(TOTAL, SEQ)
    assert "tuned at batch 8 -> 0.0003 at batch 8)" in text
    assert f"base (cosine, constant batch 8): {math.ceil(TOTAL / (8 * SEQ)):,} optimizer steps" in text
    doubled = dataclasses.replace(config, batch_table=[[0, 16], [0.5, 32]])  # starts at twice the tuned batch
    assert doubled.coupled_peak_lr() == pytest.approx(6e-4, rel=1e-12)


def test_final_lr_means_a_fraction_of_peak_in_config_and_classes():
    # one meaning: the [schedule] field and the class argument are the same number, and the
    # schedule ends at final_lr * peak_lr
    from largebatch.schedules import Cosine, Seesaw

    config = ScheduleConfig(peak_lr=6e-3, warmup=0.1, final_lr=0.1, lr_schedule="cosine")
    built = config.build_lr(TOTAL)
    assert built == Cosine(6e-3, TOTAL, TOTAL // 10, final_lr=0.1)
    assert built(TOTAL) == pytest.approx(6e-4, rel=1e-12) and built.end_lr == 0.1 * 6e-3
    # Seesaw's milestones depend on the fraction only: the same at any peak
    milestones = [Seesaw(Cosine(peak, TOTAL, TOTAL // 10, 0.1), 64, ratio=0.5).milestones
                  for peak in (1.0, 6e-3, 3e-4)]
    assert milestones[0] == milestones[1] == milestones[2] and len(milestones[0]) == 3


@pytest.mark.parametrize("overrides, build_args, fragment", [
    ({"warmup": 1.5}, {}, "schedule.warmup = 1.5: must lie in [0, 1)"),
    ({"lr_schedule": "cosin"}, {}, "schedule.lr_schedule = 'cosin': must be one of"),
    ({"batch_size": 100}, {"micro_batch": 8},
     "schedule.batch_size=100 is not a whole number of micro_batch (8)"),
    ({"batch_policy": "seesaw", "ratio": 1.1}, {}, "schedule.ratio=1.1"),
    ({"batch_policy": "seesaw", "ratio": 0.999}, {}, "schedule.ratio=0.999 gives 2,301 milestones"),
    ({"batch_policy": "smith", "ratio": 1e-9}, {}, "schedule.ratio=1e-09 is at or below final_lr=0.1"),
    ({"batch_policy": "seesaw", "final_lr": 0.0}, {}, "schedule.final_lr = 0.0: Seesaw-type"),
    ({"batch_policy": "seesaw-family"}, {}, "schedule.alpha = None: seesaw-family needs alpha and beta"),
    ({"batch_policy": "seesaw-family", "alpha": 1.0, "beta": 4.0}, {}, "schedule.alpha=1.0 < sqrt(beta)"),
    ({"batch_policy": "ramp", "ramp_start": 16, "ramp_increment": 20}, {}, "ramp_increment = 20: must be > 0"),
    ({"batch_policy": "ramp", "ramp_start": 0, "ramp_increment": 16}, {}, "ramp_start = 0: must be a positive number"),
    ({"batch_policy": "ramp", "ramp_start": 8, "ramp_increment": 0}, {},
     "ramp_increment = 0: must be a positive number"),
    ({"peak_lr": -1.0}, {}, "schedule.peak_lr = -1.0: must be a finite number > 0"),
    ({"peak_lr": 0.0}, {}, "schedule.peak_lr = 0.0: must be a finite number > 0"),
    # ranges of the fields another schedule or policy reads, refused whichever is chosen
    ({"ratio": -0.5}, {}, "schedule.ratio = -0.5: must lie in (0, 1)"),
    ({"ratio": 2.0}, {}, "schedule.ratio = 2.0: must lie in (0, 1)"),
    ({"wsd_cooldown": -1.0}, {}, "schedule.wsd_cooldown = -1.0: must lie in (0, 1]"),
    ({"lans_hold": 2.0}, {}, "schedule.lans_hold = 2.0: must lie in [0, 1)"),
    ({"ramp_tokens": -1.0}, {}, "schedule.ramp_tokens = -1.0: must lie in (0, 1]"),
    ({"alpha": -2.0}, {}, "schedule.alpha = -2.0: must be > 0"),
    ({"batch_policy": "seesaw", "lr_schedule": "constant"}, {}, "Seesaw-type schedules place a milestone"),
    ({"batch_policy": "ramp", "ramp_start": 8, "ramp_increment": 8}, {"micro_batch": 3},
     "schedule.ramp_start=8 is not a whole number of micro_batch (3)"),
    ({"lr_schedule": "wsd", "wsd_cooldown": 0.95}, {}, "schedule.wsd_cooldown = 0.95"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [0.5, 62]]}, {"micro_batch": 4},
     "table batch at token 5000000=62"),
    ({"batch_policy": "seesaw", "max_batch_size": -4}, {}, "schedule.max_batch_size = -4: must be > 0"),
    ({"batch_size": 0}, {}, "schedule.batch_size = 0: must be a positive number of sequences"),
    ({"batch_size": 0, "batch_policy": "seesaw"}, {}, "schedule.batch_size = 0: must be a positive"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [1.0, 128]]}, {},
     "schedule.batch_table = [[0, 64], [1.0, 128]]: the fraction 1.0 must lie in [0, 1)"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [1.5, 128]]}, {}, "the fraction 1.5 must lie in [0, 1)"),
    ({"batch_policy": "table"}, {}, "schedule.batch_table = []: batch_policy 'table' needs"),
    ({"batch_policy": "table", "batch_table": [[0, 64, 2]]}, {}, "row [0, 64, 2] is not [token fraction, batch"),
    ({"noise_scale_multiple": 2.0}, {}, "schedule.noise_scale_multiple = 2.0: only applies"),
    # a value the user never gave, or no field, was named; or nothing was checked at all
    ({"noise_scale_ema": 1.0}, {}, "schedule.noise_scale_ema = 1.0: must lie in [0, 1)"),
    ({"lr_schedule": "lans", "lans_power": 0.0}, {}, "schedule.lans_power = 0.0: must be > 0"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [0.5, 128.7]]}, {},
     "the batch size 128.7 (row [0.5, 128.7]) must be a positive whole number"),  # was truncated to 128
    ({"batch_policy": "table", "batch_table": [[0, 64], [0.5, math.inf]]}, {}, "the batch size inf"),
    ({"batch_policy": "table", "batch_table": [[0.1, 64]]}, {}, "the first row starts at fraction 0.1"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [0.5, 128], [0.4, 256]]}, {},
     "the fractions [0, 0.5, 0.4] must increase"),
    ({"batch_policy": "table", "batch_table": [[0, 64], [1e-9, 128]]}, {},
     "schedule.batch_table = [[0, 64], [1e-09, 128]]: the row [1e-09, 128] starts at token 0"),
    ({"batch_policy": "ramp", "ramp_start": 16, "ramp_increment": 16, "ramp_tokens": 1e-9}, {},
     "schedule.ramp_tokens = 1e-09: is 0.01 tokens of the 10,000,000-token budget, less than one"),
    ({"warmup": 0.999999999}, {}, "schedule.warmup = 0.999999999: is 10,000,000 of the 10,000,000-token"),
])
def test_bad_config_names_the_field(overrides, build_args, fragment):
    with pytest.raises(ValueError) as err:
        ScheduleConfig(**overrides).build(TOTAL, SEQ, **build_args)
    assert fragment in str(err.value)
    if "batch_size = 0" in fragment:  # it is not about reference_batch_size, which was not given
        assert "reference_batch_size" not in str(err.value)


def test_from_dict_suggests_a_close_field():
    with pytest.raises(ValueError, match="Did you mean 'schedule.peak_lr'"):
        ScheduleConfig.from_dict({"peak_lrr": 1e-3})


def test_cli_prints_table_and_writes_png(tmp_path, capsys):
    out = tmp_path / "seesaw.png"
    code = main(["--total-tokens", "10M", "--seq-len", "128", "--batch-size", "64",
                 "--batch-policy", "seesaw", "--ratio", "1/2", "--micro-batch", "8", "--dp", "2",
                 "--plot", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "total optimizer steps" in text and "base (cosine, constant batch 64)" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_cli_bad_value_exits_2_with_the_field(capsys):
    code = main(["--total-tokens", "1e6", "--seq-len", "128", "--batch-size", "60",
                 "--micro-batch", "8"])
    assert code == 2
    assert "batch_size=60" in capsys.readouterr().err


def test_a_registered_lr_schedule_is_a_choice_of_the_config_and_the_cli(capsys):
    """register_lr_schedule declares a shape in one place: ScheduleConfig builds it, the CLI lists
    it; its LR follows the cosine-to-zero formula written here in float64."""
    from largebatch.schedules import lr as lr_module
    from largebatch.schedules.config import LR_BUILDERS, register_lr_schedule

    register_lr_schedule("cosine-to-zero", lambda c, peak, total, warmup: lr_module.Cosine(peak, total, warmup, 0.0),
                         help="cosine all the way to 0")
    try:
        cfg = ScheduleConfig(lr_schedule="cosine-to-zero", peak_lr=1e-3, warmup=0.1)
        sched = cfg.build(TOTAL, SEQ)
        warmup = TOTAL // 10
        for t in (warmup, TOTAL // 2, 0.9 * TOTAL, TOTAL):
            expected = 1e-3 * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (TOTAL - warmup)))
            assert sched.lr(t) == pytest.approx(expected, rel=1e-9, abs=1e-15)
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "cosine-to-zero" in capsys.readouterr().out
        from largebatch.train.cli import main as train_main

        assert train_main(["--help-config"]) in (0, None)
        assert "cosine-to-zero: cosine all the way to 0" in capsys.readouterr().out
    finally:
        LR_BUILDERS.pop("cosine-to-zero")
    with pytest.raises(ValueError, match="lr_schedule = 'cosine-to-zero': must be one of 'constant'"):
        ScheduleConfig(lr_schedule="cosine-to-zero").build(TOTAL, SEQ)


def test_cli_takes_the_train_spelling_and_the_old_one_alike(capsys):
    """`schedule --schedule.FIELD` (as `train` spells it) and the older `--field` alias print what
    ScheduleConfig built in Python describes."""
    expected = ScheduleConfig(batch_size=64, batch_policy="seesaw", ratio=1 / 1.1, max_batch_size=256,
                              lr_schedule="wsd", wsd_shape="1-sqrt").describe(10_000_000, 128, 8, 2)
    new = ["--run.total_tokens", "10M", "--model.seq_len", "128", "--run.micro_batch", "8", "--parallel.dp=2",
           "--schedule.batch_size", "64", "--schedule.batch_policy=seesaw", "--schedule.ratio", "1/1.1",
           "--schedule.max_batch_size=256", "--schedule.lr_schedule", "wsd", "--schedule.wsd_shape=1-sqrt"]
    old = ["--total-tokens", "10M", "--seq-len", "128", "--micro-batch", "8", "--dp", "2", "--batch-size", "64",
           "--batch-policy", "seesaw", "--ratio", "1/1.1", "--max-batch-size", "256", "--lr-schedule", "wsd",
           "--wsd-shape", "1-sqrt"]
    for argv in (new, old):
        assert main(argv) == 0
        assert capsys.readouterr().out.strip() == expected
    assert main(old[:8] + ["--schedule.max_batch_size=0", "--batch-policy", "seesaw"]) == 2
    assert capsys.readouterr().err == ("largebatch schedule: error: schedule.max_batch_size = 0: 0 does not mean "
                                       "off; omit it or give none to turn it off\n")


def test_cli_plot_write_failure_after_the_check_is_one_line(tmp_path, capsys, monkeypatch):
    """A plot that passed the up-front check but fails to write (a disk that filled meanwhile) is one
    line naming --plot, exit code 2, no traceback."""
    import largebatch.schedules.cli as schedule_cli

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(schedule_cli, "plot", full_disk)
    code = main(["--total-tokens", "1e6", "--seq-len", "128", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--plot" in err and "No space left on device" in err and "x.png" in err


def test_the_schedule_command_starts_without_torch():
    """`largebatch schedule` plans in pure Python: importing torch (~2 s of a 2.3 s command) is left
    to TokenLR, imported on first use."""
    code = ("import sys\n"
            "from largebatch.cli import main\n"
            "assert main(['schedule', '--total-tokens', '1e6', '--seq-len', '64']) == 0\n"
            "assert 'torch' not in sys.modules, 'the schedule command imported torch'\n"
            "from largebatch.schedules import TokenLR\n"
            "assert TokenLR.__module__ == 'largebatch.schedules.token_lr' and 'torch' in sys.modules\n")
    from processes import src_env

    env = src_env()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_short_forms_are_read_by_train_as_by_schedule():
    """`largebatch schedule --schedule.ratio 1/1.1` (as the docs write Seesaw's ratio) and the table's
    0:64,0.5:128 were refused by `largebatch train` ("expected a number"): both read them now, from a
    command line or as a TOML string, and a bad one names the field."""
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.typed_config import ConfigError, parse_overrides

    overrides = parse_overrides(["--schedule.batch_policy=seesaw", "--schedule.ratio", "1/1.1"])
    assert load_config(resolve_config(None), overrides).schedule.ratio == 1 / 1.1
    table = ScheduleConfig.from_dict({"batch_policy": "table", "batch_table": "0:16,0.5:32"})
    assert table.batch_table == [[0.0, 16], [0.5, 32]]
    with pytest.raises(ConfigError, match=r"schedule.ratio = '1/0': '1/0' is not a number or a fraction"):
        ScheduleConfig.from_dict({"ratio": "1/0"})
    with pytest.raises(ConfigError, match=r"schedule.batch_table = '0:16,0.5:3.5': .* expected FRACTION:BATCH"):
        ScheduleConfig.from_dict({"batch_table": "0:16,0.5:3.5"})


def test_a_warmup_of_less_than_one_token_is_refused():
    """The docs promise that a warmup, a ramp or a table row that rounds to no token of the budget is
    refused; the ramp and the table were, a warmup of 1e-9 ran with none."""
    with pytest.raises(ValueError, match=r"schedule.warmup = 1e-09: is 0.001 tokens of the 1,000,000-token "
                                         r"budget, less than one: no warmup would run; raise it, or give 0"):
        ScheduleConfig(warmup=1e-9).build(1_000_000, 128)
    assert ScheduleConfig(warmup=1e-6).build(1_000_000, 128).lr_schedule.warmup_tokens == 1
    assert ScheduleConfig(warmup=0.0).build(1_000_000, 128).lr_schedule.warmup_tokens == 0


def test_token_counts_take_the_short_forms_in_train_as_in_schedule(tmp_path):
    """`largebatch schedule --run.total_tokens 300M` worked while `largebatch train` refused 300M and
    1.5B ("expected a whole number"), on the command line and in a TOML file alike. Every token-count
    field reads them now (the budget, evaluation and checkpoint intervals, a phase's budget), the
    same numbers as the flag's, and a bad one names the field."""
    from largebatch.schedules.cli import parse_tokens
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.typed_config import ConfigError, parse_overrides

    overrides = parse_overrides(["--run.total_tokens", "1.5B", "--run.eval_tokens=16k",
                                 "--run.eval_every_tokens", "300M", "--run.checkpoint_every_tokens=1_000_000"])
    run = load_config(resolve_config(None), overrides).run
    assert (run.total_tokens, run.eval_tokens, run.eval_every_tokens, run.checkpoint_every_tokens) == (
        1_500_000_000, 16_000, 300_000_000, 1_000_000)
    assert parse_tokens("1.5B") == 1_500_000_000 and parse_tokens("16k") == 16_000
    config = tmp_path / "phases.toml"
    config.write_text('[run]\ntotal_tokens = "2M"\n[[phases]]\nseq_len = 64\ntotal_tokens = "1.5M"\n'
                      '[[phases]]\nseq_len = 128\ntotal_tokens = "500k"\n')
    assert [p.total_tokens for p in load_config(config).phases] == [1_500_000, 500_000]
    with pytest.raises(ConfigError, match=r"run.total_tokens = '300X': not a token count \(e.g. 2e9, 300M"):
        load_config(resolve_config(None), parse_overrides(["--run.total_tokens=300X"]))
    with pytest.raises(ConfigError, match=r"run.total_tokens = '1e30': at most 2\*\*53"):
        load_config(resolve_config(None), {"run.total_tokens": "1e30"})
    # a fraction of a token: refused by train; `largebatch schedule` rounded it away (2.5 -> 2)
    with pytest.raises(ConfigError, match=r"run.total_tokens = 100000.7: expected a whole number"):
        load_config(resolve_config(None), parse_overrides(["--run.total_tokens=100000.7"]))
    with pytest.raises(argparse.ArgumentTypeError, match="'2.5': 2.5 is not a whole number of tokens"):
        parse_tokens("2.5")
    assert parse_tokens("1.1M") == 1_100_000 and parse_tokens("2.5k") == 2_500


def test_whole_token_counts_written_as_floats_stay_whole():
    """Cosine(3e-4, 1e9, 1e8) (a budget as Python writes it) counted its optimizer steps as floats
    (15259.0; ``range()`` of it raised); a fractional budget, a bool, or a table batch of 12.7 (which
    became 12) are refused, naming the argument."""
    from largebatch.schedules import count_optimizer_steps

    schedule = Cosine(3e-4, 1e9, 1e8, 0.1)
    assert type(schedule.total_tokens) is int and type(schedule.warmup_tokens) is int
    steps = count_optimizer_steps(ConstantBatch(schedule, 64), 1024)
    assert type(steps) is int and steps == math.ceil(1e9 / (64 * 1024))
    with pytest.raises(ValueError, match=r"total_tokens=1000.5 must be a whole number of tokens"):
        Cosine(3e-4, 1000.5, 100)
    with pytest.raises(TypeError, match="total_tokens=True is a bool"):
        Cosine(3e-4, True)
    with pytest.raises(ValueError, match="table batch at token 5000=12.7 must be a positive integer"):
        PiecewiseBatch(Cosine(1e-3, 10_000, 1_000, 0.1), [(0, 8), (5000, 12.7)])
    with pytest.raises(ValueError, match="table start 7000.9 must be a whole number of tokens"):
        PiecewiseBatch(Cosine(1e-3, 10_000, 1_000, 0.1), [(0, 8), (7000.9, 16)])


@pytest.mark.parametrize("argv, fragment", [
    (["--run.total_tokens", "1e6", "--model.seq_len", "128", "--run.micro_batch", "0"],
     "argument --run.micro_batch/--micro-batch: 0 must be a positive whole number"),
    (["--run.total_tokens", "1e6", "--model.seq_len", "0"], "argument --model.seq_len/--seq-len: 0 must be"),
    (["--run.total_tokens", "0.4", "--model.seq_len", "128"], "'0.4': less than one token"),
])
def test_cli_sizes_are_checked_where_they_are_typed(argv, fragment, capsys):
    """(They reached the schedule classes as 'schedule: micro_batch=0 ...', 'seq_len=0 ...', or as a
    budget rounded to 0 tokens.)"""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and fragment in capsys.readouterr().err


def test_cli_plot_is_written_before_the_table_meets_a_closed_pipe(tmp_path):
    """`largebatch schedule ... --plot P | head`: the table used to be printed first, so a reader
    gone before it ended the command (141) without the plot."""
    from pathlib import Path

    out = tmp_path / "p.png"
    env = {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "PATH": "/usr/bin:/bin"}
    # ~1000 milestones: a table of ~80 KiB, more than the output buffer holds
    proc = subprocess.Popen([sys.executable, "-m", "largebatch", "schedule", "--run.total_tokens", "1e10",
                             "--model.seq_len", "1", "--schedule.batch_size", "4096", "--schedule.batch_policy",
                             "seesaw", "--schedule.ratio", "0.9977", "--plot", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before a line is printed
    assert proc.wait(timeout=120) == 141, proc.stderr.read()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("make, error, fragment", [
    (lambda: Seesaw(Cosine(1e-3, 1000, 100, 0.1), 8, noise_scale_multiple=math.inf), ValueError,
     "noise_scale_multiple=inf must be > 0 and finite"),
    (lambda: Seesaw(1e-3, 8), TypeError, "base=0.001 must be an LR schedule"),
    (lambda: Seesaw(Cosine(1e-3, 1000, 100, 0.1), 8).lr("x"), TypeError, "tokens='x' is a str"),
    (lambda: next(ConstantBatch(Cosine(1e-3, 1000, 100, 0.1), 8).steps(16, math.nan)), ValueError,
     "tokens_seen=nan"),
    (lambda: Cosine(1e-3, 1000, None), TypeError, "warmup_tokens=None is not a number of tokens"),
    (lambda: WarmupHoldPolynomial(1e-3, 1000, 100, 0.0, 0, math.inf), ValueError, "power=inf must be > 0 and finite"),
    (lambda: scale_lr_for_batch(math.nan, 64, 32, "sqrt"), ValueError, "lr=nan must be a finite number >= 0"),
    (lambda: scale_lr_for_batch(-1.0, 64, 32, "sqrt"), ValueError, "lr=-1.0 must be a finite number >= 0"),
    (lambda: scale_lr_for_batch(1e-3, math.inf, 32, "sqrt"), ValueError, "batch_size=inf must be positive and finite"),
    (lambda: NoiseScale().update(1.0, True, 0.5, 8), ValueError, "small_batch=True must be a whole number"),
    (lambda: NoiseScale().update(1.0, 1.5, 0.5, 8), ValueError, "small_batch=1.5 must be a whole number"),
    (lambda: ScheduleConfig(lr_schedule="wsd", wsd_cooldown=1e-9).build(TOTAL, SEQ), ValueError,
     "schedule.wsd_cooldown = 1e-09: is 0.01 tokens of the 10,000,000-token budget, less than one"),
])
def test_the_python_api_refuses_what_it_cannot_mean(make, error, fragment):
    """Each of these was accepted (an infinite cap, a negative or NaN LR, an infinite batch, a batch
    of 1.5 samples, a cooldown of no token) or failed with an error naming no argument."""
    with pytest.raises(error) as raised:
        make()
    assert fragment in str(raised.value)


def test_token_lr_takes_an_integer_tensor_of_tokens():
    import torch

    from largebatch.schedules import TokenLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1e-3)
    scheduler = TokenLR(optimizer, Cosine(1e-3, 10_000, 1_000, 0.1))
    optimizer.step()
    scheduler.step(tokens=torch.tensor(512))
    assert scheduler.tokens_seen == 512 and optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 512 / 1000)


def test_an_adaptive_seesaw_table_says_it_is_the_uncapped_plan():
    """With noise_scale_multiple the start-up table showed batches 8 -> 64 in 56 steps, while the
    measured noise scale held the batch at 8 for all 79 steps of the run, and nothing said so."""
    adaptive = ScheduleConfig(batch_size=8, batch_policy="seesaw", final_lr=0.1, noise_scale_multiple=2.0)
    assert "adaptive: each milestone's batch is capped at 2 x the noise scale measured by then, so the " \
           "table above is the uncapped plan: its batches an upper bound, its steps and % of base a lower " \
           "bound" in adaptive.describe(TOTAL, SEQ)
    assert "adaptive:" not in dataclasses.replace(adaptive, noise_scale_multiple=None).describe(TOTAL, SEQ)


def test_cli_reads_a_train_config_as_the_trainer_does(tmp_path, capsys):
    """``largebatch schedule --config FILE [--phase N]``: the schedule of a `largebatch train` config
    (there was no way to table or plot one; every field had to be copied as a flag). The table equals
    the one built from the trainer's own config loader; a flag beside it overrides the file."""
    import largebatch.schedules.cli as schedule_cli
    from largebatch.models.config import ModelConfig
    from largebatch.train.config import RunConfig, load_config
    from largebatch.train.phases import resolve_phases
    assert schedule_cli.TRAIN_DEFAULTS == {"run.total_tokens": RunConfig.total_tokens,
                                           "run.micro_batch": RunConfig.micro_batch,
                                           "model.seq_len": ModelConfig.seq_len}
    config = tmp_path / "run.toml"
    config.write_text("[model]\nseq_len = 64\n[run]\ntotal_tokens = 200_000\nmicro_batch = 4\n"
                      "[schedule]\nbatch_policy = 'seesaw'\nratio = 0.5\nbatch_size = 16\npeak_lr = 2e-3\n")
    cfg = load_config(config)
    expected = cfg.schedule.describe(cfg.run.total_tokens, cfg.model.seq_len, cfg.run.micro_batch, 1)
    assert main(["--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
    assert main(["--config", str(config), "--schedule.ratio", "1/1.1", "--run.micro_batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch 2" in out and out.strip() == cfg.schedule.__class__.from_dict(
        {**{k: v for k, v in vars(cfg.schedule).items()}, "ratio": 1 / 1.1}).describe(200_000, 64, 2, 1).strip()
    phased = tmp_path / "phased.toml"
    phased.write_text("[model]\nseq_len = 128\n[schedule]\nlr_schedule = 'lans'\nbatch_size = 16\n"
                      "[[phases]]\nseq_len = 32\ntotal_tokens = 65536\nmicro_batch = 8\n"
                      "[[phases]]\nseq_len = 128\ntotal_tokens = 32768\n[phases.schedule]\nbatch_size = 8\n")
    cfg = load_config(phased)
    phases = resolve_phases(cfg.phases, cfg.schedule, cfg.model.seq_len, cfg.run.total_tokens, cfg.run.micro_batch)
    for phase in phases:
        assert main(["--config", str(phased), "--phase", str(phase.index)]) == 0
        wanted = phase.schedule.describe(phase.total_tokens, phase.seq_len, phase.micro_batch, 1)
        assert capsys.readouterr().out.strip() == wanted.strip()
    for argv, fragment in ((["--config", str(phased)], "it has [[phases]] 0..1, each with its own budget"),
                           (["--config", str(phased), "--phase", "2"], "--phase 2: "),
                           (["--config", str(config), "--phase", "0"], "has no [[phases]]"),
                           (["--phase", "0"], "--phase 0: needs --config"),
                           (["--config", str(tmp_path / "none.toml")], "is neither a file nor a shipped config"),
                           ([], "--run.total_tokens and --model.seq_len required (or --config CONFIG")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (argv, err)


def test_wsd_cooldown_at_its_documented_bound_is_accepted_at_every_budget(capsys):
    """schedule.wsd_cooldown = 1 - warmup is documented as allowed; at 206,075 tokens (warmup 0.1) the CLI
    refused it ("schedule: cooldown_fraction=0.9 starts the cooldown at token 20607, inside the warmup
    (20608 tokens)"): the two roundings differed by one token. Random budgets and shares: none refused."""
    argv = ["--run.total_tokens", "206075", "--model.seq_len", "1", "--schedule.batch_size", "1",
            "--schedule.lr_schedule", "wsd", "--schedule.warmup", "0.1", "--schedule.wsd_cooldown", "0.9"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "20,608        206,075  3.000e-04  3.000e-05" in out  # the cooldown starts at the warmup's end
    rng = __import__("random").Random(3)
    for _ in range(3000):
        share, total = round(rng.uniform(0.01, 0.9), rng.choice([1, 2, 3])), rng.randint(10, 10**6)
        schedule = ScheduleConfig(lr_schedule="wsd", warmup=share, wsd_cooldown=1 - share).build_lr(total)
        assert schedule.warmup_tokens == round(share * total), (share, total)
        assert schedule.cooldown_start - schedule.warmup_tokens in (0, 1), (share, total)  # both rounded
    with pytest.raises(ValueError, match=r"schedule.wsd_cooldown = 0.91: must lie in \(0, 1 - warmup = 0.9\]"):
        ScheduleConfig(lr_schedule="wsd", warmup=0.1, wsd_cooldown=0.91).build_lr(206_075)
    from largebatch.schedules.config import _named_once  # the class's message, as the config names it

    with pytest.raises(ValueError) as err:
        WSD(3e-4, 1000, 101, 0.1, cooldown_fraction=0.9)  # a real overlap (one whole token): refused
    assert _named_once(str(err.value)).startswith("schedule.wsd_cooldown=0.9 starts the cooldown at token 100, "
                                                  "inside the warmup (101 tokens)")


def test_the_schedule_command_refuses_a_field_of_another_policy_as_train_does(tmp_path, capsys):
    """`largebatch schedule` never asked unread_fields_problem(), so it printed a table for a config that
    `largebatch train --check` refuses (schedule.alpha under batch_policy constant, silently ignored).
    Refused now with the trainer's message and exit code 2; for a phase of [[phases]], only the fields
    its own table sets, as the trainer checks them."""
    from largebatch.train.config import load_config
    from largebatch.typed_config import ConfigError

    config = tmp_path / "unread.toml"
    config.write_text("[schedule]\nbatch_policy = 'constant'\nalpha = 2.0\nbatch_size = 8\n"
                      "[run]\ntotal_tokens = 20000\nmicro_batch = 4\n[model]\nseq_len = 32\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    message = ("schedule.alpha = 2.0: only batch_policy seesaw-family reads it, and this run's is 'constant'; "
               "omit it, or choose that policy")
    assert str(err.value) == message
    for argv in (["--config", str(config)],
                 ["--run.total_tokens", "1e6", "--model.seq_len", "16", "--schedule.alpha", "2"]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err == f"largebatch schedule: error: {message}\n" and captured.out == "", argv
    assert main(["--run.total_tokens", "1e6", "--model.seq_len", "16", "--schedule.ramp_start", "8"]) == 2
    assert "schedule.ramp_start = 8: only batch_policy ramp reads it" in capsys.readouterr().err
    phased = tmp_path / "phased.toml"
    phased.write_text("[model]\nseq_len = 32\n[schedule]\nbatch_policy = 'seesaw-family'\nalpha = 2.0\n"
                      "beta = 1.0\nbatch_size = 8\n[[phases]]\nseq_len = 32\ntotal_tokens = 20000\n"
                      "[[phases]]\nseq_len = 32\ntotal_tokens = 20000\n[phases.schedule]\nbatch_policy = 'constant'\n")
    load_config(phased)  # the trainer takes it (alpha inherited: it serves phase 0's policy)
    assert main(["--config", str(phased), "--phase", "1"]) == 0
    assert "base (cosine, constant batch 8)" in capsys.readouterr().out
    # a field the phase's own table sets for another policy: refused by both, naming the phase's field
    own = tmp_path / "own.toml"
    own.write_text(phased.read_text() + "ramp_start = 4\n")
    message = ("phases[1].schedule.ramp_start = 4: only batch_policy ramp reads it, and this phase's is "
               "'constant'; omit it, or choose that policy")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(own)
    assert main(["--config", str(own), "--phase", "1"]) == 2
    assert capsys.readouterr().err == f"largebatch schedule: error: {message}\n"
