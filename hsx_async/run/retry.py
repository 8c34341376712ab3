"""Retry policy: which failures are retried and how long to wait. Pure."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with "equal jitter": half fixed, half random.

    The fixed half keeps a flapping server from being hammered; the random half keeps
    workers that failed together from retrying in lockstep.
    """

    max_attempts: int
    base: float
    cap: float

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        # 2.0 ** 1024 raises OverflowError; at 1023 the product is at worst inf, and capped.
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt - 1, 1023))
        r = rng.random() if rng is not None else random.random()
        return ceiling / 2 + r * ceiling / 2

    def exhausted(self, attempt: int) -> bool:
        """True when ``attempt`` was the last one allowed."""
        return attempt >= self.max_attempts
