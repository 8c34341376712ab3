"""The worker pool: N workers keep requests in flight; writers make dumps durable.

Flow of one sample::

    intake queue ─► worker: reserve /dev/shm bytes ─► POST /generate (rid per attempt)
        ─► wait for meta.json ─► validate ─► writer queue ─► writer thread: copy, hash,
        fsync a temp file ─► committer (a batch at a time): rename, fsync of the
        directories, manifest lines, fsync ─► delete dump ─► release bytes

A failed attempt deletes its dump, backs off and retries with a new rid; after the last
attempt the sample goes to quarantine with the reason. A sample reaches the manifest only
after its file is durable, and leaves /dev/shm only after its manifest line is.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import Config
from hsx_async.dataset.durable import write_error
from hsx_async.dataset.layout import build_layout, data_relpath, sample_key
from hsx_async.dataset.manifest import AppendLog, QuarantineEntry
from hsx_async.errors import DiskFullError, DumpError, RequestError, WriteError
from hsx_async.run.budget import ByteBudget
from hsx_async.run.client import ServerPool, SGLangClient
from hsx_async.run.dump import (
    Dump,
    has_debris,
    on_tmpfs,
    prepare_namespace,
    read_dump,
    remove_tree,
    sweep_namespace,
    validate_dump,
)
from hsx_async.run.dump import wait_for_meta as _wait_for_meta
from hsx_async.run.failpoints import failpoint
from hsx_async.run.guard import DiskGuard
from hsx_async.run.metrics import Metrics
from hsx_async.run.retry import RetryPolicy
from hsx_async.run.source import BadLine, Sample
from hsx_async.run.writer import FileWriter, Staged, WriteJob

log = structlog.get_logger("hsx.pool")

# A tiny sample waits for its group commit several times as long as its copy took, so a
# copy thread needs several writer tasks to stay busy (tiny samples, bench/overhead.py:
# 4 tasks a thread 310 requests/s, 8: 342, 16: 368); large ones queue on the copy threads
# whatever the count, within the /dev/shm budget.
WRITER_TASKS_PER_THREAD = 8


class _Eof:
    """End marker: a consumer that takes it puts it back for the next one."""


EOF = _Eof()


@dataclass(frozen=True, slots=True)
class _Handoff:
    """A validated dump on its way to the writer, with what the worker reserved for it."""

    job: WriteJob
    ns: str
    need: int
    tries: _Tries  # the attempts behind this dump, counting it


@dataclass(slots=True)
class _Tries:
    """Attempts of one sample so far. ``rids``: requests sent (each rid is used once, also
    when the writer hands a sample back); ``failed``: the failures that count against
    ``workers.max_attempts``, wherever they happened — a request, a dump, or a dump that
    changed before its copy. A paused disk (ENOSPC) counts in ``rids`` only."""

    rids: int = 0
    failed: int = 0


@dataclass(slots=True)
class _Line:
    log_file: AppendLog
    line: bytes
    done: asyncio.Future[None]
    staged: Staged | None = None  # a sample file to name before its manifest line
    dump: Path | None = None  # ... and its dump, deleted once the line is durable


@dataclass
class Committer:
    """Group commit: every sample file and log line that arrived while the previous batch
    was syncing is made durable together, so the cost per sample falls as load rises.

    A batch: rename the staged files into place, one fsync per directory they touched,
    then one write + fsync per log file, then delete the samples' dumps. A manifest line
    is never durable before its file and name are (PROTOCOL §4); a crash in between leaves
    a named file without a line, which a resume deletes; a dump goes only after its line.
    """

    manifest: AppendLog
    quarantine: AppendLog
    executor: ThreadPoolExecutor
    publish: Callable[[list[Staged]], None]
    fsync: bool = True
    _pending: list[_Line] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: bool = False
    _failed: BaseException | None = None

    async def commit(self, log_file: AppendLog, line: bytes) -> None:
        await self._submit(_Line(log_file, line, self._future()))

    async def commit_sample(self, staged: Staged, dump: Path) -> None:
        """Name the staged file and list it in the manifest, durably; then delete its dump."""
        line = _Line(self.manifest, staged.entry.to_line(), self._future(), staged, dump)
        await self._submit(line)

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
        for item in batch:
            if item.dump is not None:
                delete_dump(item.dump)


class Pipeline:
    """Workers, writers and committer for one run. The daemon owns their tasks."""

    def __init__(
        self,
        config: Config,
        *,
        client: SGLangClient,
        metrics: Metrics,
        manifest: AppendLog,
        quarantine: AppendLog,
        guard: DiskGuard,
    ) -> None:
        self.config = config
        self.guard = guard
        self.client = client
        self.servers: ServerPool = client.pool
        self.metrics = metrics
        self.nonce = secrets.token_hex(6)  # rids stay unique across restarts
        self.budget = ByteBudget(config.dump.shm_budget)
        self.intake: asyncio.Queue[Sample | _Eof] = asyncio.Queue(
            maxsize=2 * config.workers.concurrency
        )
        self.requeued: collections.deque[Sample] = collections.deque()
        self.tries: dict[int, _Tries] = {}  # line → attempts, for requeued samples only
        self.write_queue: asyncio.Queue[_Handoff | _Eof] = asyncio.Queue(
            maxsize=config.writer.queue_depth
        )
        # Small blocking calls (sweeps, validation, deletes, commits) never wait behind
        # the copies: those have their own threads, writer.threads of them.
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="hsx-io")
        self.copy_executor = ThreadPoolExecutor(
            config.writer.threads, thread_name_prefix="hsx-copy"
        )
        self.file_writer = FileWriter(
            config.output.dir,
            method=config.writer.method,
            fsync=config.writer.fsync,
            row_bytes=config.model.row_bytes,
        )
        self.committer = Committer(
            manifest, quarantine, self.executor, self.file_writer.publish, config.writer.fsync
        )
        # Writer tasks: more than copy threads, so that a sample waiting for its group
        # commit and delete does not hold a copy thread idle.
        self.writer_tasks = WRITER_TASKS_PER_THREAD * config.writer.threads
        self.retry = RetryPolicy(
            config.workers.max_attempts, config.workers.backoff_base, config.workers.backoff_max
        )
        self.target_workers = config.workers.concurrency
        self.stopping = False
        self.live_rids: dict[str, set[str]] = collections.defaultdict(set)  # ns → rids
        self.workers_running = 0
        self.workers_done = asyncio.Event()
        self.namespaces: set[Path] = set()  # removed when the run ends
        # Dumps on a tmpfs are looked at on the event loop, elsewhere from a thread.
        self.dump_on_tmpfs: bool | None = None  # known once the first namespace exists
        self._next_worker = 0
        self.in_flight = 0
        self._changed = asyncio.Event()
        self.settled = 0  # samples taken from the intake that reached manifest or quarantine

    # -- helpers ------------------------------------------------------------------------

    async def to_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        """At the end of the run (blocking): queued calls are dropped, running ones
        finish; temp files staged but never committed (a failed or cut-short run) are
        deleted, and nothing is left in /dev/shm."""
        for executor in (self.copy_executor, self.executor):
            executor.shutdown(wait=True, cancel_futures=True)
        self.file_writer.discard_temps()
        for ns_dir in self.namespaces:
            remove_tree(ns_dir)

    def namespace(self, index: int) -> str:
        return f"{namespace_base(self.config)}{index}"

    async def quarantine(self, line: int, sample_id: Any, reason: str) -> None:
        entry = QuarantineEntry(sample_id, line, reason)
        await asyncio.shield(self.committer.commit(self.committer.quarantine, entry.to_line()))
        self.metrics.sample_quarantined()
        log.warning("sample_quarantined", id=sample_id, line=line, reason=reason)

    async def quarantine_bad_line(self, bad: BadLine) -> None:
        await self.quarantine(bad.line, bad.id, bad.reason)

    # -- workers ------------------------------------------------------------------------

    def spawn_worker(self, tg: asyncio.TaskGroup) -> None:
        index = self._next_worker
        self._next_worker += 1
        self.workers_running += 1
        self.metrics.workers.set(self.workers_running)
        tg.create_task(self._worker(index), name=f"hsx-worker-{index}")

    async def _next_sample(self) -> Sample | _Eof:
        if self.requeued:
            return self.requeued.popleft()
        return await self.intake.get()

    async def _requeue_after_eof(self) -> bool:
        """At the end of input, wait while samples are still in flight: the writer may
        hand one back (ENOSPC, a dump changed before its copy). True: one is waiting."""
        while not (self.requeued or self.in_flight == 0 or self.stopping):
            self._changed.clear()  # no await between the check and the clear: no lost wake
            await self._changed.wait()
        return bool(self.requeued) and not self.stopping

    def wake_workers(self) -> None:
        """Something a worker at the end of input waits for changed."""
        self._changed.set()

    def resize(self, target: int, tg: asyncio.TaskGroup) -> None:
        """Live resize: spawn workers, or let the surplus retire after their sample."""
        self.target_workers = target
        while self.workers_running < target:
            self.spawn_worker(tg)

    async def _worker(self, index: int) -> None:
        ns = self.namespace(index)
        ns_dir = await self.to_thread(prepare_namespace, self.config.dump.root, ns)
        self.namespaces.add(ns_dir)
        if self.dump_on_tmpfs is None:
            self.dump_on_tmpfs = await self.to_thread(on_tmpfs, ns_dir)
        try:
            # The check and the decrement in `finally` run without an await between
            # them, so exactly the surplus retires after a shrink.
            while self.workers_running <= self.target_workers:
                await self.guard.open.wait()  # the disk guard pauses intake here
                item = await self._next_sample()
                if isinstance(item, _Eof):
                    self.intake.put_nowait(item)  # let the next worker see it too
                    if await self._requeue_after_eof():
                        continue
                    break
                if self.stopping:
                    continue  # stop intake: skip queued samples, a resume redoes them
                await self._process(item, ns, ns_dir)
        finally:
            self.workers_running -= 1
            self.metrics.workers.set(self.workers_running)
            if self.workers_running == 0:
                self.workers_done.set()
            log.debug("worker_exit", worker=index, ns=ns)

    async def _process(self, sample: Sample, ns: str, ns_dir: Path) -> None:
        need = sample.num_tokens * self.config.model.row_bytes
        await self.budget.acquire(need)
        self.metrics.shm_used.set(self.budget.used)
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        handed_off = False
        try:
            extracted = await self._extract(sample, ns, ns_dir)
            if extracted is not None:
                await self._hand_off(sample, *extracted, ns, need)
                handed_off = True
        finally:
            if not handed_off:
                self._release(need)

    def _release(self, need: int) -> None:
        self.budget.release(need)
        self.metrics.shm_used.set(self.budget.used)
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        self.wake_workers()

    async def _extract(self, sample: Sample, ns: str, ns_dir: Path) -> tuple[Dump, _Tries] | None:
        """Attempts until one yields a valid dump; None once the sample is quarantined.
        A sample the writer handed back goes on from its earlier attempts."""
        tries = self.tries.pop(sample.line, None) or _Tries()
        while True:
            tries.rids += 1
            rid = f"{self.nonce}-{sample.line}-{tries.rids}"
            started = time.monotonic()
            try:
                dump = await self._attempt(sample, rid, ns, ns_dir)
            except (RequestError, DumpError) as exc:
                # The failed dump goes, and any debris with it (late writes of abandoned
                # attempts): everything but the dumps the writers hold.
                await self.to_thread(sweep_namespace, ns_dir, set(self.live_rids[ns]))
                kind = "request" if isinstance(exc, RequestError) else "dump"
                self.metrics.attempt_failed(kind)
                log.info(
                    "attempt_failed", id=sample.id, rid=rid, attempt=tries.rids, error=str(exc)
                )
                if await self._count_failure(sample, tries, str(exc)):
                    return None
                await asyncio.sleep(self.retry.delay(tries.failed))
                continue
            self.metrics.request_latency.observe(time.monotonic() - started)
            return dump, tries

    async def _count_failure(self, sample: Sample, tries: _Tries, error: str) -> bool:
        """Count one failed attempt; True once the sample is quarantined for it."""
        tries.failed += 1
        if self.retry.exhausted(tries.failed):
            reason = f"{tries.failed} attempts failed; last: {error}"
            await self.quarantine(sample.line, sample.id, reason)
            self.settled += 1
            return True
        if tries.failed == 1:
            self.metrics.totals.samples_retried += 1
        return False

    async def _attempt(self, sample: Sample, rid: str, ns: str, ns_dir: Path) -> Dump:
        cfg = self.config
        async with self.servers.lease() as server:
            try:
                await self.client.generate(
                    server,
                    rid=rid,
                    ns=ns,
                    input_ids=sample.input_ids,
                    timeout=cfg.server.request_timeout,
                )
            except RequestError as exc:
                await self.servers.failed(server, exc)
                raise
            self.servers.succeeded(server)
        rid_dir = ns_dir / rid
        keep = {*self.live_rids[ns], rid}

        def validate(meta: bytes, sizes: dict[tuple[int, int], int] | None) -> Dump:
            return validate_dump(
                rid_dir,
                meta,
                rid=rid,
                num_tokens=sample.num_tokens,
                hidden_size=cfg.model.hidden_size,
                aux_layers=cfg.model.aux_layers,
                row_bytes=cfg.model.row_bytes,
                sizes=sizes,
            )

        def look() -> Dump | None:
            found = read_dump(rid_dir)
            return None if found is None else validate(*found)

        # The hook commits before it responds, so the first look nearly always finds
        # meta.json; the poll (on the event loop, backing off) is for late commits.
        dump: Dump | None
        if self.dump_on_tmpfs:
            # No call here waits for a device: on the loop they cost less than a thread
            # hop (a wake-up and a GIL hand-over each way). Debris, rare, goes in a thread.
            dump = look()
            if dump is None:
                dump = validate(await _wait_for_meta(rid_dir, cfg.dump.timeout), None)
            if has_debris(ns_dir, keep):
                await self.to_thread(sweep_namespace, ns_dir, keep)
            return dump

        def look_and_sweep(meta: bytes | None) -> Dump | None:
            dump = look() if meta is None else validate(meta, None)
            if dump is not None:
                sweep_namespace(ns_dir, keep)  # debris since the last look: same thread hop
            return dump

        dump = await self.to_thread(look_and_sweep, None)
        if dump is None:
            meta = await _wait_for_meta(rid_dir, cfg.dump.timeout)
            dump = await self.to_thread(look_and_sweep, meta)
        assert dump is not None
        return dump

    async def _hand_off(
        self, sample: Sample, dump: Dump, tries: _Tries, ns: str, need: int
    ) -> None:
        layout = build_layout(
            sample_id=sample.id,
            num_tokens=sample.num_tokens,
            hidden_size=self.config.model.hidden_size,
            aux_layers=self.config.model.aux_layers,
            has_loss_mask=sample.loss_mask is not None,
        )
        job = WriteJob(
            sample,
            dump,
            layout,
            data_relpath(sample_key(sample.id)),
            f"s{self.config.shard.index}-{self.nonce}",
        )
        self.live_rids[ns].add(dump.path.name)
        await self.write_queue.put(_Handoff(job, ns, need, tries))
        self.metrics.writer_queue.set(self.write_queue.qsize())

    # -- writers ------------------------------------------------------------------------

    def _requeue(self, sample: Sample, tries: _Tries) -> None:
        """Hand a sample back to the workers, with its attempts so far."""
        self.tries[sample.line] = tries
        self.requeued.append(sample)
        self.wake_workers()

    async def close_writers(self) -> None:
        """After the last worker: let the writers finish the queue and stop."""
        await self.workers_done.wait()
        await self.write_queue.put(EOF)

    async def writer(self) -> None:
        while True:
            item = await self.write_queue.get()
            self.metrics.writer_queue.set(self.write_queue.qsize())
            if isinstance(item, _Eof):
                self.write_queue.put_nowait(item)
                return
            deleted = False
            try:
                deleted = await asyncio.shield(self._finish(item.job, item.tries))
            finally:
                if not deleted:
                    await self.to_thread(delete_dump, item.job.dump.path)
                self.live_rids[item.ns].discard(item.job.dump.path.name)
                self._release(item.need)

    async def _finish(self, job: WriteJob, tries: _Tries) -> bool:
        """Write, then commit the manifest line: shielded so a drain never cuts it in half.
        True once committed (the commit deleted the dump too)."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        sample = job.sample
        try:
            staged = await loop.run_in_executor(self.copy_executor, self.file_writer.stage, job)
        except DumpError as exc:
            # Nothing was written. A failed attempt like any other: it counts, so a dump
            # that keeps changing (a hostile or still-writing server) ends in quarantine.
            log.warning("dump_changed_before_copy", id=sample.id, error=str(exc))
            self.metrics.attempt_failed("dump")
            if not await self._count_failure(sample, tries, str(exc)):
                self._requeue(sample, tries)
            return False
        except DiskFullError as exc:
            # The temp file is gone; pause intake and extract this sample again later.
            # Not the sample's fault: ENOSPC pauses are unbounded by design.
            self.guard.trip(str(exc))
            self._requeue(sample, tries)
            return False
        try:
            await self.committer.commit_sample(staged, job.dump.path)
        except Exception:
            self.file_writer.forget(staged)  # the temp file, if it was not renamed yet
            if self.committer.failed:
                return False  # the committer's task reports the error; a resume redoes this
            raise
        entry = staged.entry
        self.settled += 1
        self.metrics.write_latency.observe(time.monotonic() - started)
        self.metrics.sample_done(entry.num_tokens, entry.size)
        log.debug("sample_done", id=entry.id, tokens=entry.num_tokens, bytes=entry.size)
        return True


def namespace_base(config: Config) -> str:
    """What every worker namespace of this run starts with; a worker's number follows.
    Names made from different prefixes never collide (a base ends in ``-w``, the rest is
    digits), so one lock per base (:func:`~hsx_async.run.dump.namespace_lock`) covers them."""
    prefix, shard = config.dump.namespace_prefix, config.shard
    return f"{prefix}-s{shard.index}-w" if shard.count > 1 else f"{prefix}-w"


def delete_dump(path: Path) -> None:
    """Free a dump's /dev/shm bytes. Never fails a run: what it leaves, the namespace
    sweep or the end of the run removes."""
    failpoint("dump.during_delete")
    with contextlib.suppress(OSError):
        remove_tree(path)
