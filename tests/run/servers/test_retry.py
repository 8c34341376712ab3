"""Retry policy: exponential backoff with equal jitter, capped; attempts are counted from 1."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.dataset.manifest import Reason
from hsx_async.dataset.quarantine import attempts_reason, refused_reason
from hsx_async.run.servers.faults import Fault
from hsx_async.run.servers.retry import Attempts, Eviction, RetryPolicy

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


# -- which failures a sample pays for (issue 24) -------------------------------------------


@dataclass
class _Server:
    """A server's record, as :class:`~hsx_async.run.servers.retry.Witness` reads it."""

    requests: int = 0
    worked: int = 0
    evictions: list[Eviction] = field(default_factory=list)
    healthy: bool = True

    def send(self) -> int:
        """A request leased to the server now: its lease number."""
        self.requests += 1
        return self.requests

    def land(self, lease: int) -> None:
        """The dump of the request with lease number ``lease`` became a sample."""
        self.worked = max(self.worked, lease)

    def serve(self, n: int = 1) -> None:
        """``n`` requests sent now whose dumps became samples."""
        for _ in range(n):
            self.land(self.send())

    def evict(self) -> None:
        self.healthy = False
        self.evictions.append(Eviction(self.worked))

    def probe(self, ok: bool) -> None:
        self.evictions[-1].verdict = ok
        self.healthy = ok


POLICY = RetryPolicy(3, 0.1, 1.0)
SOFT = Fault("server", "http_5xx", "HTTP 500", reached=True)


def test_a_sample_fault_is_charged_and_a_refusal_ends_the_sample_at_once() -> None:
    tries = Attempts()
    tries.record(Fault("sample", "rejected", "HTTP 400: bad id", permanent=True), None)
    assert tries.charged == 1 and tries.exhausted(POLICY)
    assert tries.quarantine_reason() == Reason(
        refused_reason("HTTP 400: bad id"), "sample", "rejected", retriable=True
    )


def test_a_fault_that_never_reached_the_server_is_never_charged() -> None:
    tries, server = Attempts(), _Server()
    for _ in range(10):
        tries.record(Fault("server", "unreachable", "refused", evict=True), server)
        server.serve()  # even while the server works for others
        tries.settle(POLICY)
    assert (tries.failed, tries.charged, tries.suspicions) == (10, 0, [])


def test_a_suspicion_is_charged_once_the_server_works_for_another_request() -> None:
    tries, server = Attempts(), _Server()
    tries.record(SOFT, server)
    tries.settle(POLICY)
    assert tries.charged == 0 and len(tries.suspicions) == 1  # not known yet
    server.serve()
    tries.settle(POLICY)
    assert tries.charged == 1 and tries.suspicions == []


def test_a_dump_sent_before_the_failure_that_lands_after_it_proves_nothing() -> None:
    """A request in flight when the server broke was answered before it broke; its dump
    becoming a sample after the failure says nothing about the server since (CI saw a
    sample quarantined so while its server failed every request)."""
    tries, server = Attempts(), _Server()
    early = server.send()
    tries.record(SOFT, server)
    server.land(early)
    tries.settle(POLICY)
    assert tries.charged == 0 and len(tries.suspicions) == 1
    server.serve()  # a request sent after the failure: the server works
    tries.settle(POLICY)
    assert tries.charged == 1 and tries.suspicions == []


def test_a_suspicion_is_forgiven_when_the_server_is_out_and_its_probe_fails() -> None:
    tries, server = Attempts(), _Server()
    tries.record(SOFT, server)
    server.evict()
    tries.settle(POLICY)
    assert tries.suspicions  # the probe has not spoken
    server.probe(ok=False)
    server.serve(5)  # fixed later: the failure stays the server's
    tries.settle(POLICY)
    assert (tries.charged, tries.suspicions) == (0, [])


def test_a_suspicion_is_charged_when_the_first_probe_after_it_passes() -> None:
    """One worker, a sample that crashes the server: the server leaves rotation, passes
    its probe (it works for another request) — so the failures were the sample's."""
    tries, server = Attempts(), _Server()
    for _ in range(3):
        tries.record(SOFT, server)
    server.evict()
    server.probe(ok=True)
    tries.settle(POLICY)
    assert tries.charged == 3 and tries.exhausted(POLICY)
    assert tries.quarantine_reason() == Reason(
        attempts_reason(3, "HTTP 500"), "server", "http_5xx", retriable=True
    )


def test_suspicions_settled_together_charge_no_more_than_max_attempts() -> None:
    """A sample retried uncharged while its suspicions were open (two charged already,
    then a streak that took the server out, whose probe passed): it pays for
    ``max_attempts`` failures, not five, and is quarantined saying so."""
    tries, server = Attempts(), _Server()
    for _ in range(2):
        tries.record(SOFT, server)
        server.serve()
        tries.settle(POLICY)
    assert tries.charged == 2 and not tries.exhausted(POLICY)
    for _ in range(3):
        tries.record(Fault("server", "http_5xx", "HTTP 502", reached=True), server)
    server.evict()
    server.probe(ok=True)
    tries.settle(POLICY)
    assert (tries.failed, tries.charged, tries.suspicions) == (5, 3, [])
    assert tries.exhausted(POLICY)
    assert tries.quarantine_reason().text == attempts_reason(3, "HTTP 502")


def test_a_failure_on_a_server_already_out_waits_for_that_spells_probe() -> None:
    tries, server = Attempts(), _Server()
    server.evict()
    tries.record(SOFT, server)  # an attempt in flight when the server left
    server.serve()  # (in-flight success elsewhere does not count: it is out)
    tries.settle(POLICY)
    assert tries.suspicions
    server.probe(ok=False)
    tries.settle(POLICY)
    assert (tries.charged, tries.suspicions) == (0, [])


def test_a_server_that_served_before_it_left_rotation_charges_the_sample() -> None:
    tries, server = Attempts(), _Server()
    tries.record(SOFT, server)
    server.serve()
    server.evict()
    server.probe(ok=False)
    tries.settle(POLICY)
    assert tries.charged == 1


def test_the_quarantine_reason_is_the_fault_charged_last_with_its_cause_and_kind() -> None:
    """Issue 38: the line records the charged fault's cause and kind as faults.py
    classified them (not prose for a reader to parse back); a timeout charged after
    a 5xx is a timeout."""
    tries, server = Attempts(), _Server()
    tries.record(SOFT, server)
    tries.record(Fault("server", "timeout", "no response in 60 s", reached=True), server)
    server.serve()
    tries.settle(POLICY)
    why = tries.quarantine_reason()
    assert (why.cause, why.kind, why.retriable) == ("server", "timeout", True)
    assert why.text == attempts_reason(2, "no response in 60 s")


def test_a_sample_never_charged_has_no_quarantine_reason() -> None:
    with pytest.raises(ValueError, match="no attempt was charged"):
        Attempts().quarantine_reason()
