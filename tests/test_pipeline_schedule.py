"""The walk of torch's pipeline schedules (largebatch.memory.pipeline_schedule), no processes: activations
in flight per rank against Korthikanti et al. 2022 §4.2.3 where the closed form holds, the bubble
against Narayanan et al. 2021 §2.2, and the zero-bubble schedules' own numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from largebatch.memory.activations import first_stage_layers
from largebatch.memory.pipeline_schedule import SCHEDULES, check, theoretical_bubble, walk

LAYOUTS = [(p, m) for p in (2, 4, 8) for m in (2 * p, 3 * p, 4 * p)]  # m a multiple of p, m >= 2p


@pytest.mark.parametrize("p, m", LAYOUTS)
def test_one_stage_schedules_equal_the_closed_forms(p, m):
    L = 4 * p
    gpipe, f1b = walk("gpipe", p, 1, m), walk("1f1b", p, 1, m)
    assert gpipe.layers_worth(L) == first_stage_layers(L, p, "gpipe", 1, m) == m * L / p
    assert f1b.layers_worth(L) == first_stage_layers(L, p, "1f1b") == L
    assert f1b.peak_in_flight == tuple(p - r for r in range(p))  # rank r: p - r micro-batches
    for w in (gpipe, f1b):  # a backward is two slots: the bubble is (p - 1) / (m + p - 1) all the same
        assert w.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)
        assert w.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p, m", LAYOUTS)
@pytest.mark.parametrize("V", [2, 4])
def test_interleaved_equals_the_closed_forms_from_m_2p(p, m, V):
    """The first rank's warm-up is (V - 1) p + 2 (p - 1) forwards: p V + p - 1 stages in flight."""
    L = p * V * 2
    w = walk("interleaved-1f1b", p, V, m)
    assert w.layers_worth(L) == pytest.approx(first_stage_layers(L, p, "interleaved-1f1b", V), abs=1e-12)
    assert w.peak_in_flight[0] == p * V + p - 1
    assert w.bubble == pytest.approx(theoretical_bubble("interleaved-1f1b", p, V, m), abs=1e-15)


def test_interleaved_with_m_equal_p_keeps_every_forward():
    """m = p: the warm-up is capped at the m V forwards of the step, below the closed form."""
    w = walk("interleaved-1f1b", 4, 2, 4)
    assert w.peak_in_flight[0] == 8 < 4 * 2 + 4 - 1
    assert w.layers_worth(16) == 16 < first_stage_layers(16, 4, "interleaved-1f1b", 2)


@pytest.mark.parametrize("p, m", LAYOUTS)
@pytest.mark.parametrize("schedule, V", [("interleaved-zb", 2), ("interleaved-zb", 3), ("interleaved-zb", 4),
                                         ("zbv", 2)])
def test_zero_bubble_keeps_pV_stages_until_their_weight_gradients(p, m, schedule, V):
    """Qi et al. 2024: ZB-1P (interleaved) and ZB-V hold p micro-batches' worth -- p V stages of L / (p V)
    layers, L layers, as 1F1B -- on every rank, and each rank idles p - 1 of 3 V m + p - 1 slots."""
    w = walk(schedule, p, V, m)
    assert w.peak_in_flight == (p * V,) * p
    assert w.layers_worth(4 * p * V) == 4 * p * V
    assert w.idle == (p - 1,) * p
    assert w.bubble == pytest.approx((p - 1) / (3 * V * m + p - 1), abs=1e-15)
    assert theoretical_bubble(schedule, p, V, m) is None


def test_zbv_with_m_equal_p_is_not_zero_bubble():
    w = walk("zbv", 4, 2, 4)  # torch plans 2p - 1 micro-batches and drops those past m
    assert w.peak_in_flight == (5, 6, 7, 8)
    assert w.bubble == pytest.approx(0.2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_action_runs_once_and_weight_gradients_follow_input_gradients(schedule):
    p, V, m = 4, 1 if schedule in ("gpipe", "1f1b") else 2, 8
    w = walk(schedule, p, V, m)
    actions = [a for rank in w.actions for a in rank]
    kinds = {"F"} | ({"I", "W"} if schedule in ("interleaved-zb", "zbv") else {"B"})
    assert {k for k, _, _ in actions} == kinds
    for kind in kinds:
        assert sorted((s, mb) for k, s, mb in actions if k == kind) == \
            [(s, mb) for s in range(p * V) for mb in range(m)]
    for rank in w.actions:
        for i, (kind, s, mb) in enumerate(rank):
            if kind == "W":
                assert ("I", s, mb) in rank[:i]


@pytest.mark.parametrize("schedule, p, V, m, message", [
    ("zb", 2, 2, 4, "must be one of"),
    ("1f1b", 2, 2, 4, "V=2 must be 1"),
    ("zbv", 2, 3, 4, "exactly 2 stages per rank"),
    ("1f1b", 4, 1, 2, "needs m >= 4"),
    ("interleaved-1f1b", 4, 2, 9, "not a multiple of its 2 rounds"),
    ("gpipe", 64, 1, 1000, "more than 50,000"),
])
def test_bad_layouts_are_refused(schedule, p, V, m, message):
    with pytest.raises(ValueError, match=message):
        check(schedule, p, V, m)


@pytest.mark.parametrize("schedule, V", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_bytes_of_the_walk_equal_the_closed_form(schedule, V):
    """Per stage bytes along the walk: the closed form's first-stage bytes (fp16 with dropout masks for
    one-stage schedules; interleaved: without dropout, whose embedding mask the closed form counts
    for every stage in flight)."""
    from largebatch.memory.activations import model_activation_bytes
    from largebatch.memory.pipeline_schedule import schedule_activation_bytes
    from largebatch.models import preset

    config = preset("gpt3-175b") if V == 1 else preset("gpt3-175b", dropout=0.0)
    p, m = 8, 16
    ours = schedule_activation_bytes(config, 1, schedule, p, V, m, tp=8, sequence_parallel=True)
    theirs = model_activation_bytes(config, 1, tp=8, pp=p, sequence_parallel=True, schedule=schedule,
                                    virtual_stages=V, micro_batches=m)
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_zbv_puts_the_output_layer_on_the_first_rank():
    from largebatch.memory.activations import stage_activation_bytes
    from largebatch.memory.pipeline_schedule import schedule_activation_bytes
    from largebatch.models import preset

    config = preset("demo")
    p, m, n = 2, 4, 4
    per = [stage_activation_bytes(config, 2, config.n_layer // n, first=s == 0, last=s == n - 1) for s in range(n)]
    assert per[3] > per[1]  # the last stage also keeps the final norm's input and the fp32 logits
    ours = schedule_activation_bytes(config, 2, "zbv", p, 2, m)
    assert ours == walk("zbv", p, 2, m).peak_bytes(per.__getitem__) > walk("zbv", p, 2, m).peak_in_flight[0] * per[1]


def test_memory_cli_reports_every_schedule_with_its_bubble(capsys):
    from largebatch.memory.cli import main

    flags = ["--model", "gpt3-175b", "--tp", "8", "--pp", "16", "--sequence-parallel", "--pp-virtual-stages", "3"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith("  ") and line.split()[0] in SCHEDULES}
    assert set(rows) == set(SCHEDULES)
    assert rows["1f1b"].split()[1:5] == ["96.00", "32.11", "GiB", f"{15 / 47:.3f}"]  # (p - 1) / (m + p - 1)
    assert rows["interleaved-1f1b"].split()[1] == "126.00"
    for name in ("interleaved-zb", "zbv"):  # lower bounds: torch keeps more than the walk counts
        assert rows[name].split()[1] == "96.00" and rows[name].split()[2].startswith(">=")
    assert "lower bound" in out
    # one column for activations, also past 100 GiB (micro-batch 8: 128-831 GiB)
    assert main(flags + ["--micro-batch", "8"]) == 0
    wide = [line for line in capsys.readouterr().out.splitlines() if " GiB   0." in line]
    assert len(wide) == len(SCHEDULES) and len({line.index(" GiB") for line in wide}) == 1
    docs = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    table = out[out.index("First pipeline stage"):out.index("lower bound")].splitlines()
    assert all(line in docs for line in table)  # docs/memory.md shows this command's table
    zbv = [f for f in flags if f not in ("--pp-virtual-stages", "3")]  # (zbv holds 2: a 3 is refused)
    assert main(zbv + ["--pp-schedule", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "  zbv " in out and "  1f1b " not in out and "  gpipe " not in out


def test_memory_cli_refuses_a_chosen_schedule_it_cannot_walk(capsys):
    from largebatch.memory.cli import main

    flags = ["--model", "gpt3-175b", "--pp", "16", "--pp-schedule", "interleaved-zb", "--pp-micro-batches", "8"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "needs m >= 16 micro-batches, got 8" in err and err.count("\n") == 1
