"""The hand-off between the two halves of a pipeline, and the one answer that comes back.

The *worker half* (:mod:`hsx_async.run.pipeline.workers`) turns a sample into something to write
(a validated dump); the *writer half* (:mod:`hsx_async.run.pipeline.writers`) makes it durable. One
:class:`Handoff` carries it across, and the writers answer each hand-off with exactly one
:class:`Outcome`, through the hand-off's future. Nothing else crosses back: the writers
never count attempts, requeue or quarantine a sample, they say what happened, and the
worker half alone decides what that means for the sample (release what it reserved,
charge an attempt, try again, quarantine).

The outcomes:

- :class:`Committed` — the sample's file and its manifest line are durable (its dump is
  deleted next: :attr:`Handoff.freed`).
- :class:`Requeue` — not written, for a reason that is not the sample's (the output disk
  is full): extract it again, uncharged.
- :class:`Failed` — the attempt failed after all (the dump changed before its copy); the
  error carries its cause, and the worker half charges or forgives it like a failure of
  its own (:mod:`hsx_async.run.servers.faults`).
- :class:`Abandoned` — not written and not to be tried again in this run (an earlier
  commit failed, or the run is being torn down); a resume redoes it.

The writer half is, as the worker half sees it, a :class:`Sink`: where hand-offs go and
where a sample the workers give up on is quarantined. A second client of the pipeline
(``hsx regenerate``'s answers, written as JSONL lines) uses the same pieces with its own
job type: ``Handoff[MyJob]``, a sink that answers each with an :class:`Outcome`, and the
retry bookkeeping of :mod:`hsx_async.run.servers.retry` on the worker side.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from hsx_async.dataset.manifest import ManifestEntry, Reason
from hsx_async.errors import HsxError


class EndOfInput:
    """End marker of a queue: a consumer that takes it puts it back for the next one."""

    def __repr__(self) -> str:
        return "EOF"


EOF = EndOfInput()

T = TypeVar("T")


class Conveyor(Generic[T]):
    """A bounded queue from one reader to many workers whose end is said without waiting
    (:meth:`close`): a reader cut off while the queue is full (the run is ending, its
    workers are gone) never waits for room to say so (issue 38: ``hsx regenerate`` with
    more conversations than workers hung there after a ``NoServerError``)."""

    def __init__(self, maxsize: int) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._maxsize = max(1, maxsize)
        self._room = asyncio.Event()
        self._ready = asyncio.Event()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: T) -> None:
        """Queue ``item``, waiting while the queue is full (dropped once closed)."""
        while len(self._items) >= self._maxsize and not self.closed:
            self._room.clear()
            await self._room.wait()
        if not self.closed:
            self._items.append(item)
            self._ready.set()

    def close(self) -> None:
        """No more items: workers take what is queued, then :data:`EOF`. Never waits."""
        self.closed = True
        self._ready.set()
        self._room.set()

    async def get(self) -> T | EndOfInput:
        """The next item, or :data:`EOF` once the queue is closed and empty."""
        while not self._items:
            if self.closed:
                return EOF
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        self._room.set()
        return item


@dataclass(frozen=True, slots=True)
class Committed:
    entry: ManifestEntry


@dataclass(frozen=True, slots=True)
class Requeue:
    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    error: HsxError


@dataclass(frozen=True, slots=True)
class Abandoned:
    reason: str


Outcome = Committed | Requeue | Failed | Abandoned

JobT_co = TypeVar("JobT_co", covariant=True)
JobT_contra = TypeVar("JobT_contra", contravariant=True)


@dataclass(frozen=True, eq=False, slots=True)
class Handoff(Generic[JobT_co]):
    """One job on its way to the writers. ``outcome`` resolves once, when they are done
    with the sample; ``freed`` once they hold nothing of the job any more (its dump
    deleted), never before ``outcome``. For a committed sample that comes later: freeing a
    large dump's tmpfs pages takes a while (bench/README.md, issue 27), and neither the
    next sample nor the end of the run waits for it, only the bytes it held."""

    job: JobT_co
    outcome: asyncio.Future[Outcome]
    freed: asyncio.Future[None]

    def settle(self, outcome: Outcome) -> None:
        """Answer the hand-off (a second answer is ignored: the first one stands)."""
        if not self.outcome.done():
            self.outcome.set_result(outcome)

    def free(self) -> None:
        """The writers hold nothing of the job any more (after :meth:`settle`)."""
        if not self.freed.done():
            self.freed.set_result(None)


class Sink(Protocol[JobT_contra]):
    """The writer half as the worker half sees it."""

    async def submit(self, handoff: Handoff[JobT_contra]) -> None:
        """Queue a hand-off (waits while the writers' queue is full)."""

    async def quarantine(self, line: int, sample_id: Any, reason: Reason) -> None:
        """Record durably that the sample on input ``line`` (0-based) cannot be made."""
