"""Lifecycle of ``hsx run``: resume, start, drain, stop.

One :class:`asyncio.TaskGroup` owns every long-lived task. The run ends by a task raising
a private exception (:class:`_Finished`, :class:`_Stopped`), filtered with ``except*``:

- end of input: the feeder sends EOF, workers finish, writers empty their queue, the
  committer makes the last lines durable, then :class:`_Finished`.
- SIGTERM/SIGINT: stop intake, let in-flight samples finish within
  ``daemon.drain_timeout``, then the same path; past the deadline, cancel the rest (their
  samples are redone on resume). A second signal raises :class:`ForcedExit` at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from hsx_async.client import ServerPool, SGLangClient
from hsx_async.config import Config, load_config
from hsx_async.errors import ForcedExit, HsxError
from hsx_async.manifest import MANIFEST, QUARANTINE, AppendLog, DoneSet, load_done, log_name
from hsx_async.metrics import Metrics
from hsx_async.pool import EOF, Pipeline
from hsx_async.resume import check_entries, clean_orphans
from hsx_async.source import BadLine, SampleReader, shard_of

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
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.signals_seen = 0
        self.fed = 0  # samples put into the intake this run
        self.settled = 0  # of those, now in the manifest or the quarantine
        self._on_ready: list[Callable[[], None]] = []

    # -- start --------------------------------------------------------------------------

    def _prepare_output(self) -> DoneSet:
        out = self.config.output.dir
        out.mkdir(parents=True, exist_ok=True)
        done = load_done(out)
        check_entries(out, done.manifest)
        clean_orphans(out, done.manifest, self.config.shard)
        return done

    def _open_logs(self) -> tuple[AppendLog, AppendLog]:
        out, shard = self.config.output.dir, self.config.shard
        return (
            AppendLog(out / log_name(MANIFEST, shard.index, shard.count)),
            AppendLog(out / log_name(QUARANTINE, shard.index, shard.count)),
        )

    async def run(self) -> RunSummary:
        started = time.monotonic()
        done = await asyncio.to_thread(self._prepare_output)
        manifest, quarantine = await asyncio.to_thread(self._open_logs)
        cfg = self.config
        pool = ServerPool(
            cfg.server.urls,
            health_interval=cfg.server.health_interval,
            unreachable_timeout=cfg.server.unreachable_timeout,
        )
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                client = SGLangClient(session, pool)
                await client.probe_all()
                await pool.wait_healthy()
                pipeline = Pipeline(
                    cfg,
                    client=client,
                    metrics=self.metrics,
                    manifest=manifest,
                    quarantine=quarantine,
                )
                try:
                    await self._serve(pipeline, client, done)
                finally:
                    pipeline.executor.shutdown(wait=False, cancel_futures=True)
                    await asyncio.to_thread(pipeline.remove_namespaces)
        finally:
            manifest.close()
            quarantine.close()
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

    # -- the task group -----------------------------------------------------------------

    async def _serve(self, pipeline: Pipeline, client: SGLangClient, done: DoneSet) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._install_signals(pipeline)
                tg.create_task(self._feed(pipeline, done), name="hsx-feeder")
                for _ in range(self.config.workers.concurrency):
                    pipeline.spawn_worker(tg)
                writers = [
                    tg.create_task(pipeline.writer(), name=f"hsx-writer-{i}")
                    for i in range(self.config.writer.threads)
                ]
                committer = tg.create_task(pipeline.committer.run(), name="hsx-committer")
                tg.create_task(client.probe_forever(), name="hsx-prober")
                tg.create_task(self._finish(pipeline, writers, committer), name="hsx-finish")
                tg.create_task(self._watch_signals(pipeline), name="hsx-signals")
                for hook in self._on_ready:
                    hook()
                log.info(
                    "run_started",
                    workers=self.config.workers.concurrency,
                    servers=len(self.config.server.urls),
                    skipped=done_count(done),
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

    # -- signals ------------------------------------------------------------------------

    def _install_signals(self, pipeline: Pipeline) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        self.signals_seen += 1
        if self.signals_seen == 1:
            log.warning(
                "stop_requested", signal=sig.name, drain_timeout=self.config.daemon.drain_timeout
            )
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
        # Unblock a feeder waiting on a full intake: workers now skip what they take.
        try:
            async with asyncio.timeout(self.config.daemon.drain_timeout):
                await self.force_requested.wait()
        except TimeoutError:
            raise _DrainExpired from None
        raise ForcedExit("second stop signal: exiting at once; run again to resume")


def done_count(done: DoneSet) -> int:
    return len(done.ids)


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

    from hsx_async.logs import configure_logging  # noqa: PLC0415

    config = load_config(Path(args.config))
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    summary = uvloop.run(Daemon(config).run())
    print(summary.line())
    if summary.unfinished and not summary.stopped:
        print(f"hsx: {summary.unfinished} samples were not finished; run again to resume")
        return 1
    return 0


def register_cli(sub: Any) -> None:
    p = sub.add_parser("run", help="extract hidden states for every sample of the input")
    p.add_argument("--config", required=True, help="TOML config file (see README)")
    p.set_defaults(handler=run_command)
