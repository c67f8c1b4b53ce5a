"""TokenLR (a torch LRScheduler on the token clock) and the plain-loop step plan, against float64
formulas written here: warmup + cosine, WSD, and Seesaw's milestones on a cosine base."""

import io
import math
import random

import pytest
import torch

from largebatch.optim import LAMB
from largebatch.schedules import WSD, ConstantBatch, Cosine, Seesaw, TokenLR, count_optimizer_steps

PEAK, TOTAL, WARMUP, FRACTION = 2e-3, 200_000, 20_000, 0.1
SEQ, BATCH = 64, 8
TOKENS_PER_STEP = SEQ * BATCH


def cosine_ref(t):
    """Linear warmup from 0, then cosine from PEAK to FRACTION * PEAK, held past TOTAL."""
    if t < WARMUP:
        return PEAK * t / WARMUP
    s = min(1.0, (t - WARMUP) / (TOTAL - WARMUP))
    final = FRACTION * PEAK
    return final + (PEAK - final) * (1 + math.cos(math.pi * s)) / 2


def wsd_ref(t, cooldown=0.2):
    """Warmup, PEAK, then a linear cooldown to FRACTION * PEAK over the last 20% of tokens."""
    start = TOTAL * (1 - cooldown)
    if t < WARMUP:
        return PEAK * t / WARMUP
    if t < start:
        return PEAK
    return PEAK + (FRACTION * PEAK - PEAK) * min(1.0, (t - start) / (TOTAL - start))


def two_groups(scale=0.1):
    """An optimizer with a group at the peak LR and one at ``scale`` x peak."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": scale * PEAK}], lr=PEAK)


def run(scheduler, optimizer, steps, tokens=None):
    """LRs of every group at each step (read from the optimizer, as the step uses them)."""
    seen = []
    for k in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step() if tokens is None else scheduler.step(tokens=tokens[k])
    return seen


@pytest.mark.parametrize("schedule, reference", [
    (Cosine(PEAK, TOTAL, WARMUP, FRACTION), cosine_ref),
    (WSD(PEAK, TOTAL, WARMUP, FRACTION, cooldown_fraction=0.2), wsd_ref)])
def test_equals_the_formula_at_every_step_and_groups_are_multipliers(schedule, reference):
    optimizer = two_groups(0.1)
    scheduler = TokenLR(optimizer, schedule, tokens_per_step=TOKENS_PER_STEP)
    steps = TOTAL // TOKENS_PER_STEP + 20  # past the budget: held at the end
    for k, (lr_peak, lr_tenth) in enumerate(run(scheduler, optimizer, steps)):
        expected = reference(k * TOKENS_PER_STEP)
        assert lr_peak == pytest.approx(expected, rel=1e-12, abs=1e-18), k
        assert lr_tenth == pytest.approx(0.1 * expected, rel=1e-12, abs=1e-18), k
    assert scheduler.tokens_seen == steps * TOKENS_PER_STEP
    assert scheduler.get_last_lr()[0] == optimizer.param_groups[0]["lr"]


def test_varying_tokens_per_step_keeps_the_clock():
    optimizer = two_groups()
    scheduler = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION))  # tokens each step
    rng = random.Random(0)
    tokens = [rng.choice([1, 2, 4, 8]) * SEQ for _ in range(300)]
    clock = 0
    for k, (lr, _) in enumerate(run(scheduler, optimizer, 300, tokens)):
        assert lr == pytest.approx(cosine_ref(clock), rel=1e-12, abs=1e-18), k
        clock += tokens[k]
    with pytest.raises(ValueError, match=r"tokens_per_step=None: call step\(tokens=...\)"):
        scheduler.step()


def test_state_dict_resumes_identically():
    torch.manual_seed(0)

    def fresh():
        model = torch.nn.Linear(4, 4)
        optimizer = LAMB(model.parameters(), lr=PEAK, weight_decay=0.01)
        return model, optimizer, TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION),
                                         tokens_per_step=TOKENS_PER_STEP)

    def train(model, optimizer, scheduler, steps, seed):
        gen, lrs = torch.Generator().manual_seed(seed), []
        for _ in range(steps):
            model(torch.randn(2, 4, generator=gen)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
        return lrs

    model, optimizer, scheduler = fresh()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    straight = train(model, optimizer, scheduler, 40, 1) + train(model, optimizer, scheduler, 40, 2)
    straight_weights = model.state_dict()

    model, optimizer, scheduler = fresh()
    model.load_state_dict(start)
    first = train(model, optimizer, scheduler, 40, 1)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain data only
    model, optimizer, scheduler = fresh()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    assert scheduler.tokens_seen == 40 * TOKENS_PER_STEP
    assert first + train(model, optimizer, scheduler, 40, 2) == straight
    for name, value in model.state_dict().items():
        assert torch.equal(value, straight_weights[name]), name

    other = TokenLR(two_groups(), Cosine(PEAK, TOTAL, WARMUP, 0.2), tokens_per_step=64)
    with pytest.raises(ValueError, match="does not match this one"):
        other.load_state_dict(saved["scheduler"])


def test_chained_with_a_torch_scheduler_multiplies():
    optimizer = two_groups()
    gamma = 0.97
    token_lr = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)
    exponential = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
    chained = torch.optim.lr_scheduler.ChainedScheduler([token_lr, exponential])
    for k, (lr, lr_tenth) in enumerate(run(chained, optimizer, 120)):
        expected = cosine_ref(k * TOKENS_PER_STEP) * gamma**k
        assert lr == pytest.approx(expected, rel=1e-9, abs=1e-18), k
        assert lr_tenth == pytest.approx(0.1 * expected, rel=1e-9, abs=1e-18), k


def test_sequential_hands_over_with_a_fresh_clock():
    # torch's LinearLR warms up for 5 steps, then a cosine without warmup runs on its own clock
    optimizer = two_groups()
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=5)
    cosine = TokenLR(optimizer, Cosine(PEAK, TOTAL, 0, FRACTION), TOKENS_PER_STEP)
    sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])
    lrs = [lr for lr, _ in run(sequential, optimizer, 60)]
    for k in range(5):
        assert lrs[k] == pytest.approx(PEAK * (0.2 + 0.8 * k / 5), rel=1e-12)
    for k in range(5, 60):
        s = (k - 5) * TOKENS_PER_STEP / TOTAL
        expected = FRACTION * PEAK + (1 - FRACTION) * PEAK * (1 + math.cos(math.pi * s)) / 2
        assert lrs[k] == pytest.approx(expected, rel=1e-12), k


def seesaw_batch_ref(tokens, batch0, ratio, fraction):
    """Batch B0 / r^k after the k milestones at or before ``tokens``; milestone k solves
    final + (peak - final) (1 + cos(pi s)) / 2 = peak r^k on the cosine base (float64)."""
    k_max = math.floor(math.log(fraction) / math.log(ratio) + 1e-9)
    passed = 0
    for k in range(1, k_max + 1):
        s = math.acos(2 * (ratio**k - fraction) / (1 - fraction) - 1) / math.pi
        if WARMUP + s * (TOTAL - WARMUP) <= tokens:
            passed = k
    return round(batch0 / ratio**passed)


def test_seesaw_from_a_plain_loop():
    # the plan a loop follows: batch grows at the closed-form milestones, micro-batches of 2
    seesaw = Seesaw(Cosine(PEAK, TOTAL, WARMUP, 0.1), batch_size=4, ratio=0.5, micro_batch=2)
    optimizer = two_groups()
    scheduler = TokenLR(optimizer, seesaw)
    plans = list(seesaw.steps(SEQ))
    assert len(plans) == count_optimizer_steps(seesaw, SEQ)
    # 4 -> 8 -> 16 -> 32 over 3 milestones; the last step takes only what the budget still needs
    last = plans[-1]
    assert seesaw.batch_size(last.tokens_seen) == 32
    assert last.batch_size == min(32, -(-(TOTAL - last.tokens_seen) // SEQ))
    assert sum(p.tokens for p in plans) == -(-TOTAL // SEQ) * SEQ
    clock = 0
    for plan in plans:
        assert plan.tokens_seen == clock and plan.tokens == plan.batch_size * SEQ
        milestone_near = any(abs(clock - m) <= plan.tokens for m in seesaw.milestones)
        if not milestone_near:  # a step that straddles a milestone may round either way
            needed = -(-(TOTAL - clock) // SEQ)  # the budget's last step is trimmed to it
            assert plan.batch_size == min(seesaw_batch_ref(clock, 4, 0.5, 0.1), needed), clock
        assert plan.micro_batches == -(-plan.batch_size // plan.micro_batch)  # the last may be short
        assert optimizer.param_groups[0]["lr"] == plan.lr == seesaw.lr(clock)
        optimizer.step()
        scheduler.step(tokens=plan.tokens)
        clock += plan.tokens
    assert clock >= TOTAL and clock - plans[-1].tokens < TOTAL
    resumed = list(seesaw.steps(SEQ, tokens_seen=plans[10].tokens_seen))
    assert resumed == plans[10:]


def test_bad_input():
    optimizer = two_groups()
    schedule = Cosine(PEAK, TOTAL, WARMUP, FRACTION)
    with pytest.raises(ValueError, match="tokens_per_step=0 must be a positive integer"):
        TokenLR(optimizer, schedule, tokens_per_step=0)
    with pytest.raises(TypeError, match="must be an LR schedule"):
        TokenLR(optimizer, lambda t: 1.0)
    scheduler = TokenLR(optimizer, ConstantBatch(schedule, 8), 64)
    optimizer.step()
    with pytest.raises(ValueError, match=r"step\(tokens=-5\)"):
        scheduler.step(tokens=-5)


def test_loaded_state_is_a_copy_and_needs_no_optimizer_state():
    """A scheduler state loaded without the optimizer's follows the clock; the saved state, the
    scheduler it came from and the one that loaded it never share a list."""
    def fresh():
        optimizer = two_groups()
        return optimizer, TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)

    optimizer, scheduler = fresh()
    run(scheduler, optimizer, 30)
    state = scheduler.state_dict()
    snapshot = (list(state["_others"]), list(state["_written"]), list(state["base_lrs"]))
    other_optimizer, other = fresh()  # its optimizer starts at the warmup's LR of 0
    other.load_state_dict(state)  # the first step after it runs at the clock's LR, not the warmup's 0
    lrs = run(other, other_optimizer, 5) + [[g["lr"] for g in other_optimizer.param_groups]]
    for k, (lr, lr_tenth) in enumerate(lrs, start=30):
        assert lr == pytest.approx(cosine_ref(k * TOKENS_PER_STEP), rel=1e-12), k
        assert lr_tenth == pytest.approx(0.1 * cosine_ref(k * TOKENS_PER_STEP), rel=1e-12), k
    # The original goes on undisturbed, and the snapshot it gave does not change with either.
    for k, (lr, _) in enumerate(run(scheduler, optimizer, 10), start=30):
        assert lr == pytest.approx(cosine_ref(k * TOKENS_PER_STEP), rel=1e-12), k
    assert (state["_others"], state["_written"], state["base_lrs"]) == snapshot
    assert other._others is not scheduler._others and other._written is not scheduler._written


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-first", "schedulers-first"])
def test_chained_resume_keeps_the_other_schedulers_factor(optimizer_first):
    """Optimizer and both schedulers of a chain saved mid-run and loaded into fresh ones, in either
    order: the LR goes on as cosine x gamma^k, as if never stopped."""
    gamma = 0.97

    def fresh():
        optimizer = two_groups()
        token_lr = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)
        exponential = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
        return optimizer, token_lr, exponential

    optimizer, token_lr, exponential = fresh()
    run(torch.optim.lr_scheduler.ChainedScheduler([token_lr, exponential]), optimizer, 50)
    saved = (optimizer.state_dict(), token_lr.state_dict(), exponential.state_dict())
    optimizer, token_lr, exponential = fresh()
    if optimizer_first:
        optimizer.load_state_dict(saved[0])
    token_lr.load_state_dict(saved[1])
    exponential.load_state_dict(saved[2])
    if not optimizer_first:
        optimizer.load_state_dict(saved[0])
    chained = torch.optim.lr_scheduler.ChainedScheduler([token_lr, exponential])
    for k, (lr, lr_tenth) in enumerate(run(chained, optimizer, 20), start=50):
        expected = cosine_ref(k * TOKENS_PER_STEP) * gamma**k
        assert lr == pytest.approx(expected, rel=1e-9), k
        assert lr_tenth == pytest.approx(0.1 * expected, rel=1e-9), k


def test_a_group_set_to_zero_by_hand_returns_to_the_schedule():
    optimizer = two_groups()
    scheduler = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)
    run(scheduler, optimizer, 40)
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine_ref(41 * TOKENS_PER_STEP),
                                                            rel=1e-12)


def test_a_resume_with_another_step_size_counts_the_new_one():
    """A run resumed with twice the batch: the clock counts the resumed scheduler's tokens_per_step,
    not the checkpoint's (the schedule was stretched: cosine at 200k tokens where 300k were seen)."""
    optimizer = two_groups()
    scheduler = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), TOKENS_PER_STEP)
    run(scheduler, optimizer, 100)
    saved = (optimizer.state_dict(), scheduler.state_dict())
    optimizer = two_groups()
    scheduler = TokenLR(optimizer, Cosine(PEAK, TOTAL, WARMUP, FRACTION), 2 * TOKENS_PER_STEP)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert scheduler.tokens_per_step == 2 * TOKENS_PER_STEP
    for k, (lr, _) in enumerate(run(scheduler, optimizer, 50)):
        assert lr == pytest.approx(cosine_ref((100 + 2 * k) * TOKENS_PER_STEP), rel=1e-12), k


def test_last_epoch_starts_the_clock_as_torch_counts_steps():
    """torch's resume without a state dict (``last_epoch=k``, groups holding ``initial_lr``): k + 1
    steps were taken, as LambdaLR counts them -- the clock ignored it and started at 0."""
    def resumed():
        optimizer = two_groups()
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        return optimizer

    schedule = Cosine(PEAK, TOTAL, WARMUP, FRACTION)
    lambda_lr = resumed()
    torch.optim.lr_scheduler.LambdaLR(lambda_lr, lambda step: cosine_ref(step * TOKENS_PER_STEP) / PEAK,
                                      last_epoch=49)
    optimizer = resumed()
    scheduler = TokenLR(optimizer, schedule, TOKENS_PER_STEP, last_epoch=49)
    assert scheduler.tokens_seen == 50 * TOKENS_PER_STEP and scheduler.last_epoch == 50
    for ours, theirs in zip(optimizer.param_groups, lambda_lr.param_groups):
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine_ref(50 * TOKENS_PER_STEP), rel=1e-12)
    with pytest.raises(ValueError, match="last_epoch=49 with tokens_per_step=None"):
        TokenLR(resumed(), schedule, None, last_epoch=49)
    with pytest.raises(ValueError, match="last_epoch=-2 must be an integer >= -1"):
        TokenLR(two_groups(), schedule, TOKENS_PER_STEP, last_epoch=-2)


def test_an_optimizer_that_is_none_is_named():
    """``TokenLR(None, schedule)``: an AttributeError from inside; torch's schedulers refuse it first."""
    with pytest.raises(TypeError, match=r"optimizer=None is not a torch.optim.Optimizer"):
        TokenLR(None, Cosine(3e-4, 10**6, 10**5, 0.1))
