"""``hsx serve OUT``: a live dataset for trainers on other nodes (PROTOCOL §6.4).

Runs on the node that holds the output directory, beside (or after) ``hsx run``. It makes
the leases and acknowledgements of remote readers in the very logs a local reader uses
(:class:`~hsx_async.dataset.live.LocalSource`, one per consumer), and sends sample files
with ``sendfile`` from the page cache. It holds no state of its own that matters: killed
and started again, it goes on from the logs; a reader retries through the gap.

Bounded everywhere (:mod:`hsx_async.dataset.live.wire`): bodies, leases, acks, the long poll,
and at most ``--max-streams`` files in flight at once (more wait their turn). Its HTTP face
(the application, the secret, TLS, connection limits, listening):
:mod:`hsx_async.dataset.live.http`.
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
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsx_async.dataset.export.plan import dataset_facts
from hsx_async.dataset.layout import manifest_path_problem
from hsx_async.dataset.live.follow import DatasetFollower
from hsx_async.dataset.live.ledger import read_registry
from hsx_async.dataset.live.sources import LocalSource
from hsx_async.dataset.live.wire import (
    REPLAY,
    WIRE_VERSION,
    Caller,
    WireError,
    caller,
    id_list,
    lease_request,
    renew_timeout,
)
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError

log = structlog.get_logger("hsx.serve")

LONG_POLL_S = 0.2  # between looks while a lease waits for a sample
MAX_STREAMS = 8


@dataclass
class _Consumer:
    """One consumer's source, used by one call at a time, and each owner's last answers
    (a repeated ``call`` gets its answer again)."""

    source: LocalSource
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answers: dict[str, collections.OrderedDict[str, dict[str, Any]]] = field(default_factory=dict)
    stats: tuple[int, int, int] = (0, 0, 0)  # lag, acked, live leases: after the last call


def _stats(source: LocalSource) -> tuple[int, int, int]:
    committed = set(source.follower.state.entries)
    state = source.log.state
    acked = len(state.acked.get(0, set()) & committed)
    return len(committed) - acked, acked, sum(state.held(0, time.time()).values())


class LiveServer:
    def __init__(self, out_dir: Path, *, max_streams: int = MAX_STREAMS) -> None:
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
        self.registry.register(_ServeCollector(self))

    def _consumer(self, name: str) -> _Consumer:
        found = self.consumers.get(name)
        if found is None:
            found = self.consumers[name] = _Consumer(LocalSource(self.out_dir, name))
        return found

    async def _once(
        self, who: Caller, call: Callable[[_Consumer], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Run ``call`` for ``who`` unless it repeats one of the owner's last calls."""
        consumer = self._consumer(who.consumer)
        async with consumer.lock:
            answers = consumer.answers.setdefault(who.owner, collections.OrderedDict())
            if who.call in answers:
                return answers[who.call]
            answer = await call(consumer)
            answers[who.call] = answer
            while len(answers) > REPLAY:
                answers.popitem(last=False)
            consumer.stats = await asyncio.to_thread(_stats, consumer.source)
            return answer

    # -- handlers -------------------------------------------------------------------------

    async def lease(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, req = caller(raw), lease_request(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            deadline = time.monotonic() + req.wait
            while True:
                leased = await asyncio.to_thread(
                    consumer.source.lease, who.owner, req.rank, req.epoch, req.count, req.timeout
                )
                if leased.entries or leased.ended or time.monotonic() >= deadline:
                    return {
                        "entries": [orjson.loads(e.to_line()) for e in leased.entries],
                        "ended": leased.ended,
                    }
                await asyncio.sleep(LONG_POLL_S)  # a poll of logs other processes append to

        return await self._once(who, call)

    async def ack(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids) = caller(raw), id_list(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            await asyncio.to_thread(consumer.source.ack, who.owner, epoch, ids)
            return {"acked": len(ids)}

        return await self._once(who, call)

    async def release(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids) = caller(raw), id_list(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            await asyncio.to_thread(consumer.source.release, who.owner, epoch, ids)
            return {}

        return await self._once(who, call)

    async def renew(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, timeout = caller(raw), renew_timeout(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            until = time.time() + timeout
            await asyncio.to_thread(consumer.source.renew, who.owner, until)
            return {}

        return await self._once(who, call)

    async def info(self) -> dict[str, Any]:
        def facts() -> dict[str, Any]:
            followed = self.follower.refresh()
            first = [followed.entries[followed.order[0]]] if followed.order else []
            f = dataset_facts(self.out_dir, first)
            registry = read_registry(self.out_dir)
            return {
                "protocol": WIRE_VERSION,
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

    async def sample_file(self, rel: str) -> tuple[Path, ManifestEntry]:
        problem = manifest_path_problem(rel)
        if problem:
            raise WireError(problem)
        async with self._follow_lock:
            followed = await asyncio.to_thread(self.follower.refresh)
        entry = next((e for e in followed.entries.values() if e.path == rel), None)
        if entry is None or rel in followed.retired:
            raise FileNotFoundError(rel)
        return self.out_dir / rel, entry


class _ServeCollector(Collector):
    """Per consumer: its lag, acknowledged samples and live leases (after its last call)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        families = [
            GaugeMetricFamily(name, doc, labels=["consumer"])
            for name, doc in (
                ("hsx_consumer_lag_samples", "Committed samples not acknowledged"),
                ("hsx_consumer_acked_samples", "Samples acknowledged (epoch 0)"),
                ("hsx_consumer_leases", "Live leases of the consumer"),
            )
        ]
        for name, consumer in self.server.consumers.items():
            for family, value in zip(families, consumer.stats, strict=True):
                family.add_metric([name], value)
        yield from families


__all__ = ["MAX_STREAMS", "LiveServer"]
