"""Bounded, ordered fan-out over an executor (threads or processes)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


def ordered_map(
    pool: Executor, fn: Callable[[_T], _R], items: Iterable[_T], in_flight: int
) -> Iterator[_R]:
    """``map`` over any executor (threads or processes), results in input order, at most
    ``in_flight`` tasks submitted and not yet taken back: memory stays bounded."""
    pending: deque[Future[_R]] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
