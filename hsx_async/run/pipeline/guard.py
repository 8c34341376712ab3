"""The disk guard: pause intake before the output disk fills, resume when space returns.

Samples already in flight still finish (their dumps sit in RAM and must go somewhere);
only new samples wait. ENOSPC in the middle of a write trips the guard at once: the
writer removes its temp file, the sample is queued again, and nothing partial is ever
visible under a final name or in the manifest.

The same pause serves the *limits* that may hold intake besides free space: a bounded
spool (:mod:`hsx_async.run.daemon.spool`) refuses a sample whose file would not fit; the worker
puts it back first in line and intake stays closed, as after ENOSPC, until the limit has
room again (:meth:`DiskGuard.reevaluate`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from hsx_async.run.source import Sample

log = structlog.get_logger("hsx.guard")

FreeFn = Callable[[Path], int]
# Resume only this far above the reserve, so the guard does not flap at the threshold.
HYSTERESIS = 1.05


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class IntakeLimit(Protocol):
    """Something besides free space that may hold intake (the spool)."""

    def admit(self, sample: Sample) -> bool:
        """Take room for ``sample``'s file now; False when it does not fit."""
        ...

    def holds(self) -> str:
        """Why intake must stay closed ('' when it may open)."""
        ...

    def fix(self) -> str:
        """What the operator can do while it holds."""
        ...


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
        self.limits: list[IntakeLimit] = []
        self.reason = ""  # why intake is paused ('' while open)
        self._limit_pause = False  # the pause now is a limit's (not the disk's)
        self._limit_said = False  # a limit's pause was logged at info once this run

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
        """One line per change; a limit's pauses (a full spool: the intended steady state
        of an online job, several a second) at info once a run, then at debug: the
        progress line, ``hsx status`` and ``hsx_intake_paused`` show them."""
        held = "" if open_ else self._held()
        self.reason = "" if open_ else held or "output disk below output.disk_reserve"
        if open_ and self._limit_pause:
            log.debug("intake_resumed", reason="the limit has room again", **why)
        elif open_:
            log.warning("intake_resumed", free=self.free, reserve=self.reserve, **why)
        elif held:
            say = log.debug if self._limit_said else log.info
            say("intake_paused_limit", reason=held, fix=self._fix(), **why)
            self._limit_said = True
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
        self._limit_pause = bool(held)
        for callback in self.on_change:
            callback(open_)

    def _held(self) -> str:
        return next((why for limit in self.limits if (why := limit.holds())), "")

    def _fix(self) -> str:
        return next((limit.fix() for limit in self.limits if limit.holds()), "")

    def apply(self, free: int) -> bool:
        """Open or close intake for a measured free space (and the limits); returns
        whether it is open."""
        self.free = free
        measured = free >= 0
        if (measured and self.free < self.reserve) or self._held():
            self._set(False)
        elif not measured or self.free >= self.reserve * HYSTERESIS:
            self._set(True)
        return self.open.is_set()

    def reevaluate(self) -> bool:
        """A limit changed (the spool freed room): apply the last measured free space."""
        return self.apply(self.free)

    def admit(self, sample: Sample) -> bool:
        """Take room for ``sample`` in every limit. False: it does not fit, intake is
        closed now (as on ENOSPC) and the caller puts the sample back in line."""
        for limit in self.limits:
            if not limit.admit(sample):
                self._set(False)
                return False
        return True

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
