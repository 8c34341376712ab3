"""One job runner: the skeleton every job of hsx runs in — ``hsx run``'s extraction
(:class:`~hsx_async.run.daemon.daemon.Daemon`) and ``hsx regenerate``'s turns
(:class:`~hsx_async.prepare.regenerate.run.Regenerator`) are two kinds of :class:`Work`
plugged into it (STYLE §4c: *arq*'s one ``Worker`` runs every job).

What it owns, once for every kind:

- the servers: one :class:`~hsx_async.run.servers.pool.ServerPool` built from ``[server]``
  (:func:`~hsx_async.run.servers.pool.server_pool`; ``hsx check`` builds its own the same
  way) and one HTTP session (:func:`~hsx_async.run.servers.client.connected`);
- one :class:`asyncio.TaskGroup` with the work's tasks, the admission task (the one wait
  for a server: :class:`~hsx_async.run.servers.admission.ServerWait`, exit 3 after
  ``server.unreachable_timeout``), the events log and the signals (STYLE §5, §7);
- the endings, filtered with ``except*``: the work drained (:class:`_Finished`), the
  drain deadline passed (:class:`~hsx_async.run.daemon.signals.DrainExpired`), or the first
  :class:`~hsx_async.errors.HsxError` of the group raised alone.

A work's reader never waits for room to say its input ended (it closes a
:class:`~hsx_async.run.pipeline.handoff.Conveyor`), so a job cut off by the admission's
:class:`~hsx_async.errors.NoServerError` ends however much input waits (issue 38).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from hsx_async.config import Config
from hsx_async.errors import HsxError, first_error
from hsx_async.run.daemon.signals import DrainExpired, Stopper
from hsx_async.run.notify import Notifier
from hsx_async.run.report.numbers import RunRecorder

log = structlog.get_logger("hsx.job")


class _Finished(Exception):
    """Every item of the input is settled (or left for a resume)."""


class Work(Protocol):
    """A kind of job, as the runner runs it."""

    name: str  # its log events: "<name>_started", "<name>_finished"

    def start(self, tg: asyncio.TaskGroup) -> None:
        """Its long-lived tasks (the reader, the workers, the writers), in ``tg``."""

    async def drained(self) -> None:
        """Return once every item taken from the input is settled or abandoned."""

    async def stop(self) -> None:
        """Stop intake and stop waiting for a server; what is in flight finishes."""

    @property
    def in_flight(self) -> int:
        """Items taken from the input and not yet settled."""

    def started(self) -> dict[str, Any]:
        """The fields of its ``<name>_started`` line."""

    def finished(self) -> dict[str, Any]:
        """The fields of its ``<name>_finished`` line."""


class Admitting(Protocol):
    """The admission task (:class:`~hsx_async.run.servers.admission.Admission`)."""

    async def run(self) -> None: ...


class JobRunner:
    """Runs one :class:`Work` in one task group until it drains, its drain deadline
    passes, or an error of the job stops it."""

    def __init__(
        self,
        config: Callable[[], Config],
        *,
        stopper: Stopper,
        notifier: Notifier,
        recorder: RunRecorder,
    ) -> None:
        self.config = config  # read when needed: a reload may replace it
        self.stopper = stopper
        self.notifier = notifier
        self.recorder = recorder

    async def serve(
        self,
        work: Work,
        admission: Admitting,
        *,
        on_reload: Callable[[], None] | None,
        services: Callable[[asyncio.TaskGroup], None] = lambda tg: None,
    ) -> None:
        """``on_reload``: what SIGHUP does (None: signals are not handled, as when
        embedded); ``services``: the work's helpers that never end the job by returning."""
        try:
            async with asyncio.TaskGroup() as tg:
                if on_reload is not None:
                    self.stopper.install(on_reload)
                work.start(tg)
                tg.create_task(self._finish(work), name="hsx-finish")
                tg.create_task(self.stopper.watch(work), name="hsx-signals")
                tg.create_task(admission.run(), name="hsx-admission")
                tg.create_task(self.recorder.run(), name="hsx-events")
                services(tg)
                self.notifier.ready()
                log.info(f"{work.name}_started", **work.started())
        except* _Finished:
            log.info(f"{work.name}_finished", **work.finished())
        except* DrainExpired:
            log.warning(
                "drain_deadline_passed",
                deadline_s=self.config().daemon.drain_timeout,
                in_flight=work.in_flight,
            )
        except* HsxError as group:
            raise first_error(group) from None
        finally:
            if on_reload is not None:
                self.stopper.remove()

    @staticmethod
    async def _finish(work: Work) -> None:
        await work.drained()
        raise _Finished
