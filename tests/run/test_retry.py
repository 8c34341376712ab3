"""Retry policy: exponential backoff with equal jitter, capped; attempts are counted from 1."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.run.retry import RetryPolicy

FAST = settings(max_examples=200, deadline=None)


class _FixedRandom(random.Random):
    """A Random whose ``random()`` is a chosen value, to pin the jitter to its ends."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [
        (1, 0.25, 0.5),
        (2, 0.5, 1.0),
        (3, 1.0, 2.0),
        (6, 8.0, 16.0),
        (7, 15.0, 30.0),
        (50, 15.0, 30.0),
    ],
)
def test_delay_doubles_then_caps(attempt: int, low: float, high: float) -> None:
    policy = RetryPolicy(max_attempts=100, base=0.5, cap=30.0)
    assert policy.delay(attempt, _FixedRandom(0.0)) == low
    assert policy.delay(attempt, _FixedRandom(0.999999)) == pytest.approx(high, rel=1e-5)
    assert policy.delay(attempt, _FixedRandom(0.5)) == pytest.approx((low + high) / 2)


@FAST
@given(
    attempt=st.integers(1, 1000),
    base=st.floats(0, 100),
    cap=st.floats(0, 1000),
    seed=st.integers(0, 2**32),
)
def test_delay_stays_within_half_and_whole_ceiling(
    attempt: int, base: float, cap: float, seed: int
) -> None:
    policy = RetryPolicy(max_attempts=5, base=base, cap=cap)
    ceiling = min(cap, base * 2.0 ** (attempt - 1))
    d = policy.delay(attempt, random.Random(seed))
    assert ceiling / 2 <= d <= ceiling
    assert d <= cap


def test_delay_is_reproducible_with_a_seeded_rng() -> None:
    policy = RetryPolicy(max_attempts=5, base=1.0, cap=60.0)
    a = [policy.delay(n, random.Random(42)) for n in range(1, 6)]
    b = [policy.delay(n, random.Random(42)) for n in range(1, 6)]
    assert a == b


def test_delay_without_an_rng_uses_the_module_random() -> None:
    policy = RetryPolicy(max_attempts=5, base=2.0, cap=60.0)
    delays = {policy.delay(3) for _ in range(50)}
    assert all(4.0 <= d <= 8.0 for d in delays)
    assert len(delays) > 1  # jittered, so workers failing together spread out


def test_zero_base_means_no_wait() -> None:
    assert RetryPolicy(max_attempts=3, base=0.0, cap=30.0).delay(2) == 0.0


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempts_start_at_one(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt numbers start at 1"):
        RetryPolicy(max_attempts=3, base=1.0, cap=2.0).delay(attempt)


def test_delay_of_a_very_late_attempt_is_the_cap() -> None:
    policy = RetryPolicy(max_attempts=5000, base=0.5, cap=30.0)
    assert 15.0 <= policy.delay(2000) <= 30.0


def test_exhausted() -> None:
    policy = RetryPolicy(max_attempts=3, base=1.0, cap=2.0)
    assert [policy.exhausted(n) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert RetryPolicy(max_attempts=1, base=1.0, cap=2.0).exhausted(1)
