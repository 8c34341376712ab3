"""``workers.concurrency = "auto"``: a throughput-gradient concurrency limit.

The right number of requests in flight is the smallest that keeps every server's queue
just non-empty: fewer leave the GPU idle between passes, more only add latency and
/dev/shm. It moves with prompt lengths, so it is measured, not configured. The
controller watches the run's own delivered rate (tokens made durable per second), the
way concurrency-limit controllers (Netflix's gradient/AIMD limiters, TCP slow start)
watch latency and throughput, so it works for any server behind ``[server].urls``
without its metrics:

1. **Slow start**: double the limit after each measured window while the rate rises by
   more than ``gain``; at the first window that does not, go back to the best level.
2. **Steady**: every ``probe_every`` windows try a step of a quarter up, then down. A
   step up is kept if the rate rose by more than ``gain / 2``; a step down whenever the
   rate stayed within ``gain / 2`` (the same rate with fewer requests waiting).

Every level is bounded by ``workers.max_concurrency`` and by what the /dev/shm budget
holds at the mean sample size seen so far. A window starts once every sample that was in
flight at the last change has had time to finish (``limit`` completions), so a level is
never judged on its predecessor's work. Pure: no clock, no I/O; the daemon feeds it
readings and applies the :class:`Change` it returns (and logs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TuneSettings:
    start: int = 4
    maximum: int = 64
    window_s: float = 8.0  # the shortest window a level's rate is measured over
    min_window_samples: int = 8  # ... and the fewest completions in it
    gain: float = 0.1  # a rise smaller than this is noise
    probe_every: int = 4  # steady windows between two probes

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.maximum:
            raise ValueError(f"need 1 <= start <= maximum, got {self.start}, {self.maximum}")


@dataclass(frozen=True)
class Reading:
    """The run's counters at one moment (cumulative since the run started)."""

    now: float  # seconds, any monotonic origin
    samples: int  # samples made durable
    tokens: int  # their tokens
    shm_limit: int  # the most samples the /dev/shm budget holds at once (see shm_ceiling)


@dataclass(frozen=True)
class Change:
    old: int
    new: int
    reason: str
    tokens_per_s: float | None  # the rate measured at ``old``, if a window was finished


def shm_ceiling(budget_bytes: int, tokens: int, samples: int, row_bytes: int, maximum: int) -> int:
    """How many samples of the mean size so far fit in the /dev/shm budget (≥ 1), or
    ``maximum`` before any sample is done."""
    if samples <= 0 or tokens <= 0:
        return maximum
    mean_need = max(1, tokens * row_bytes // samples)
    return max(1, min(maximum, budget_bytes // mean_need))


@dataclass
class _Window:
    now: float
    samples: int
    tokens: int


class ConcurrencyController:
    def __init__(self, settings: TuneSettings) -> None:
        self.settings = settings
        self.limit = settings.start
        self.phase: Literal["slow_start", "steady"] = "slow_start"
        self.best_rate = 0.0  # slow start: the best window so far, at best_limit
        self.best_limit = settings.start
        self.base_rate: float | None = None  # steady: the rate at the level probes start from
        self.probe_from: int | None = None  # steady: the level a probe left, while it runs
        self.next_probe_up = True
        self.windows_since_probe = 0
        self._settle_until: int | None = 0  # completions to wait for before a window opens
        self._window: _Window | None = None

    @property
    def settled_limit(self) -> int:
        """The level in use apart from a running probe."""
        return self.probe_from if self.probe_from is not None else self.limit

    def observe(self, r: Reading) -> Change | None:
        """Feed one reading; a :class:`Change` when the limit should move now."""
        ceiling = max(1, min(self.settings.maximum, r.shm_limit))
        if self.limit > ceiling:
            self.probe_from = None
            return self._move(r, ceiling, "the /dev/shm budget or max_concurrency", None)
        rate = self._measure(r)
        if rate is None:
            return None
        if self.phase == "slow_start":
            return self._slow_start(r, rate, ceiling)
        return self._steady(r, rate, ceiling)

    # -- measuring ----------------------------------------------------------------------

    def _measure(self, r: Reading) -> float | None:
        """The rate over a finished window (and a new window opened), else None."""
        if self._settle_until is not None:
            if r.samples < self._settle_until:
                return None
            self._settle_until = None
            self._window = _Window(r.now, r.samples, r.tokens)
            return None
        w = self._window
        assert w is not None
        elapsed = r.now - w.now
        need = max(self.settings.min_window_samples, 2 * self.limit)
        if elapsed < self.settings.window_s or r.samples - w.samples < need:
            return None
        self._window = _Window(r.now, r.samples, r.tokens)
        return (r.tokens - w.tokens) / elapsed

    def _move(self, r: Reading, new: int, reason: str, rate: float | None) -> Change | None:
        if new == self.limit:
            return None
        change = Change(self.limit, new, reason, rate)
        self.limit = new
        self._settle_until = r.samples + new
        self._window = None
        return change

    # -- deciding -----------------------------------------------------------------------

    def _slow_start(self, r: Reading, rate: float, ceiling: int) -> Change | None:
        s = self.settings
        if rate > self.best_rate * (1 + s.gain):
            self.best_rate, self.best_limit = rate, self.limit
            up = min(2 * self.limit, ceiling)
            if up > self.limit:
                return self._move(r, up, "slow start: the rate is still rising", rate)
            self._enter_steady(rate)
            return None
        self._enter_steady(self.best_rate)
        return self._move(
            r, self.best_limit, "slow start done: more requests did not raise the rate", rate
        )

    def _enter_steady(self, rate: float) -> None:
        self.phase = "steady"
        self.base_rate = rate
        self.windows_since_probe = 0

    def _steady(self, r: Reading, rate: float, ceiling: int) -> Change | None:
        s = self.settings
        base = self.base_rate if self.base_rate is not None else rate
        if self.probe_from is not None:
            went_up = self.limit > self.probe_from
            # Up: a step of a quarter must buy a real rise (half of ``gain``: slow start
            # already took the big ones); down: the rate must hold within ``gain / 2``.
            kept = rate > base * (1 + s.gain / 2) if went_up else rate >= base * (1 - s.gain / 2)
            back, self.probe_from = self.probe_from, None
            self.windows_since_probe = 0
            if kept:
                self.base_rate = rate
                return None
            why = "probe up did not raise the rate" if went_up else "probe down lost rate"
            return self._move(r, back, why, rate)
        # The level's rate drifts with the workload: follow it between probes.
        self.base_rate = rate if self.base_rate is None else 0.5 * (self.base_rate + rate)
        self.windows_since_probe += 1
        if self.windows_since_probe < s.probe_every:
            return None
        step = max(1, self.limit // 4)
        up, self.next_probe_up = self.next_probe_up, not self.next_probe_up
        target = min(self.limit + step, ceiling) if up else max(1, self.limit - step)
        if target == self.limit:
            self.windows_since_probe = 0
            return None
        self.probe_from = self.limit
        return self._move(r, target, "probe " + ("up" if up else "down"), rate)
