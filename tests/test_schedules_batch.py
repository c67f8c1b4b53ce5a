"""Batch schedules, granularity, phase tables and step counting (docs/papers.md: schedules)."""

import pickle

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from largebatch.schedules import (
    Constant,
    ConstantBatch,
    Cosine,
    LinearRamp,
    PiecewiseBatch,
    Seesaw,
    check_batch_size,
    count_optimizer_steps,
)


def simulate_steps(schedule, seq_len):
    """Independent step count: step k starts at tokens_k and consumes batch_size(tokens_k) * L."""
    tokens, steps = 0, 0
    while tokens < schedule.total_tokens:
        tokens += schedule.batch_size(tokens) * seq_len
        steps += 1
    return steps


def test_check_batch_size_names_the_conflict_and_the_fix():
    assert check_batch_size(128, 8, 4) == 128
    with pytest.raises(ValueError) as err:
        check_batch_size(100, 8, 4)
    message = str(err.value)
    for part in ("batch_size=100", "micro_batch (8)", "dp_size (4)", "= 32", "96", "128"):
        assert part in message
    with pytest.raises(ValueError, match="micro_batch=0"):
        check_batch_size(64, 0, 1)


def test_megatron_linear_ramp():
    # 32 -> 128 by 32: three increments over 300 tokens, 100 tokens each
    ramp = LinearRamp(Cosine(1.0, 1000, 0, 0.1), start_batch=32, increment=32, ramp_tokens=300,
                      batch_size=128, micro_batch=8, dp_size=2)
    expected = {0: 32, 99: 32, 100: 64, 199: 64, 200: 96, 299: 96, 300: 128, 999: 128}
    assert {t: ramp.batch_size(t) for t in expected} == expected
    assert ramp.lr(500) == Cosine(1.0, 1000, 0, 0.1)(500)  # the LR is untouched by the ramp
    assert [ramp.micro_batches(t) for t in (0, 100, 300)] == [2, 4, 8]  # batch / (8 x 2)
    with pytest.raises(ValueError, match="increment=24"):
        LinearRamp(Cosine(1.0, 1000), 32, 24, 300, 128, micro_batch=8, dp_size=2)
    with pytest.raises(ValueError, match="must be a non-negative multiple of increment=32"):
        LinearRamp(Cosine(1.0, 1000), 32, 32, 300, 112)
    with pytest.raises(ValueError, match="ramp_tokens=2000"):
        LinearRamp(Cosine(1.0, 1000), 32, 32, 2000, 128)


def test_piecewise_table():
    table = PiecewiseBatch(Cosine(1.0, 1000), [(0, 16), (400, 32), (700, 64)], micro_batch=16)
    assert [table.batch_size(t) for t in (0, 399, 400, 699, 700, 5000)] == [16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="table batch at token 400=24"):
        PiecewiseBatch(Cosine(1.0, 1000), [(0, 16), (400, 24)], micro_batch=16)
    with pytest.raises(ValueError, match="token 0"):
        PiecewiseBatch(Cosine(1.0, 1000), [(10, 16)])


def test_piecewise_table_row_past_the_budget_is_refused():
    """A row starting at or past total_tokens would never be used: refused, not silently kept."""
    with pytest.raises(ValueError, match=r"table start token 1000 is at or past total_tokens=1000"):
        PiecewiseBatch(Cosine(1.0, 1000), [(0, 16), (1000, 32)])
    with pytest.raises(ValueError, match=r"table start token 5000 is at or past total_tokens=1000"):
        PiecewiseBatch(Cosine(1.0, 10_000), [(0, 16), (5000, 32)], total_tokens=1000)
    last = PiecewiseBatch(Cosine(1.0, 1000), [(0, 16), (999, 32)])  # the last token still counts
    assert [last.batch_size(t) for t in (998, 999)] == [16, 32]


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_step_count_matches_simulation(seq_len):
    lr = Cosine(1.0, 200_000, 20_000, 0.1)
    for schedule in (ConstantBatch(lr, 48), LinearRamp(lr, 8, 8, 50_000, 64),
                     PiecewiseBatch(lr, [(0, 8), (33_333, 40), (150_001, 24)]),
                     Seesaw(lr, 12, ratio=0.5), Seesaw(lr, 10, ratio=1 / 1.1, micro_batch=2)):
        phases = schedule.phases(seq_len)
        assert count_optimizer_steps(schedule, seq_len) == simulate_steps(schedule, seq_len)
        # the table tiles [0, total) and each row's batch is the batch throughout its range
        assert phases[0].start_tokens == 0 and phases[-1].end_tokens == schedule.total_tokens
        for row, following in zip(phases, phases[1:]):
            assert row.end_tokens == following.start_tokens
            assert schedule.batch_size(row.end_tokens - 1) == row.batch_size


def test_constant_batch_state_round_trip_rejects_a_changed_schedule():
    sched = ConstantBatch(Cosine(1.0, 1000, 100), 64, micro_batch=8)
    clone = ConstantBatch(Cosine(1.0, 1000, 100), 64, micro_batch=8)
    clone.load_state_dict(pickle.loads(pickle.dumps(sched.state_dict())))
    other = ConstantBatch(Cosine(1.0, 1000, 100), 128, micro_batch=8)
    with pytest.raises(ValueError, match="batch_size=64"):
        other.load_state_dict(sched.state_dict())


def test_ramp_resumes_mid_ramp():
    def build():
        return LinearRamp(Cosine(1.0, 100_000, 10_000, 0.1), 8, 8, 60_000, 64)

    seq_len, tokens, trace = 16, 0, []
    first = build()
    while tokens < 30_000:  # stop mid-ramp and checkpoint
        trace.append((first.lr(tokens), first.batch_size(tokens)))
        tokens += first.batch_size(tokens) * seq_len
    checkpoint = pickle.dumps({"schedule": first.state_dict(), "tokens_seen": tokens})
    resumed, saved = build(), pickle.loads(checkpoint)
    resumed.load_state_dict(saved["schedule"])
    tokens = saved["tokens_seen"]
    while tokens < resumed.total_tokens:
        trace.append((resumed.lr(tokens), resumed.batch_size(tokens)))
        tokens += resumed.batch_size(tokens) * seq_len
    uninterrupted, tokens = [], 0
    while tokens < first.total_tokens:
        uninterrupted.append((first.lr(tokens), first.batch_size(tokens)))
        tokens += first.batch_size(tokens) * seq_len
    assert trace == uninterrupted


def test_step_count_up_to_a_token_count():
    lr = Cosine(1.0, 200_000, 20_000, 0.1)
    ramp = LinearRamp(lr, 8, 8, 50_000, 64)
    steps, tokens = 0, 0
    while tokens < 70_000:
        tokens += ramp.batch_size(tokens) * 16
        steps += 1
    assert count_optimizer_steps(ramp, 16, tokens=70_000) == steps
    assert count_optimizer_steps(ramp, 16, tokens=70_000) < count_optimizer_steps(ramp, 16)


@settings(max_examples=60, deadline=None)
@given(start=st.integers(1, 8), increments=st.integers(0, 6), step=st.integers(1, 8),
       ramp_share=st.floats(0.01, 1.0), seq_len=st.integers(1, 300),
       total=st.integers(1_000, 200_000))
def test_ramp_step_count_property(start, increments, step, ramp_share, seq_len, total):
    lr = Cosine(1.0, total, total // 10, 0.1)
    ramp = LinearRamp(lr, 4 * start, 4 * step, max(1, int(ramp_share * total)),
                      4 * (start + increments * step), micro_batch=4)
    assert count_optimizer_steps(ramp, seq_len) == simulate_steps(ramp, seq_len)
    assert ramp.batch_size(numpy.int64(0)) == check_batch_size(numpy.int64(4 * start), 4)


def test_a_budget_past_the_lr_schedules_is_warned_about():
    """ConstantBatch, LinearRamp and PiecewiseBatch take a total_tokens of their own; past the LR
    schedule's the decay was planned for a shorter run and its final LR is held: a warning names both
    budgets and the fix. Within it (a shorter run), or with a Constant LR, there is none."""
    import warnings

    cosine = Cosine(1.0, 10_000, 1000, 0.1)
    builds = (lambda total: ConstantBatch(cosine, 8, total_tokens=total),
              lambda total: LinearRamp(cosine, 2, 2, 3000, 8, total_tokens=total),
              lambda total: PiecewiseBatch(cosine, [(0, 4), (5000, 8)], total_tokens=total))
    for build in builds:
        with pytest.warns(UserWarning) as caught:
            schedule = build(100_000)
        assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
        message = str(caught[0].message)
        assert ("total_tokens=100,000 is past the LR schedule's total_tokens=10,000" in message
                and "last 90,000 tokens" in message and "total_tokens=100000" in message)
        assert schedule.lr(99_999) == pytest.approx(0.1)  # the held final LR, final_lr * peak
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build(None), build(10_000), build(6000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ConstantBatch(Constant(1.0, 1000), 8, total_tokens=100_000)  # no decay to have planned


@pytest.mark.parametrize("build", [lambda lr: ConstantBatch(lr, 64), lambda lr: LinearRamp(lr, 8, 8, 1000, 64),
                                   lambda lr: PiecewiseBatch(lr, [(0, 8)])])
def test_a_number_where_the_lr_schedule_belongs_is_named(build):
    """``ConstantBatch(3e-4, 64)`` (the LR where the schedule goes) was an AttributeError
    ('float' object has no attribute 'total_tokens'); Seesaw already named it."""
    with pytest.raises(TypeError, match=r"lr_schedule=0.0003 must be an LR schedule"):
        build(3e-4)


@pytest.mark.parametrize("make, error, message", [
    (lambda lr: PiecewiseBatch(lr, [(0, 8, 1)]), ValueError,
     "table row (0, 8, 1) is not a (start_tokens, batch_size) pair; e.g. table=[(0, 64), (500_000, 128)]"),
    (lambda lr: PiecewiseBatch(lr, [8]), ValueError, "table row 8 is not a (start_tokens, batch_size) pair"),
    (lambda lr: PiecewiseBatch(lr, [(0, 8), "ab"]), ValueError, "table row 'ab' is not a (start_tokens, batch"),
    (lambda lr: PiecewiseBatch(lr, 8), TypeError, "table=8 is a int, not a list of (start_tokens, batch_size) rows"),
    (lambda lr: ConstantBatch(lr, 64).load_state_dict({"kind": "ConstantBatch"}), ValueError,
     "checkpoint schedule state has config=None (keys: ['kind']): not a state_dict() of a ConstantBatch"),
    (lambda lr: ConstantBatch(lr, 64).load_state_dict(None), TypeError, "state=None is a NoneType, not the dict"),
])
def test_a_malformed_argument_is_named_not_a_raw_python_error(make, error, message):
    """A table row of three or a bare number raised "too many values to unpack" / "cannot unpack
    non-iterable int object"; a state without its config a bare KeyError('config')."""
    with pytest.raises(error) as err:
        make(Cosine(1e-3, 10**6, 1000, 0.1))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("make, message", [
    (lambda lr: ConstantBatch(lr, 64, total_tokens=1000.5), "total_tokens=1000.5 must be a whole number of "
     "tokens (the budget's optimizer steps are counted from it), e.g. total_tokens=1000"),
    (lambda lr: LinearRamp(lr, 8, 8, 1000.7, 64), "ramp_tokens=1000.7 must be a whole number of tokens, "
     "e.g. ramp_tokens=1001"),
    (lambda lr: next(ConstantBatch(lr, 64).steps(16, 100.5)), "tokens_seen=100.5 must be a whole number"),
    (lambda lr: ConstantBatch(lr, 64).plan(100.5, 16), "tokens_seen=100.5 must be a whole number"),
])
def test_a_fractional_token_count_is_refused_not_truncated(make, message):
    """ConstantBatch(total_tokens=1000.5) ran a budget of 1000, LinearRamp(ramp_tokens=1000.7) a ramp of 1000,
    steps(tokens_seen=100.5) a plan at token 100 with the LR of token 100.5. Whole floats stay accepted."""
    base = Cosine(1e-3, 10**6, 1000, 0.1)
    with pytest.raises(ValueError) as err:
        make(base)
    assert str(err.value).startswith(message)
    assert ConstantBatch(base, 64, total_tokens=5e5).total_tokens == 500_000
    ramp = LinearRamp(base, 8, 8, 1e4, 64)
    assert ramp.ramp_tokens == 10_000 and type(ramp.ramp_tokens) is int
    step = next(ConstantBatch(base, 64).steps(16, 100.0))
    assert step.tokens_seen == 100 and step.lr == pytest.approx(1e-3 * 100 / 1000, rel=1e-12)
