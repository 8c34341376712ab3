"""Stopping a run in three steps (STYLE §7): the first SIGTERM/SIGINT stops intake and
starts the drain; the drain deadline (``daemon.drain_timeout``, read when the signal
comes) cancels what is left; a second signal exits at once. SIGHUP asks for a reload."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Protocol

import structlog

from hsx_async.errors import ForcedExit
from hsx_async.run.notify import Notifier

log = structlog.get_logger("hsx.signals")
_STOP = (signal.SIGTERM, signal.SIGINT)


class Stoppable(Protocol):
    """What a stop signal stops (a run's pipeline, a regenerate)."""

    async def stop(self) -> None:
        """Stop intake; what is in flight finishes."""


class DrainExpired(Exception):
    """The drain deadline passed; what is still in flight is abandoned."""


class Stopper:
    def __init__(self, notifier: Notifier, drain_timeout: Callable[[], float]) -> None:
        self.notifier = notifier
        self.drain_timeout = drain_timeout
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.signals_seen = 0

    def install(self, on_reload: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        for sig in _STOP:
            loop.add_signal_handler(sig, self.on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, on_reload)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (*_STOP, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals_seen += 1
        if self.signals_seen == 1:
            log.warning("stop_requested", signal=sig.name, drain_timeout=self.drain_timeout())
            self.notifier.stopping()
            self.stop_requested.set()
        else:
            log.error("forced_exit", signal=sig.name)
            self.force_requested.set()

    async def watch(self, pipeline: Stoppable) -> None:
        """A task of the run: stop intake at the first signal, then end the drain at its
        deadline (:class:`DrainExpired`) or at a second signal (:class:`ForcedExit`)."""
        await self.stop_requested.wait()
        await pipeline.stop()
        try:
            async with asyncio.timeout(self.drain_timeout()):
                await self.force_requested.wait()
        except TimeoutError:
            raise DrainExpired from None
        raise ForcedExit("second stop signal: exiting at once; run again to resume")
