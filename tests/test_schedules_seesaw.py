"""Seesaw, its (alpha, beta) family, Smith's ramp, caps and granularity (Meterez et al. 2025;
docs/papers.md: schedules). References are float64 formulas written here from the paper."""

import math
import pickle
import re

import pytest

from largebatch.schedules import (
    Constant,
    ConstantBatch,
    Cosine,
    InverseSqrt,
    Seesaw,
    SeesawFamily,
    SmithRamp,
    WarmupHoldPolynomial,
    count_optimizer_steps,
)

PEAK = 1.0


def cosine_milestone_fractions(warmup, final, ratio):
    """Token fractions u_k where a warmup+cosine schedule (peak 1) reaches ratio**k, solved in
    closed form: ratio**k = final + (1 - final) * (1 + cos(pi * s)) / 2."""
    k_max = math.floor(math.log(final) / math.log(ratio) + 1e-9)
    fractions = []
    for k in range(1, k_max + 1):
        x = (ratio**k - final) / (1 - final)
        s = math.acos(2 * x - 1) / math.pi
        fractions.append(warmup + (1 - warmup) * s)
    return fractions


def seesaw_step_fraction_reference(warmup, final, ratio):
    """Continuous-token Seesaw/cosine step ratio: warmup + sum_k (phase length) * ratio**k."""
    bounds = [warmup, *cosine_milestone_fractions(warmup, final, ratio), 1.0]
    return warmup + sum((b - a) * ratio**k for k, (a, b) in enumerate(zip(bounds, bounds[1:])))


def test_reference_arithmetic_reproduces_the_paper():
    assert len(cosine_milestone_fractions(0.1, 0.1, 1 / 1.1)) == 24
    assert seesaw_step_fraction_reference(0.1, 0.1, 1 / 1.1) == pytest.approx(0.6155, abs=5e-5)


def test_seesaw_takes_61_55_percent_of_cosine_steps():
    total, base_batch = 10**10, 4096  # fine granularity: micro_batch 1, large base batch
    cosine = Cosine(PEAK, total, total // 10, 0.1)
    seesaw = Seesaw(cosine, base_batch, ratio=1 / 1.1)
    fraction = (count_optimizer_steps(seesaw, seq_len=1)
                / count_optimizer_steps(ConstantBatch(cosine, base_batch), seq_len=1))
    assert fraction == pytest.approx(0.6155, rel=0.005)
    assert seesaw.batches[-1] / base_batch == pytest.approx(1.1**24, rel=1e-3)  # ~9.85x


def test_milestones_are_where_cosine_first_reaches_peak_r_k():
    total, warmup, ratio = 10**8, 10**7, 1 / 1.1
    seesaw = Seesaw(Cosine(PEAK, total, warmup, 0.1), 64, ratio=ratio)
    expected = cosine_milestone_fractions(0.1, 0.1, ratio)
    assert len(seesaw.milestones) == len(expected) == 24
    for k, (tokens, fraction) in enumerate(zip(seesaw.milestones, expected), start=1):
        assert abs(tokens - fraction * total) <= 1
        assert seesaw.lr_schedule(tokens) <= ratio**k * (1 + 1e-12) < seesaw.lr_schedule(tokens - 1)


def test_seesaw_lr_times_sqrt_r_and_batch_over_r_between_milestones():
    cosine = Cosine(PEAK, 10**6, 10**5, 0.06)  # k_max = 4 at ratio 1/2
    seesaw = Seesaw(cosine, 64, ratio=0.5, micro_batch=4, dp_size=2)
    assert seesaw.lr(5 * 10**4) == cosine(5 * 10**4) and seesaw.batch_size(0) == 64  # warmup
    bounds = [10**5, *seesaw.milestones, 10**6]
    assert len(bounds) == 6
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for t in (start, (start + end) // 2, end - 1):
            assert seesaw.lr(t) == pytest.approx(PEAK * 0.5 ** (k / 2), rel=1e-12)
            assert seesaw.batch_size(t) == 64 * 2**k


def test_max_batch_size_cap_hands_the_whole_factor_to_the_lr():
    cosine = Cosine(PEAK, 10**6, 10**5, 0.015)  # 6 milestones at ratio 1/2
    capped = Seesaw(cosine, 64, ratio=0.5, max_batch_size=256)
    after = [capped.milestones[k] for k in range(6)]
    assert [capped.batch_size(t) for t in after] == [128, 256, 256, 256, 256, 256]
    expected_lr = [2**-0.5, 0.5, 0.25, 0.125, 0.0625, 0.03125]  # sqrt(r), sqrt(r), then r each
    assert [capped.lr(t) for t in after] == pytest.approx(expected_lr, rel=1e-12)
    # final = r^4 exactly: the 4th milestone would fall on the last token, a phase of length 0
    assert len(Seesaw(Cosine(PEAK, 10**6, 10**5, 1 / 16), 64, ratio=0.5).milestones) == 3
    # a cap between two sizes: the batch grows to the cap and the LR takes the rest of r
    partial = Seesaw(cosine, 64, ratio=0.5, max_batch_size=192)
    assert partial.batch_size(after[1]) == 192
    assert partial.lr(after[1]) == pytest.approx(0.25 * math.sqrt(192 / 64), rel=1e-12)


def test_granularity_rounds_the_ramp_away():
    # docs/papers.md: schedules: r = 1/1.1, batch 16 in micro-batches of 16 cannot grow before milestone 8
    cosine = Cosine(PEAK, 10**8, 10**7, 0.1)
    coarse = Seesaw(cosine, 16, ratio=1 / 1.1, micro_batch=16)
    assert coarse.batches[:9] == [16] * 8 + [32]
    assert [16 * 1.1**k // 16 * 16 for k in range(9)] == [16] * 8 + [32]  # the paper's claim
    # while the batch is held the LR falls like the base schedule's steps, peak * r^k
    for k in range(1, 8):
        assert coarse.lr(coarse.milestones[k - 1]) == pytest.approx((1 / 1.1) ** k, rel=1e-12)
    # when the batch catches up (16 -> 32 at milestone 8) the LR rises by sqrt(2) * r: the
    # effective LR, lr * sqrt(B_0 / B), still falls by exactly r at every milestone
    for k, t in enumerate(coarse.milestones, start=1):
        effective = coarse.lr(t) * math.sqrt(16 / coarse.batch_size(t))
        assert effective == pytest.approx((1 / 1.1) ** k, rel=1e-12)
    assert coarse.lrs[8] > coarse.lrs[7]
    table = coarse.phases(seq_len=1)
    assert "milestone 7 (batch held)" in [row.label for row in table]
    fine = Seesaw(cosine, 16, ratio=1 / 1.1, micro_batch=1)
    assert fine.batches[1] == 17
    assert count_optimizer_steps(coarse, 1) > count_optimizer_steps(fine, 1)


def test_family_alpha_beta():
    cosine = Cosine(PEAK, 10**6, 10**5, 0.015)
    alpha, beta = 2 / math.sqrt(1.5), 1.5  # alpha * sqrt(beta) = 2 = 1/ratio, alpha > sqrt(beta)
    family = SeesawFamily(cosine, 64, alpha=alpha, beta=beta)
    assert family.ratio == pytest.approx(0.5)
    assert len(family.milestones) == 6
    for k, t in enumerate(family.milestones, start=1):
        assert family.batch_size(t) == 64 * 1.5**k  # 96, 144, 216, 324, 486, 729
        assert family.lr(t) == pytest.approx(alpha**-k, rel=1e-12)
    # the boundary alpha = sqrt(beta) is Seesaw
    boundary = SeesawFamily(cosine, 64, alpha=math.sqrt(2), beta=2)
    seesaw = Seesaw(cosine, 64, ratio=0.5)
    assert boundary.batches == seesaw.batches
    assert boundary.lrs == pytest.approx(seesaw.lrs, rel=1e-12)
    with pytest.raises(ValueError, match=r"alpha=1 < sqrt\(beta\)=2"):
        SeesawFamily(cosine, 64, alpha=1, beta=4)


def test_smith_holds_the_lr_and_grows_the_batch():
    cosine = Cosine(PEAK, 10**6, 10**5, 0.06)
    smith = SmithRamp(cosine, 32, ratio=0.5, max_batch_size=128)
    after = smith.milestones
    assert [smith.batch_size(t) for t in after] == [64, 128, 128, 128]
    assert [smith.lr(t) for t in after] == pytest.approx([1.0, 1.0, 0.5, 0.25])  # cap: LR * r


@pytest.mark.parametrize("make, argument", [
    (lambda c: Seesaw(c, 64, ratio=1.5), "ratio=1.5"),
    (lambda c: Seesaw(c, 64, ratio=0), "ratio=0"),
    (lambda c: Seesaw(Cosine(PEAK, 1000, 100, 0.0), 64), "final_lr"),
    (lambda c: Seesaw(c, 60, micro_batch=8), "batch_size=60"),
    (lambda c: Seesaw(c, 64, max_batch_size=32), "max_batch_size=32"),
    (lambda c: Seesaw(c, 64, max_batch_size=100, micro_batch=8), "max_batch_size=100"),
    (lambda c: Seesaw(c, 64).lr(-1), "tokens=-1"),
    (lambda c: Seesaw(c, 64).observe_noise_scale(10, 5.0), "noise_scale_multiple"),
])
def test_bad_input_names_the_argument(make, argument):
    with pytest.raises(ValueError, match=argument):
        make(Cosine(PEAK, 1000, 100, 0.1))


@pytest.mark.parametrize("make", [
    lambda c, r: Seesaw(c, 64, ratio=r), lambda c, r: SmithRamp(c, 64, ratio=r)])
def test_a_ratio_near_1_is_refused_before_its_milestones_are_searched(make):
    """k_max = floor(log(final_lr) / log(r)) grows without bound as r -> 1 (r = 1/1.0001 gave a
    23,027-row table); more than 1000 milestones are refused with the largest ratio that fits."""
    cosine = Cosine(PEAK, 10**6, 10**5, 0.1)
    largest = 0.1 ** (1 / 1000)  # k_max = 1000 exactly
    for ratio in (0.999, 1 / 1.0001):
        k_max = math.floor(math.log(0.1) / math.log(ratio))
        assert k_max > 1000
        with pytest.raises(ValueError) as err:
            make(cosine, ratio)
        message = str(err.value)
        assert f"ratio={ratio!r} gives {k_max:,} milestones" in message and "1,000 allowed" in message
        bound = float(message.split("use ratio in (0.1, ")[1].split("]")[0])
        assert largest - 1e-6 <= bound <= largest and "\n" not in message
    at_the_limit = make(Cosine(PEAK, 10**8, 10**7, 0.1), 0.9977)  # 0.1 ** (1/1000) = 0.99770006
    assert len(at_the_limit.milestones) == len(cosine_milestone_fractions(0.1, 0.1, 0.9977)) == 999


@pytest.mark.parametrize("ratio, fragment", [
    (1e-9, "is at or below final_lr=0.1"), (0.05, "is at or below final_lr=0.1"),
    (0.1, "is at or below final_lr=0.1"),  # reached only at the last token
])
@pytest.mark.parametrize("total", [10**6, 10**10])
def test_a_ratio_that_leaves_no_milestone_is_refused(ratio, fragment, total):
    """A ratio at or below final_lr leaves k_max < 1 (or its milestone on the last token): the
    schedule would silently be the base schedule. At a 1e10 budget ratio = final_lr was accepted:
    the cosine's flat end fell within the search's tolerance 1,909 tokens before the last one."""
    cosine = Cosine(PEAK, total, total // 10, 0.1)
    assert math.floor(math.log(0.1) / math.log(ratio) + 1e-9) <= 1
    with pytest.raises(ValueError, match=re.escape(f"ratio={ratio!r}")) as err:
        Seesaw(cosine, 64, ratio=ratio)
    assert fragment in str(err.value) and "use ratio in (0.1, 0.9977]" in str(err.value)


@pytest.mark.parametrize("total", [10**6, 10**10])
def test_a_milestone_at_the_base_end_lr_is_dropped_at_any_budget(total):
    """ratio = sqrt(final_lr): its second milestone's LR is the base's end LR, reached at the last
    token; one milestone at every budget (two at 1e10 before, the second 1,909 tokens from the end)."""
    ratio = math.sqrt(0.1)
    seesaw = Seesaw(Cosine(PEAK, total, total // 10, 0.1), 64, ratio=ratio)
    assert len(seesaw.milestones) == 1
    assert seesaw.milestones[0] / total == pytest.approx(cosine_milestone_fractions(0.1, 0.1, ratio)[0], abs=1e-5)


def test_seesaw_family_names_its_ratio_when_it_is_near_1():
    with pytest.raises(ValueError, match=re.escape("1/(alpha*sqrt(beta))=")) as err:
        SeesawFamily(Cosine(PEAK, 10**6, 10**5, 0.1), 64, alpha=1.0001, beta=1.0)
    assert "23,027 milestones" in str(err.value)  # floor(log(0.1) / log(1/1.0001))


@pytest.mark.parametrize("make, message", [
    (lambda c: Seesaw(c, 64, ratio="0.5"), "ratio='0.5' is a str, not a number; pass a number, e.g. ratio=0.5"),
    (lambda c: SmithRamp(c, 64, ratio="1/2"), "ratio='1/2' is a str, not a number"),
    (lambda c: SeesawFamily(c, 64, alpha="2", beta=2.0), "alpha='2' is a str, not a number"),
    (lambda c: Seesaw(c, 64, noise_scale_multiple="2"), "noise_scale_multiple='2' is a str"),
])
def test_a_string_argument_is_a_type_error_naming_it(make, message):
    with pytest.raises(TypeError) as err:
        make(Cosine(PEAK, 1000, 100, 0.1))
    assert str(err.value).startswith(message)


def run(schedule, seq_len, start, stop, noise_scale_at=None, trace=None):
    """Train-loop stand-in: step through tokens, feeding a B_simple estimate every step."""
    tokens = start
    while tokens < stop:
        if noise_scale_at is not None:
            schedule.observe_noise_scale(tokens, noise_scale_at(tokens))
        trace.append((tokens, schedule.lr(tokens), schedule.batch_size(tokens)))
        tokens += schedule.batch_size(tokens) * seq_len
    return tokens


def test_adaptive_cap_is_deterministic_and_resumes_exactly():
    def build():
        return Seesaw(Cosine(PEAK, 2 * 10**6, 2 * 10**5, 1 / 64), 8, ratio=0.5,
                      noise_scale_multiple=2.0)

    def b_simple(tokens):  # a noise scale that grows during training, as measured ones do
        return 10.0 + 40.0 * tokens / 2e6

    full = []
    run(build(), 16, 0, 2 * 10**6, b_simple, full)
    first, resumed_trace = build(), []
    tokens = run(first, 16, 0, 10**6, b_simple, resumed_trace)
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = pickle.loads(pickle.dumps(build()))  # the schedule object itself pickles too
    resumed.load_state_dict(saved)
    run(resumed, 16, tokens, 2 * 10**6, b_simple, resumed_trace)
    assert resumed_trace == full
    assert len(first.noise_cap_log) <= len(first.milestones) + 1  # coalesced, not one per step
    # at each milestone the batch is the ideal 8 * 2^k held at 2 * B_simple(milestone) rounded down
    resumed_batches = resumed.batches
    for k, t in enumerate(resumed.milestones, start=1):
        cap = 2.0 * b_simple(max(s for s, _, _ in full if s < t))
        assert resumed_batches[k] == max(resumed_batches[k - 1], min(8 * 2**k, math.floor(cap)))
    assert resumed_batches[-1] < 8 * 2 ** len(resumed.milestones)  # the cap did bind
    # an observation only changes milestones after its token count
    before = [(resumed.lr(t), resumed.batch_size(t)) for t in range(0, 2 * 10**6, 9973)]
    resumed.observe_noise_scale(2 * 10**6, 1.0)
    assert [(resumed.lr(t), resumed.batch_size(t)) for t in range(0, 2 * 10**6, 9973)] == before
    with pytest.raises(ValueError, match="tokens=5"):
        resumed.observe_noise_scale(5, 1.0)


def test_an_observation_at_a_milestone_leaves_the_batch_its_step_used():
    """The trainer observes B_simple at the token its step started from. When that step started on a
    milestone it ran with the milestone's batch, which must not change under it (the batch shrank
    from 32 to 16 there, and the realised schedule no longer said what had run); the observation
    caps the milestones after it."""
    schedule = Seesaw(Cosine(PEAK, 1000, 100, 0.1), 8, ratio=0.5, noise_scale_multiple=1.0)
    assert schedule.milestones == [582, 760, 905]  # bisected from the cosine, as find_milestones does
    schedule.observe_noise_scale(0, 1000.0)  # no cap binds
    assert [schedule.batch_size(t) for t in (582, 760, 905)] == [16, 32, 64]
    schedule.observe_noise_scale(760, 20.0)  # made by the step that started at 760 with batch 32
    assert schedule.batch_size(760) == 32 and schedule.batch_size(800) == 32
    assert schedule.batch_size(905) == 32  # held at the cap, rounded down to a whole batch
    assert schedule.lr(905) == pytest.approx(PEAK * 0.5**3 * (32 / 8) ** 0.5)  # the LR takes the whole r


def test_load_state_rejects_a_different_seesaw():
    cosine = Cosine(PEAK, 1000, 100, 0.1)
    with pytest.raises(ValueError, match="ratio=0.5"):
        Seesaw(cosine, 64, ratio=0.8).load_state_dict(Seesaw(cosine, 64, ratio=0.5).state_dict())
    with pytest.raises(ValueError, match="kind='Seesaw'"):
        SmithRamp(cosine, 64).load_state_dict(Seesaw(cosine, 64).state_dict())


def test_seesaw_on_a_wsd_base_places_milestones_in_the_cooldown():
    from largebatch.schedules import WSD

    total, final, ratio = 10**7, 0.1, 0.5
    wsd = WSD(PEAK, total, 10**6, final, cooldown_fraction=0.2, shape="linear")
    seesaw = Seesaw(wsd, 32, ratio=ratio)
    # linear cooldown over [0.8 T, T]: peak * (1 - s (1 - f)) = r^k  =>  s = (1 - r^k) / (1 - f)
    expected = [0.8 * total + 0.2 * total * (1 - ratio**k) / (1 - final) for k in (1, 2, 3)]
    assert len(seesaw.milestones) == 3
    for tokens, reference in zip(seesaw.milestones, expected):
        assert abs(tokens - reference) <= 1
    assert seesaw.lr(5 * 10**6) == PEAK and seesaw.batch_size(5 * 10**6) == 32  # stable phase


def test_a_state_saved_with_an_absolute_final_lr_still_loads():
    # states written before final_lr became a fraction of peak_lr lack "final_lr_of" and hold the
    # absolute end LR (what the old code stored: fraction * peak)
    from largebatch.schedules.lr import lr_schedule_from_state

    seesaw = Seesaw(Cosine(6e-3, 10**6, 10**5, 0.1), 64, ratio=0.5)
    old = seesaw.state_dict()
    old_lr = {k: v for k, v in old["config"]["lr_schedule"].items() if k != "final_lr_of"}
    old["config"]["lr_schedule"] = {**old_lr, "final_lr": 0.1 * 6e-3}
    seesaw.load_state_dict(old)
    assert lr_schedule_from_state(old["config"]["lr_schedule"]).final_lr == pytest.approx(0.1)
    old["config"]["lr_schedule"] = {**old_lr, "final_lr": 0.2 * 6e-3}  # a different schedule
    with pytest.raises(ValueError, match="checkpoint schedule has lr_schedule="):
        seesaw.load_state_dict(old)


def test_seesaw_on_an_inverse_sqrt_base_cuts_where_its_lr_crosses_each_level():
    """InverseSqrt has no final_lr: its end is peak * sqrt(W / T). Milestone k is where
    peak * sqrt(W / t) = peak * r^k, t_k = W * r^(-2k), for every k the budget reaches (it was
    refused for a final_lr of 0)."""
    from largebatch.schedules import InverseSqrt, find_milestones

    warmup, total, r = 10_000, 1_000_000, 0.5
    base = InverseSqrt(3e-4, total, warmup)
    assert base.end_lr == pytest.approx(3e-4 * math.sqrt(warmup / total), rel=1e-12)
    expected = [warmup * r ** (-2 * k) for k in range(1, 10) if warmup * r ** (-2 * k) < total]
    assert len(expected) == 3
    assert find_milestones(base, r) == pytest.approx(expected, abs=1)
    schedule = Seesaw(base, batch_size=8, ratio=r)
    assert [schedule.batch_size(t + 1) for t in expected] == [16, 32, 64]
    assert [schedule.lr(t + 1) for t in expected] == pytest.approx([3e-4 * math.sqrt(r) ** k for k in (1, 2, 3)])


@pytest.mark.parametrize("make, message", [
    (lambda: Cosine(PEAK, 10**6, 1000, 1.0), "base Cosine has final_lr=1.0: it ends at its peak LR and never "
     "falls, so there is no milestone to place; set final_lr below 1, e.g. 0.1"),
    (lambda: WarmupHoldPolynomial(PEAK, 10**6, 1000, 0.0), "base WarmupHoldPolynomial (LANS) decays to 0 and "
     "takes no other final_lr: milestones are placed down to the base's end LR, so they would never end; use a "
     "base that ends above 0: Cosine, LinearDecay or WSD with final_lr in (0, 1), e.g. 0.1, or InverseSqrt "
     "with total_tokens"),
    (lambda: InverseSqrt(PEAK, None, 1000), "base InverseSqrt has total_tokens=None: milestones are placed down "
     "to its LR at the end of a token budget, and it has none; give it total_tokens (the run's budget)"),
    (lambda: Constant(PEAK, 10**6, 1000), "base Constant: its LR never falls, so there is no milestone to place"),
    (lambda: Constant(PEAK, 10**6, 1000, 0.1), "base Constant: its LR never falls"),
    (lambda: Cosine(PEAK, 10**6, 1000, 0.0), "base Cosine has final_lr=0.0: it ends at LR 0"),
])
def test_a_base_without_milestones_is_refused_with_its_cause_and_a_fix_that_works(make, message):
    """final_lr=1 was blamed on the ratio with the empty range "(1, 1]"; LANS, Constant and a budget-less
    InverseSqrt were told "set final_lr, e.g. 0.1", which LANS refuses, Constant ignores and InverseSqrt
    does not read. Each fix named is checked to be accepted."""
    with pytest.raises(ValueError) as err:
        Seesaw(make(), 8, 0.5)
    assert str(err.value).startswith(message)
    fixed = {"Cosine": Cosine(PEAK, 10**6, 1000, 0.1), "InverseSqrt": InverseSqrt(PEAK, 10**6, 1000)}
    for base in fixed.values():
        assert len(Seesaw(base, 8, 0.5).milestones) >= 1


def test_observe_noise_scale_names_a_string_b_simple():
    """observe_noise_scale(0, "5") raised TypeError("must be real number, not str")."""
    schedule = Seesaw(Cosine(PEAK, 10**6, 10**5, 0.1), 8, 0.5, noise_scale_multiple=1.0)
    with pytest.raises(TypeError, match=re.escape("b_simple='5' is a str, not a number; pass a number, "
                                                  "e.g. b_simple=5")):
        schedule.observe_noise_scale(0, "5")
    schedule.observe_noise_scale(0, 3.0)
    assert schedule.noise_cap_log == [(0, 3.0)]
