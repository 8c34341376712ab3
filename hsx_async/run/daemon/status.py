"""Where a run stands: a typed snapshot, and the Prometheus gauges read from it.

:class:`RunStatus` is what ``/status``, the progress line and the systemd status show;
:class:`StatusCollector` turns the same snapshot into gauges when ``/metrics`` is scraped,
so both always agree and nothing is refreshed as a side effect of asking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsx_async.dataset.live.view import consumer_families
from hsx_async.run.daemon.spool import ConsumerLag, Spool
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.pipeline.pipeline import Pipeline
from hsx_async.run.servers.pool import Server, ServerPool


@dataclass(frozen=True, slots=True)
class ServerStatus:
    url: str  # as logs show it: no password
    healthy: bool  # in rotation
    in_flight: int
    requests: int
    last_error: str
    out_of_rotation: str  # why it is out (its fault kind and reason), '' while in
    model: str  # what it was admitted as ('' before)


@dataclass(frozen=True, slots=True)
class SpoolStatus:
    """A bounded spool (PROTOCOL §6), as the run follows it."""

    held: int  # bytes: committed files not yet deleted + room of the samples in flight
    limit: int  # output.spool_limit (0: none)
    peak: int  # the most ``held`` reached this run
    retired: int  # samples of this shard the spool deleted (read this run)
    paused_s: float  # seconds intake waited for room this run
    waiting: bool  # a sample waits for room now (intake paused by the spool)
    consumers: tuple[ConsumerLag, ...]

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["consumers"] = [
            {name: getattr(c, name) for name in c.__dataclass_fields__} for c in self.consumers
        ]
        return out


def spool_status(spool: Spool) -> SpoolStatus:
    return SpoolStatus(
        held=spool.used,
        limit=spool.limit,
        peak=spool.peak,
        retired=spool.retired,
        paused_s=round(spool.paused_seconds(), 3),
        waiting=spool.blocked > 0,
        consumers=tuple(spool.consumers),
    )


@dataclass(frozen=True, slots=True)
class RunStatus:
    done: int
    quarantined: int
    skipped: int
    retried: int
    attempts_failed: int
    tokens: int
    bytes: int
    tokens_per_s: float
    bytes_per_s: float
    total_samples: int | None  # None until the input is counted
    remaining_tokens: int | None
    eta_s: float | None
    in_flight: int
    workers: int
    shm_used: int
    shm_budget: int
    writer_queue: int
    paused: bool
    free_disk: int  # -1 until first measured
    disk_reserve: int  # output.disk_reserve
    stopping: bool
    servers: tuple[ServerStatus, ...]  # those in the config (retired ones left out)
    spool: SpoolStatus | None = None  # with [output].consumers or retention "acked"

    @property
    def remaining_samples(self) -> int:
        settled = self.done + self.skipped + self.quarantined
        return max(0, (self.total_samples or 0) - settled)

    def as_dict(self) -> dict[str, Any]:
        """The ``/status`` JSON object (its keys are a stable interface)."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["servers"] = [
            {name: getattr(s, name) for name in s.__dataclass_fields__} for s in self.servers
        ]
        out["spool"] = None if self.spool is None else self.spool.as_dict()
        return out


def take_status(
    metrics: Metrics,
    *,
    pending: tuple[int, int] | None,
    pipeline: Pipeline | None,
    servers: ServerPool | None,
    guard: DiskGuard,
    stopping: bool,
    shm_budget: int,
    spool: Spool | None = None,
) -> RunStatus:
    """The snapshot of a run from its parts (``pipeline`` None before it starts)."""
    t = metrics.totals
    tok_s, bytes_s = metrics.rates()
    remaining_tokens = total = None
    if pending is not None:
        total = pending[0] + t.samples_skipped
        remaining_tokens = max(0, pending[1] - t.tokens_done)
    eta = remaining_tokens / tok_s if remaining_tokens is not None and tok_s > 0 else None
    workers = pipeline.workers if pipeline else None
    return RunStatus(
        done=t.samples_done,
        quarantined=t.samples_quarantined,
        skipped=t.samples_skipped,
        retried=t.samples_retried,
        attempts_failed=t.attempts_failed,
        tokens=t.tokens_done,
        bytes=t.bytes_written,
        tokens_per_s=tok_s,
        bytes_per_s=bytes_s,
        total_samples=total,
        remaining_tokens=remaining_tokens,
        eta_s=eta,
        in_flight=workers.in_flight if workers else 0,
        workers=workers.workers_running if workers else 0,
        shm_used=workers.budget.used if workers else 0,
        shm_budget=workers.budget.capacity if workers else shm_budget,
        writer_queue=pipeline.writers.queue.qsize() if pipeline else 0,
        paused=guard.paused,
        free_disk=guard.free,
        disk_reserve=guard.reserve,
        stopping=stopping,
        servers=tuple(
            server_status(s) for s in (servers.servers if servers else []) if not s.retired
        ),
        spool=None if spool is None else spool_status(spool),
    )


def server_status(s: Server) -> ServerStatus:
    out = "" if s.healthy else f"{s.out_kind}: {s.last_error}"
    model = (s.identity.model or s.identity.served_as) if s.identity else ""
    return ServerStatus(s.display, s.healthy, s.in_flight, s.requests, s.last_error, out, model)


# name → help text, exactly as the run has always exported them (alert rules and the
# dashboard use these names).
_GAUGES: dict[str, tuple[str, Callable[[RunStatus], float]]] = {
    "hsx_in_flight": ("Samples between send and durable write", lambda s: s.in_flight),
    "hsx_shm_budget_used_bytes": ("/dev/shm bytes reserved", lambda s: s.shm_used),
    "hsx_shm_budget_bytes": ("/dev/shm byte budget", lambda s: s.shm_budget),
    "hsx_writer_queue_depth": ("Dumps waiting for the writer", lambda s: s.writer_queue),
    "hsx_workers": ("Worker tasks running", lambda s: s.workers),
    "hsx_output_free_bytes": ("Free bytes on the output disk", lambda s: max(s.free_disk, 0)),
    "hsx_output_disk_reserve_bytes": (
        "output.disk_reserve: intake pauses when free bytes fall under it",
        lambda s: s.disk_reserve,
    ),
    "hsx_intake_paused": ("1 while intake is paused (disk guard)", lambda s: int(s.paused)),
    "hsx_samples_remaining": ("Samples not yet done", lambda s: s.remaining_samples),
    "hsx_eta_seconds": (
        "Estimated seconds to finish",
        lambda s: s.eta_s if s.eta_s is not None else -1,
    ),
    "hsx_spool_bytes": (
        "Bytes the spool holds: sample files not yet deleted + room of samples in flight",
        lambda s: s.spool.held if s.spool else 0,
    ),
    "hsx_spool_limit_bytes": (
        "output.spool_limit (0: none): intake pauses rather than pass it",
        lambda s: s.spool.limit if s.spool else 0,
    ),
    "hsx_spool_retired_samples": (
        "Samples the spool deleted once every consumer acknowledged them (seen this run)",
        lambda s: s.spool.retired if s.spool else 0,
    ),
    "hsx_spool_paused_seconds": (
        "Seconds intake waited for spool room this run",
        lambda s: s.spool.paused_s if s.spool else 0,
    ),
}
_SERVER_UP = ("hsx_server_up", "1 if the server is in rotation")


class StatusCollector(Collector):
    """The run's gauges, read from one :class:`RunStatus` per scrape."""

    def __init__(self, snapshot: Callable[[], RunStatus]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        for name, (doc, _) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc)
        yield GaugeMetricFamily(*_SERVER_UP, labels=["server"])
        yield from consumer_families(())

    def collect(self) -> Iterator[Metric]:
        status = self.snapshot()
        for name, (doc, value) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=value(status))
        up = GaugeMetricFamily(*_SERVER_UP, labels=["server"])
        for server in status.servers:
            up.add_metric([server.url], 1 if server.healthy else 0)
        yield up
        yield from consumer_families(status.spool.consumers if status.spool else ())
