"""The fake server's forward pass (the scheduler's ``step``): deterministic rows for each
slice of the pass (:mod:`.content`), dumped through the dumper every hook uses, by the
writer threads every hook uses, with the fault injection (:class:`.faults.DumpFaults`) as
the only difference. Runs in a worker thread; one pass at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from hsx_async.errors import DumpError
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.fake.content import U16, fill_rows
from hsx_async.server.fake.faults import NO_COMMIT_FAULTS, DumpFaults
from hsx_async.server.fake.options import FakeOptions, FakeStats, writer_threads
from hsx_async.server.hook_core import HookConfig, Reject
from hsx_async.server.hook_writer import BackgroundWriter
from hsx_async.server.rows import BatchHidden
from hsx_async.server.sched import Job, PassDumper, Slice, SliceResult

# A pass's writes end long before this on any machine; past it the pass fails.
FLUSH_S = 300.0
# The writers hold one pass at a time (each step waits for its writes): no budget to spend.
_QUEUE_BYTES = 1 << 62


class FakeEngine:
    """Makes and dumps the rows of each pass. Keeps one growing row buffer: allocating
    (and faulting in) hundreds of MB per pass would cost more than producing the rows; it
    is reused once the writers are done with a pass (and hold none of it, issue 24)."""

    def __init__(
        self, options: FakeOptions, stats: FakeStats, faults: DumpFaults, server: str
    ) -> None:
        self._options, self._stats, self._faults = options, stats, faults
        self._loop = asyncio.get_running_loop()
        self._failed: dict[str, str] = {}  # written by the writer threads
        config = HookConfig(
            dump_root=options.dump_root,
            aux_layers=options.aux_layers,
            model=options.model,
            server=server,
        )
        self.writer = BackgroundWriter(
            options.dump_root,
            threads=writer_threads(options),
            queue_bytes=_QUEUE_BYTES,
            on_reject=self._write_failed,
            name="hsx-fake-writer",
            tamper=faults,
        )
        self._passes = PassDumper(PrefillDumper(config, sink=self.writer), self._layers)
        self._buffer: U16 = np.empty((0, self._layers, options.hidden_size), dtype="<u2")

    @property
    def _layers(self) -> int:
        return len(self._options.aux_layers) + 1

    def drop(self, job: Job) -> None:
        self._passes.drop(job)

    def step(self, slices: Sequence[Slice]) -> list[SliceResult]:
        rows = self._rows(slices)
        k = len(self._options.aux_layers)
        hidden = BatchHidden(
            aux=rows[:, :k, :], final=rows[:, k, :], aux_layers=self._options.aux_layers
        )
        errors = self._passes.dump(self._passes.views(slices), lambda: hidden)
        if not self.writer.flush(FLUSH_S):
            raise DumpError(f"the dump writers did not finish a pass in {FLUSH_S:g} s")
        errors.update(self._take_failed())
        # FakeStats wakes awaiting tests: it is touched on the event loop only.
        self._loop.call_soon_threadsafe(self._account, slices, errors)
        return [SliceResult(error=self._error(s.job.rid, errors.get(s.job.rid))) for s in slices]

    def close(self, drain_s: float = 10.0) -> None:
        self.writer.close(drain_s)

    def _rows(self, slices: Sequence[Slice]) -> U16:
        total = sum(s.end - s.start for s in slices)
        if self._buffer.shape[0] < total:
            self._buffer = np.empty((total, *self._buffer.shape[1:]), dtype="<u2")
        out, at = self._buffer[:total], 0
        for s in slices:
            n = s.end - s.start
            ids = np.asarray(s.job.tokens[s.start : s.end], dtype=np.int64)
            fill_rows(
                out[at : at + n],
                ids,
                np.arange(s.start, s.end, dtype=np.int64),
                self._options.weights,
            )
            at += n
        return out

    def _write_failed(self, reject: Reject) -> None:
        self._failed[reject.rid] = reject.reason

    def _take_failed(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    @staticmethod
    def _error(rid: str, reason: str | None) -> str | None:
        return None if reason is None else f"dump of rid {rid} failed: {reason}"

    def _account(self, slices: Sequence[Slice], errors: dict[str, str]) -> None:
        stats = self._stats
        stats.passes += 1
        stats.max_pass_requests = max(stats.max_pass_requests, len(slices))
        for s in slices:
            job = s.job
            if job.ns is None or job.rid in errors:
                continue
            fault = self._faults.fault_of(job.rid)
            stats.tokens_dumped += s.end - s.start
            last = s.end == job.prompt_len
            stats.parts_written += 2 if last and fault == "overlap_parts" else 1
            if last and fault not in NO_COMMIT_FAULTS:
                stats.note_committed(job.rid)
