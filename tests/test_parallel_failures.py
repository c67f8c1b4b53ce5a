"""A failing or stuck rank ends a real 2-rank gloo job with a message naming it; nothing hangs."""

from __future__ import annotations

import time

import pytest

import parallel_cases as cases
from largebatch.parallel import RankFailure, spawn


def test_failing_rank_is_named_and_the_job_ends():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(cases.fail_on_rank_one, 2)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed first")
    assert "rank 1/2 (dp 1/2, tp 0/1)" in message and "injected failure while loading a batch" in message
    assert time.monotonic() - start < 40  # far below the 60 s collective timeout: no waiting on the dead


def test_stuck_rank_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(cases.stuck_rank_one, 2)
    message = str(info.value)
    assert "rank 0/2 (dp 0/2, tp 0/1)" in message
    assert "another rank died or is stuck" in message
    assert time.monotonic() - start < 40  # the 3 s timeout fired; rank 1 would sleep 60 s
