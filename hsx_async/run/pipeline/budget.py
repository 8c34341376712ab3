"""A byte budget for /dev/shm: a worker reserves a dump's size before it sends the request.

/dev/shm is RAM. Each in-flight dump holds rows × L × H × 2 bytes there until the writer
has copied it to disk and deleted it, so the sum over every request sent and not yet
deleted must stay under the budget. Waiters are served first come, first served, so a
32k-token sample is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import collections


class ByteBudget:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def resize(self, capacity: int) -> None:
        """Change the budget live; shrinking never revokes what is held, it only waits."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._wake()

    async def acquire(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot acquire a negative number of bytes ({n})")
        if n > self._capacity:
            raise ValueError(f"{n} bytes can never fit a budget of {self._capacity}")
        if not self._waiters and self._used + n <= self._capacity:
            self._used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                if entry in self._waiters:  # _wake may have dropped it already
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot release a negative number of bytes ({n})")
        if n > self._used:
            raise ValueError(f"releasing {n} bytes but only {self._used} are held")
        self._used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self._used + n > self._capacity:
                return
            self._waiters.popleft()
            self._used += n
            fut.set_result(None)
