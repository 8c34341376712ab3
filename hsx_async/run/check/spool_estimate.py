"""``hsx check``'s estimate of the spool a job needs (``retention = "acked"``, PROTOCOL §6.3).

From four inputs, each named on the first line it prints: the extraction rate (the
check's own measured estimate, the slowest of servers, disk and client, or
``--extraction-rate``), the consumers' rate (``--consumer-rate``: tokens/s of all ranks
together, the slowest consumer), how often they acknowledge (``--ack-interval``: samples are
deleted only once acknowledged, at a checkpoint or an optimizer step) and the input's own
tokens and samples. The model, in bytes of sample files on the disk:

- *in flight*: ``workers.concurrency`` (``max_concurrency`` when auto) files of the input's
  mean length, whose room a worker takes before it sends the request (§6.3);
- *unacknowledged*: one ack interval of consumption, consumed but not yet deletable;
- *backlog*: when the consumers are slower than extraction, what they have not consumed when
  extraction ends, ``tokens × (1 − consumer / extraction)``.

The peak is their sum, at most every sample file of the job. A ``spool_limit`` under it
throttles extraction to the consumers' rate once the spool is full (the job takes longer,
said how much); one under in flight plus one ack interval pauses intake before the
consumers can free anything: both are warnings naming ``output.spool_limit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsx_async.config import Config, spool_bytes_bound
from hsx_async.dataset.live.registry import ACKED
from hsx_async.units import eta_text, human_bytes

Line = tuple[str, str, str]  # (level, check, detail), as hsx check prints them
KEY = "output.spool_limit"


@dataclass(frozen=True, slots=True)
class SpoolRates:
    """What the operator told ``hsx check`` (tokens/s; seconds)."""

    consumer: float | None = None  # --consumer-rate
    ack_interval: float = 60.0  # --ack-interval
    extraction: float | None = None  # --extraction-rate (overrides the measured one)


@dataclass(frozen=True, slots=True)
class SpoolNeed:
    per_token: float  # a mean sample file's bytes a token
    in_flight: int
    unacked: int
    backlog: int
    extraction_s: float  # the job at full extraction speed
    consumer_s: float  # the consumers through every token
    extraction: float  # tokens/s
    consumer: float  # tokens/s
    tokens: int
    total: int  # every sample file: the spool never holds more

    @property
    def window(self) -> int:
        """What the spool holds while the consumers keep up."""
        return min(self.total, self.in_flight + self.unacked)

    @property
    def peak(self) -> int:
        return min(self.total, self.window + self.backlog)

    def throttled(self, limit: int) -> tuple[float, float] | None:
        """With a ``limit`` between the window and the peak: (seconds until the spool is
        full, the job's seconds). The spool fills at extraction − consumption until it
        holds the limit; from then on extraction runs at the consumers' rate. None for a
        limit outside that range (no limit, one that holds the peak, one under the window)."""
        if not self.window <= limit < self.peak:
            return None
        fill_s = (limit - self.window) / ((self.extraction - self.consumer) * self.per_token)
        return fill_s, fill_s + (self.tokens - self.extraction * fill_s) / self.consumer

    def job_seconds(self, limit: int) -> float | None:
        """The job's seconds with ``limit`` (0: none); None under the window (the model
        does not say how long extraction waits on each ack)."""
        if not limit or limit >= self.peak:
            return self.extraction_s
        throttled = self.throttled(limit)
        return None if throttled is None else throttled[1]


def spool_need(
    config: Config, *, samples: int, tokens: int, extraction: float, consumer: float,
    ack_interval: float,
) -> SpoolNeed:  # fmt: skip
    """The model of the module docstring; rates in tokens/s, all positive."""
    mean = math.ceil(tokens / samples)
    per_token = spool_bytes_bound(config, mean) / mean  # a mean file's bytes a token
    workers = config.workers
    flight = workers.max_concurrency if workers.auto else workers.start_concurrency
    in_flight = min(samples, flight) * spool_bytes_bound(config, mean)
    unacked = int(min(tokens, consumer * ack_interval) * per_token)
    backlog = 0 if consumer >= extraction else int(tokens * (1 - consumer / extraction) * per_token)
    return SpoolNeed(per_token, in_flight, unacked, backlog, tokens / extraction,
                     tokens / consumer, extraction, consumer, tokens,
                     samples * spool_bytes_bound(config, mean))  # fmt: skip


def spool_lines(
    config: Config, *, samples: int, tokens: int, measured: tuple[float, str] | None,
    rates: SpoolRates,
) -> list[Line]:  # fmt: skip
    """The estimate's lines (none when the job keeps every sample and no rate was given).
    ``measured``: the check's extraction estimate (tokens/s, what bounds it), if any."""
    out = config.output
    if out.retention != ACKED:
        if rates.consumer is None:
            return []
        return [("INFO", "spool", 'retention "keep": every sample stays on disk (the whole '
                 "dataset, the output line); --consumer-rate sizes a spool only with "
                 'output.retention = "acked"')]  # fmt: skip
    if rates.consumer is None:
        return [("INFO", "spool", "give --consumer-rate TOKENS/S (the consumers' rate, all "
                 "ranks together) and --ack-interval SECONDS to estimate the spool this job "
                 "needs")]  # fmt: skip
    if not tokens:
        return [("INFO", "spool", "no tokens to extract: the spool stays empty")]
    if rates.extraction is not None:
        extraction, source = rates.extraction, "given: --extraction-rate"
    elif measured is not None:
        extraction, source = measured[0], f"measured: bound by the {measured[1]}"
    else:
        return [("WARN", "spool", "the extraction rate was not measured (no server answered "
                 "the probe): give --extraction-rate TOKENS/S to estimate the spool")]  # fmt: skip
    need = spool_need(config, samples=samples, tokens=tokens, extraction=extraction,
                      consumer=rates.consumer, ack_interval=rates.ack_interval)  # fmt: skip
    lines: list[Line] = [
        ("INFO", "spool", f"inputs: extraction ~{extraction:,.0f} tokens/s ({source}), "
         f"consumers ~{rates.consumer:,.0f} tokens/s (given: --consumer-rate), acknowledging "
         f"every {rates.ack_interval:g} s (--ack-interval), {samples:,} samples, "
         f"{tokens:,} tokens"),
        _peak_line(need, rates.consumer / extraction),
    ]  # fmt: skip
    lines.append(_limit_line(need, int(out.spool_limit)))
    return lines


def _peak_line(need: SpoolNeed, ratio: float) -> Line:
    parts = (
        f"{human_bytes(need.in_flight)} in flight + {human_bytes(need.unacked)} consumed and "
        "not yet acknowledged"
    )
    if need.backlog:
        parts += (
            f" + a backlog of {human_bytes(need.backlog)} when extraction ends (the consumers "
            f"at {ratio:.2f}x extraction: they finish ~{eta_text(need.consumer_s)} after the "
            f"start, extraction alone ~{eta_text(need.extraction_s)})"
        )
    else:
        parts += f" (the consumers keep up: {ratio:.2f}x extraction)"
    if need.in_flight + need.unacked + need.backlog > need.total:
        parts += "; at most every sample file of the job"
    return "INFO", "spool", f"peak ~{human_bytes(need.peak)} at full extraction speed: {parts}"


def _limit_line(need: SpoolNeed, limit: int) -> Line:
    if not limit:
        return ("INFO", "spool", f"{KEY} is not set: the spool may grow to "
                f"~{human_bytes(need.peak)} on the output disk")  # fmt: skip
    if limit >= need.peak:
        return ("OK", "spool", f"{KEY} {human_bytes(limit)} holds the peak "
                f"~{human_bytes(need.peak)}: extraction is not throttled")  # fmt: skip
    if limit < need.window:
        return ("WARN", "spool", f"{KEY} {human_bytes(limit)} cannot hold what is in flight "
                f"plus one ack interval of consumption (~{human_bytes(need.window)}): intake "
                "pauses before the consumers acknowledge anything, so extraction waits on "
                f"every ack; raise {KEY} to at least ~{human_bytes(need.window)}, or "
                "acknowledge more often")  # fmt: skip
    throttled = need.throttled(limit)
    assert throttled is not None  # window <= limit < peak
    fill_s, throttled_s = throttled
    return ("WARN", "spool", f"{KEY} {human_bytes(limit)} is below the ~{human_bytes(need.peak)} "
            f"the rates need: once it is full (~{eta_text(fill_s)} in) extraction is "
            f"throttled to the consumers' ~{need.consumer:,.0f} tokens/s and takes "
            f"~{eta_text(throttled_s)} instead of ~{eta_text(need.extraction_s)}; raise {KEY} "
            f"to ~{human_bytes(need.peak)} to extract at full speed")  # fmt: skip
