"""The disk guard: pause intake before the output disk fills, resume when space returns.

Samples already in flight still finish (their dumps sit in RAM and must go somewhere);
only new samples wait. ENOSPC in the middle of a write trips the guard at once: the
writer removes its temp file, the sample is queued again, and nothing partial is ever
visible under a final name or in the manifest.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger("hsx.guard")

FreeFn = Callable[[Path], int]
# Resume only this far above the reserve, so the guard does not flap at the threshold.
HYSTERESIS = 1.05


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class DiskGuard:
    def __init__(
        self, path: Path, reserve: int, *, free_fn: FreeFn = free_bytes, interval: float = 5.0
    ) -> None:
        self.path = path
        self.reserve = reserve
        self.free_fn = free_fn
        self.interval = interval
        self.open = asyncio.Event()
        self.open.set()
        self.free = -1
        # Called with True (resumed) or False (paused) at each change: the daemon puts it
        # in systemd's status line; code embedding a Daemon may listen too.
        self.on_change: list[Callable[[bool], None]] = []

    @property
    def paused(self) -> bool:
        return not self.open.is_set()

    def _set(self, open_: bool, **why: object) -> None:
        if open_ == self.open.is_set():
            return
        if open_:
            self.open.set()
        else:
            self.open.clear()
        self._announce(open_, **why)

    def _announce(self, open_: bool, **why: object) -> None:
        if open_:
            log.warning("intake_resumed", free=self.free, reserve=self.reserve, **why)
        else:
            log.error(
                "intake_paused_disk_low",
                free=self.free,
                reserve=self.reserve,
                output=str(self.path),
                fix="free space on the output disk or lower "
                "output.disk_reserve (SIGHUP applies it)",
                **why,
            )
        for callback in self.on_change:
            callback(open_)

    def apply(self, free: int) -> bool:
        """Open or close intake for a measured free space; returns whether it is open."""
        self.free = free
        if self.free < self.reserve:
            self._set(False)
        elif self.free >= self.reserve * HYSTERESIS:
            self._set(True)
        return self.open.is_set()

    async def trip(self, reason: str) -> None:
        """Close intake now (ENOSPC seen); :meth:`run` reopens it when space returns.
        Intake closes before the free space is measured, in a thread (statvfs can block
        on a busy disk), so no sample starts meanwhile."""
        was_open = self.open.is_set()
        self.open.clear()
        self.free = await asyncio.to_thread(self.free_fn, self.path)
        if was_open:
            self._announce(False, reason=reason)

    async def run(self) -> None:
        while True:
            self.apply(await asyncio.to_thread(self.free_fn, self.path))
            await asyncio.sleep(self.interval)
