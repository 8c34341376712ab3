"""Lifecycle of ``hsx run``: resume, start, serve, reload, drain, stop.

One :class:`asyncio.TaskGroup` owns every long-lived task. The run ends by a task raising
a private exception, filtered with ``except*``:

- end of input: the feeder sends EOF, workers finish, writers empty their queue, the
  committer makes the last lines durable, then :class:`_Finished`.
- SIGTERM/SIGINT: stop intake, let in-flight samples finish within
  ``daemon.drain_timeout``, then the same path; past the deadline :class:`_DrainExpired`
  cancels the rest (their samples are redone on resume). A second signal raises
  :class:`ForcedExit` at once.
- SIGHUP: re-read the config file and apply what may change live (see :mod:`config`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import structlog

from hsx_async.config import Config, ConfigDiff, diff_config, load_config, redact_url
from hsx_async.dataset.manifest import MANIFEST, QUARANTINE, AppendLog, DoneSet, load_done, log_name
from hsx_async.dataset.provenance import (
    check_and_record,
    check_shard_layout,
    directory_lock,
    provenance_for,
    read_provenance,
    record_input_count,
    remove_stale_temps,
    shard_lock,
)
from hsx_async.errors import ConfigError, ForcedExit, HsxError
from hsx_async.logs import configure_logging
from hsx_async.run.client import ServerPool, SGLangClient
from hsx_async.run.dump import namespace_lock
from hsx_async.run.guard import DiskGuard, FreeFn, free_bytes
from hsx_async.run.metrics import Metrics
from hsx_async.run.notify import Notifier, watchdog_loop
from hsx_async.run.observe import progress_line, progress_loop, serve_http
from hsx_async.run.pool import EOF, Pipeline, namespace_base
from hsx_async.run.preflight import operator_problem
from hsx_async.run.resume import check_entries, clean_orphans
from hsx_async.run.retry import RetryPolicy
from hsx_async.run.source import (
    BadLine,
    SampleReader,
    count_pending,
    fingerprint_input,
    shard_of,
)

log = structlog.get_logger("hsx.daemon")


class _Finished(Exception):
    """Every sample of the input is in the manifest or the quarantine."""


class _DrainExpired(Exception):
    """The drain deadline passed; what is still in flight is abandoned."""


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

    def line(self) -> str:
        rate = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        tok = self.tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.done} samples written, {self.quarantined} quarantined, {self.skipped} "
            f"already done; {self.tokens} tokens, {self.bytes / 1e9:.2f} GB in "
            f"{self.seconds:.1f} s ({tok:,.0f} tokens/s, {rate:.2f} GB/s)"
        )


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        allow_provenance_change: bool = False,
        free_fn: FreeFn = free_bytes,
        notifier: Notifier | None = None,
        progress_stream: TextIO | None = None,
    ) -> None:
        self.config = config
        self.allow_provenance_change = allow_provenance_change
        self.metrics = Metrics()
        self.notifier = notifier or Notifier.from_env()
        self.progress_stream = progress_stream
        self.guard = DiskGuard(config.output.dir, config.output.disk_reserve, free_fn=free_fn)
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.reloaded = asyncio.Event()  # set after each reload attempt (tests wait on it)
        self.last_reload = ""  # "applied", "refused" or "invalid"
        self.signals_seen = 0
        self.fed = 0  # samples put into the intake this run
        self.settled = 0  # of those, now in the manifest or the quarantine
        self.pending: tuple[int, int] | None = None  # (samples, tokens) to do, once counted
        self.http_url: str | None = None
        self.pipeline: Pipeline | None = None

    # -- start --------------------------------------------------------------------------

    def _prepare_output(self, stack: contextlib.ExitStack) -> tuple[DoneSet, AppendLog, AppendLog]:
        """Under the directory lock: the shard layout is checked, provenance recorded and
        this run's logs created (so a run starting next sees them), then the directory is
        made to agree with its manifests. The logs close with ``stack``."""
        cfg = self.config
        out, shard = cfg.output.dir, cfg.shard
        old = read_provenance(out)
        recorded = old.get("input", {}).get("bytes") if old else None
        input_fp = fingerprint_input(
            cfg.input.path, prefix=recorded if type(recorded) is int else None
        )
        record = provenance_for(cfg, input_fp)
        with directory_lock(out):
            remove_stale_temps(out)
            check_shard_layout(out, shard.count)
            check_and_record(out, record, allow_change=self.allow_provenance_change)
            manifest = AppendLog(out / log_name(MANIFEST, shard.index, shard.count))
            stack.callback(manifest.close)
            quarantine = AppendLog(out / log_name(QUARANTINE, shard.index, shard.count))
            stack.callback(quarantine.close)
            done = load_done(out)
            check_entries(out, done.manifest)
            clean_orphans(out, done.manifest, shard)
        return done, manifest, quarantine

    async def run(self) -> RunSummary:
        started = time.monotonic()
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
            done, manifest, quarantine = await asyncio.to_thread(self._prepare_output, stack)
            await self._connect_and_serve(done, manifest, quarantine)
        t = self.metrics.totals
        return RunSummary(
            done=t.samples_done,
            quarantined=t.samples_quarantined,
            skipped=t.samples_skipped,
            tokens=t.tokens_done,
            bytes=t.bytes_written,
            seconds=time.monotonic() - started,
            stopped=self.stop_requested.is_set(),
            unfinished=self.fed - self.settled,
        )

    async def _connect_and_serve(
        self, done: DoneSet, manifest: AppendLog, quarantine: AppendLog
    ) -> None:
        cfg = self.config
        pool = ServerPool(
            cfg.server.urls,
            health_interval=cfg.server.health_interval,
            unreachable_timeout=cfg.server.unreachable_timeout,
        )
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session:
            client = SGLangClient(session, pool)
            await client.probe_all()
            if not pool.healthy():
                self.notifier.status(
                    "waiting for a server: " + ", ".join(redact_url(u) for u in cfg.server.urls)
                )
                log.warning(
                    "waiting_for_server",
                    urls=[redact_url(u) for u in cfg.server.urls],
                    timeout_s=cfg.server.unreachable_timeout,
                )
            await pool.wait_healthy()
            await self._record_server(client)
            pipeline = Pipeline(
                cfg,
                client=client,
                metrics=self.metrics,
                manifest=manifest,
                quarantine=quarantine,
                guard=self.guard,
            )
            self.pipeline = pipeline
            try:
                await self._serve(pipeline, client, done)
            finally:
                await asyncio.to_thread(pipeline.close)
                self.notifier.close()

    async def _record_server(self, client: SGLangClient) -> None:
        """Put the served model and server version into provenance; refuse another model."""
        server = client.pool.healthy()[0]
        model = version = ""
        with contextlib.suppress(HsxError, aiohttp.ClientError, TimeoutError, ValueError):
            info = await client.get_json(server.url, "/get_model_info")
            model = str(info.get("model_path", "")) if isinstance(info, dict) else ""
        with contextlib.suppress(HsxError, aiohttp.ClientError, TimeoutError, ValueError):
            info = await client.get_json(server.url, "/get_server_info")
            version = str(info.get("version", "")) if isinstance(info, dict) else ""
        if not model:
            return
        out = self.config.output.dir
        old = await asyncio.to_thread(read_provenance, out) or {}
        record = provenance_for(self.config, old.get("input", {}), model, version)
        await asyncio.to_thread(
            check_and_record, out, record, allow_change=self.allow_provenance_change
        )

    # -- the task group -----------------------------------------------------------------

    async def _serve(self, pipeline: Pipeline, client: SGLangClient, done: DoneSet) -> None:
        cfg = self.config
        try:
            async with asyncio.TaskGroup() as tg:
                self._install_signals()
                tg.create_task(self._feed(pipeline, done), name="hsx-feeder")
                for _ in range(cfg.workers.concurrency):
                    pipeline.spawn_worker(tg)
                writers = [
                    tg.create_task(pipeline.writer(), name=f"hsx-writer-{i}")
                    for i in range(pipeline.writer_tasks)
                ]
                committer = tg.create_task(pipeline.committer.run(), name="hsx-committer")
                tg.create_task(self._finish(pipeline, writers, committer), name="hsx-finish")
                tg.create_task(self._watch_signals(pipeline), name="hsx-signals")
                self._start_services(tg, pipeline, client, done)
                self.notifier.ready()
                log.info(
                    "run_started",
                    workers=cfg.workers.concurrency,
                    servers=len(cfg.server.urls),
                    already_done=len(done.ids),
                    shard=f"{cfg.shard.index}/{cfg.shard.count}",
                )
        except* _Finished:
            log.info("run_finished", **vars(self.metrics.totals))
        except* _DrainExpired:
            log.warning(
                "drain_deadline_passed",
                deadline_s=self.config.daemon.drain_timeout,
                in_flight=pipeline.in_flight,
            )
        except* HsxError as group:
            raise _first(group) from None
        finally:
            self.settled = pipeline.settled
            self._remove_signals()

    def _start_services(
        self, tg: asyncio.TaskGroup, pipeline: Pipeline, client: SGLangClient, done: DoneSet
    ) -> None:
        """The long-lived helpers: none of them ends the run by returning."""
        cfg = self.config
        tg.create_task(client.probe_forever(), name="hsx-prober")
        tg.create_task(self.guard.run(), name="hsx-disk-guard")
        tg.create_task(self._count_input(done), name="hsx-count")
        tg.create_task(self._reload_loop(pipeline, tg), name="hsx-reload")
        tg.create_task(
            progress_loop(self.status, cfg.daemon.progress_interval, stream=self.progress_stream),
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
        interval = self.notifier.ping_interval(cfg.daemon.progress_interval)
        tg.create_task(
            watchdog_loop(self.notifier, interval, lambda: progress_line(self.status())),
            name="hsx-notify",
        )

    def _http_bound(self, url: str) -> None:
        self.http_url = url

    async def _feed(self, pipeline: Pipeline, done: DoneSet) -> None:
        cfg = self.config
        reader = SampleReader(cfg.input.path, cfg.input.max_tokens)
        async for item in reader.items():
            if pipeline.stopping:
                break
            if cfg.shard.count > 1 and shard_of(item, cfg.shard.count) != cfg.shard.index:
                continue
            if isinstance(item, BadLine):
                if item.line not in done.lines and not (
                    item.id is not None and done.is_done(item.id, item.line)
                ):
                    await pipeline.quarantine_bad_line(item)
                continue
            if done.is_done(item.id, item.line):
                self.metrics.totals.samples_skipped += 1
                continue
            self.fed += 1
            await pipeline.intake.put(item)
        await pipeline.intake.put(EOF)

    async def _finish(
        self, pipeline: Pipeline, writers: list[asyncio.Task[None]], committer: asyncio.Task[None]
    ) -> None:
        await pipeline.close_writers()
        for task in writers:
            await task
        pipeline.committer.close()
        await committer
        raise _Finished

    async def _count_input(self, done: DoneSet) -> None:
        """Count what is left (for progress and ETA) and compare it with free disk."""
        cfg = self.config
        reader = SampleReader(cfg.input.path, cfg.input.max_tokens)
        samples, tokens = await asyncio.to_thread(
            count_pending, reader, cfg.shard.index, cfg.shard.count, done.is_done
        )
        self.pending = (samples, tokens)
        need = tokens * cfg.model.row_bytes
        free = await asyncio.to_thread(self.guard.free_fn, cfg.output.dir)
        log.info(
            "input_counted", samples=samples, tokens=tokens, estimated_bytes=need, free_bytes=free
        )
        if need + cfg.output.disk_reserve > free:
            log.error(
                "disk_too_small_for_job",
                estimated_bytes=need,
                free_bytes=free,
                reserve=cfg.output.disk_reserve,
                fix="free space or move output.dir; the run pauses when it reaches the reserve",
            )
        if cfg.shard.count == 1:  # a shard's count is not the whole input's
            await asyncio.to_thread(record_input_count, cfg.output.dir, len(done.ids) + samples)

    # -- status -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        t = self.metrics.totals
        tok_s, bytes_s = self.metrics.rates()
        pipe = self.pipeline
        remaining_tokens = None
        total = None
        if self.pending is not None:
            total = self.pending[0] + t.samples_skipped
            remaining_tokens = max(0, self.pending[1] - t.tokens_done)
        eta = remaining_tokens / tok_s if remaining_tokens is not None and tok_s > 0 else None
        snapshot = {
            "done": t.samples_done,
            "quarantined": t.samples_quarantined,
            "skipped": t.samples_skipped,
            "retried": t.samples_retried,
            "attempts_failed": t.attempts_failed,
            "tokens": t.tokens_done,
            "bytes": t.bytes_written,
            "tokens_per_s": tok_s,
            "bytes_per_s": bytes_s,
            "total_samples": total,
            "remaining_tokens": remaining_tokens,
            "eta_s": eta,
            "in_flight": pipe.in_flight if pipe else 0,
            "workers": pipe.workers_running if pipe else 0,
            "shm_used": pipe.budget.used if pipe else 0,
            "shm_budget": pipe.budget.capacity if pipe else self.config.dump.shm_budget,
            "writer_queue": pipe.write_queue.qsize() if pipe else 0,
            "paused": self.guard.paused,
            "free_disk": self.guard.free,
            "stopping": self.stop_requested.is_set(),
            "servers": [
                {
                    "url": s.display,
                    "healthy": s.healthy,
                    "in_flight": s.in_flight,
                    "requests": s.requests,
                    "last_error": s.last_error,
                }
                for s in (pipe.servers.servers if pipe else [])
                if not s.retired
            ],
        }
        self._update_gauges(snapshot)
        return snapshot

    def _update_gauges(self, snap: dict[str, Any]) -> None:
        """Gauges are refreshed from the same snapshot ``/status`` shows (on every scrape)."""
        m = self.metrics
        m.eta.set(snap["eta_s"] if snap["eta_s"] is not None else -1)
        m.remaining.set(
            max(
                0,
                (snap["total_samples"] or 0) - snap["done"] - snap["skipped"] - snap["quarantined"],
            )
        )
        m.free_disk.set(max(snap["free_disk"], 0))
        m.paused.set(1 if snap["paused"] else 0)
        m.shm_used.set(snap["shm_used"])
        m.shm_capacity.set(snap["shm_budget"])
        m.writer_queue.set(snap["writer_queue"])
        for server in snap["servers"]:
            m.server_up.labels(server["url"]).set(1 if server["healthy"] else 0)

    # -- reload -------------------------------------------------------------------------

    def request_reload(self) -> None:
        """Programmatic SIGHUP."""
        self.reload_requested.set()

    async def _reload_loop(self, pipeline: Pipeline, tg: asyncio.TaskGroup) -> None:
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            self.notifier.reloading()
            self.last_reload = await self._reload(pipeline, tg)
            self.notifier.ready()
            self.reloaded.set()

    async def _reload(self, pipeline: Pipeline, tg: asyncio.TaskGroup) -> str:
        path = self.config.path
        if path is None:
            log.error("reload_invalid", error="this run has no config file to re-read")
            return "invalid"
        try:
            new = await asyncio.to_thread(load_config, path)
        except ConfigError as exc:
            log.error("reload_invalid", error=str(exc), kept="the running config")
            return "invalid"
        diff = diff_config(self.config, new)
        if diff.restart:
            log.error(
                "reload_refused",
                needs_restart=sorted(diff.restart),
                kept="the running config",
                fix="restart hsx to change these keys (progress is kept)",
            )
            return "refused"
        await self._apply(new, diff, pipeline, tg)
        return "applied"

    async def _apply(
        self, new: Config, diff: ConfigDiff, pipeline: Pipeline, tg: asyncio.TaskGroup
    ) -> None:
        old, self.config = self.config, new
        pipeline.config = new
        if "workers.concurrency" in diff.live:
            pipeline.resize(new.workers.concurrency, tg)
        if "dump.shm_budget" in diff.live:
            pipeline.budget.resize(new.dump.shm_budget)
            self.metrics.shm_capacity.set(new.dump.shm_budget)
        w = new.workers
        pipeline.retry = RetryPolicy(w.max_attempts, w.backoff_base, w.backoff_max)
        pool = pipeline.servers
        pool.health_interval = new.server.health_interval
        pool.unreachable_timeout = new.server.unreachable_timeout
        if "server.urls" in diff.live:
            await pool.set_urls(new.server.urls)
        self.guard.reserve = new.output.disk_reserve
        if old.daemon.log_level != new.daemon.log_level:
            configure_logging(new.daemon.log_format, new.daemon.log_level)
        shown = {k: [_shown(k, a), _shown(k, b)] for k, (a, b) in diff.live.items()}
        log.info("config_reloaded", changed=shown)

    # -- signals ------------------------------------------------------------------------

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        self.signals_seen += 1
        if self.signals_seen == 1:
            log.warning(
                "stop_requested", signal=sig.name, drain_timeout=self.config.daemon.drain_timeout
            )
            self.notifier.stopping()
            self.stop_requested.set()
        else:
            log.error("forced_exit", signal=sig.name)
            self.force_requested.set()

    def request_stop(self) -> None:
        """Programmatic SIGTERM (tests, embedding)."""
        self._on_stop_signal(signal.SIGTERM)

    async def _watch_signals(self, pipeline: Pipeline) -> None:
        await self.stop_requested.wait()
        pipeline.stopping = True
        pipeline.wake_workers()
        try:
            async with asyncio.timeout(self.config.daemon.drain_timeout):
                await self.force_requested.wait()
        except TimeoutError:
            raise _DrainExpired from None
        raise ForcedExit("second stop signal: exiting at once; run again to resume")


def _shown(key: str, value: Any) -> str:
    if key == "server.urls":
        return ", ".join(redact_url(u) for u in value)
    return str(value)


def _first(group: BaseExceptionGroup[HsxError]) -> HsxError:
    """The first error of a group: the one the operator must act on."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, HsxError)
    return exc


# -- CLI -----------------------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    import uvloop  # noqa: PLC0415 - keep `hsx --help` light

    config = load_config(Path(args.config))
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    daemon = Daemon(config, allow_provenance_change=args.allow_provenance_change)
    summary = uvloop.run(daemon.run())
    print(summary.line())
    if summary.unfinished and not summary.stopped:
        print(f"hsx: {summary.unfinished} samples were not finished; run again to resume")
        return 1
    return 0


def register_cli(sub: Any) -> None:
    p = sub.add_parser("run", help="extract hidden states for every sample of the input")
    p.add_argument("--config", required=True, help="TOML config file (see README)")
    p.add_argument(
        "--allow-provenance-change",
        action="store_true",
        help="resume even though the input or model differs from the dataset's",
    )
    p.set_defaults(handler=run_command)
