"""Feeding a run: the input's samples into the pipeline, and the count of what is left.

The feeder skips what an earlier run finished (the manifest and the quarantine say which)
and what belongs to another shard, quarantines bad lines, and puts the rest into the
intake; the count (for progress, the ETA and the disk check) runs beside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from hsx_async.config import Config
from hsx_async.dataset.manifest import DoneSet
from hsx_async.dataset.provenance import record_input_count
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.pipeline.pipeline import Pipeline
from hsx_async.run.source import BadLine, SampleReader, count_pending, shard_of

log = structlog.get_logger("hsx.feed")


class Feeder:
    def __init__(
        self,
        config: Config,
        done: DoneSet,
        metrics: Metrics,
        *,
        on_input_read: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self._on_input_read = on_input_read  # told this shard's line count at the end
        self.done = done
        self.metrics = metrics
        self.fed = 0  # samples put into the intake this run
        self.pending: tuple[int, int] | None = None  # (samples, tokens) to do, once counted

    async def run(self, pipeline: Pipeline) -> None:
        """Feed every sample still to do, then the end of input (or stop at a signal)."""
        cfg, done = self.config, self.done
        reader = SampleReader(cfg.input.path, cfg.input.max_tokens)
        lines = 0  # of this shard: each ends in the manifest or the quarantine
        async for item in reader.items():
            if pipeline.stopping:
                break
            if cfg.shard.count > 1 and shard_of(item, cfg.shard.count) != cfg.shard.index:
                continue
            lines += 1
            if isinstance(item, BadLine):
                own = item.own_id
                if item.line not in done.lines and not (
                    own is not None and done.is_done(own, item.line)
                ):
                    await pipeline.quarantine_bad_line(item)
                continue
            if done.is_done(item.id, item.line):
                self.metrics.totals.samples_skipped += 1
                continue
            self.fed += 1
            await pipeline.put(item)
        else:
            if self._on_input_read is not None:
                await self._on_input_read(lines)
        await pipeline.end_input()

    async def count(self, guard: DiskGuard) -> None:
        """Count what is left (for progress and ETA) and compare it with free disk."""
        cfg, done = self.config, self.done
        reader = SampleReader(cfg.input.path, cfg.input.max_tokens)
        samples, tokens = await asyncio.to_thread(
            count_pending, reader, cfg.shard.index, cfg.shard.count, done.is_done
        )
        self.pending = (samples, tokens)
        need = tokens * cfg.dataset_bytes_per_token
        if cfg.output.spool_limit:  # a bounded spool never holds more
            need = min(need, cfg.output.spool_limit)
        free = await asyncio.to_thread(guard.free_fn, cfg.output.dir)
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
