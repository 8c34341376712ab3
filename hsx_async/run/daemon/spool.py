"""The run's side of a bounded spool (``[output].spool_limit``, PROTOCOL §6).

The bytes this shard holds on disk are the sample files it committed that are not yet
retired (deleted once every consumer acknowledged them, :mod:`hsx_async.dataset.live.retire`)
plus the files of the samples admitted and not yet committed or quarantined. A worker
asks :class:`SpoolLimit` (through the disk guard, :meth:`DiskGuard.admit`) for room for
a sample's whole file *before* it sends the request; when it does not fit, the sample goes
back first in line and intake pauses, as on ENOSPC, until consumers free enough room. So
the spool never holds more than the limit, in flight included, and no GPU work is thrown
away for want of disk.

What the spool holds is read from the logs (this shard's manifest and quarantine, and
``retired.jsonl``) as they grow, in a thread; a retired sample's bytes count until its
file is really gone. Shards sharing one directory each hold their own limit.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import structlog

from hsx_async.config import Config
from hsx_async.dataset.layout import build_layout, canonical_id
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.registry import (
    ACKED,
    Registry,
    read_registry,
    record_registry,
)
from hsx_async.dataset.live.retire import Retirer, delete_retired, finish_retirement, read_retired
from hsx_async.dataset.live.view import ConsumerProgress, log_progress
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    RETIRED,
    LogTail,
    log_name,
    manifest_entry,
    read_manifest,
    retired_record,
)
from hsx_async.protocol import POST_NORM
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.source import Sample
from hsx_async.units import human_bytes

log = structlog.get_logger("hsx.spool")

POLL_S = 0.2  # how often the logs are looked at (each look reads only what is new)
LAG_S = 1.0  # how often the consumers' logs are (the lag gauges)


def file_bytes(config: Config, sample: Sample) -> int:
    """The size of ``sample``'s dataset file: its layout, exactly (with the longer
    final-state name, so never less than the file the writer makes)."""
    return build_layout(
        sample_id=sample.id,
        num_tokens=sample.num_tokens,
        hidden_size=config.model.hidden_size,
        aux_layers=config.model.aux_layers,
        has_loss_mask=sample.loss_mask is not None,
        final_state=POST_NORM,
        storage=config.storage,
    ).total_bytes


ConsumerLag = ConsumerProgress  # the run's name for it (its /status, its metrics)


@dataclass
class _Seen:
    """What one look at the logs found (built in a thread, applied on the loop)."""

    committed: list[tuple[str, str, int]] = field(default_factory=list)  # (id, path, bytes)
    quarantined: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)  # paths
    gone: set[str] = field(default_factory=set)  # retired paths whose files are gone
    consumers: list[ConsumerLag] | None = None


class Spool:
    """This shard's spool: the bytes it holds, each registered consumer's lag, and — with
    ``[output].spool_limit`` — admission against the limit (an ``IntakeLimit`` of the
    guard)."""

    def __init__(self, config: Config, *, poll: float = POLL_S) -> None:
        out, shard = config.output.dir, config.shard
        self.config = config
        self.limit = config.output.spool_limit
        self.poll = poll
        self.registry = registry_for(config)
        self.held: dict[str, int] = {}  # path → bytes: committed files on disk
        self.reserved: dict[str, int] = {}  # id → bytes: admitted, not committed yet
        self.retiring: set[str] = set()  # retired paths whose files may still be there
        self.retired = 0  # samples of this shard whose files the spool deleted
        self.blocked = 0  # the bytes of the sample refused last (0: none waiting)
        self.peak = 0
        self.paused_s = 0.0
        self.consumers: list[ConsumerLag] = []
        self._paused_since: float | None = None
        self._committed: set[str] = set()
        self._retired_paths: set[str] = set()  # every retired path seen
        self._logs = {n: ConsumerLog(out, n) for n in self.registry.consumers}
        self._manifest = LogTail(out / log_name(MANIFEST, shard.index, shard.count))
        self._quarantine = LogTail(out / log_name(QUARANTINE, shard.index, shard.count))
        self._retired = LogTail(out / RETIRED)
        self._out = out
        self._lags_at = 0.0

    @property
    def used(self) -> int:
        """Bytes held: committed files not yet gone, plus the room of admitted samples."""
        return sum(self.held.values()) + sum(self.reserved.values())

    # -- the guard's questions (on the loop) -----------------------------------------------

    def admit(self, sample: Sample) -> bool:
        if not self.limit:
            return True
        need = file_bytes(self.config, sample)
        key = canonical_id(sample.id)
        held = self.used - self.reserved.get(key, 0)  # a handed-back sample: its old room
        if held + need > self.limit:
            if not self.blocked:
                self._paused_since = time.monotonic()
            self.blocked = need
            return False
        self.reserved[key] = need
        self.peak = max(self.peak, held + need)
        self._unblock()
        return True

    def holds(self) -> str:
        if not self.blocked:
            return ""
        if self.used + self.blocked <= self.limit:
            self._unblock()  # room again: the guard may reopen
            return ""
        return (
            f"spool full: {human_bytes(self.used)} of output.spool_limit "
            f"{human_bytes(self.limit)} held, the next sample needs {human_bytes(self.blocked)}"
        )

    def fix(self) -> str:
        return (
            "the consumers in output.consumers free the spool as they acknowledge samples: "
            "check they are training (hsx status OUT shows each one's lag), or raise "
            "output.spool_limit and restart"
        )

    def _unblock(self) -> None:
        if self._paused_since is not None:
            self.paused_s += time.monotonic() - self._paused_since
            self._paused_since = None
        self.blocked = 0

    def paused_seconds(self) -> float:
        """Seconds intake waited for spool room in this run (the current wait included)."""
        ongoing = 0.0 if self._paused_since is None else time.monotonic() - self._paused_since
        return self.paused_s + ongoing

    # -- following the logs ----------------------------------------------------------------

    def look(self) -> _Seen:
        """Blocking (a thread): what the logs added; which retired files are gone; every
        LAG_S the consumers' lag."""
        seen = _Seen()
        for number, rec in self._manifest.read():
            entry = manifest_entry(rec, f"{self._manifest.path}:{number}")
            seen.committed.append((canonical_id(entry.id), entry.path, entry.size))
        for _, rec in self._quarantine.read():
            if isinstance(rec, dict) and rec.get("id") is not None:
                seen.quarantined.append(canonical_id(rec["id"]))
        for _, rec in self._retired.read():
            found = retired_record(rec)
            if found is not None:
                seen.retired.append(found[0])
        for path in self.retiring | set(seen.retired):
            if self._gone(path):
                seen.gone.add(path)
        now = time.monotonic()
        if self._logs and now - self._lags_at >= LAG_S:
            self._lags_at = now
            committed = self._committed | {key for key, _, _ in seen.committed}
            seen.consumers = self._lags(committed)
        return seen

    def _gone(self, path: str) -> bool:
        """Whether a retired sample's file is gone; one still there (its retirer was killed
        between the retired line and the unlink) is deleted now: the line is durable, so
        deleting is what the rule says."""
        try:
            os.lstat(self._out / path)
        except FileNotFoundError:
            return True
        delete_retired(self._out, [path])
        return False

    def _lags(self, committed: set[str]) -> list[ConsumerLag]:
        return [log_progress(log, committed) for log in self._logs.values()]

    def apply(self, seen: _Seen) -> None:
        # A sample may be committed, consumed and retired between the two reads of one
        # look: its retired line can come first. Both orders end in `retiring`.
        self._retired_paths.update(seen.retired)
        for key, path, size in seen.committed:
            self.reserved.pop(key, None)
            self.held[path] = size
            self._committed.add(key)
            if path in self._retired_paths:
                self.retiring.add(path)
        for key in seen.quarantined:
            self.reserved.pop(key, None)
        self.retiring.update(p for p in seen.retired if p in self.held)
        for path in seen.gone & self.retiring:
            self.held.pop(path, None)
            self.retiring.discard(path)
            self.retired += 1
        if seen.consumers is not None:
            self.consumers = seen.consumers

    async def run(self, guard: DiskGuard) -> None:
        """A task of the run: follow the logs; let the guard reopen intake on room."""
        while True:
            self.apply(await asyncio.to_thread(self.look))
            if guard.paused:
                guard.reevaluate()
            await asyncio.sleep(self.poll)


def registry_for(config: Config) -> Registry:
    out = config.output
    return Registry(out.retention, tuple(out.consumers), int(out.spool_limit))


def wants_spool(config: Config) -> bool:
    """Whether the run follows a spool: consumers named, or a retention that deletes."""
    return bool(config.output.consumers) or config.output.retention == ACKED


def prepare_spool(config: Config) -> None:
    """At start, under the directory lock (blocking): record the registry, finish a
    retirement a crash cut short, and retire what the consumers already acknowledged
    (a consumer may have been dropped from the registry since)."""
    out = config.output.dir
    retired = read_retired(out)
    if wants_spool(config) or read_registry(out) is not None:
        record_registry(out, registry_for(config), retired=len(retired))
    finish_retirement(out)
    gone = Retirer(out).retire(read_manifest(out))
    if gone:
        log.info("spool_retired_at_start", samples=len(gone))
