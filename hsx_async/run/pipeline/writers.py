"""The writer/commit half of the pipeline: writers make dumps durable, the committer
lists them.

Flow of one handed-off dump::

    writer queue ─► writer task: copy, hash, fsync a temp file (a copy thread)
        ─► committer (a batch at a time): rename, fsync of the directories, manifest
        lines, fsync ─► outcome ─► delete dump (an I/O thread, not awaited) ─► freed:
        the worker half releases the bytes

A sample reaches the manifest only after its file is durable, and leaves /dev/shm only
after its manifest line is. Each hand-off is answered with its outcome
(:mod:`hsx_async.run.pipeline.handoff`); the worker half does the rest. Neither the next commit
nor the end of the run waits for a committed dump's deletion: freeing a large dump's
tmpfs pages takes ~0.2 CPU-s per GB on 4 KiB pages, and as long again in wall time on a
busy machine (bench/README.md, issue 27).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import Config
from hsx_async.dataset.durable import write_error
from hsx_async.dataset.manifest import AppendLog, QuarantineEntry, Reason
from hsx_async.errors import DiskFullError, DumpError, WriteError
from hsx_async.run.dumps.dump import remove_tree
from hsx_async.run.dumps.failpoints import failpoint
from hsx_async.run.dumps.writer import FileWriter, Staged, WriteJob
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.handoff import (
    EOF,
    Abandoned,
    Committed,
    EndOfInput,
    Failed,
    Handoff,
    Outcome,
    Requeue,
)
from hsx_async.run.pipeline.metrics import Metrics

log = structlog.get_logger("hsx.commit")

# A tiny sample waits for its group commit several times as long as its copy took, so a
# copy thread needs several writer tasks to stay busy (tiny samples, bench/overhead.py:
# 4 tasks a thread 310 requests/s, 8: 342, 16: 368); large ones queue on the copy threads
# whatever the count, within the /dev/shm budget.
WRITER_TASKS_PER_THREAD = 8


@dataclass(slots=True)
class _Line:
    log_file: AppendLog
    line: bytes
    done: asyncio.Future[None]
    staged: Staged | None = None  # a sample file to name before its manifest line


@dataclass
class Committer:
    """Group commit: every sample file and log line that arrived while the previous batch
    was syncing is made durable together, so the cost per sample falls as load rises.

    A batch: rename the staged files into place, one fsync per directory they touched,
    then one write + fsync per log file. A manifest line is never durable before its file
    and name are (PROTOCOL §4); a crash in between leaves a named file without a line,
    which a resume deletes. The writers delete a sample's dump once its commit returned.
    """

    manifest: AppendLog
    quarantine: AppendLog
    executor: ThreadPoolExecutor
    publish: Callable[[list[Staged]], None]
    fsync: bool = True
    _pending: list[_Line] = field(default_factory=list)
    _holds: list[asyncio.Future[None]] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: bool = False
    _failed: BaseException | None = None

    async def commit(self, log_file: AppendLog, line: bytes) -> None:
        await self._submit(_Line(log_file, line, self._future()))

    async def commit_sample(self, staged: Staged) -> None:
        """Name the staged file and list it in the manifest, durably."""
        await self._submit(_Line(self.manifest, staged.entry.to_line(), self._future(), staged))

    def _future(self) -> asyncio.Future[None]:
        if self._failed is not None:
            raise WriteError(f"not committed: an earlier commit failed ({self._failed})")
        if self._closed:
            raise RuntimeError("committer is closed")
        return asyncio.get_running_loop().create_future()

    async def _submit(self, item: _Line) -> None:
        self._pending.append(item)
        self._wake.set()
        await item.done

    def hold(self, write: asyncio.Future[None]) -> None:
        """Commit nothing before ``write`` is done: a durable record no sample may precede
        (an admitted server's identity, written while it takes its first samples). Its
        failure fails the commit waiting for it, and so the run."""
        write.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved
        self._holds.append(write)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    @property
    def failed(self) -> bool:
        return self._failed is not None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                try:
                    while self._holds:
                        await asyncio.shield(self._holds[0])  # its error: the commit's
                        del self._holds[0]
                    await loop.run_in_executor(self.executor, self._flush, batch)
                except BaseException as exc:
                    self._failed = exc
                    # Nothing after a failed commit is committed. (A new list: the thread
                    # may still be running its flush of `batch`.)
                    failed, self._pending = [*batch, *self._pending], []
                    for item in failed:
                        if not item.done.done():
                            item.done.set_exception(
                                exc
                                if isinstance(exc, Exception)
                                else RuntimeError("commit cancelled")
                            )
                    raise
                for item in batch:
                    if not item.done.done():
                        item.done.set_result(None)
            elif self._closed:
                return

    def _flush(self, batch: list[_Line]) -> None:
        staged = [item.staged for item in batch if item.staged is not None]
        if staged:
            self.publish(staged)  # raises WriteError: the run stops, resume cleans up
        failpoint("commit.before_append")
        for log_file in (self.manifest, self.quarantine):
            lines = [item.line for item in batch if item.log_file is log_file]
            if lines:
                try:
                    log_file.append(lines, sync=self.fsync)
                except OSError as exc:
                    # A failed append or fsync is not retried: after a failed fsync the
                    # kernel may have dropped the pages. Stop; resume repairs the tail.
                    raise write_error(exc, log_file.path) from exc
        failpoint("commit.after_append")


class Writers:
    """The writer tasks, their copy threads and the committer of one run: the writer half
    of the pipeline, a :class:`~hsx_async.run.pipeline.handoff.Sink` for the worker half.

    Each hand-off is answered with one :class:`~hsx_async.run.pipeline.handoff.Outcome` once the
    writers are done with its dump; what the outcome means for the sample (retry, charge,
    quarantine) is the worker half's business, never decided here.
    """

    def __init__(
        self,
        config: Config,
        *,
        metrics: Metrics,
        manifest: AppendLog,
        quarantine: AppendLog,
        guard: DiskGuard,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.guard = guard
        self.executor = executor  # deletes and commits (not owned)
        self.queue: asyncio.Queue[Handoff[WriteJob] | EndOfInput] = asyncio.Queue(
            maxsize=config.writer.queue_depth
        )
        # Copies never wait behind the small blocking calls: writer.threads of their own.
        self.copy_executor = ThreadPoolExecutor(
            config.writer.threads, thread_name_prefix="hsx-copy"
        )
        self.file_writer = FileWriter(
            config.output.dir,
            method=config.writer.method,
            fsync=config.writer.fsync,
            row_bytes=config.model.row_bytes,
            copies=config.writer.threads,
        )
        self.committer = Committer(
            manifest, quarantine, executor, self.file_writer.publish, config.writer.fsync
        )
        # Writer tasks: more than copy threads, so that a sample waiting for its group
        # commit and delete does not hold a copy thread idle.
        self.tasks = WRITER_TASKS_PER_THREAD * config.writer.threads

    def apply(self, config: Config) -> None:
        """A reloaded config. No ``writer.*`` key is live (threads, method and fsync are
        fixed for the run), so only later reads see the new config."""
        self.config = config

    def close(self) -> None:
        """At the end of the run (blocking): queued copies are dropped, running ones
        finish, and the writer's threads stop."""
        self.copy_executor.shutdown(wait=True, cancel_futures=True)
        self.file_writer.close()

    def discard_temps(self) -> None:
        """Delete the temp files staged but never committed (once no commit runs)."""
        self.file_writer.discard_temps()

    async def submit(self, handoff: Handoff[WriteJob]) -> None:
        await self.queue.put(handoff)

    async def finish_input(self) -> None:
        """No more dumps: the writers finish the queue and stop."""
        await self.queue.put(EOF)

    async def quarantine(
        self, line: int, sample_id: Any, reason: Reason, duplicate_of: int | None = None
    ) -> None:
        entry = QuarantineEntry.of(sample_id, line, reason, duplicate_of)
        await asyncio.shield(self.committer.commit(self.committer.quarantine, entry.to_line()))
        self.metrics.sample_quarantined()
        # input_line: the number editors and grep -n show (the record keeps 0-based line)
        log.warning(
            "sample_quarantined", id=sample_id, input_line=line + 1, reason=reason.text,
            cause=reason.cause, kind=reason.kind, retriable=reason.retriable,
        )  # fmt: skip

    async def writer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            if isinstance(item, EndOfInput):
                self.queue.put_nowait(item)
                return
            outcome: Outcome = Abandoned("not written: the run stopped first")
            try:
                outcome = await asyncio.shield(self._finish(item.job))
            finally:
                gone = loop.run_in_executor(self.executor, delete_dump, item.job.dump.path)
                if isinstance(outcome, Committed):
                    # Durable: answered at once; the dump goes meanwhile (not awaited:
                    # Pipeline.close removes whatever is still there at the end).
                    item.settle(outcome)
                    gone.add_done_callback(functools.partial(_freed, item))
                else:  # gone before the answer: a retry never meets its dump
                    with contextlib.suppress(Exception):
                        await gone
                    item.settle(outcome)
                    item.free()

    async def _finish(self, job: WriteJob) -> Outcome:
        """Write, then commit the manifest line: shielded so a drain never cuts it in half."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        sample = job.sample
        try:
            staged = await loop.run_in_executor(self.copy_executor, self.file_writer.stage, job)
        except DumpError as exc:
            # Nothing was written: the attempt failed after all (a hostile or still-writing
            # server), which the worker half charges or forgives like any other.
            log.warning("dump_refused_at_copy", id=sample.id, error=str(exc))
            return Failed(exc)
        except DiskFullError as exc:
            # The temp file is gone; pause intake and extract this sample again later.
            # Not the sample's fault: ENOSPC pauses are unbounded by design.
            await self.guard.trip(str(exc))
            return Requeue(str(exc))
        try:
            await self.committer.commit_sample(staged)
        except Exception as exc:
            self.file_writer.forget(staged)  # the temp file, if it was not renamed yet
            if self.committer.failed:
                # The committer's task reports the error; a resume redoes this sample.
                return Abandoned(f"not committed: {exc}")
            raise
        entry = staged.entry
        self.metrics.write_latency.observe(time.monotonic() - started)
        self.metrics.sample_done(entry.num_tokens, entry.size)
        log.debug("sample_done", id=entry.id, tokens=entry.num_tokens, bytes=entry.size)
        return Committed(entry)


def _freed(item: Handoff[WriteJob], gone: asyncio.Future[None]) -> None:
    item.free()
    if not gone.cancelled() and (exc := gone.exception()) is not None:
        log.warning("dump_not_deleted", dump=str(item.job.dump.path), error=repr(exc))


def delete_dump(path: Path) -> None:
    """Free a dump's /dev/shm bytes. Never fails a run: what it leaves, the namespace
    sweep or the end of the run removes."""
    failpoint("dump.during_delete")
    with contextlib.suppress(OSError):
        remove_tree(path)
