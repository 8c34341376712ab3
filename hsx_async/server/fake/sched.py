"""The fake server's scheduler: batched, chunked prefill passes that write dump parts.

Like SGLang, waiting requests are packed first-come-first-served into forward passes of at
most ``max_batch_tokens`` rows; a prompt that does not fit continues in the next pass
(chunked prefill), and ``chunk_size`` caps one request's rows per pass. Each pass writes
one part file per request it touched, in a worker thread, then commits the requests it
finished. Faults that corrupt parts or ``meta.json`` are applied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hsx_async.errors import HsxError
from hsx_async.protocol import BF16_STORAGE, POST_NORM, DumpMeta, Storage
from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part
from hsx_async.server.fake.content import I64, U16, fill_rows
from hsx_async.server.fake.options import FakeStats
from hsx_async.server.hook_core import RequestDump
from hsx_async.server.rows import encode_bits

# Faults whose meta.json is not written at the end of the last pass.
_NO_COMMIT_IN_PASS = frozenset({"abort_dump", "late_meta"})


class ServerStopped(Exception):
    """The simulated server went away while the request was in flight."""


@dataclass(frozen=True)
class DumpSpec:
    """What every dump of one server shares."""

    root: Path
    hidden_size: int
    aux_layers: tuple[int, ...]
    model: str
    server: str


@dataclass(eq=False)
class Job:
    """One hsx request from the waiting queue to its commit."""

    rid: str
    ns: str
    input_ids: I64
    fault: str | None
    cuts: tuple[int, ...]  # rows a pass may not cross (random chunks); ends with T
    done: asyncio.Future[None]
    scheduled: int = 0  # rows handed to passes so far (touched on the loop only)
    listed: list[tuple[int, int]] = field(default_factory=list)  # parts as named on disk
    error: str | None = None  # why the dump failed (e.g. a symlink in the dump root)
    storage: Storage = BF16_STORAGE  # how its parts hold the rows (what it asked for)
    dump: RequestDump = field(init=False)

    def __post_init__(self) -> None:
        self.dump = RequestDump(
            rid=self.rid, ns=self.ns, num_tokens=self.num_tokens, storage=self.storage
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def next_cut(self) -> int:
        return next(c for c in self.cuts if c > self.scheduled)


Slice = tuple[Job, int, int]


def plan_pass(waiting: Sequence[Job], budget: int, chunk_size: int) -> list[Slice]:
    """The rows of the next pass: FCFS, each job capped by chunk_size and its next cut."""
    plan: list[Slice] = []
    for job in waiting:
        if budget <= 0:
            break
        take = min(job.next_cut() - job.scheduled, budget)
        if chunk_size > 0:
            take = min(take, chunk_size)
        plan.append((job, job.scheduled, job.scheduled + take))
        budget -= take
    return plan


def split_plan(plan: Sequence[Slice], groups: int) -> list[list[Slice]]:
    """Spread a pass's slices over writer threads, balancing rows (largest first)."""
    out: list[list[Slice]] = [[] for _ in range(max(1, min(groups, len(plan))))]
    load = [0] * len(out)
    for item in sorted(plan, key=lambda x: x[1] - x[2]):
        i = load.index(min(load))
        out[i].append(item)
        load[i] += item[2] - item[1]
    return out


def pass_delay_s(base_ms: float, per_token_us: float, rows: int) -> float:
    return base_ms / 1e3 + per_token_us * rows / 1e6


def part_spans(fault: str | None, start: int, end: int, num_tokens: int) -> list[tuple[int, int]]:
    """The part names written for rows [start, end): a gap or overlap fault renames or adds
    a part after the last real one, with a size that matches its name."""
    if end != num_tokens:
        return [(start, end)]
    if fault == "gap_parts":
        return [(start + 1, end + 1)]
    if fault == "overlap_parts":
        return [(start, end), (num_tokens - 1, num_tokens)]
    return [(start, end)]


def encoded(rows: U16, storage: Storage) -> memoryview:
    """A part's bytes: the rows' bfloat16 bits, or their FP8 sections back to back
    (quantized here, where the rows are produced, by the hook's own quantizer)."""
    if not storage.is_fp8:
        return memoryview(rows.data).cast("B")
    return memoryview(b"".join(encode_bits(rows, storage)))


def part_bytes(fault: str | None, data: memoryview, rows: int, is_last: bool) -> bytes | memoryview:
    if not is_last or rows == 0:
        return data
    row = len(data) // rows
    if fault == "truncated_part":
        return data[: len(data) - max(1, row // 2)]
    if fault == "oversized_part":
        return bytes(data) + bytes(data[len(data) - row :])
    return data


def faulty_meta(meta: DumpMeta, fault: str | None) -> DumpMeta:
    if fault == "wrong_num_tokens":
        return dataclasses.replace(meta, num_tokens=meta.num_tokens + 1)
    if fault == "wrong_hidden_size":
        return dataclasses.replace(meta, hidden_size=meta.hidden_size + 1)
    if fault == "wrong_layers":
        layers = meta.aux_layers or (0,)
        return dataclasses.replace(meta, aux_layers=(*layers[:-1], layers[-1] + 1))
    return meta


def job_meta(spec: DumpSpec, job: Job) -> DumpMeta:
    meta = job.dump.meta(
        hidden_size=spec.hidden_size,
        aux_layers=list(spec.aux_layers),
        model=spec.model,
        server=spec.server,
        final_state=POST_NORM,
    )
    return faulty_meta(dataclasses.replace(meta, parts=tuple(job.listed)), job.fault)


def commit(spec: DumpSpec, job: Job) -> None:
    """Write ``meta.json`` (blocking: call in a thread)."""
    with request_dir_fd(spec.root, job.ns, job.rid) as dir_fd:
        write_meta(dir_fd, job_meta(spec, job))


class PassWriter:
    """Generates and writes the parts of one pass; runs in a worker thread.

    Keeps one growing buffer: allocating (and faulting in) hundreds of MB per pass would
    cost more than producing the rows.
    """

    def __init__(self, spec: DumpSpec) -> None:
        self._spec = spec
        layers = len(spec.aux_layers) + 1
        self._buffer: U16 = np.empty((0, layers, spec.hidden_size), dtype="<u2")

    def _rows(self, job: Job, start: int, end: int) -> U16:
        if self._buffer.shape[0] < end - start:
            self._buffer = np.empty((end - start, *self._buffer.shape[1:]), dtype="<u2")
        out = self._buffer[: end - start]
        fill_rows(out, job.input_ids[start:end], np.arange(start, end, dtype=np.int64))
        return out

    def _write_slice(self, job: Job, start: int, end: int) -> int:
        rows = self._rows(job, start, end)
        spans = part_spans(job.fault, start, end, job.num_tokens)
        with request_dir_fd(self._spec.root, job.ns, job.rid) as dir_fd:
            for i, (s, e) in enumerate(spans):
                view = rows[(s - start) :] if i > 0 else rows
                is_last = end == job.num_tokens and i == len(spans) - 1
                data = encoded(view, job.storage)
                write_part(dir_fd, s, e, part_bytes(job.fault, data, view.shape[0], is_last))
        job.dump.add_part(start, end)
        job.listed.extend(spans)
        return len(spans)

    def write(self, plan: Sequence[Slice]) -> int:
        """Write every slice; a job whose dump fails records why and writes nothing more.
        Returns the number of part files written."""
        parts = 0
        for job, start, end in plan:
            if job.error is not None:
                continue
            try:
                parts += self._write_slice(job, start, end)
                if end == job.num_tokens and job.fault not in _NO_COMMIT_IN_PASS:
                    commit(self._spec, job)
            except (HsxError, OSError) as exc:
                job.error = f"dump of rid {job.rid} failed: {exc}"
        return parts


class Scheduler:
    """Owns the waiting queue and the pass loop of one (simulated) server process."""

    def __init__(
        self,
        spec: DumpSpec,
        stats: FakeStats,
        *,
        max_batch_tokens: int,
        chunk_size: int,
        latency: tuple[float, float] = (0.0, 0.0),
        writer_threads: int = 1,
        gate: asyncio.Event | None = None,
    ) -> None:
        self._spec = spec
        self._stats = stats
        self._budget = max_batch_tokens
        self._chunk_size = chunk_size
        self._latency = latency
        # One writer (and buffer) per thread: one tmpfs write stream tops out near 1.3 GB/s.
        self._writers = [PassWriter(spec) for _ in range(writer_threads)]
        self._waiting: deque[Job] = deque()
        self._in_pass: list[Job] = []  # in a pass computing or being written
        self._writing: asyncio.Future[None] | None = None  # the previous pass's writes
        self._wake = asyncio.Event()
        self._gate = gate or asyncio.Event()
        if gate is None:
            self._gate.set()

    def submit(self, job: Job) -> None:
        self._waiting.append(job)
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                if not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._gate.wait()
                await self._one_pass()
        finally:
            # Server stop: the pass being written ends first, so nothing lands afterwards.
            if self._writing is not None:
                await asyncio.wait([self._writing])

    async def _one_pass(self) -> None:
        plan = plan_pass(self._waiting, self._budget, self._chunk_size)
        for job, _, end in plan:
            job.scheduled = end
        # Not only the head: a capped head can leave a later, shorter job fully scheduled.
        self._waiting = deque(j for j in self._waiting if j.scheduled < j.num_tokens)
        self._in_pass += [job for job, _, _ in plan]
        rows = sum(end - start for _, start, end in plan)
        delay = pass_delay_s(*self._latency, rows)
        if delay <= 0:
            await self._complete(plan)
            return
        await asyncio.sleep(delay)  # the simulated GPU time, not synchronisation
        # Like SGLang's overlap scheduling, the host-side work of a pass (here: writing its
        # dump parts) runs while the next pass computes, so the modelled GPU time alone
        # sets the capacity. One pass is written at a time, in pass order.
        if self._writing is not None:
            await asyncio.wait([self._writing])
            self._writing.result()  # a failure of the write surfaces here, as it did inline
        self._writing = asyncio.ensure_future(self._complete(plan))

    async def _complete(self, plan: Sequence[Slice]) -> None:
        parts = await _finish_even_if_cancelled(self._write(plan))
        self._account(plan, parts)
        for job, _, _ in plan:  # once per pass: a chunked job may be in the next one too
            at = next(i for i, other in enumerate(self._in_pass) if other is job)
            del self._in_pass[at]
        self._settle(plan)

    async def _write(self, plan: Sequence[Slice]) -> int:
        groups = split_plan(plan, len(self._writers))
        calls = (asyncio.to_thread(w.write, g) for w, g in zip(self._writers, groups, strict=False))
        return sum(await asyncio.gather(*calls))

    def _account(self, plan: Sequence[Slice], parts: int) -> None:
        stats = self._stats
        stats.passes += 1
        stats.max_pass_requests = max(stats.max_pass_requests, len(plan))
        stats.parts_written += parts
        for job, start, end in plan:
            if job.error is None:
                stats.tokens_dumped += end - start
                if end == job.num_tokens and job.fault not in _NO_COMMIT_IN_PASS:
                    stats.note_committed(job.rid)

    def _settle(self, plan: Sequence[Slice]) -> None:
        for job, _, end in plan:
            if job.error is not None:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(job)
            if (job.error is not None or end == job.num_tokens) and not job.done.done():
                job.done.set_result(None)

    def fail_all(self) -> None:
        """The simulated process died: every request in flight loses its connection."""
        for job in (*self._waiting, *self._in_pass):
            if not job.done.done():
                job.done.set_exception(ServerStopped())
        self._waiting.clear()


async def _finish_even_if_cancelled(work: Coroutine[Any, Any, int]) -> int:
    """Await a thread's work; if cancelled (server stop), let the write end first so that
    nothing is written after the server has stopped, then propagate the cancellation."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise
