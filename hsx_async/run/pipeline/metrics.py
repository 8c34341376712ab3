"""Run metrics: Prometheus counters and histograms on a private registry, plus the totals
``/status`` shows. The gauges are read from the run's state at each scrape
(:mod:`hsx_async.run.daemon.status`).

One :class:`Metrics` per run; labels stay low-cardinality (server URL, outcome, fault
kind), never per sample.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class Totals:
    """Plain counters of this run (Prometheus counters cannot be read back cheaply)."""

    samples_done: int = 0
    samples_quarantined: int = 0
    samples_retried: int = 0
    attempts_failed: int = 0
    tokens_done: int = 0
    bytes_written: int = 0
    samples_skipped: int = 0  # already done by an earlier run
    started: float = field(default_factory=time.monotonic)
    cpu_started: float = field(default_factory=time.process_time)  # every thread's

    def counters(self) -> dict[str, int]:
        """The counts, without the two start marks (clocks that mean nothing outside the
        process)."""
        marks = ("started", "cpu_started")
        return {k: v for k, v in vars(self).items() if k not in marks}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.totals = Totals()
        self.failure_reasons: collections.Counter[str] = collections.Counter()
        # Listeners called (on the event loop) right after each sample is durable: the
        # hook for code embedding a Daemon to react to progress without polling.
        self.on_sample_done: list[Callable[[Totals], None]] = []
        r = self.registry
        self.samples = Counter(
            "hsx_samples", "Samples finished, by outcome", ["outcome"], registry=r
        )
        self.retries = Counter(
            "hsx_attempts_failed",
            "Failed attempts, by fault kind and cause (sample, server, job)",
            ["kind", "cause"],
            registry=r,
        )
        self.evictions = Counter(
            "hsx_server_out_of_rotation",
            "Times a server left rotation (or was refused at a probe), by fault kind",
            ["server", "kind"],
            registry=r,
        )
        self.tokens = Counter("hsx_tokens", "Tokens written to the dataset", registry=r)
        self.bytes = Counter("hsx_bytes_written", "Dataset bytes written", registry=r)
        self.request_latency = Histogram(
            "hsx_request_seconds",
            "/generate + dump wait, per attempt",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.write_latency = Histogram(
            "hsx_write_seconds",
            "Copy + hash + fsync + rename, per sample",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def sample_done(self, tokens: int, nbytes: int) -> None:
        self.totals.samples_done += 1
        self.totals.tokens_done += tokens
        self.totals.bytes_written += nbytes
        self.samples.labels("done").inc()
        self.tokens.inc(tokens)
        self.bytes.inc(nbytes)
        for callback in self.on_sample_done:
            callback(self.totals)

    def sample_quarantined(self) -> None:
        self.totals.samples_quarantined += 1
        self.samples.labels("quarantined").inc()

    def attempt_failed(self, kind: str, cause: str, reason: str = "") -> None:
        """``kind`` (a fault kind, :mod:`hsx_async.run.servers.faults`) and ``cause`` label the
        Prometheus series; ``reason`` (what failed, without its particulars) is counted
        for the job report."""
        self.totals.attempts_failed += 1
        self.retries.labels(kind, cause).inc()
        self.failure_reasons[reason or kind] += 1

    def server_out(self, server: str, kind: str) -> None:
        self.evictions.labels(server, kind).inc()

    def elapsed(self) -> float:
        """Seconds since this run started (see :meth:`run_starts`; the monotonic start
        never leaves the process)."""
        return time.monotonic() - self.totals.started

    def cpu(self) -> float:
        """CPU seconds the process (every thread) spent since this run started: its
        imports and set-up excluded (see :meth:`run_starts`)."""
        return time.process_time() - self.totals.cpu_started

    def run_starts(self) -> None:
        """The pipeline is built and its tasks start now (``run_started``): both start
        marks are set here, so :meth:`elapsed`, :meth:`cpu` and the rates all cover the
        run itself. Set-up before it — the output checks, the copies' buffers touched in
        advance (on a VM a first touch costs from ~0 to ~0.1 CPU-s a run, by how much of
        the memory the host has backed already) — is not the run's."""
        self.totals.started = time.monotonic()
        self.totals.cpu_started = time.process_time()

    def rates(self) -> tuple[float, float]:
        """(tokens/s, bytes/s) since the start of this run."""
        elapsed = max(self.elapsed(), 1e-9)
        return self.totals.tokens_done / elapsed, self.totals.bytes_written / elapsed
