"""The pipeline of one run: the worker half and the writer/commit half, wired together.

Flow of one sample::

    intake queue ─► worker: reserve /dev/shm bytes ─► POST /generate (rid per attempt)
        ─► wait for meta.json ─► validate ─► writer queue ─► writer thread: copy, hash,
        fsync a temp file ─► committer (a batch at a time): rename, fsync of the
        directories, manifest lines, fsync ─► delete dump ─► release bytes

:mod:`hsx_async.run.pipeline.workers` holds the first half (up to the writer queue),
:mod:`hsx_async.run.pipeline.writers` the second; they meet in one interface, the hand-off
(:mod:`hsx_async.run.pipeline.handoff`): the workers submit a validated dump, the writers answer
with its outcome, and the workers alone keep the retry bookkeeping. A failed attempt
deletes its dump, backs off and retries with a new rid; after the last attempt the sample
goes to quarantine with the reason. A sample reaches the manifest only after its file is
durable, and leaves /dev/shm only after its manifest line is.
"""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor

from hsx_async.config import Config
from hsx_async.dataset.manifest import AppendLog
from hsx_async.dataset.quarantine import input_reason
from hsx_async.run.dumps.dump import remove_tree
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.handoff import EOF
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.pipeline.workers import Workers
from hsx_async.run.pipeline.writers import WRITER_TASKS_PER_THREAD, Committer, Writers, delete_dump
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.source import BadLine, Sample

__all__ = ["EOF", "WRITER_TASKS_PER_THREAD", "Committer", "Pipeline", "delete_dump"]


class Pipeline:
    """Workers, writers and committer for one run. The daemon owns their tasks."""

    def __init__(
        self,
        config: Config,
        *,
        client: EngineClient,
        metrics: Metrics,
        manifest: AppendLog,
        quarantine: AppendLog,
        guard: DiskGuard,
    ) -> None:
        # Small blocking calls (sweeps, validation, deletes, commits) never wait behind
        # the copies: those have their own threads, writer.threads of them.
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="hsx-io")
        self.writers = Writers(
            config,
            metrics=metrics,
            manifest=manifest,
            quarantine=quarantine,
            guard=guard,
            executor=self.executor,
        )
        self.workers = Workers(
            config,
            client=client,
            metrics=metrics,
            guard=guard,
            executor=self.executor,
            sink=self.writers,
            nonce=secrets.token_hex(6),  # rids stay unique across restarts
        )
        self._writer_tasks: list[asyncio.Task[None]] = []
        self._committer_task: asyncio.Task[None] | None = None

    def start(self, tg: asyncio.TaskGroup) -> None:
        """Every task of the pipeline, in the run's task group."""
        self.workers.start(tg)
        self._writer_tasks = [
            tg.create_task(self.writers.writer(), name=f"hsx-writer-{i}")
            for i in range(self.writers.tasks)
        ]
        self._committer_task = tg.create_task(self.writers.committer.run(), name="hsx-committer")

    async def drained(self) -> None:
        """Return once every sample taken from the intake is settled or abandoned: the
        workers are done, the writers emptied their queue, the last lines are durable."""
        assert self._committer_task is not None, "start() first"
        await self.workers.workers_done.wait()
        await self.writers.finish_input()
        for task in self._writer_tasks:
            await task
        self.writers.committer.close()
        await self._committer_task

    async def put(self, sample: Sample) -> None:
        """Feed one sample (waits while the intake is full). A sample needs a server: the
        admission starts with the first, while the workers are still getting ready."""
        self.workers.servers.wanted.set()
        await self.workers.intake.put(sample)

    async def end_input(self) -> None:
        await self.workers.intake.put(EOF)

    def stop_intake(self) -> None:
        self.workers.intake.stop()

    async def stop(self) -> None:
        """Stop intake, and stop waiting for a server: a sample not yet sent anywhere is
        left for a resume, rather than held until the drain deadline."""
        self.stop_intake()
        await self.workers.servers.stop_waiting()

    @property
    def stopping(self) -> bool:
        return self.workers.intake.stopping

    @property
    def in_flight(self) -> int:
        return self.workers.in_flight

    def apply(self, config: Config) -> None:
        """A reloaded config, for both halves."""
        self.workers.apply(config)
        self.writers.apply(config)

    async def quarantine_bad_line(self, bad: BadLine) -> None:
        why = input_reason(bad.reason, duplicate=bad.duplicate_of is not None)
        await self.writers.quarantine(bad.line, bad.id, why, bad.duplicate_of)

    @property
    def settled(self) -> int:
        """Samples taken from the intake that reached the manifest or the quarantine."""
        return self.workers.settled

    def close(self) -> None:
        """At the end of the run (blocking): queued calls are dropped, running ones
        finish; temp files staged but never committed (a failed or cut-short run) are
        deleted, and nothing is left in /dev/shm."""
        self.writers.close()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.writers.discard_temps()
        for ns_dir in self.workers.namespaces:
            remove_tree(ns_dir)
