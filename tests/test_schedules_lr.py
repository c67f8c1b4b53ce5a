"""LR schedules against hand-written float64 formulas (docs/papers.md: schedules, §1 LANS)."""

import math
import pickle
import re

import pytest

from largebatch.schedules import (
    WSD,
    Constant,
    Cosine,
    InverseSqrt,
    LinearDecay,
    WarmupHoldPolynomial,
    scale_lr_for_batch,
)
from largebatch.schedules.lr import lr_schedule_from_state

PEAK, TOTAL, WARMUP = 2e-3, 1_000_000, 100_000
FRACTION = 0.1  # final_lr is a fraction of peak_lr
FINAL = FRACTION * PEAK  # the absolute end LR the references use


def cosine_ref(t):
    if t < WARMUP:
        return PEAK * t / WARMUP
    s = min(1.0, (t - WARMUP) / (TOTAL - WARMUP))
    return FINAL + 0.5 * (PEAK - FINAL) * (1 + math.cos(math.pi * s))


POINTS = [0, 1, 50_000, 99_999, 100_000, 123_457, 550_000, 777_777, 999_999, 1_000_000, 1_500_000]


def test_cosine_matches_formula_and_landmarks():
    sched = Cosine(PEAK, TOTAL, WARMUP, FRACTION)
    for t in POINTS:
        assert sched(t) == pytest.approx(cosine_ref(t), rel=1e-12, abs=1e-15)
    assert sched(0) == 0.0
    assert sched(WARMUP // 2) == pytest.approx(PEAK / 2)
    assert sched(WARMUP) == pytest.approx(PEAK)
    assert sched((WARMUP + TOTAL) // 2) == pytest.approx((PEAK + FINAL) / 2)  # cos(pi/2) = 0
    assert sched(TOTAL) == pytest.approx(FINAL) and sched(3 * TOTAL) == pytest.approx(FINAL)


def test_linear_decay_and_constant():
    lin = LinearDecay(PEAK, TOTAL, WARMUP, FRACTION)
    assert lin(WARMUP + (TOTAL - WARMUP) // 4) == pytest.approx(PEAK - 0.25 * (PEAK - FINAL))
    assert lin(TOTAL) == pytest.approx(FINAL)
    const = Constant(PEAK, warmup_tokens=10)
    assert const(5) == pytest.approx(PEAK / 2) and const(10**12) == PEAK


@pytest.mark.parametrize("shape, s, expected_fraction", [
    ("linear", 0.5, 0.5), ("cosine", 0.5, 0.5), ("cosine", 0.25, (1 + math.cos(math.pi / 4)) / 2),
    ("1-sqrt", 0.25, 0.5), ("1-sqrt", 0.81, 0.1), ("exponential", 0.5, None)])
def test_wsd_cooldown_shapes(shape, s, expected_fraction):
    sched = WSD(PEAK, TOTAL, WARMUP, FRACTION, cooldown_fraction=0.2, shape=shape)
    cooldown_start = 800_000
    assert sched(WARMUP) == PEAK and sched(cooldown_start) == pytest.approx(PEAK)
    assert sched(500_000) == PEAK  # stable phase
    t = cooldown_start + s * 200_000
    if expected_fraction is None:  # geometric: peak * (final/peak)^s
        expected = PEAK * (FINAL / PEAK) ** s
    else:  # fraction of the way from final up to peak
        expected = FINAL + expected_fraction * (PEAK - FINAL)
    assert sched(t) == pytest.approx(expected, rel=1e-9)
    assert sched(TOTAL) == pytest.approx(FINAL)
    assert sched.breakpoints() == [WARMUP, cooldown_start]


def test_lans_warmup_hold_polynomial_matches_paper_formula():
    hold, power = 200_000, 2.0
    sched = WarmupHoldPolynomial(PEAK, TOTAL, WARMUP, hold_tokens=hold, power=power)
    w, c = WARMUP / TOTAL, hold / TOTAL
    for t in [0, 30_000, 100_000, 250_000, 299_999, 300_000, 640_000, 999_999, 1_000_000]:
        u = t / TOTAL
        expected = (PEAK * u / w if u < w else PEAK if u < w + c
                    else PEAK * ((1 - u) / (1 - w - c)) ** power)
        assert sched(t) == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_inverse_sqrt():
    sched = InverseSqrt(PEAK, warmup_tokens=WARMUP)
    assert sched(WARMUP) == pytest.approx(PEAK)
    assert sched(4 * WARMUP) == pytest.approx(PEAK / 2)
    assert sched(100 * WARMUP) == pytest.approx(PEAK / 10)


def test_inverse_sqrt_holds_its_last_value_past_the_budget():
    """Past total_tokens every schedule holds its final value; InverseSqrt too (it decayed on)."""
    sched = InverseSqrt(PEAK, TOTAL, WARMUP)
    last = PEAK * math.sqrt(WARMUP / TOTAL)  # sqrt(0.1): 0.316 x peak
    assert sched(TOTAL // 2) == pytest.approx(PEAK * math.sqrt(2 * WARMUP / TOTAL), rel=1e-12)
    for t in (TOTAL, TOTAL + 1, 4 * TOTAL, 10**12):
        assert sched(t) == pytest.approx(last, rel=1e-12)
    assert InverseSqrt(PEAK, None, WARMUP)(4 * TOTAL) == pytest.approx(last / 2)  # no budget: decays on


def test_schedules_pickle_and_rebuild_from_state():
    schedules = (Cosine(PEAK, TOTAL, WARMUP, FRACTION),
                 WSD(PEAK, TOTAL, WARMUP, FRACTION, 0.1, "1-sqrt"),
                 WarmupHoldPolynomial(PEAK, TOTAL, WARMUP, hold_tokens=5),
                 InverseSqrt(PEAK, None, 7))
    for sched in schedules:
        rebuilt = lr_schedule_from_state(sched.state_dict())
        for clone in (pickle.loads(pickle.dumps(sched)), rebuilt):
            assert clone == sched
            assert [clone(t) for t in POINTS] == [sched(t) for t in POINTS]


@pytest.mark.parametrize("make, argument", [
    (lambda: Cosine(PEAK, TOTAL, warmup_tokens=TOTAL), "warmup_tokens"),
    (lambda: Cosine(PEAK, TOTAL, warmup_tokens=-1), "warmup_tokens"),
    (lambda: Cosine(PEAK, TOTAL, final_lr=1.5), "final_lr=1.5 must lie in [0, 1]: it is a"),
    (lambda: Cosine(-1.0, TOTAL), "peak_lr"),
    (lambda: Cosine(PEAK), "total_tokens"),
    (lambda: WSD(PEAK, TOTAL, shape="sqrt"), "shape"),
    (lambda: WSD(PEAK, TOTAL, WARMUP, cooldown_fraction=0.95), "cooldown_fraction"),
    (lambda: WarmupHoldPolynomial(PEAK, TOTAL, WARMUP, hold_tokens=TOTAL), "hold_tokens"),
    (lambda: InverseSqrt(PEAK), "warmup_tokens"),
    (lambda: Cosine(PEAK, TOTAL)(-5), "tokens=-5"),
    (lambda: scale_lr_for_batch(1.0, 64, 32, "cubic"), "policy='cubic'"),
])
def test_bad_input_names_the_argument(make, argument):
    with pytest.raises(ValueError, match=re.escape(argument)):
        make()


@pytest.mark.parametrize("make, message", [
    (lambda: Cosine("2e-3", TOTAL), "peak_lr='2e-3' is a str, not a number; pass a number, e.g. peak_lr=0.002"),
    (lambda: Cosine(PEAK, "1000000"), "total_tokens='1000000' is a str, not a number; pass a number, "
                                      "e.g. total_tokens=1000000"),
    (lambda: Cosine(PEAK, TOTAL, WARMUP, "0.1"), "final_lr='0.1' is a str"),
    (lambda: WSD(PEAK, TOTAL, cooldown_fraction="0.2"), "cooldown_fraction='0.2' is a str"),
    (lambda: WarmupHoldPolynomial(PEAK, TOTAL, power="2"), "power='2' is a str"),
    (lambda: Cosine(PEAK, TOTAL)("5"), "tokens='5' is a str, not a number; pass a number, e.g. tokens=5"),
    (lambda: Cosine(PEAK, TOTAL)(None), "tokens=None is a NoneType, not a number"),
])
def test_a_string_argument_is_a_type_error_naming_it(make, message):
    with pytest.raises(TypeError) as err:
        make()
    assert str(err.value) == message or str(err.value).startswith(message)


def test_coupling_error_names_only_the_bad_batch_size():
    with pytest.raises(ValueError) as err:
        scale_lr_for_batch(1e-3, 0, 256, "sqrt")
    assert str(err.value).startswith("batch_size=0 must be positive") and "reference" not in str(err.value)
    with pytest.raises(ValueError, match=r"^reference_batch_size=0 must be positive"):
        scale_lr_for_batch(1e-3, 64, 0, "sqrt")


def test_lr_batch_coupling_policies():
    assert scale_lr_for_batch(1e-3, 1024, 256, "none") == 1e-3
    assert scale_lr_for_batch(1e-3, 1024, 256, "linear") == pytest.approx(4e-3)
    assert scale_lr_for_batch(1e-3, 1024, 256, "sqrt") == pytest.approx(2e-3)
    assert scale_lr_for_batch(1e-3, 64, 256, "sqrt") == pytest.approx(5e-4)


def test_a_wsd_cooldown_that_rounds_to_no_token_is_refused_and_a_span_of_none_holds_until_it():
    """WSD(3e-4, 1e6, 1e5, 0.1, cooldown_fraction=1e-7) put its cooldown start on the last token, and
    the progress through a span of no token was 1 everywhere: the LR was final_lr over the whole
    stable phase. Such a cooldown (0.1 token) is refused; progress through an empty span is 0 before it."""
    with pytest.raises(ValueError, match=re.escape(
            "cooldown_fraction=1e-07 is 0.1 tokens of the 1,000,000-token budget, which rounds to no token: "
            "there would be no cooldown; raise it to at least 1 / total_tokens = 1e-06")):
        WSD(3e-4, TOTAL, WARMUP, 0.1, cooldown_fraction=1e-7)
    shortest = WSD(3e-4, TOTAL, WARMUP, 0.1, cooldown_fraction=1e-6)  # the suggested fix: one token
    assert shortest.cooldown_start == TOTAL - 1
    assert [shortest(t) for t in (WARMUP, 500_000, TOTAL - 1)] == [3e-4, 3e-4, 3e-4]
    assert shortest(TOTAL) == pytest.approx(3e-5, rel=1e-12)
    cosine = Cosine(PEAK, TOTAL, WARMUP, FRACTION)
    assert [cosine._progress(t, TOTAL) for t in (0, WARMUP, TOTAL - 1, TOTAL, TOTAL + 5)] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("total, share", [(206_075, 0.1), (653_625, 0.22), (87_500, 0.293), (1015, 0.1)])
def test_a_wsd_cooldown_of_one_minus_the_warmup_share_starts_at_the_warmups_end(total, share):
    """cooldown_fraction = 1 - warmup share (the documented bound of schedule.wsd_cooldown) was refused at
    these budgets: round(206,075 * (1 - 0.9)) = 20,607 (1 - 0.9 is 0.09999999999999998) fell one token
    inside the warmup round(0.1 * 206,075) = 20,608 (half to even). A start inside the warmup by rounding
    alone (< 1 token) is moved to the warmup's end; a real overlap is still refused."""
    warmup = round(share * total)
    assert round(total * (1 - (1 - share))) == warmup - 1  # the case: one token apart by rounding
    schedule = WSD(PEAK, total, warmup, FRACTION, cooldown_fraction=1 - share)
    assert schedule.cooldown_start == warmup and schedule(warmup) == PEAK
    for t in (warmup + 1, (warmup + total) // 2, total - 1):  # linear from the warmup's end, float64
        assert schedule(t) == pytest.approx(PEAK + (FINAL - PEAK) * (t - warmup) / (total - warmup), rel=1e-12)
    with pytest.raises(ValueError, match=r"cooldown_fraction=0.9 starts the cooldown at token 100, inside the "
                                         r"warmup \(101 tokens\); shorten the warmup or the cooldown"):
        WSD(PEAK, 1000, 101, FRACTION, cooldown_fraction=0.9)  # exactly one token of overlap: refused


@pytest.mark.parametrize("make, message", [
    (lambda: Cosine(PEAK, TOTAL, 10.5), "warmup_tokens=10.5 must be a whole number of tokens, e.g. warmup_tokens=10"),
    (lambda: WarmupHoldPolynomial(PEAK, TOTAL, WARMUP, 0.0, hold_tokens=1000.7),
     "hold_tokens=1000.7 must be a whole number of tokens, e.g. hold_tokens=1001"),
    (lambda: Cosine(PEAK, 1000.5, 100), "total_tokens=1000.5 must be a whole number of tokens (the budget's "
                                        "optimizer steps are counted from it), e.g. total_tokens=1000"),
])
def test_a_fractional_token_count_is_refused(make, message):
    """Cosine(warmup_tokens=10.5) was accepted and its phase table ended the warmup at token 10.5; the docs
    promise a fractional token count is refused. A whole count written as a float stays accepted."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message
    held = WarmupHoldPolynomial(PEAK, 1e6, 1e5, 0.0, hold_tokens=2e5)
    assert (held.warmup_tokens, held.hold_tokens) == (100_000, 200_000) and type(held.hold_tokens) is int
