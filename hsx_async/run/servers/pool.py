"""The servers of a job and their rotation.

:class:`ServerPool` spreads requests over the servers in rotation (fewest in flight
first) and takes a server out of rotation with the reason — at once for a fault that says
the server cannot serve (refused connection, no hook, 404, another model), after a streak
of soft ones (5xx, timeouts, broken dumps). It keeps each server's record (dumps served,
each time it left rotation, what its first probe after showed), from which
:mod:`hsx_async.run.servers.retry` decides whether a failure was the sample's. Workers wait
for a server in rotation instead of burning attempts while every server is out.

A server comes into rotation only through its admission
(:mod:`hsx_async.run.servers.admission`: a probe — a real request through the dump path for
``hsx run``, a one-token decode for ``hsx regenerate`` — and the server's identity checked
against the job's). :func:`server_pool` builds the job's pool from ``[server]``, once for
run, regenerate and ``hsx check``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import structlog
import yarl

from hsx_async.config import Config, ServerConfig, redact_url
from hsx_async.engines import DEFAULT_ENGINE, ENGINES, Engine, EngineName
from hsx_async.errors import NoServerError, RequestError
from hsx_async.run.servers.faults import Fault
from hsx_async.run.servers.identity import Identity
from hsx_async.run.servers.retry import Eviction

log = structlog.get_logger("hsx.pool")

# Consecutive 5xx or timeouts before a server leaves rotation; a refused or reset
# connection takes it out at once.
SOFT_FAILURES_TO_EVICT = 3
NOT_CHECKED = "not_checked"  # the out-of-rotation kind of a server not admitted yet


class PoolStopped(Exception):
    """The run is stopping while a worker waits for a server (its sample was not sent)."""


@dataclass(eq=False)
class Server:
    url: str
    engine_name: EngineName = DEFAULT_ENGINE
    healthy: bool = True
    in_flight: int = 0
    soft_failures: int = 0
    requests: int = 0
    last_error: str = ""
    down_since: float | None = None
    retired: bool = False  # removed from the config by a reload
    out_kind: str = ""  # why it is out of rotation (a fault kind: hsx_async.run.servers.faults)
    served: int = 0  # dumps that became samples
    worked: int = 0  # the lease number (``requests`` then) of the latest of them
    evictions: list[Eviction] = field(default_factory=list)
    identity: Identity | None = None  # what it was admitted as (hsx run)

    @property
    def engine(self) -> Engine:
        return ENGINES[self.engine_name]

    @functools.cached_property
    def generate_url(self) -> yarl.URL:
        """Parsed once: a string would be parsed again for every request."""
        return yarl.URL(f"{self.url}{self.engine.generate_path}")

    @functools.cached_property
    def decode_url(self) -> yarl.URL:
        return yarl.URL(f"{self.url}{self.engine.decode_path}")

    @property
    def display(self) -> str:
        """The URL as logs, errors, metrics and /status show it (no password)."""
        return redact_url(self.url)


class ServerPool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        health_interval: float,
        unreachable_timeout: float,
        engines: Sequence[EngineName] | None = None,
        admission: bool = False,
    ) -> None:
        names: list[EngineName] = (
            list(engines) if engines is not None else [DEFAULT_ENGINE] * len(urls)
        )
        # admission: every server starts out of rotation until it is admitted (hsx run).
        self.admission = admission
        self.servers = [self._new(u.rstrip("/"), e) for u, e in zip(urls, names, strict=True)]
        self.health_interval = health_interval
        self.unreachable_timeout = unreachable_timeout
        self._changed = asyncio.Condition()
        self._rr = 0
        self._stopped = False
        # Set once a sample needs a server (the first fed, or a wait for one): admission
        # starts then (hsx run).
        self.wanted = asyncio.Event()
        # Called with (server, in_rotation) at each change: the events log, the metrics.
        self.on_change: list[Callable[[Server, bool], None]] = []

    def _new(self, url: str, engine: EngineName) -> Server:
        if not self.admission:
            return Server(url, engine)
        return Server(
            url,
            engine,
            healthy=False,
            out_kind=NOT_CHECKED,
            last_error="not checked yet",
            down_since=time.monotonic(),
        )

    def healthy(self) -> list[Server]:
        return [s for s in self.servers if s.healthy and not s.retired]

    def out_of_rotation(self) -> list[Server]:
        """The servers an admission examines (not retired by a reload)."""
        return [s for s in self.servers if not s.healthy and not s.retired]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def stop_waiting(self) -> None:
        """The run is stopping: every wait for a server ends (:class:`PoolStopped`)."""
        self._stopped = True
        if not self.healthy():
            log.warning(
                "stopped_while_waiting_for_server",
                servers={s.display: s.last_error or "no answer" for s in self.servers},
                note="samples not sent anywhere are left for the next run",
            )
        await self._notify()

    async def wait_healthy(self, timeout: float | None = -1.0) -> None:
        """Return once a server is in rotation; NoServerError after ``timeout`` (default:
        the unreachable timeout; None: wait as long as it takes); PoolStopped once
        :meth:`stop_waiting` was called."""
        if self.healthy():
            return
        self.wanted.set()
        limit = self.unreachable_timeout if timeout == -1.0 else timeout
        try:
            async with asyncio.timeout(limit), self._changed:
                await self._changed.wait_for(lambda: bool(self.healthy()) or self._stopped)
            if not self.healthy():
                raise PoolStopped("the run is stopping")
        except TimeoutError:
            detail = "; ".join(f"{s.display}: {s.last_error or 'no answer'}" for s in self.servers)
            raise NoServerError(
                f"no server answered for {self.unreachable_timeout:g} s "
                f"(server.unreachable_timeout) — {detail}. Start or fix the servers, or "
                "check [server].urls"
            ) from None

    @contextlib.asynccontextmanager
    async def lease(self, timeout: float | None = -1.0) -> AsyncIterator[Server]:
        """A healthy server for one attempt, least loaded first (round robin on ties);
        ``timeout`` as for :meth:`wait_healthy`. The attempt's lease number is the
        server's ``requests`` as the block starts (pass it to :meth:`served`)."""
        await self.wait_healthy(timeout)
        candidates = self.healthy()
        self._rr += 1
        low = min(s.in_flight for s in candidates)
        ties = [s for s in candidates if s.in_flight == low]
        server = ties[self._rr % len(ties)]
        server.in_flight += 1
        server.requests += 1
        try:
            yield server
        finally:
            server.in_flight -= 1

    def succeeded(self, server: Server) -> None:
        server.soft_failures = 0

    def served(self, server: Server, lease: int) -> None:
        """A dump of ``server``, from the attempt with lease number ``lease``, became a
        sample: it works (the evidence :mod:`hsx_async.run.servers.retry` settles suspicions
        with); its streak of soft faults ends."""
        server.served += 1
        server.worked = max(server.worked, lease)
        server.soft_failures = 0

    async def failed(self, server: Server, error: RequestError) -> None:
        server.last_error = str(error)
        if not error.server_fault:
            return
        server.soft_failures += 1
        if error.hard or server.soft_failures >= SOFT_FAILURES_TO_EVICT:
            await self.evict(server, str(error))

    async def fault(self, server: Server, fault: Fault) -> None:
        """A failed attempt on ``server``: a server fault counts against it (out of
        rotation at once, or after a streak of soft ones); a sample's does not."""
        if fault.cause != "server":
            return
        server.last_error = fault.reason
        if fault.kind == "throttled":
            return  # busy, not broken: the backoff is enough
        server.soft_failures += 1
        if fault.evict or server.soft_failures >= SOFT_FAILURES_TO_EVICT:
            await self.evict(server, fault.reason, fault.kind)

    async def evict(self, server: Server, reason: str, kind: str = "") -> None:
        if server.healthy:
            server.healthy = False
            server.down_since = time.monotonic()
            server.out_kind = kind or "unreachable"
            server.last_error = server.last_error or reason
            server.evictions.append(Eviction(server.worked))
            log.warning(
                "server_out_of_rotation",
                server=server.display,
                kind=server.out_kind,
                reason=reason,
                healthy=len(self.healthy()),
            )
            self._changed_state(server, False)
            await self._notify()

    async def refuse(self, server: Server, reason: str, kind: str) -> None:
        """A server out of rotation stays out, with a new reason (its probe failed)."""
        changed = server.out_kind != kind  # not the text: it may name a rid or a path
        server.out_kind, server.last_error = kind, reason
        if changed:
            log.warning("server_refused", server=server.display, kind=kind, reason=reason)
            self._changed_state(server, False)

    async def restore(self, server: Server) -> None:
        if not server.healthy:
            down = time.monotonic() - (server.down_since or time.monotonic())
            first = server.out_kind == NOT_CHECKED  # admitted: it was never out of rotation
            server.healthy, server.soft_failures, server.down_since = True, 0, None
            server.out_kind = ""
            if first:  # the admission logs server_admitted: it never left rotation
                server.last_error = ""  # "not checked yet" was no error
            else:
                log.info("server_back_in_rotation", server=server.display, down_s=round(down, 1))
            self._changed_state(server, True)
            await self._notify()

    def _changed_state(self, server: Server, in_rotation: bool) -> None:
        for listener in self.on_change:
            listener(server, in_rotation)

    async def apply(self, config: ServerConfig) -> None:
        """A reloaded ``[server]`` section: intervals at once, URLs (and their engines)
        added or retired."""
        self.health_interval = config.health_interval
        self.unreachable_timeout = config.unreachable_timeout
        engines = [config.engine_of(u) for u in config.urls]
        current = [(s.url, s.engine_name) for s in self.servers if not s.retired]
        if current != [(u.rstrip("/"), e) for u, e in zip(config.urls, engines, strict=True)]:
            await self.set_urls(config.urls, engines)

    async def set_urls(
        self, urls: Sequence[str], engines: Sequence[EngineName] | None = None
    ) -> None:
        """Live reload: add new servers, retire removed ones (in-flight calls finish). A URL
        whose engine changed is retired and added anew."""
        names: list[EngineName] = (
            list(engines) if engines is not None else [DEFAULT_ENGINE] * len(urls)
        )
        wanted = {(u.rstrip("/"), e) for u, e in zip(urls, names, strict=True)}
        for s in self.servers:
            s.retired = (s.url, s.engine_name) not in wanted
        known = {(s.url, s.engine_name) for s in self.servers if not s.retired}
        order = [(u.rstrip("/"), e) for u, e in zip(urls, names, strict=True)]
        self.servers.extend(self._new(u, e) for u, e in order if (u, e) not in known)
        await self._notify()


def server_pool(config: Config, *, admission: bool = True) -> ServerPool:
    """The job's servers, from ``[server]``: with ``admission``, none takes an item before
    it is admitted (:mod:`hsx_async.run.servers.admission`)."""
    s = config.server
    return ServerPool(
        s.urls,
        health_interval=s.health_interval,
        unreachable_timeout=s.unreachable_timeout,
        engines=[s.engine_of(u) for u in s.urls],
        admission=admission,
    )
