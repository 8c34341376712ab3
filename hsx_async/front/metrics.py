"""The front's metrics: Prometheus counters and histograms on a private registry, served on
the front's own port at ``/metrics`` (as vLLM serves its own), plus what Mooncake holds
for the trainer, read at each scrape.

Labels stay low-cardinality (an outcome, a fault's cause and kind), never per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# A trainer's request: a prefill of up to a context's tokens, then one Mooncake put.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# What a trainer's request came to (the ``outcome`` label).
PUBLISHED = "published"  # the sample is in Mooncake at its handle
ERROR_MARKER = "error_marker"  # its ``:error`` marker is, naming the fault
REFUSED = "refused"  # a 4xx the trainer's client raises (wrong model, not token ids, ...)
UNANSWERED = "unanswered"  # a 503: not even the marker could be put


class Held(Collector):
    """Objects and bytes this front put that the trainer has not removed yet."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        objects, nbytes = self._read()
        yield GaugeMetricFamily(
            "hsx_front_mooncake_objects_held",
            "Objects put (samples and error markers) the trainer has not removed yet",
            value=objects,
        )
        yield GaugeMetricFamily(
            "hsx_front_mooncake_bytes_held",
            "Bytes of those objects in this front's Mooncake segment",
            value=nbytes,
        )


class FrontMetrics:
    def __init__(self, held: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "hsx_front_requests",
            "Trainer requests answered, by outcome (published, error_marker, refused, unanswered)",
            ["outcome"],
            registry=r,
        )
        self.failures = Counter(
            "hsx_front_failures",
            "Samples that failed, by cause (sample, server, mooncake) and kind",
            ["cause", "kind"],
            registry=r,
        )
        self.bytes_published = Counter(
            "hsx_front_bytes_published", "Sample bytes put to Mooncake", registry=r
        )
        self.request_latency = Histogram(
            "hsx_front_request_seconds",
            "A trainer's request: extraction and publication",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_latency = Histogram(
            "hsx_front_publish_seconds",
            "One Mooncake put (a sample or an error marker)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(Held(held))

    def answered(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def failed(self, cause: str, kind: str) -> None:
        self.failures.labels(cause, kind).inc()
