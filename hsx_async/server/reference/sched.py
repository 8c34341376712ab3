"""The reference server's scheduler: SGLang-like batched, chunked prefill passes.

Requests wait in arrival order. Each pass takes, first come first served, at most
``chunk_size`` rows of each waiting request until ``max_batch_tokens`` rows are taken; a
request whose rows do not all fit continues in the next pass from its KV cache (chunked
prefill), so a pass mixes new requests with continuations, as in SGLang. The forward pass
and the dump writes of a pass run in a worker thread (``step``), never on the event loop,
one pass at a time. No torch here: the step is given by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


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
    prompt_len: int = 0
    rows_done: int = 0
    kv: Any = None  # the engine's cache of rows [0, rows_done)
    stop_ids: frozenset[int] = frozenset()  # decoding ends once one is generated
    picker: Any = None  # picks the next token from logits; None: greedy
    custom_params: dict[str, Any] = field(default_factory=dict)  # as the request sent them
    future: asyncio.Future[Completion] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.future = asyncio.get_running_loop().create_future()

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending_rows(self) -> int:
        return len(self.tokens) - self.rows_done

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
    kv: Any
    next_token: int | None
    error: str | None = None  # the dump write failed: the request fails, the pass stands


Step = Callable[[Sequence[Slice]], list[SliceResult]]
PassRecord = tuple[tuple[str, int, int], ...]


def plan_pass(
    pending: Sequence[int], chunk_size: int, max_batch_tokens: int
) -> list[tuple[int, int]]:
    """``(index, rows)`` for one pass over requests with ``pending`` rows, in order."""
    budget = max_batch_tokens
    plan: list[tuple[int, int]] = []
    for index, rows in enumerate(pending):
        if budget == 0:
            break
        take = min(rows, chunk_size, budget)
        if take > 0:
            plan.append((index, take))
            budget -= take
    return plan


@dataclass
class ReferenceStats:
    """What the scheduler did; served on ``GET /get_server_info`` too."""

    passes: int = 0
    rows: int = 0
    max_pass_requests: int = 0  # most requests batched into one pass
    batched_passes: int = 0  # passes holding two requests or more
    completed: int = 0
    failed: int = 0
    # The most recent passes: (rid, start, end) of every slice.
    pass_log: deque[PassRecord] = field(default_factory=lambda: deque(maxlen=1024))

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


class Scheduler:
    """Owns the waiting requests and runs their passes, one at a time, through ``step``."""

    def __init__(
        self,
        step: Step,
        *,
        chunk_size: int,
        max_batch_tokens: int,
        on_drop: Callable[[Job], None] | None = None,
    ) -> None:
        self._step = step
        self._on_drop = on_drop  # told of every job leaving the queue (done or not)
        self._chunk_size = chunk_size
        self._max_batch_tokens = max_batch_tokens
        self._active: list[Job] = []
        self._rids: set[str] = set()
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()
        self._paused = False
        self._closing = False
        self.running = False
        self.stats = ReferenceStats()

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
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def wait_queued(self, count: int) -> None:
        """Until at least ``count`` requests are queued."""
        while len(self._active) < count:
            self._arrived.clear()
            await self._arrived.wait()

    def close(self) -> None:
        """Stop after the pass in flight; the requests still waiting get ServerClosing."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        self.running = True
        try:
            while not self._closing:
                if self._paused or not self._active:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                slices = self._plan()
                if slices:  # empty when every queued request was cancelled
                    await self._run_pass(slices)
        finally:
            self.running = False
            self._closing = True  # whatever stopped the loop, later requests get 503
            for job in list(self._active):
                self._fail(job, ServerClosing("the server shut down before the request finished"))

    def _plan(self) -> list[Slice]:
        for job in [j for j in self._active if j.future.cancelled()]:
            self._remove(job)
        plan = plan_pass(
            [job.pending_rows for job in self._active], self._chunk_size, self._max_batch_tokens
        )
        slices = []
        for index, rows in plan:
            job = self._active[index]
            slices.append(Slice(job, job.rows_done, job.rows_done + rows))
        return slices

    async def _run_pass(self, slices: list[Slice]) -> None:
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
