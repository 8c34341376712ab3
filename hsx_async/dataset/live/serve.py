"""``hsx serve OUT``: a live dataset for trainers on other nodes (PROTOCOL §6.4).

Runs on the node that holds the output directory, beside (or after) ``hsx run``. It makes
the leases and acknowledgements of remote readers in the very logs a local reader uses
(:class:`~hsx_async.dataset.live.LocalSource`, one per consumer), and sends sample files
with ``sendfile`` from the page cache. It holds no state of its own that matters: killed
and started again, it goes on from the logs; a reader retries through the gap.

Bounded everywhere (:mod:`hsx_async.dataset.live.wire`): bodies, leases, acks, the long poll,
and at most ``--max-streams`` files in flight at once (more wait their turn).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hsx_async.dataset.export.plan import dataset_facts
from hsx_async.dataset.layout import manifest_path_problem
from hsx_async.dataset.live.follow import DatasetFollower
from hsx_async.dataset.live.ledger import VOID, LeaseLost, OwnerVoid, consumer_names
from hsx_async.dataset.live.registry import dataset_identity, read_registry
from hsx_async.dataset.live.sources import LocalSource, check_live_dir
from hsx_async.dataset.live.view import ConsumerProgress, consumer_families, log_progress
from hsx_async.dataset.live.wire import (
    DEFAULT_TIMEOUT_S,
    GONE,
    MAX_HOLDERS,
    REPLAY,
    VOID_STATUS,
    WIRE_VERSION,
    Caller,
    WireError,
    adopted_from,
    caller,
    file_request,
    heartbeat_timeout,
    id_list,
    lease_request,
)
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError

log = structlog.get_logger("hsx.serve")

LONG_POLL_S = 0.2  # between looks while a lease waits for a sample (holding no lock)
REAP_S = 1.0  # how often owners not heard from are let go
SERVE = "serve"  # the `via` of the leases serve makes
MAX_STREAMS = 8


@dataclass
class _Holder:
    """A remote owner this serve keeps alive: its lock, when it was last heard from (this
    process's monotonic clock) and how long it may stay silent."""

    heard: float
    timeout: float
    answers: collections.OrderedDict[str, dict[str, Any]] = field(
        default_factory=collections.OrderedDict
    )


@dataclass
class _Consumer:
    """One consumer's source (its ledger calls run one at a time, under ``lock``, which
    no waiting lease holds) and the remote owners serve keeps alive."""

    source: LocalSource
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    holders: dict[str, _Holder] = field(default_factory=dict)
    progress: ConsumerProgress | None = None  # as of the last scrape of /metrics


class LiveServer:
    def __init__(self, out_dir: Path, *, max_streams: int = MAX_STREAMS) -> None:
        check_live_dir(out_dir)
        if not out_dir.is_dir():
            raise DatasetError(f"{out_dir} is not a directory; give an output directory")
        self.out_dir = out_dir
        self.consumers: dict[str, _Consumer] = {}
        self.follower = DatasetFollower(out_dir)  # which files may be sent
        self._follow_lock = asyncio.Lock()
        self.streams = asyncio.Semaphore(max_streams)
        self.registry = CollectorRegistry(auto_describe=True)
        self.files_sent = Counter("hsx_serve_files", "Sample files sent", registry=self.registry)
        self.bytes_sent = Counter("hsx_serve_bytes", "Sample bytes sent", registry=self.registry)
        self.files_cut = Counter(
            "hsx_serve_files_cut",
            "Sample file sends cut at their deadline (a reader that stopped taking bytes)",
            registry=self.registry,
        )
        self.registry.register(_ServeCollector(self))

    async def _consumer(self, name: str, epoch: int = 0) -> _Consumer:
        """The consumer, if the registry in force lets it read ``epoch`` (a new one:
        at most MAX_CONSUMERS of an unregistered dataset)."""
        found = self.consumers.get(name)
        if found is None:
            source = await asyncio.to_thread(LocalSource, self.out_dir, name)
            found = self.consumers.setdefault(name, _Consumer(source))
        await asyncio.to_thread(found.source.check, epoch)
        return found

    # -- liveness of remote owners (serve's monotonic clock) -------------------------------

    async def adopt_served_owners(self) -> int:
        """At start: every owner whose leases serve made, not void, is held for its
        timeout from now (a restarted serve gives its readers time to come back)."""
        adopted = 0
        for name in await asyncio.to_thread(consumer_names, self.out_dir):
            consumer = await self._consumer_or_none(name)
            if consumer is None:
                continue
            state = await asyncio.to_thread(consumer.source.log.refresh)
            holding = {lease.owner for lease in state.leases.values()}
            for owner, timeout in state.served.items():
                if owner in holding and owner not in state.void:
                    await self._hear(consumer, owner, timeout)
                    adopted += 1
        return adopted

    async def _consumer_or_none(self, name: str) -> _Consumer | None:
        try:
            return await self._consumer(name)
        except DatasetError:
            return None  # no longer registered: nothing of it is served

    async def _hear(self, consumer: _Consumer, owner: str, timeout: float) -> _Holder:
        holder = consumer.holders.get(owner)
        if holder is None:
            if len(consumer.holders) >= MAX_HOLDERS:
                raise Busy(
                    f"consumer {consumer.source.consumer!r} has {MAX_HOLDERS} live readers at "
                    "this serve; a reader is started per rank and DataLoader worker: check for "
                    "a loop that starts new ones"
                )
            await asyncio.to_thread(consumer.source.hold, owner)
            holder = consumer.holders[owner] = _Holder(time.monotonic(), timeout)
        holder.heard, holder.timeout = time.monotonic(), timeout
        return holder

    def lapse(self, now: float | None = None) -> int:
        """Let go of every owner not heard from within its timeout: its leases end. The
        count let go."""
        now = time.monotonic() if now is None else now
        gone = 0
        for consumer in self.consumers.values():
            for owner, holder in list(consumer.holders.items()):
                if now - holder.heard > holder.timeout:
                    del consumer.holders[owner]
                    consumer.source.drop(owner)
                    gone += 1
        return gone

    async def reap(self, every: float = REAP_S) -> None:
        """A task of serve: :meth:`lapse` every ``every`` seconds."""
        while True:
            if self.lapse():
                log.info("serve_owners_lapsed")
            await asyncio.sleep(every)

    async def refresh_progress(self) -> None:
        """Each consumer's progress, computed when ``/metrics`` is scraped (not on every
        call: it probes every lease's owner)."""
        for consumer in list(self.consumers.values()):
            async with consumer.lock:
                consumer.progress = await asyncio.to_thread(_progress, consumer.source)

    def close(self) -> None:
        for consumer in self.consumers.values():
            consumer.source.close()
            consumer.holders.clear()

    # -- one call ---------------------------------------------------------------------------

    async def _once(
        self,
        who: Caller,
        timeout: float | None,
        call: Callable[[_Consumer], Awaitable[dict[str, Any] | None]],
        epoch: int = 0,
    ) -> dict[str, Any] | None:
        """Run ``call`` under the consumer's lock unless it repeats one of the owner's last
        calls; None from ``call``: nothing to answer yet (the lease waits, unlocked)."""
        consumer = await self._consumer(who.consumer, epoch)
        async with consumer.lock:
            holder = await self._hear(
                consumer,
                who.owner,
                timeout if timeout is not None else self._timeout(consumer, who),
            )
            if who.call in holder.answers:
                return holder.answers[who.call]
            answer = await call(consumer)
            if answer is None:
                return None
            holder.answers[who.call] = answer
            while len(holder.answers) > REPLAY:
                holder.answers.popitem(last=False)
            return answer

    @staticmethod
    def _timeout(consumer: _Consumer, who: Caller) -> float:
        holder = consumer.holders.get(who.owner)
        return holder.timeout if holder is not None else DEFAULT_TIMEOUT_S

    # -- handlers -------------------------------------------------------------------------

    async def lease(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, req = caller(raw), lease_request(raw)

        async def attempt(consumer: _Consumer) -> dict[str, Any] | None:
            leased = await asyncio.to_thread(
                consumer.source.lease, who.owner, req.rank, req.epoch, req.count,
                call=who.call, via=SERVE, timeout=req.timeout,
            )  # fmt: skip
            if not (leased.entries or leased.ended or time.monotonic() >= deadline):
                return None
            return {
                "entries": [orjson.loads(e.to_line()) for e in leased.entries],
                "ended": leased.ended,
            }

        deadline = time.monotonic() + req.wait
        while True:
            answer = await self._once(who, req.timeout, attempt, req.epoch)
            if answer is not None:
                return answer
            await asyncio.sleep(LONG_POLL_S)  # a poll of logs other processes append to

    async def ack(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids), earlier = caller(raw), id_list(raw), adopted_from(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            result = await asyncio.to_thread(
                consumer.source.ack, who.owner, epoch, ids, adopted_from=earlier, call=who.call
            )
            return result.to_json()

        return await self._answer(who, None, call, epoch)

    async def release(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids) = caller(raw), id_list(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            await asyncio.to_thread(consumer.source.release, who.owner, epoch, ids)
            return {}

        return await self._answer(who, None, call, epoch)

    async def renew(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The heartbeat: the owner is alive (its leases stay its own)."""
        who, timeout = caller(raw), heartbeat_timeout(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            state = await asyncio.to_thread(consumer.source.log.refresh)
            if who.owner in state.void:
                raise OwnerVoid(f"owner {who.owner}: {VOID}")
            return {}

        return await self._answer(who, timeout, call)

    async def _answer(
        self,
        who: Caller,
        timeout: float | None,
        call: Callable[[_Consumer], Awaitable[dict[str, Any]]],
        epoch: int = 0,
    ) -> dict[str, Any]:
        answer = await self._once(who, timeout, call, epoch)
        assert answer is not None
        return answer

    async def info(self) -> dict[str, Any]:
        def facts() -> dict[str, Any]:
            followed = self.follower.refresh()
            first = [followed.entries[followed.order[0]]] if followed.order else []
            f = dataset_facts(self.out_dir, first)
            registry = read_registry(self.out_dir)
            return {
                "protocol": WIRE_VERSION,
                "dataset": dataset_identity(self.out_dir),
                "facts": {
                    "aux_layers": None if f.aux_layers is None else list(f.aux_layers),
                    "hidden_size": f.hidden_size,
                    "final_state": f.final_state,
                    "storage": {"dtype": f.storage.dtype, "quantized": list(f.storage.quantized)},
                    "provenance": f.provenance,
                },
                "registry": None if registry is None else orjson.loads(registry.to_json()),
            }

        async with self._follow_lock:
            return await asyncio.to_thread(facts)

    async def sample_file(self, query: Any) -> tuple[Path, ManifestEntry]:
        """The file ``query`` asks for, if its owner holds the sample's lease now."""
        rel = str(query.get("path", ""))
        problem = manifest_path_problem(rel)
        if problem:
            raise WireError(problem)
        async with self._follow_lock:
            followed = await asyncio.to_thread(self.follower.refresh)
        entry = followed.entries.get(followed.by_path.get(rel, ""))
        if entry is None or entry.path != rel:  # unknown, or its id was committed again since
            raise FileNotFoundError(rel)
        if rel in followed.retired:  # every consumer has it: no lease of it is anyone's
            raise LeaseLost(f"sample {entry.id} was acknowledged by every consumer and deleted")
        req = file_request(query)
        consumer = await self._consumer(req.consumer, req.epoch)
        holder = consumer.holders.get(req.owner)
        if holder is not None:
            holder.heard = time.monotonic()
        held = await asyncio.to_thread(consumer.source.still_holds, req.owner, req.epoch, entry)
        if not held:
            raise LeaseLost(f"sample {entry.id} is not leased to owner {req.owner}")
        return self.out_dir / rel, entry


class Busy(WireError):
    """A bound of serve is reached (HTTP 429): the request may come again later."""


def _progress(source: LocalSource) -> ConsumerProgress:
    """``source``'s consumer now: its log and the manifests read to their ends."""
    return log_progress(source.log, set(source.follower.refresh().entries))


class _ServeCollector(Collector):
    """Per consumer: its lag, acknowledged samples and live leases (at the scrape),
    as :mod:`~hsx_async.dataset.live.view` computes them for the run and ``hsx status``."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        yield from consumer_families(
            [c.progress for c in self.server.consumers.values() if c.progress is not None]
        )


def http_status(exc: DatasetError) -> int:
    """The HTTP status of a refusal (PROTOCOL §6.4)."""
    if isinstance(exc, Busy):
        return 429
    if isinstance(exc, WireError):
        return 400
    if isinstance(exc, LeaseLost):
        return GONE
    return VOID_STATUS  # a replaced owner, an unregistered consumer, a refused epoch


__all__ = ["MAX_STREAMS", "LiveServer", "http_status"]
