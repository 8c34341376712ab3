"""Retry policy and the attempt bookkeeping of one sample: which failures it pays for. Pure.

:class:`RetryPolicy` says how long to wait and how many charged failures a sample may
have. :class:`Attempts` counts one sample's attempts by cause (:mod:`hsx_async.run.servers.faults`):

- a **sample** fault is charged at once (a permanent one ends the sample at once);
- a **server** fault that never reached the server, or says nothing about the sample
  (refused connection, no hook, another model, a 404), is never charged;
- a server fault that the sample might have caused (a 5xx, a reset, a timeout, a broken
  dump) is a :class:`Suspicion` against that server, settled by what the server does next
  (:meth:`Suspicion.verdict`): a request sent to it after the failure became a sample —
  the server works, so the sample is charged (one sent before it proves nothing: it may
  have been answered before the server broke, and committed after); it was taken out of
  rotation and its first probe failed — the server was broken, so the sample is forgiven.
  Until then the sample is retried uncharged.

So a server that fails every request takes nothing from the input (its samples wait,
uncharged, until it is fixed or the run exits 3), while a sample that fails on servers
that work for everything else still ends in quarantine after ``max_attempts``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hsx_async.dataset.manifest import Reason
from hsx_async.dataset.quarantine import attempts_reason, refused_reason
from hsx_async.run.servers.faults import Fault


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with "equal jitter": half fixed, half random.

    The fixed half keeps a flapping server from being hammered; the random half keeps
    workers that failed together from retrying in lockstep.
    """

    max_attempts: int
    base: float
    cap: float

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        # 2.0 ** 1024 raises OverflowError; at 1023 the product is at worst inf, and capped.
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt - 1, 1023))
        r = rng.random() if rng is not None else random.random()
        return ceiling / 2 + r * ceiling / 2

    def exhausted(self, attempt: int) -> bool:
        """True when ``attempt`` was the last one allowed."""
        return attempt >= self.max_attempts


@dataclass(slots=True)
class Eviction:
    """One time a server left rotation: its record's ``worked`` by then, and what its
    first probe after it showed (None until probed)."""

    worked_before: int
    verdict: bool | None = None


class Witness(Protocol):
    """What a server's record says about whether it works (``Server`` is one).

    ``requests``: requests sent to it so far (each one's number is its lease number);
    ``worked``: the lease number of the latest request whose dump became a sample."""

    @property
    def requests(self) -> int: ...

    @property
    def worked(self) -> int: ...

    @property
    def evictions(self) -> Sequence[Eviction]: ...

    @property
    def healthy(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Suspicion:
    """A failure the sample might have caused, on ``server``, with the server's record at
    the moment it happened."""

    server: Witness
    fault: Fault
    sent_at: int  # requests sent to the server up to the failure
    evictions_at: int
    was_down: bool  # the server was already out of rotation when the attempt failed

    @classmethod
    def against(cls, server: Witness, fault: Fault) -> Suspicion:
        """Record before the server's record changes for this same fault."""
        return cls(server, fault, server.requests, len(server.evictions), not server.healthy)

    def verdict(self) -> bool | None:
        """True: a request sent to the server after it became a sample (the sample is to blame);
        False: the server was broken (forgiven); None: not known yet."""
        evictions = self.server.evictions
        if self.was_down and self.evictions_at:
            return evictions[self.evictions_at - 1].verdict
        if len(evictions) == self.evictions_at:  # still in rotation since the failure
            return True if self.server.worked > self.sent_at else None
        later = evictions[self.evictions_at]  # the eviction that followed it
        if later.worked_before > self.sent_at:
            return True
        return later.verdict


@dataclass(slots=True)
class Attempts:
    """One sample's attempts so far. ``rids``: requests sent (each rid used once, also
    when the writers hand a sample back); ``failed``: every failed attempt, whatever its
    cause (for the backoff); ``charged``: the failures the sample pays for, which count
    against ``workers.max_attempts``; ``suspicions``: failures not settled yet."""

    rids: int = 0
    failed: int = 0
    charged: int = 0
    last_charged: Fault | None = None
    suspicions: list[Suspicion] = field(default_factory=list)
    permanent: bool = False  # a sample fault no retry can change

    def record(self, fault: Fault, server: Witness | None) -> None:
        """One failed attempt. Call before the server's record is updated for it."""
        self.failed += 1
        if fault.cause == "sample":
            self.charge(fault)
            self.permanent = self.permanent or fault.permanent
        elif fault.cause == "server" and fault.reached and server is not None:
            self.suspicions.append(Suspicion.against(server, fault))

    def charge(self, fault: Fault) -> None:
        self.charged += 1
        self.last_charged = fault

    def settle(self, policy: RetryPolicy) -> None:
        """Charge the suspicions whose server has since been shown to work; forgive those
        whose server was shown broken; keep the rest.

        A sample pays for at most ``policy.max_attempts`` failures: suspicions settled
        together (a probe that passes after a streak took the server out settles every
        failure behind it) are charged only up to that; the rest are settled at no charge,
        and the sample, exhausted, is quarantined saying ``max_attempts`` attempts."""
        open_ = []
        for suspicion in self.suspicions:
            verdict = suspicion.verdict()
            if verdict is None:
                open_.append(suspicion)
            elif verdict and not policy.exhausted(self.charged):
                self.charge(suspicion.fault)
        self.suspicions = open_

    def exhausted(self, policy: RetryPolicy) -> bool:
        """The sample is to be quarantined (after :meth:`settle`)."""
        return self.permanent or (self.charged > 0 and policy.exhausted(self.charged))

    def quarantine_reason(self) -> Reason:
        """The quarantine line's reason (after :meth:`exhausted`): the fault charged last,
        its cause and kind as :mod:`~hsx_async.run.servers.faults` classified it; retriable (the
        sample was sent and failed: a rerun may pass once the cause is fixed)."""
        last = self.last_charged
        if last is None:
            raise ValueError("no attempt was charged: nothing to quarantine the sample for")
        if self.permanent:
            text = refused_reason(last.reason)
        else:
            text = attempts_reason(self.charged, last.reason)
        return Reason(text, last.cause, last.kind, retriable=True)
