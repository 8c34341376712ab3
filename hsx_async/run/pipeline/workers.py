"""The worker half of the pipeline: N workers keep requests in flight.

A worker takes a sample from the intake, reserves its /dev/shm bytes, sends
``POST /generate`` (a new rid per attempt), waits for the dump's ``meta.json``, validates
it and hands it to the writers (:mod:`hsx_async.run.pipeline.writers`). A failed attempt deletes its
dump, backs off and retries; after the last attempt the sample goes to quarantine with the
reason. The writers answer each hand-off with its outcome (:mod:`hsx_async.run.pipeline.handoff`):
the reserved bytes are released then, and a sample they could not write is retried or
quarantined here — the retry bookkeeping lives in this half only.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import Config
from hsx_async.dataset.layout import build_layout, data_relpath, sample_key
from hsx_async.dataset.provenance import FinalStateGuard
from hsx_async.dataset.quarantine import reason_kind
from hsx_async.errors import DumpError, RequestError
from hsx_async.run.dumps.dump import (
    Dump,
    has_debris,
    on_tmpfs,
    prepare_namespace,
    read_dump,
    sweep_namespace,
    validate_dump,
)
from hsx_async.run.dumps.dump import wait_for_meta as _wait_for_meta
from hsx_async.run.dumps.writer import WriteJob
from hsx_async.run.pipeline.budget import ByteBudget
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
    Sink,
)
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault, fault_of
from hsx_async.run.servers.identity import check_dump
from hsx_async.run.servers.pool import PoolStopped, Server, ServerPool
from hsx_async.run.servers.retry import Attempts, RetryPolicy
from hsx_async.run.source import Sample

log = structlog.get_logger("hsx.workers")


@dataclass(frozen=True, slots=True)
class _Reserved:
    """What a worker holds for a handed-off dump: the sample until its outcome comes back,
    the rid and the bytes until the writers freed the dump."""

    sample: Sample
    tries: Attempts  # the attempts behind this dump, counting it
    server: Server  # where the dump came from
    lease: int  # its attempt's lease number at that server
    ns: str
    rid: str
    need: int  # /dev/shm bytes


@dataclass(frozen=True, slots=True)
class _Extracted:
    """A valid dump, the server it came from (and the attempt's lease number there) and
    the attempts behind it."""

    dump: Dump
    server: Server
    lease: int
    tries: Attempts


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed attempt: its error, and the server it went to (None: none was leased)."""

    error: RequestError | DumpError
    server: Server | None
    lease: int = 0  # the attempt's lease number on ``server``


def retry_policy(config: Config) -> RetryPolicy:
    w = config.workers
    return RetryPolicy(w.max_attempts, w.backoff_base, w.backoff_max)


class Intake:
    """Samples waiting for a worker: the feeder's bounded queue, and the samples the
    writers hand back (ENOSPC, a dump changed before its copy), which go first."""

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[Sample | EndOfInput] = asyncio.Queue(maxsize=maxsize)
        self.requeued: collections.deque[Sample] = collections.deque()
        self.stopping = False
        self._changed = asyncio.Event()

    async def put(self, item: Sample | EndOfInput) -> None:
        await self.queue.put(item)

    async def next(self) -> Sample | EndOfInput:
        if self.requeued:
            return self.requeued.popleft()
        return await self.queue.get()

    def requeue(self, sample: Sample) -> None:
        self.requeued.append(sample)
        self.wake()

    def stop(self) -> None:
        """Stop taking samples: workers skip what is queued (a resume redoes it)."""
        self.stopping = True
        self.wake()

    def wake(self) -> None:
        """Something a worker at the end of input waits for changed."""
        self._changed.set()

    async def changed(self, also: asyncio.Future[Any]) -> None:
        """Until :meth:`wake` (a stop, a requeue) or ``also`` is done."""
        self._changed.clear()
        wake: asyncio.Future[Any] = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({wake, also}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()

    async def after_eof(self, in_flight: Callable[[], int]) -> bool:
        """At the end of input (the EOF put back for the next worker), wait while samples
        are still in flight: the writers may hand one back. True: one is waiting."""
        self.queue.put_nowait(EOF)
        while not (self.requeued or in_flight() == 0 or self.stopping):
            self._changed.clear()  # no await between the check and the clear: no lost wake
            await self._changed.wait()
        return bool(self.requeued) and not self.stopping


class Workers:
    """The workers of one run; the daemon's task group runs them (:meth:`start`)."""

    def __init__(
        self,
        config: Config,
        *,
        client: EngineClient,
        metrics: Metrics,
        guard: DiskGuard,
        executor: ThreadPoolExecutor,
        sink: Sink[WriteJob],
        nonce: str,
    ) -> None:
        self.config = config
        self.client = client
        self.servers: ServerPool = client.pool
        self.metrics = metrics
        self.guard = guard
        self.executor = executor  # small blocking calls: sweeps, validation (not owned)
        self.sink = sink  # the writer half
        self.nonce = nonce  # rids stay unique across restarts
        self.budget = ByteBudget(config.dump.shm_budget)
        self.final_states = FinalStateGuard(config.output.dir)  # one kind per dataset
        self.intake = Intake(maxsize=2 * config.workers.start_concurrency)
        self.tries: dict[int, Attempts] = {}  # line → attempts, for handed-back samples only
        self.retry = retry_policy(config)
        self.target_workers = config.workers.start_concurrency
        self.live_rids: dict[str, set[str]] = collections.defaultdict(set)  # ns → rids
        # Settles a server's refusal of a sample (its lease number): True, the sample's.
        self.arbiter: Callable[[Server, int], Awaitable[bool]] | None = None
        self.workers_running = 0
        self.workers_done = asyncio.Event()
        self.namespaces: set[Path] = set()  # removed when the run ends
        # Dumps on a tmpfs are looked at on the event loop, elsewhere from a thread.
        self.dump_on_tmpfs: bool | None = None  # known once the first namespace exists
        # The namespaces of the run's first workers, made together (:meth:`_namespace`).
        self._first: asyncio.Future[tuple[list[Path], bool]] | None = None
        self._first_count = 0
        self.in_flight = 0
        self.settled = 0  # samples taken from the intake now in the manifest or quarantine
        self._next_worker = 0
        self._tg: asyncio.TaskGroup | None = None

    # -- life cycle and live changes -----------------------------------------------------

    def start(self, tg: asyncio.TaskGroup) -> None:
        """Spawn the run's first workers (``workers.concurrency``, or where ``"auto"``
        starts) in the run's task group."""
        self._tg = tg
        self._first_count = self.config.workers.start_concurrency
        self.set_concurrency(self._first_count)

    def set_concurrency(self, n: int) -> None:
        """Live resize: spawn workers, or let the surplus retire after their sample."""
        if n < 1:
            raise ValueError(f"concurrency must be at least 1, not {n}")
        if self._tg is None:
            raise RuntimeError("the workers have not been started")
        self.target_workers = n
        while self.workers_running < n:
            self._spawn(self._tg)

    def apply(self, config: Config) -> None:
        """A reloaded config: concurrency, /dev/shm budget and retry policy change now;
        timeouts are read at each attempt."""
        old, self.config = self.config, config
        # Under "auto" the controller owns the count (the daemon's autotune loop).
        if config.workers.concurrency != old.workers.concurrency and not config.workers.auto:
            self.set_concurrency(config.workers.start_concurrency)
        if config.dump.shm_budget != old.dump.shm_budget:
            self.budget.resize(config.dump.shm_budget)
        self.retry = retry_policy(config)

    async def to_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- one worker ----------------------------------------------------------------------

    def _spawn(self, tg: asyncio.TaskGroup) -> None:
        index = self._next_worker
        self._next_worker += 1
        self.workers_running += 1
        tg.create_task(self._worker(index), name=f"hsx-worker-{index}")

    async def _worker(self, index: int) -> None:
        ns_dir = await self._namespace(index)
        ns = ns_dir.name
        try:
            # The check and the decrement in `finally` run without an await between
            # them, so exactly the surplus retires after a shrink.
            while self.workers_running <= self.target_workers:
                await self._intake_open()  # the disk guard pauses intake here
                item = await self.intake.next()
                if isinstance(item, EndOfInput):
                    if await self.intake.after_eof(lambda: self.in_flight):
                        continue
                    break
                if self.intake.stopping:
                    continue  # stop intake: skip queued samples, a resume redoes them
                await self._process(item, ns, ns_dir)
        finally:
            self.workers_running -= 1
            if self.workers_running == 0:
                self.workers_done.set()
            log.debug("worker_exit", worker=index, ns=ns)

    async def _namespace(self, index: int) -> Path:
        """Worker ``index``'s dump namespace, made empty; the first time, whether the dump
        root is a tmpfs too. The run's first workers have theirs made together, in one
        call off the loop: a call each (and a tmpfs check each, all started before the
        first answered) put 16 thread calls, contending with the event loop for the GIL,
        on the first sample's path (bench/README.md, issue 27, sixth round)."""
        if index < self._first_count:
            if self._first is None:
                self._first = self._prepare(range(self._first_count))
            dirs, tmpfs = await asyncio.shield(self._first)
            ns_dir = dirs[index]
        else:
            (ns_dir,), tmpfs = await self._prepare([index])
        if self.dump_on_tmpfs is None:
            self.dump_on_tmpfs = tmpfs
        return ns_dir

    def _prepare(self, indices: Iterable[int]) -> asyncio.Future[tuple[list[Path], bool]]:
        """The namespaces of workers ``indices`` made empty, in one call off the loop, and
        whether they lie on a tmpfs (looked at once a run). Each is removed when the run
        ends, whatever happens to the call."""
        root, known = self.config.dump.root, self.dump_on_tmpfs
        dirs = [root / namespace(self.config, index) for index in indices]
        self.namespaces.update(dirs)

        def prepare() -> tuple[list[Path], bool]:
            made = [prepare_namespace(root, ns_dir.name) for ns_dir in dirs]
            return made, known if known is not None else on_tmpfs(made[0])

        done = asyncio.ensure_future(self.to_thread(prepare))
        # Retrieved: every worker waiting for it may be gone (the run ended).
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return done

    async def _intake_open(self) -> None:
        """Until the guard lets samples in, or a stop makes waiting pointless (a paused
        run drains at once: what is queued is redone on resume)."""
        if self.guard.open.is_set() or self.intake.stopping:
            return
        opened: asyncio.Future[Any] = asyncio.ensure_future(self.guard.open.wait())
        try:
            while not (opened.done() or self.intake.stopping):
                await self.intake.changed(opened)
        finally:
            opened.cancel()

    async def _process(self, sample: Sample, ns: str, ns_dir: Path) -> None:
        if not self.guard.admit(sample):  # a full spool: back first in line, intake paused
            self.intake.requeue(sample)
            return
        need = sample.num_tokens * self.config.model.row_bytes
        await self.budget.acquire(need)
        self.in_flight += 1
        handed_off = False
        try:
            extracted = await self._extract(sample, ns, ns_dir)
            if extracted is not None:
                await self._hand_off(sample, extracted, ns, need)
                handed_off = True
        finally:
            if not handed_off:
                self._release(need)

    def _release(self, need: int) -> None:
        self.budget.release(need)
        self._landed()

    def _landed(self) -> None:
        """A sample is no longer in flight (settled, or back in the intake)."""
        self.in_flight -= 1
        self.intake.wake()

    async def _extract(self, sample: Sample, ns: str, ns_dir: Path) -> _Extracted | None:
        """Attempts until one yields a valid dump; None once the sample is quarantined
        (or abandoned: the run stops while it waits for a server). A sample the writers
        handed back goes on from its earlier attempts."""
        tries = self.tries.pop(sample.line, None) or Attempts()
        while True:
            tries.settle(self.retry)  # a suspicion may have been settled while it waited
            if tries.exhausted(self.retry):
                await self._quarantine(sample, tries)
                return None
            tries.rids += 1
            rid = f"{self.nonce}-{sample.line}-{tries.rids}"
            started = time.monotonic()
            # Every event of this attempt, here and in the modules it calls, names it.
            with structlog.contextvars.bound_contextvars(id=sample.id, rid=rid, attempt=tries.rids):
                try:
                    result = await self._attempt(sample, rid, ns, ns_dir)
                except PoolStopped:
                    log.info("sample_abandoned", why="the run stopped while it waited for a server")
                    return None
                if isinstance(result, _Failure):
                    if await self._failed_attempt(sample, tries, ns, ns_dir, result):
                        return None
                    continue
            self.metrics.request_latency.observe(time.monotonic() - started)
            return _Extracted(*result, tries)

    async def _failed_attempt(
        self, sample: Sample, tries: Attempts, ns: str, ns_dir: Path, failure: _Failure
    ) -> bool:
        """Clean up after a failed attempt, attribute it and back off; True once the
        sample is quarantined."""
        # The failed dump goes, and any debris with it (late writes of abandoned
        # attempts): everything but the dumps the writers hold.
        await self.to_thread(sweep_namespace, ns_dir, set(self.live_rids[ns]))
        fault = await self._arbitrated(fault_of(failure.error), failure)
        log.info("attempt_failed", cause=fault.cause, kind=fault.kind, error=fault.reason)
        if await self._count(sample, tries, fault, failure.server):
            return True
        if fault.cause == "server" and not fault.reached:
            return False  # the server is out of rotation: the next lease waits for one
        await asyncio.sleep(self.retry.delay(tries.failed))
        return False

    async def _arbitrated(self, fault: Fault, failure: _Failure) -> Fault:
        """A refusal of the sample's content (a 4xx) is the sample's only once its server is
        shown to work for a request sent at or after it (:meth:`Admission.arbitrate`: a
        storm of refusals from one server is arbitrated by its probe before the samples
        pay). Refused by a server that fails its probe too, it is that server's, and the
        sample goes on uncharged."""
        server = failure.server
        if fault.cause != "sample" or server is None or self.arbiter is None:
            return fault
        if await self.arbiter(server, failure.lease):
            return fault
        return Fault("server", fault.kind, f"{fault.reason} (its probe was refused too)")

    async def _count(
        self, sample: Sample, tries: Attempts, fault: Fault, server: Server | None
    ) -> bool:
        """Record one failed attempt (here, or a dump that changed before its copy) by its
        cause; True once the sample is quarantined for it."""
        self.metrics.attempt_failed(fault.kind, fault.cause, reason_kind(fault.reason))
        tries.record(fault, server)  # before the server's record changes for it
        if server is not None:
            await self.servers.fault(server, fault)
        tries.settle(self.retry)
        if tries.exhausted(self.retry):
            await self._quarantine(sample, tries)
            return True
        if tries.failed == 1:
            self.metrics.totals.samples_retried += 1
        return False

    async def _quarantine(self, sample: Sample, tries: Attempts) -> None:
        await self.sink.quarantine(sample.line, sample.id, tries.quarantine_reason())
        self.settled += 1

    def _requeue(self, sample: Sample, tries: Attempts) -> None:
        """Put a sample back into the intake (ahead of new ones), with its attempts so far."""
        self.tries[sample.line] = tries
        self.intake.requeue(sample)

    async def _attempt(
        self, sample: Sample, rid: str, ns: str, ns_dir: Path
    ) -> tuple[Dump, Server, int] | _Failure:
        cfg = self.config
        # No deadline here: the admission task owns the wait for a server (exit 3).
        async with self.servers.lease(timeout=None) as server:
            lease = server.requests
            try:
                await self.client.generate(
                    server,
                    rid=rid,
                    ns=ns,
                    input_ids=sample.input_ids,
                    timeout=cfg.server.request_timeout,
                    storage=cfg.storage,
                )
            except (RequestError, DumpError) as exc:
                return _Failure(exc, server, lease)
        keep = {*self.live_rids[ns], rid}
        try:
            dump = await collect_dump(
                self.config,
                sample,
                ns_dir / rid,
                keep,
                on_tmpfs=bool(self.dump_on_tmpfs),
                to_thread=self.to_thread,
                final_states=self.final_states,
            )
            if server.identity is not None:  # every meta.json against its server's identity
                check_dump(server.identity, dump.meta, server.display)
        except DumpError as exc:
            return _Failure(exc, server, lease)
        return dump, server, lease

    async def _hand_off(self, sample: Sample, got: _Extracted, ns: str, need: int) -> None:
        """Queue the dump for the writers; its outcome comes back to :meth:`_settle`, and
        :meth:`_freed` releases what it holds once the writers deleted it."""
        job = write_job(self.config, sample, got.dump, self.nonce)
        loop = asyncio.get_running_loop()
        handoff = Handoff(job, loop.create_future(), loop.create_future())
        await self.sink.submit(handoff)
        # No await since the put: the writers cannot have answered yet.
        reserved = _Reserved(sample, got.tries, got.server, got.lease, ns, got.dump.path.name, need)
        self.live_rids[ns].add(reserved.rid)
        handoff.outcome.add_done_callback(functools.partial(self._settle, reserved))
        handoff.freed.add_done_callback(functools.partial(self._freed, reserved))

    def _settle(self, held: _Reserved, done: asyncio.Future[Outcome]) -> None:
        """The writers are done with a sample: what its outcome means for it."""
        outcome = done.result() if not done.cancelled() else Abandoned("cancelled")
        if isinstance(outcome, Failed) and self._spawn_task(self._copy_failed(held, outcome)):
            # Counting may quarantine (a commit): the sample stays in flight until that
            # is durable.
            return
        if isinstance(outcome, Committed):
            self.settled += 1
            # The evidence that a server works (hsx_async.run.servers.retry): its dump became a
            # sample — not merely passed validation (a dump may change before its copy).
            self.servers.served(held.server, held.lease)
        elif isinstance(outcome, Requeue):
            self._requeue(held.sample, held.tries)  # a full disk: uncharged
        self._landed()

    def _freed(self, held: _Reserved, _: asyncio.Future[None]) -> None:
        """The writers deleted the dump: its rid and its /dev/shm bytes are free."""
        self.live_rids[held.ns].discard(held.rid)
        self.budget.release(held.need)
        self.intake.wake()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run ``coro`` in the run's task group; False (and ``coro`` dropped) once the
        group is shutting down: the run is ending, and a resume redoes the sample."""
        try:
            assert self._tg is not None, "start() first"
            self._tg.create_task(coro)
        except RuntimeError:
            coro.close()
            return False
        return True

    async def _copy_failed(self, held: _Reserved, outcome: Failed) -> None:
        """A dump that failed its copy: a failed attempt like any other."""
        try:
            fault = fault_of(outcome.error)
            if not await self._count(held.sample, held.tries, fault, held.server):
                self._requeue(held.sample, held.tries)
        finally:
            self._landed()


def namespace_base(config: Config) -> str:
    """What every worker namespace of this run starts with; a worker's number follows.
    Names made from different prefixes never collide (a base ends in ``-w``, the rest is
    digits), so one lock per base (:func:`~hsx_async.run.dumps.dump.namespace_lock`) covers them."""
    prefix, shard = config.dump.namespace_prefix, config.shard
    return f"{prefix}-s{shard.index}-w" if shard.count > 1 else f"{prefix}-w"


def probe_namespace(config: Config) -> str:
    """Where the admission's probes dump (covered by the run's namespace lock)."""
    return f"{namespace_base(config)}probe"


def namespace(config: Config, index: int) -> str:
    """Worker ``index``'s dump namespace (shards of one job never share one)."""
    return f"{namespace_base(config)}{index}"


def write_job(config: Config, sample: Sample, dump: Dump, nonce: str) -> WriteJob:
    """What the writer needs to turn a validated dump into the sample's file."""
    layout = build_layout(
        sample_id=sample.id,
        num_tokens=sample.num_tokens,
        hidden_size=config.model.hidden_size,
        aux_layers=config.model.aux_layers,
        has_loss_mask=sample.loss_mask is not None,
        final_state=dump.meta.final_state,
        storage=config.storage,
    )
    key = sample_key(sample.id)
    return WriteJob(sample, dump, layout, data_relpath(key), f"s{config.shard.index}-{nonce}")


async def collect_dump(
    cfg: Config,
    sample: Sample,
    rid_dir: Path,
    keep: set[str],
    *,
    on_tmpfs: bool,
    to_thread: Callable[..., Awaitable[Any]],
    final_states: FinalStateGuard,
) -> Dump:
    """An attempt's dump, read and validated (waiting for a late ``meta.json``); debris
    in its namespace (every rid but ``keep``) is swept on the way."""
    ns_dir = rid_dir.parent
    rid = rid_dir.name

    def validate(meta: bytes, sizes: dict[tuple[int, int], int] | None) -> Dump:
        dump = validate_dump(
            rid_dir,
            meta,
            rid=rid,
            num_tokens=sample.num_tokens,
            hidden_size=cfg.model.hidden_size,
            aux_layers=cfg.model.aux_layers,
            storage=cfg.storage,
            sizes=sizes,
        )
        final_states.accept(dump.meta.final_state)  # one kind per dataset
        return dump

    def look() -> Dump | None:
        found = read_dump(rid_dir)
        return None if found is None else validate(*found)

    # The hook commits before it responds, so the first look nearly always finds
    # meta.json; the poll (on the event loop, backing off) is for late commits.
    dump: Dump | None
    if on_tmpfs:
        # No call here waits for a device: on the loop they cost less than a thread
        # hop (a wake-up and a GIL hand-over each way). Debris, rare, goes in a thread.
        dump = look()
        if dump is None:
            dump = validate(await _wait_for_meta(rid_dir, cfg.dump.timeout), None)
        if has_debris(ns_dir, keep):
            await to_thread(sweep_namespace, ns_dir, keep)
        return dump

    def look_and_sweep(meta: bytes | None) -> Dump | None:
        dump = look() if meta is None else validate(meta, None)
        if dump is not None:
            sweep_namespace(ns_dir, keep)  # debris since the last look: same thread hop
        return dump

    dump = await to_thread(look_and_sweep, None)
    if dump is None:
        meta = await _wait_for_meta(rid_dir, cfg.dump.timeout)
        dump = await to_thread(look_and_sweep, meta)
    assert dump is not None
    return dump
