"""The one SGLang-like scheduler of the built-in servers (fake and reference), and how its
passes reach the dumper every hook uses.

Requests wait in arrival order. Each pass takes, first come first served, at most
``chunk_size`` rows of each waiting request (0: no cap), never crossing a request's cut
points, until ``max_batch_tokens`` rows are taken; a request whose rows do not all fit
continues in the next pass (chunked prefill), so a pass mixes new requests with
continuations, as in SGLang. A pass runs through the server's ``step`` in a worker thread,
never on the event loop, one at a time, in pass order. With a modelled GPU time per pass
(``latency``) and ``overlap``, a pass's step (its host-side work: writing its dump parts)
runs while the next pass "computes", as under SGLang's overlap scheduling. A request that
goes away (its handler cancelled: the client left) is dropped before its next pass, and
:class:`PassDumper` reports it to the dumper as aborted, as SGLang reports an abort.

No torch here: the step is the server's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import ReqView, request_storage
from hsx_async.server.rows import PassRows


class ServerClosing(Exception):
    """The server is shutting down; the request was not (fully) served."""


class DuplicateRid(Exception):
    """A request with this rid is already in flight."""


class PassFailed(Exception):
    """The forward pass or the dump write of this request failed."""


@dataclass(frozen=True, slots=True)
class Completion:
    prompt_tokens: int
    output_ids: list[int]
    stopped: bool = False  # ended on a stop token, not at max_new_tokens


@dataclass(eq=False)
class Job:
    """One request, from arrival to its last pass. ``tokens`` grows while it decodes."""

    rid: str
    tokens: list[int]
    max_new_tokens: int
    ns: str | None  # the hsx_ns of a request to dump; None: ordinary traffic
    custom_params: dict[str, Any] = field(default_factory=dict)  # as the request sent them
    cuts: tuple[int, ...] = ()  # prompt rows no pass crosses (the fake's random chunks)
    stop_ids: frozenset[int] = frozenset()  # decoding ends once one is generated
    kv: Any = None  # the engine's cache of rows [0, rows_done) (the reference model's)
    picker: Any = None  # picks the next token from logits; None: greedy
    prompt_len: int = 0
    rows_done: int = 0  # rows whose pass is complete
    scheduled: int = 0  # rows handed to passes (ahead of rows_done while a pass runs)
    future: asyncio.Future[Completion] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.future = asyncio.get_running_loop().create_future()

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending_rows(self) -> int:
        """Rows no pass has taken yet, up to the next cut point."""
        end = next((c for c in self.cuts if c > self.scheduled), len(self.tokens))
        return min(end, len(self.tokens)) - self.scheduled

    @property
    def stopped(self) -> bool:
        return self.generated > 0 and self.tokens[-1] in self.stop_ids

    @property
    def decoding(self) -> bool:
        """More tokens are to be generated."""
        return self.generated < self.max_new_tokens and not self.stopped

    @property
    def finished(self) -> bool:
        # The last generated token is never fed back: no pass computes its row.
        fed = len(self.tokens) - (1 if self.generated else 0)
        return not self.decoding and self.rows_done >= fed


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows ``[start, end)`` of ``job`` in one pass."""

    job: Job
    start: int
    end: int

    @property
    def want_next(self) -> bool:
        return self.end == len(self.job.tokens) and self.job.decoding


@dataclass(frozen=True, slots=True)
class SliceResult:
    kv: Any = None
    next_token: int | None = None
    error: str | None = None  # the dump write failed: the request fails, the pass stands


Step = Callable[[Sequence[Slice]], list[SliceResult]]
PassRecord = tuple[tuple[str, int, int], ...]


def plan_pass(
    pending: Sequence[int], chunk_size: int, max_batch_tokens: int
) -> list[tuple[int, int]]:
    """``(index, rows)`` for one pass over requests with ``pending`` rows, in order;
    ``chunk_size`` 0 caps no request."""
    budget = max_batch_tokens
    plan: list[tuple[int, int]] = []
    for index, rows in enumerate(pending):
        if budget == 0:
            break
        take = min(rows, chunk_size or rows, budget)
        if take > 0:
            plan.append((index, take))
            budget -= take
    return plan


def pass_delay_s(base_ms: float, per_token_us: float, rows: int) -> float:
    """The modelled GPU time of a pass of ``rows`` rows."""
    return base_ms / 1e3 + per_token_us * rows / 1e6


@dataclass
class SchedulerStats:
    """What the scheduler did (the reference server serves it on ``/get_server_info``)."""

    passes: int = 0
    rows: int = 0
    max_pass_requests: int = 0  # most requests batched into one pass
    batched_passes: int = 0  # passes holding two requests or more
    completed: int = 0
    failed: int = 0
    # The most recent passes: (rid, start, end) of every slice.
    pass_log: collections.deque[PassRecord] = field(
        default_factory=lambda: collections.deque(maxlen=1024)
    )

    def record(self, slices: Sequence[Slice]) -> None:
        self.passes += 1
        self.rows += sum(s.end - s.start for s in slices)
        self.max_pass_requests = max(self.max_pass_requests, len(slices))
        self.batched_passes += len(slices) > 1
        self.pass_log.append(tuple((s.job.rid, s.start, s.end) for s in slices))

    def to_json(self) -> dict[str, int]:
        return {
            "passes": self.passes,
            "rows": self.rows,
            "max_pass_requests": self.max_pass_requests,
            "batched_passes": self.batched_passes,
            "completed": self.completed,
            "failed": self.failed,
        }


def _open_gate() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


class Scheduler:
    """Owns the waiting requests and runs their passes, one at a time, through ``step``.

    ``gate``: passes start only while it is set (:meth:`pause`/:meth:`resume`; the fake
    server shares one across its restarts). ``latency``: ``(base ms, µs per row)`` of
    modelled GPU time per pass; with ``overlap`` a pass's step runs during the next
    pass's modelled time."""

    def __init__(
        self,
        step: Step,
        *,
        chunk_size: int,
        max_batch_tokens: int,
        on_drop: Callable[[Job], None] | None = None,
        latency: tuple[float, float] = (0.0, 0.0),
        overlap: bool = False,
        gate: asyncio.Event | None = None,
    ) -> None:
        self._step = step
        self._on_drop = on_drop  # told of every job leaving the queue (done or not)
        self._chunk_size = chunk_size
        self._max_batch_tokens = max_batch_tokens
        self._latency = latency
        self._overlap = overlap
        self._gate = gate if gate is not None else _open_gate()
        self._active: list[Job] = []
        self._rids: set[str] = set()
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()
        self._running_step: asyncio.Task[None] | None = None
        self._closing = False
        self.running = False
        self.stats = SchedulerStats()

    async def submit(self, job: Job) -> Completion:
        """Queue ``job`` and wait until its last pass is done."""
        if self._closing:
            raise ServerClosing("the server is shutting down")
        if job.rid in self._rids:
            raise DuplicateRid(f"rid {job.rid!r} is already in flight")
        self._rids.add(job.rid)
        self._active.append(job)
        self._wake.set()
        self._arrived.set()
        # Not shielded: a handler cancelled by a client that went away cancels the future,
        # and the request is dropped before its next pass, as SGLang aborts it.
        return await job.future

    @property
    def queued(self) -> int:
        """Requests accepted and not finished yet."""
        return len(self._active)

    def pause(self) -> None:
        """No pass starts until :meth:`resume` (the one in flight completes): lets a test
        queue several requests and see them batched, like SGLang's /pause_generation."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()
        self._wake.set()

    async def wait_queued(self, count: int) -> None:
        """Until at least ``count`` requests are queued."""
        while len(self._active) < count:
            self._arrived.clear()
            await self._arrived.wait()

    def close(self) -> None:
        """Stop after the pass in flight; the requests still waiting get ServerClosing
        (a paused server closes too; the gate stays as it is)."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        self.running = True
        try:
            while not self._closing:
                if not self._gate.is_set():
                    await self._gate_or_wake()
                    continue
                slices = self._plan()
                if not slices:  # nothing queued, or all of it in the pass being written
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._one_pass(slices)
        finally:
            self.running = False
            self._closing = True  # whatever stopped the loop, later requests get 503
            # The pass being written ends first: nothing is written after the server stops.
            if self._running_step is not None:
                await asyncio.wait([self._running_step])
            for job in list(self._active):
                self._fail(job, ServerClosing("the server shut down before the request finished"))

    async def _gate_or_wake(self) -> None:
        """Until the gate opens or something wakes the loop (close)."""
        self._wake.clear()
        waiters = [
            asyncio.ensure_future(self._gate.wait()),
            asyncio.ensure_future(self._wake.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _plan(self) -> list[Slice]:
        for job in [j for j in self._active if j.future.cancelled()]:
            self._remove(job)
        plan = plan_pass(
            [job.pending_rows for job in self._active], self._chunk_size, self._max_batch_tokens
        )
        slices = []
        for index, rows in plan:
            job = self._active[index]
            slices.append(Slice(job, job.scheduled, job.scheduled + rows))
            job.scheduled += rows
        return slices

    async def _one_pass(self, slices: list[Slice]) -> None:
        delay = pass_delay_s(*self._latency, sum(s.end - s.start for s in slices))
        if delay > 0:
            await asyncio.sleep(delay)  # the modelled GPU time, not synchronisation
        if self._running_step is not None:  # one pass is written at a time, in order
            await asyncio.wait([self._running_step])
        step = _finish_even_if_cancelled(self._run_step(slices))
        if not (self._overlap and delay > 0):
            await step
            return
        # The next pass computes (its modelled time) while this one is written.
        self._running_step = asyncio.ensure_future(step)
        self._running_step.add_done_callback(lambda _: self._wake.set())

    async def _run_step(self, slices: list[Slice]) -> None:
        try:
            results = await asyncio.to_thread(self._step, slices)
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, not the server
            for s in slices:
                self._fail(s.job, PassFailed(f"forward pass failed: {exc!r}"))
            return
        self.stats.record(slices)
        for s, result in zip(slices, results, strict=True):
            self._advance(s, result)

    def _advance(self, s: Slice, result: SliceResult) -> None:
        job = s.job
        if result.error is not None:
            self._fail(job, PassFailed(result.error))
            return
        job.rows_done = s.end
        job.kv = result.kv
        if result.next_token is not None:
            job.tokens.append(result.next_token)
            self._wake.set()  # its next row is pending now
        if job.finished:
            self._remove(job)
            self.stats.completed += 1
            if not job.future.done():
                output = job.tokens[job.prompt_len :]
                job.future.set_result(Completion(job.prompt_len, output, job.stopped))

    def _fail(self, job: Job, exc: Exception) -> None:
        self._remove(job)
        self.stats.failed += 1
        if not job.future.done():
            job.future.set_exception(exc)

    def _remove(self, job: Job) -> None:
        if self._on_drop is not None and job in self._active:
            self._on_drop(job)
        job.kv = None
        with contextlib.suppress(ValueError):
            self._active.remove(job)
        self._rids.discard(job.rid)


async def _finish_even_if_cancelled(work: Any) -> None:
    """Await a pass's step; if cancelled (server stop), let the step end first so that
    nothing is written after the server has stopped, then propagate the cancellation."""
    future = asyncio.ensure_future(work)
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


class PassDumper:
    """A built-in server's side of the dumper: each pass's slices described to the
    :class:`~hsx_async.server.dumper.PrefillDumper` as :class:`ReqView`\\ s, exactly as
    the SGLang glue describes a prefill batch (so planning, chunk continuity, refusals and
    aborts run the code that runs inside SGLang), with the requests the scheduler dropped
    reported as aborted first."""

    def __init__(self, dumper: PrefillDumper, layers: int) -> None:
        self.dumper = dumper
        self._layers = layers  # L: the storage a request asks for is checked against it
        # rids of marked requests the scheduler dropped (client gone, pass failed): told to
        # the dumper as aborted at the next pass. A deque: appended on the event loop,
        # drained in the worker thread.
        self._dropped: collections.deque[str] = collections.deque()

    def drop(self, job: Job) -> None:
        """The scheduler removed ``job``: its dump, if unfinished, must never commit."""
        if job.ns is not None:
            self._dropped.append(job.rid)

    def views(self, slices: Sequence[Slice]) -> list[ReqView]:
        """The dropped requests (aborted, no rows), then every slice of the pass."""
        views = []
        while self._dropped:
            rid = self._dropped.popleft()
            views.append(ReqView(rid, "dropped", 0, 0, 0, 0, aborted=True))
        return views + [self._view(s) for s in slices]

    def _view(self, s: Slice) -> ReqView:
        job = s.job
        storage, note = request_storage(job.custom_params, self._layers)
        return ReqView(
            rid=job.rid,
            ns=job.ns,
            num_tokens=job.prompt_len,
            max_new_tokens=job.max_new_tokens,
            start=s.start,
            rows=s.end - s.start,
            last_chunk=s.end >= job.prompt_len,
            storage=storage,
            storage_note=note,
        )

    def dump(self, views: Sequence[ReqView], load: Callable[[], PassRows]) -> dict[str, str]:
        """Dump the pass; the rids refused or failed, with why (a refused or failed dump
        fails that request only: the others of the pass stand)."""
        report = self.dumper.dump_batch(views, load)
        return {r.rid: r.reason for r in report.rejects}
