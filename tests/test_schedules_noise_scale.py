"""NoiseScale recovers B_simple = tr(Sigma) / |G|^2 of a synthetic problem (McCandlish et al.
2018, App. A.1; docs/papers.md: schedules): per-sample gradients drawn from a known mean and covariance."""

import pickle

import numpy as np
import pytest
import torch

from largebatch.schedules import NoiseScale


def synthetic_problem(seed, dim=32, trace=50.0):
    """True gradient G (|G| = 1) and a full covariance Sigma = A A^T with tr(Sigma) = trace."""
    rng = np.random.default_rng(seed)
    grad = rng.normal(size=dim)
    grad /= np.linalg.norm(grad)
    mixing = rng.normal(size=(dim, dim))
    mixing *= np.sqrt(trace / np.sum(mixing**2))  # tr(A A^T) = sum of squares of A
    return rng, grad, mixing


def feed(estimator, rng, grad, mixing, steps, small, big):
    for _ in range(steps):
        per_sample = grad + rng.normal(size=(big, grad.size)) @ mixing.T  # (big, dim)
        small_mean = per_sample[:small].mean(axis=0)  # one micro-batch
        big_mean = per_sample.mean(axis=0)  # the accumulated step
        estimator.update(small_mean @ small_mean, small, big_mean @ big_mean, big)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_trace_over_grad_sq_within_10_percent(seed):
    rng, grad, mixing = synthetic_problem(seed)
    true_b_simple = np.trace(mixing @ mixing.T) / (grad @ grad)  # = 50 by construction
    estimator = NoiseScale(ema_decay=0.999)
    assert estimator.b_simple is None  # undefined before any data
    feed(estimator, rng, grad, mixing, steps=3000, small=4, big=64)
    assert estimator.b_simple == pytest.approx(true_b_simple, rel=0.10)
    assert estimator.trace_covariance == pytest.approx(np.trace(mixing @ mixing.T), rel=0.10)
    assert estimator.grad_sq_norm == pytest.approx(grad @ grad, rel=0.10)


def test_single_update_matches_the_two_batch_formulas():
    estimator = NoiseScale(ema_decay=0.9)
    small_sq, big_sq, small, big = torch.tensor(3.0), torch.tensor(1.2), 2, 8  # tensors accepted
    estimator.update(small_sq, small, big_sq, big)
    grad_sq = (8 * 1.2 - 2 * 3.0) / (8 - 2)
    trace = (3.0 - 1.2) / (1 / 2 - 1 / 8)
    assert estimator.grad_sq_norm == pytest.approx(grad_sq)  # bias-corrected EMA of one value
    assert estimator.trace_covariance == pytest.approx(trace)
    assert estimator.b_simple == pytest.approx(trace / grad_sq)


def test_state_round_trip_continues_identically():
    rng, grad, mixing = synthetic_problem(3)
    first = NoiseScale(0.95)
    feed(first, rng, grad, mixing, steps=50, small=4, big=32)
    resumed = NoiseScale(0.95)
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    state = np.random.default_rng(7).bit_generator.state
    for estimator in (first, resumed):
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        feed(estimator, rng, grad, mixing, steps=20, small=4, big=32)
    assert resumed.state_dict() == first.state_dict()
    with pytest.raises(ValueError, match="ema_decay=0.95"):
        NoiseScale(0.9).load_state_dict(first.state_dict())


@pytest.mark.parametrize("args, argument", [
    ((1.0, 8, 0.5, 8), "small_batch=8"),
    ((1.0, 0, 0.5, 8), "small_batch=0"),
    ((-1.0, 1, 0.5, 8), "small_sq_norm=-1.0"),
    ((1.0, 1, float("nan"), 8), "big_sq_norm=nan"),
])
def test_bad_input_names_the_argument(args, argument):
    with pytest.raises(ValueError, match=argument):
        NoiseScale().update(*args)
    with pytest.raises(ValueError, match="ema_decay=1.0"):
        NoiseScale(ema_decay=1.0)


def test_b_simple_undefined_while_grad_estimate_is_not_positive():
    estimator = NoiseScale(0.0)
    estimator.update(1.0, 1, 1.0, 2)  # no drop with batch: tr(Sigma) estimate 0
    assert estimator.b_simple is None


@pytest.mark.parametrize("make, message", [
    (lambda: NoiseScale("0.9"), "ema_decay='0.9' is a str, not a number; pass a number, e.g. ema_decay=0.9"),
    (lambda: NoiseScale().update("1", 1, 0.5, 2), "small_sq_norm='1' is a str, not a number"),
    (lambda: NoiseScale().update(1.0, 1, "0.5", 2), "big_sq_norm='0.5' is a str, not a number"),
])
def test_a_string_argument_is_a_type_error_naming_it(make, message):
    """NoiseScale("0.9") raised "'<=' not supported between instances of 'int' and 'str'", and update()
    parsed strings as numbers (float("1"))."""
    with pytest.raises(TypeError) as err:
        make()
    assert str(err.value).startswith(message)
    # a 0-d tensor and a numpy scalar stay numbers: |G|^2 = (2 * 0.75 - 1) / 1, tr = 0.25 / (1 - 1/2)
    assert NoiseScale().update(torch.tensor(1.0), 1, np.float64(0.75), 2) == pytest.approx(0.5 / 0.5)


def test_a_state_without_its_fields_is_named():
    """(It raised a bare KeyError('ema_decay').)"""
    with pytest.raises(ValueError, match=r"noise-scale state=\{'updates': 3\} lacks ema_decay, "
                                         r"ema_trace_covariance, ema_grad_sq_norm: it is not a NoiseScale"):
        NoiseScale().load_state_dict({"updates": 3})
