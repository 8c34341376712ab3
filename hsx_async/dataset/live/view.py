"""The one view of a live dataset (PROTOCOL §6): what the spool holds and where each
consumer stands — read by ``hsx run``'s spool limit and its ``/status``, ``hsx status``,
``hsx serve``'s ``/metrics`` and the report. Each number is computed here once.

A consumer's *lag* is the committed samples it has not acknowledged in epoch 0 (the
epoch a spool retires after); its *leased* samples are those under a live lease (owner
alive and not void) now. Blocking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import Alive, ConsumerLog, ConsumerState, consumer_names
from hsx_async.dataset.live.registry import KEEP, read_registry
from hsx_async.dataset.live.retire import RETIRE_EPOCH, read_retired
from hsx_async.dataset.manifest import read_manifest
from hsx_async.units import human_bytes


@dataclass(frozen=True, slots=True)
class ConsumerProgress:
    """One consumer, as its log says, against the committed samples."""

    name: str
    acked: int  # committed samples it acknowledged (epoch 0)
    lag: int  # committed samples it has not acknowledged yet
    leased: int  # its live leases (every rank)
    duplicate_acks: int


# Per consumer, for the run's /metrics and serve's: one declaration of each series.
_CONSUMER_SERIES: dict[str, tuple[str, Callable[[ConsumerProgress], float]]] = {
    "hsx_consumer_lag_samples": (
        "Committed samples the consumer has not acknowledged (epoch 0)",
        lambda c: c.lag,
    ),
    "hsx_consumer_acked_samples": (
        "Samples the consumer acknowledged (epoch 0)",
        lambda c: c.acked,
    ),
    "hsx_consumer_leases": ("Samples leased to the consumer's live owners now", lambda c: c.leased),
    "hsx_consumer_duplicate_acks": (
        "Acknowledgements of samples already acknowledged",
        lambda c: c.duplicate_acks,
    ),
}


def consumer_families(consumers: Iterable[ConsumerProgress]) -> Iterator[Metric]:
    """The ``hsx_consumer_*`` gauges of ``consumers``."""
    consumers = list(consumers)
    for name, (doc, read) in _CONSUMER_SERIES.items():
        family = GaugeMetricFamily(name, doc, labels=["consumer"])
        for consumer in consumers:
            family.add_metric([consumer.name], read(consumer))
        yield family


def progress(
    name: str, state: ConsumerState, committed: set[str], is_alive: Alive
) -> ConsumerProgress:
    acked = len(state.acked.get(RETIRE_EPOCH, set()) & committed)
    leased = sum(state.held(RETIRE_EPOCH, is_alive).values())
    return ConsumerProgress(name, acked, len(committed) - acked, leased, state.duplicate_acks)


def log_progress(log: ConsumerLog, committed: set[str]) -> ConsumerProgress:
    """``log``'s consumer now (its log read to the end)."""
    return progress(log.name, log.refresh(), committed, log.alive.fresh())


def spool_lines(out_dir: Path) -> list[str]:
    """What ``hsx status`` says of the spool and its consumers ([] when none): the
    retention, the bytes the sample files hold now against the limit, the samples
    deleted, and each consumer's acknowledged, lagging and leased samples."""
    registry = read_registry(out_dir)
    names = sorted(set(registry.consumers if registry else ()) | set(consumer_names(out_dir)))
    if registry is None and not names:
        return []
    entries = read_manifest(out_dir, retired=True)
    retired = read_retired(out_dir)
    held = sum(e.size for e in entries if e.path not in retired)
    committed = {canonical_id(e.id) for e in entries}
    if registry is None or registry.retention == KEEP:
        head = f"spool:       keep every sample; {human_bytes(held)} on disk"
    else:
        limit = f" of {human_bytes(registry.spool_limit)}" if registry.spool_limit else ""
        head = (
            f"spool:       delete once {', '.join(registry.consumers)} acknowledged "
            f"(consumer list version {registry.version}); "
            f"{human_bytes(held)}{limit} held, {len(retired):,} samples deleted"
        )
    lines = [head]
    for name in names:
        p = log_progress(ConsumerLog(out_dir, name), committed)
        extra = f", {p.duplicate_acks:,} acknowledged twice" if p.duplicate_acks else ""
        lines.append(
            f"consumer:    {name}: {p.acked:,} acknowledged, {p.lag:,} behind, "
            f"{p.leased:,} leased now{extra}"
        )
    return lines
