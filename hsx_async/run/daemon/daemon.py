"""Lifecycle of ``hsx run``: resume, start, serve, reload, drain, stop.

The run is one kind of job of the job runner (:mod:`hsx_async.run.daemon.job`: one task group,
the admission, the signals and the endings, shared with ``hsx regenerate``); this module
holds what is ``hsx run``'s own:

- end of input: the feeder sends EOF, workers finish, writers empty their queue, the
  committer makes the last lines durable, then the runner's end.
- SIGTERM/SIGINT: stop intake, let in-flight samples finish within
  ``daemon.drain_timeout``, then the same path; past the deadline
  :class:`~hsx_async.run.daemon.signals.DrainExpired` cancels the rest (their samples are redone
  on resume). A second signal raises :class:`~hsx_async.errors.ForcedExit` at once.
- SIGHUP: re-read the config file and apply what may change live (see :mod:`config`).
- the servers: admitted by :class:`~hsx_async.run.servers.admission.Admission` with the dump
  probe (:class:`~hsx_async.run.servers.probe.DumpProbe`); each admitted server's identity is
  recorded in ``provenance.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog

from hsx_async.config import Config
from hsx_async.dataset.manifest import AppendLog
from hsx_async.dataset.provenance import record_server, shard_lock
from hsx_async.dataset.running import announce, withdraw
from hsx_async.errors import ConfigError
from hsx_async.run.check.preflight import operator_problem
from hsx_async.run.daemon.feed import Feeder
from hsx_async.run.daemon.job import JobRunner
from hsx_async.run.daemon.observe import progress_line, progress_loop, serve_http
from hsx_async.run.daemon.reload import reload_config
from hsx_async.run.daemon.signals import Stopper
from hsx_async.run.daemon.spool import Spool, wants_spool
from hsx_async.run.daemon.startup import job_record, prepare_output
from hsx_async.run.daemon.status import RunStatus, StatusCollector, take_status
from hsx_async.run.dumps.dump import namespace_lock
from hsx_async.run.notify import Notifier, watchdog_loop
from hsx_async.run.pipeline.autotune import (
    ConcurrencyController,
    Reading,
    TuneSettings,
    shm_ceiling,
)
from hsx_async.run.pipeline.guard import DiskGuard, FreeFn, free_bytes
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.pipeline.pipeline import Pipeline
from hsx_async.run.pipeline.workers import Workers, namespace_base, probe_namespace
from hsx_async.run.report.numbers import RunRecorder, Tick
from hsx_async.run.servers.admission import Admission
from hsx_async.run.servers.client import EngineClient, connected
from hsx_async.run.servers.identity import Identity, JobRecord
from hsx_async.run.servers.pool import Server, ServerPool, server_pool
from hsx_async.run.servers.probe import DumpProbe
from hsx_async.units import human_bytes

log = structlog.get_logger("hsx.daemon")

AUTOTUNE_TICK_S = 0.5  # how often concurrency = "auto" looks at the counters


@dataclass(frozen=True)
class RunSummary:
    done: int
    quarantined: int
    skipped: int
    tokens: int
    bytes: int
    seconds: float
    stopped: bool  # by a signal
    unfinished: int  # samples read but neither done nor quarantined
    remaining: int | None = None  # samples of the input (this shard) still to do; None: not counted

    def line(self) -> str:
        rate = self.bytes / self.seconds if self.seconds else 0.0
        tok = self.tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.done:,} samples written, {self.quarantined:,} quarantined, "
            f"{self.skipped:,} already done; {self.tokens:,} tokens, {human_bytes(self.bytes)} "
            f"in {self.seconds:.1f} s ({tok:,.0f} tokens/s, {human_bytes(rate)}/s)"
        )

    def next_step(self, config_path: Path | None) -> str:
        """What is left and how to finish it ('' when nothing is)."""
        left = self.remaining if self.remaining is not None else self.unfinished
        if not left:
            return ""
        again = f"hsx run --config {config_path}" if config_path else "hsx run"
        return f"{left:,} samples remaining: run `{again}` again to finish (it resumes)"


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        allow_provenance_change: bool = False,
        free_fn: FreeFn = free_bytes,
        notifier: Notifier | None = None,
        progress_stream: TextIO | None = None,
        autotune: TuneSettings | None = None,
    ) -> None:
        self.config = config
        # concurrency = "auto": the controller's settings (start and maximum come from
        # the config).
        self.autotune = autotune or TuneSettings()
        self.allow_provenance_change = allow_provenance_change
        self.metrics = Metrics()
        self.notifier = notifier or Notifier.from_env()
        self.progress_stream = progress_stream
        self.guard = DiskGuard(config.output.dir, config.output.disk_reserve, free_fn=free_fn)
        self.stopper = Stopper(self.notifier, lambda: self.config.daemon.drain_timeout)
        self.reload_requested = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self.feeder: Feeder | None = None
        self.settled = 0  # samples fed this run now in the manifest or the quarantine
        self.http_url: str | None = None
        self.pipeline: Pipeline | None = None
        self.servers: ServerPool | None = None
        self.admission: Admission | None = None
        self._held: Mapping[str, int] = {}  # what the directory held at the start
        self._began = time.time()  # when run() began (epoch seconds)
        # Called (on the event loop) with (server, in_rotation) whenever a server leaves
        # rotation, is refused again or comes back: for code embedding a Daemon.
        self.on_server_change: list[Callable[[Server, bool], None]] = []
        self.metrics.registry.register(StatusCollector(self.snapshot))
        self.guard.on_change.append(self._intake_changed)
        self.spool = Spool(config) if wants_spool(config) else None
        if self.spool is not None and self.spool.limit:
            self.guard.limits.append(self.spool)  # a full spool pauses intake as ENOSPC does
        self.recorder = RunRecorder(
            config.output.dir, config.shard.index, config.shard.count, self._tick
        )

    # -- start --------------------------------------------------------------------------

    async def run(self) -> RunSummary:
        started = time.monotonic()
        self._began = time.time()  # the start line's time: the report times what we do
        cfg = self.config
        # The operator mistakes `hsx check` reports, said the same way (one line, exit 2).
        problem = await asyncio.to_thread(operator_problem, cfg)
        if problem:
            raise ConfigError("", problem)
        out = cfg.output.dir
        with (
            shard_lock(out, cfg.shard.index),
            namespace_lock(cfg.dump.root, namespace_base(cfg)),
            contextlib.ExitStack() as stack,
        ):
            done, manifest, quarantine = await asyncio.to_thread(
                prepare_output, cfg, stack, allow_provenance_change=self.allow_provenance_change
            )
            job = await asyncio.to_thread(job_record, out, done)
            self._held = done.counts
            self.feeder = Feeder(cfg, done, self.metrics, on_input_read=self.recorder.input_read)
            try:
                await self._connect_and_serve(self.feeder, manifest, quarantine, job)
            finally:
                withdraw(out, cfg.shard.index)
                await asyncio.to_thread(self._finish_events)
        t = self.metrics.totals
        return RunSummary(
            done=t.samples_done,
            quarantined=t.samples_quarantined,
            skipped=t.samples_skipped,
            tokens=t.tokens_done,
            bytes=t.bytes_written,
            seconds=time.monotonic() - started,
            stopped=self.stop_requested.is_set(),
            unfinished=self._fed() - self.settled,
            remaining=self._remaining(),
        )

    def _fed(self) -> int:
        return self.feeder.fed if self.feeder else 0

    def _remaining(self) -> int | None:
        """Samples of this shard's input neither written nor quarantined, once counted."""
        pending = self.feeder.pending if self.feeder else None
        if pending is None:
            return None
        t = self.metrics.totals
        return max(0, pending[0] - t.samples_done - t.samples_quarantined)

    async def _connect_and_serve(
        self, feeder: Feeder, manifest: AppendLog, quarantine: AppendLog, job: JobRecord
    ) -> None:
        cfg = self.config
        pool = self.servers = server_pool(cfg)  # no server takes a sample before admission
        pool.on_change.append(self._server_changed)
        async with connected(pool) as client:
            pipeline = Pipeline(
                cfg,
                client=client,
                metrics=self.metrics,
                manifest=manifest,
                quarantine=quarantine,
                guard=self.guard,
            )
            self.pipeline = pipeline
            # The probes' namespace goes with the workers' when the run ends, whatever the
            # admission task got to do (also what a killed run left in it).
            pipeline.workers.namespaces.add(cfg.dump.root / probe_namespace(cfg))
            # Servers are admitted while the run goes: a finished dataset needs none, and
            # a job fault stops the run before any sample is sent.
            self.admission = Admission(
                cfg,
                client,
                probe=DumpProbe(
                    cfg, client, nonce=pipeline.workers.nonce, namespace=probe_namespace(cfg)
                ),
                record=self._record_server,
                job=job,
                final_states=pipeline.workers.final_states,
                notifier=self.notifier,
                stop_requested=self.stop_requested,
                allow_provenance_change=self.allow_provenance_change,
            )
            pipeline.workers.arbiter = self.admission.arbitrate
            # One shard in the directory: what it held at the start, so the report counts
            # a run killed after its last tick whole (with shards, other runs write too).
            await self.recorder.start(
                self._held if cfg.shard.count == 1 else None, began=self._began
            )
            try:
                await self._serve(pipeline, client, feeder)
            finally:
                await asyncio.to_thread(pipeline.close)
                self.notifier.close()

    # -- the task group -----------------------------------------------------------------

    async def _serve(self, pipeline: Pipeline, client: EngineClient, feeder: Feeder) -> None:
        assert self.admission is not None
        runner = JobRunner(
            lambda: self.config,
            stopper=self.stopper,
            notifier=self.notifier,
            recorder=self.recorder,
        )
        work = _Extraction(self, pipeline, feeder)
        try:
            await runner.serve(
                work,
                self.admission,
                on_reload=self.request_reload,
                services=lambda tg: self._start_services(tg, client, feeder),
            )
        finally:
            self.settled = pipeline.settled

    def _start_services(self, tg: asyncio.TaskGroup, client: EngineClient, feeder: Feeder) -> None:
        """The long-lived helpers: none of them ends the run by returning."""
        cfg = self.config
        self.metrics.run_starts()
        tg.create_task(self.guard.run(), name="hsx-disk-guard")
        if self.spool is not None:
            tg.create_task(self.spool.run(self.guard), name="hsx-spool")
        tg.create_task(feeder.count(self.guard), name="hsx-count")
        tg.create_task(self._reload_loop(), name="hsx-reload")
        if self.pipeline is not None:
            tg.create_task(self._autotune_loop(self.pipeline.workers), name="hsx-autotune")
        tg.create_task(
            progress_loop(self.status, self.progress_interval, stream=self.progress_stream),
            name="hsx-progress",
        )
        if cfg.daemon.metrics_listen:
            tg.create_task(
                serve_http(
                    cfg.daemon.metrics_listen,
                    self.metrics.registry,
                    self.status,
                    on_bound=self._http_bound,
                ),
                name="hsx-http",
            )
        tg.create_task(
            watchdog_loop(
                self.notifier,
                lambda: self.notifier.ping_interval(self.progress_interval()),
                lambda: progress_line(self.status()),
            ),
            name="hsx-notify",
        )

    def progress_interval(self) -> float:
        """Read at every round, so a reload changes it (``daemon.progress_interval``)."""
        return self.config.daemon.progress_interval

    def _record_server(
        self,
        server: Server,
        identity: Identity,
        final_norm: dict[str, Any] | None,
        final_state: str | None,
    ) -> asyncio.Future[None]:
        """An admitted server's identity, and the job's, into provenance.json (with a new
        dataset's final-state kind): the write, under way; the committer commits nothing
        before it is done."""
        assert self.admission is not None and self.admission.job is not None
        assert self.pipeline is not None
        write = asyncio.ensure_future(
            asyncio.to_thread(
                record_server,
                self.config.output.dir,
                server.display,
                identity.to_record(),
                self.admission.job.to_record(),
                final_norm=final_norm,
                final_state=final_state,
            )
        )
        self.pipeline.writers.committer.hold(write)
        return write

    def _server_changed(self, server: Server, in_rotation: bool) -> None:
        """A server left rotation, was refused again, or came back: the events log (the
        job report lists them) and the metrics."""
        if not in_rotation:
            self.metrics.server_out(server.display, server.out_kind)
        for listener in self.on_server_change:
            listener(server, in_rotation)
        self.recorder.server_changed(server, in_rotation)

    def _http_bound(self, url: str) -> None:
        self.http_url = url
        shard = self.config.shard
        announce(self.config.output.dir, shard.index, shard.count, url)  # for hsx status

    def _intake_changed(self, open_: bool) -> None:
        """The disk guard paused or resumed intake: systemd's status line says so."""
        self.notifier.status("intake resumed" if open_ else f"intake paused: {self.guard.reason}")

    # -- concurrency = "auto" -----------------------------------------------------------

    async def _autotune_loop(self, workers: Workers) -> None:
        """Feed the controller the run's counters; apply and log each change. Idle while
        the (possibly reloaded) config has a fixed concurrency."""
        controller: ConcurrencyController | None = None
        while True:
            await asyncio.sleep(AUTOTUNE_TICK_S)
            w = self.config.workers
            if not w.auto:
                controller = None
                continue
            if workers.intake.stopping or workers.workers_done.is_set():
                continue  # draining, or the input is done: no more workers
            if controller is None or controller.settings.maximum != w.max_concurrency:
                start = max(1, min(workers.target_workers, w.max_concurrency))
                settings = dataclasses.replace(
                    self.autotune, start=start, maximum=w.max_concurrency
                )
                controller = ConcurrencyController(settings)
            t = self.metrics.totals
            shm = shm_ceiling(
                workers.budget.capacity,
                t.tokens_done,
                t.samples_done,
                self.config.model.row_bytes,
                w.max_concurrency,
            )
            change = controller.observe(
                Reading(time.monotonic(), t.samples_done, t.tokens_done, shm)
            )
            if change is None:
                continue
            if change.new != workers.target_workers:
                workers.set_concurrency(change.new)
            log.info(
                "concurrency_changed",
                old=change.old,
                new=change.new,
                reason=change.reason,
                tokens_per_s=None if change.tokens_per_s is None else round(change.tokens_per_s),
            )

    # -- the events log (job report) ----------------------------------------------------

    def _tick(self) -> Tick:
        t, pool = self.metrics.totals, self.servers
        servers = {s.display: s.requests for s in pool.servers} if pool else {}
        return Tick(
            samples=t.samples_done,
            tokens=t.tokens_done,
            bytes=t.bytes_written,
            quarantined=t.samples_quarantined,
            retries=dict(self.metrics.failure_reasons),
            servers=servers,
            spool=None if self.spool is None else self._spool_tick(self.spool),
        )

    @staticmethod
    def _spool_tick(spool: Spool) -> dict[str, Any]:
        return {
            "held": spool.used,
            "limit": spool.limit,
            "paused_s": round(spool.paused_seconds(), 1),
            "lag": {c.name: c.lag for c in spool.consumers},
        }

    def _finish_events(self) -> None:
        if self.pipeline is None:
            return  # never started: no run to record
        self.recorder.finish(
            stopped=self.stop_requested.is_set(), unfinished=self._fed() - self.settled
        )

    # -- status -------------------------------------------------------------------------

    def snapshot(self) -> RunStatus:
        """Where the run stands (``/status``, the progress line, the gauges)."""
        return take_status(
            self.metrics,
            pending=self.feeder.pending if self.feeder else None,
            pipeline=self.pipeline,
            servers=self.servers,
            guard=self.guard,
            stopping=self.stop_requested.is_set(),
            shm_budget=self.config.dump.shm_budget,
            spool=self.spool,
        )

    def status(self) -> dict[str, Any]:
        """:meth:`snapshot` as the ``/status`` JSON object."""
        return self.snapshot().as_dict()

    # -- reload -------------------------------------------------------------------------

    def request_reload(self) -> None:
        """Programmatic SIGHUP: a reload soon, in the reload task."""
        self.reload_requested.set()

    async def _reload_loop(self) -> None:
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            await self.reload()

    async def reload(self) -> str:
        """Re-read the config file and apply what may change live (what SIGHUP does).
        Returns "applied"; or "refused" (a key needs a restart) or "invalid", and then the
        running config stays."""
        if self.pipeline is None or self.servers is None:
            raise RuntimeError("the run has not started: nothing to reload")
        async with self._reload_lock:
            self.notifier.reloading()
            try:
                outcome, self.config = await reload_config(
                    self.config, pipeline=self.pipeline, servers=self.servers, guard=self.guard
                )
                if self.admission is not None:
                    self.admission.apply(self.config)
            finally:
                self.notifier.ready()
        return outcome

    # -- signals ------------------------------------------------------------------------

    @property
    def stop_requested(self) -> asyncio.Event:
        return self.stopper.stop_requested

    def request_stop(self) -> None:
        """Programmatic SIGTERM (tests, embedding)."""
        self.stopper.on_signal(signal.SIGTERM)


class _Extraction:
    """``hsx run``'s kind of job for the runner: the feeder and the pipeline."""

    name = "run"

    def __init__(self, daemon: Daemon, pipeline: Pipeline, feeder: Feeder) -> None:
        self.daemon = daemon
        self.pipeline = pipeline
        self.feeder = feeder

    def start(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.feeder.run(self.pipeline), name="hsx-feeder")
        self.pipeline.start(tg)

    async def drained(self) -> None:
        await self.pipeline.drained()

    async def stop(self) -> None:
        await self.pipeline.stop()

    @property
    def in_flight(self) -> int:
        return self.pipeline.in_flight

    def started(self) -> dict[str, Any]:
        cfg = self.daemon.config
        return {
            "workers": cfg.workers.start_concurrency,
            "concurrency": cfg.workers.concurrency,
            "servers": len(cfg.server.urls),
            "already_done": len(self.feeder.done.ids),
            "shard": f"{cfg.shard.index}/{cfg.shard.count}",
        }

    def finished(self) -> dict[str, Any]:
        metrics = self.daemon.metrics
        return {
            **metrics.totals.counters(),
            "seconds": round(metrics.elapsed(), 3),
            "cpu_s": round(metrics.cpu(), 3),
        }
