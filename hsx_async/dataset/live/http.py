"""The HTTP face of ``hsx serve``: the aiohttp application over a
:class:`~hsx_async.dataset.live.serve.LiveServer`, who gets in (the shared secret on every
endpoint, TLS), how much a peer may hold (connections, header and body deadlines, files in
flight) and the listening socket.

- **The secret** (:mod:`hsx_async.dataset.live.secret`): every request, ``/metrics``
  included, carries ``Authorization: Bearer <secret>``, compared in constant time (their
  SHA-256 digests, so not even the length leaks); a missing or wrong one gets 401 and
  nothing about the dataset. A ``--listen`` other nodes can reach needs one.
- **TLS** from ``--tls-cert`` and ``--tls-key`` (readers use ``https://``), or a
  terminating proxy in front of a loopback listen (README).
- **Connections**: at most ``max_connections`` at once. One more evicts the connection that
  has waited longest without a request in progress (a half-sent request, an idle keep-alive:
  a reader reconnects for its next call) once it has waited ``EVICTABLE × header_s`` (a new
  connection's request has that long to arrive before it may go), or is closed at once.
  A connection must deliver its request's header within ``header_s`` of its opening, or of
  the first byte after its last answer (aiohttp has no header deadline: the protocol is
  wrapped, :class:`_Guarded`), and its body within ``body_s``; a connection idle between
  requests is closed after :data:`IDLE_S`. With TLS, the handshake has ``header_s`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import resource
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from hsx_async.dataset.live.secret import MAKE_ONE, read_secret
from hsx_async.dataset.live.serve import MAX_STREAMS, LiveServer, http_status
from hsx_async.dataset.live.wire import ACK, FILE, INFO, LEASE, MAX_BODY, RELEASE, RENEW, WireError
from hsx_async.errors import ArgumentError, DatasetError
from hsx_async.net import listen_address, listen_ok, loopback_host

log = structlog.get_logger("hsx.serve")

MAX_CONNECTIONS = 256
HEADER_S = 5.0  # from a connection's opening (or its next request's first byte) to its header
BODY_S = 10.0  # from the header to the end of the body (at most MAX_BODY bytes)
IDLE_S = 60.0  # a keep-alive connection without a request
SEND_GRACE_S = 10.0  # a sample file's send: this long plus its size at SEND_MIN_RATE
SEND_MIN_RATE = 8 << 20  # bytes/s a reader must at least take a file at (then: cut)
LINGER_S = 1.0  # the unread body of a refused request is drained this long, then cut
BACKLOG = 128  # the kernel's queue of connections, and asyncio's accepts per wake-up
EVICTABLE = 0.2  # of header_s: a connection waits this long before a new one may evict it


@dataclass(frozen=True, slots=True)
class Limits:
    """What one ``hsx serve`` lets its peers hold."""

    max_streams: int = MAX_STREAMS
    max_connections: int = MAX_CONNECTIONS
    header_s: float = HEADER_S
    body_s: float = BODY_S
    send_grace_s: float = SEND_GRACE_S
    send_rate: int = SEND_MIN_RATE

    def send_deadline(self, size: int) -> float:
        """Seconds a sample file of ``size`` bytes may take to send before it is cut (a
        reader paused mid-download holds no stream for longer)."""
        return self.send_grace_s + size / self.send_rate

    def check(self) -> None:
        for flag, value in (
            ("--max-streams", self.max_streams),
            ("--max-connections", self.max_connections),
        ):
            if value < 1:
                raise ArgumentError(flag, f"is {value}, expected at least 1")
        if min(self.header_s, self.body_s, self.send_grace_s, self.send_rate) <= 0:
            raise ArgumentError("deadlines", "header, body and send deadlines must be > 0")


# -- who gets in -----------------------------------------------------------------------------


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server's TLS context from a certificate (chain) and its key, both or neither."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise ArgumentError("--tls-cert", "give --tls-cert and --tls-key together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ArgumentError(
            "--tls-cert", f"cannot load {cert} with key {key}: {reason}; give a PEM certificate "
            "and its private key"
        ) from None  # fmt: skip
    return context


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _authorized(header: str, expected: bytes) -> bool:
    """``Authorization: Bearer <secret>``, the token compared in constant time."""
    scheme, _, token = header.partition(" ")
    given = _digest(token.strip().encode("utf-8", "surrogateescape"))
    return hmac.compare_digest(given, expected) and scheme.lower() == "bearer"


def _unauthorized() -> web.Response:
    response = web.json_response(
        {"error": "unauthorized: send Authorization: Bearer <the secret hsx serve reads>"},
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="hsx serve"'},
    )
    response.force_close()
    return response


# -- connections ------------------------------------------------------------------------------


class _Meters:
    """The front's own counters, beside the server's (``/metrics``)."""

    def __init__(self, server: LiveServer) -> None:
        registry = server.registry
        self.open = Gauge("hsx_serve_connections", "Open connections", registry=registry)
        self.evicted = Counter(
            "hsx_serve_connections_evicted",
            "Waiting connections closed for a new one (at --max-connections)",
            registry=registry,
        )
        self.refused = Counter(
            "hsx_serve_connections_refused",
            "Connections closed at once: every connection was in a request",
            registry=registry,
        )
        self.cut = Counter(
            "hsx_serve_connections_cut",
            "Connections cut at their header or body deadline",
            registry=registry,
        )
        self.unauthorized = Counter(
            "hsx_serve_unauthorized_requests",
            "Requests without the secret (answered 401)",
            registry=registry,
        )


class _Connections:
    """The open connections, and which of them wait without a request in progress (oldest
    first: the first to go when a new one comes at the limit)."""

    def __init__(self, limits: Limits, meters: _Meters) -> None:
        self.limits, self.meters = limits, meters
        self.open: dict[asyncio.BaseTransport, _Guarded] = {}
        self.waiting: dict[_Guarded, float] = {}  # since when (monotonic)

    def admit(self, guard: _Guarded, transport: asyncio.BaseTransport) -> bool:
        now = time.monotonic()
        if len(self.open) >= self.limits.max_connections:
            oldest = next(iter(self.waiting.items()), None)
            if oldest is None or now - oldest[1] < self.limits.header_s * EVICTABLE:
                self.meters.refused.inc()
                return False
            self.meters.evicted.inc()
            oldest[0].close()
        self.open[transport] = guard
        self.waiting[guard] = now
        self.meters.open.set(len(self.open))
        return True

    def forget(self, guard: _Guarded, transport: asyncio.BaseTransport) -> None:
        if self.open.get(transport) is guard:
            del self.open[transport]
        self.waiting.pop(guard, None)
        self.meters.open.set(len(self.open))

    def of(self, transport: asyncio.BaseTransport | None) -> _Guarded | None:
        return None if transport is None else self.open.get(transport)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped: admitted under the limit, cut when
    its request's header does not arrive within ``header_s`` (of the connection's opening,
    or of the first byte after its last answer). The application marks each request's
    start and end (:meth:`busy`, :meth:`idle`)."""

    def __init__(self, connections: _Connections, make: Callable[[], asyncio.Protocol]) -> None:
        self.connections, self._make = connections, make
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.connections.admit(self, transport):
            _abort(transport)
            return
        self.inner = self._make()
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self._busy and self._timer is None:
            self._arm()  # the first byte of the next request
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.inner is not None and self.transport is not None:
            self.connections.forget(self, self.transport)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # -- what the application says -----------------------------------------------------------

    def busy(self) -> None:
        self._busy += 1
        self._disarm()
        self.connections.waiting.pop(self, None)

    def idle(self) -> None:
        self._busy -= 1
        if not self._busy and self.transport is not None and not self.transport.is_closing():
            self.connections.waiting[self] = time.monotonic()

    def close(self) -> None:
        """Evicted (or cut): the descriptor goes now."""
        self._disarm()
        if self.transport is not None:
            self.connections.forget(self, self.transport)
            _abort(self.transport)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.connections.limits.header_s, self._cut)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cut(self) -> None:
        self._timer = None
        self.connections.meters.cut.inc()
        self.close()


def _abort(transport: asyncio.BaseTransport) -> None:
    abort = getattr(transport, "abort", None)
    if abort is not None:
        abort()
    else:
        transport.close()


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections are :class:`_Guarded` (aiohttp's ``TCPSite`` but for
    the protocol factory and the TLS handshake's deadline)."""

    __slots__ = ("_connections", "_host", "_port")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        connections: _Connections,
        *,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._connections = host, port, connections

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        inner = self._runner.server
        assert inner is not None
        connections = self._connections
        tls = self._ssl_context
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guarded(connections, inner),
            self._host,
            self._port,
            ssl=tls,
            ssl_handshake_timeout=connections.limits.header_s if tls else None,
            backlog=BACKLOG,
            reuse_address=True,
        )


# -- the application ---------------------------------------------------------------------------


def build_app(
    server: LiveServer,
    *,
    secret: bytes | None = None,
    limits: Limits | None = None,
    connections: _Connections | None = None,
) -> web.Application:
    meters = connections.meters if connections is not None else _Meters(server)
    front = _front(secret, limits or Limits(), connections, meters)
    app = web.Application(client_max_size=MAX_BODY, middlewares=[front])
    _add_routes(app, server, limits or Limits())
    return app


def _front(
    secret: bytes | None, limits: Limits, connections: _Connections | None, meters: _Meters
) -> Any:
    """What every request passes first: its connection marked busy, the secret, the body
    read within its deadline."""
    expected = None if secret is None else _digest(secret)

    @web.middleware
    async def front(request: web.Request, handler: Any) -> web.StreamResponse:
        guard = None if connections is None else connections.of(request.transport)
        if guard is not None:
            guard.busy()  # the header arrived: no deadline on the answer
        try:
            if expected is not None and not _authorized(
                request.headers.get("Authorization", ""), expected
            ):
                meters.unauthorized.inc()
                return _unauthorized()
            if request.body_exists:
                try:
                    async with asyncio.timeout(limits.body_s):
                        await request.read()  # kept for the handler
                except TimeoutError:
                    meters.cut.inc()
                    response = web.json_response({"error": "body too slow"}, status=408)
                    response.force_close()
                    return response
            answer: web.StreamResponse = await handler(request)
            return answer
        finally:
            if guard is not None:
                guard.idle()

    return front


def _add_routes(app: web.Application, server: LiveServer, limits: Limits) -> None:
    async def json_body(request: web.Request) -> dict[str, Any]:
        try:
            raw = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise WireError("the body is not JSON") from None
        if not isinstance(raw, dict):
            raise WireError("the body must be a JSON object")
        return raw

    def post(handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Any:
        async def route(request: web.Request) -> web.Response:
            try:
                answer = await handler(await json_body(request))
            except DatasetError as exc:
                return web.json_response({"error": str(exc)}, status=http_status(exc), dumps=_dumps)
            return web.json_response(answer, dumps=_dumps)

        return route

    async def info(_: web.Request) -> web.Response:
        return web.json_response(await server.info(), dumps=_dumps)

    async def file(request: web.Request) -> web.StreamResponse:
        try:
            path, entry = await server.sample_file(request.query)
        except DatasetError as exc:
            return web.json_response({"error": str(exc)}, status=http_status(exc))
        except FileNotFoundError:
            return web.json_response({"error": "no such sample in the dataset"}, status=404)
        return await _send(server, request, path, entry.size, limits.send_deadline(entry.size))

    async def metrics(_: web.Request) -> web.Response:
        await server.refresh_progress()
        body = generate_latest(server.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get(INFO, info)
    app.router.add_get(FILE, file)
    app.router.add_post(LEASE, post(server.lease))
    app.router.add_post(ACK, post(server.ack))
    app.router.add_post(RELEASE, post(server.release))
    app.router.add_post(RENEW, post(server.renew))
    app.router.add_get("/metrics", metrics)


async def _send(
    server: LiveServer, request: web.Request, path: Path, size: int, deadline: float
) -> web.StreamResponse:
    """Send a sample file within ``deadline`` seconds, holding one of the streams."""
    async with server.streams:  # sent while held: at most max_streams at once
        response = _SentFile(path, chunk_size=1 << 20)
        try:
            async with asyncio.timeout(deadline):
                await response.prepare(request)
        except TimeoutError:
            # A reader that stopped taking bytes (paused mid-download) keeps no slot: its
            # connection is cut; it fetches again (checked against the hash) when it runs.
            server.files_cut.inc()
            if request.transport is not None:
                request.transport.abort()
            return response
        server.files_sent.inc()
        server.bytes_sent.inc(size)
        return response


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class _SentFile(web.FileResponse):
    """A file response sent inside the handler (so that the stream limit holds while it
    is sent): aiohttp's own prepare after the handler then has nothing left to do (a
    FileResponse would open and send the file again, and fail)."""

    async def prepare(self, request: web.BaseRequest) -> Any:
        if self.prepared:
            return None
        return await super().prepare(request)


# -- listening ------------------------------------------------------------------------------


def check_listen(listen: str, secret: bytes | None) -> tuple[str, int]:
    """``--listen``'s host and port; one other nodes reach needs a secret."""
    if not listen or not listen_ok(listen):
        raise DatasetError(
            f"--listen {listen!r} is not HOST:PORT (e.g. 127.0.0.1:9470, 0.0.0.0:9470)"
        )
    host, port = listen_address(listen)
    if secret is None and not loopback_host(host):
        raise DatasetError(
            f"--listen {listen} reaches other nodes, and anyone there could lease, download "
            f"and acknowledge the dataset: give --secret-file FILE (or HSX_SERVE_SECRET_FILE; "
            f"{MAKE_ONE}), or listen on 127.0.0.1"
        )
    return host, port


def raise_nofile() -> tuple[int, int]:
    """The soft descriptor limit raised to the hard one (connections beyond the default
    1,024 take no one's descriptor); (before, now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve(
    out_dir: Path,
    listen: str,
    *,
    limits: Limits | None = None,
    secret: bytes | None = None,
    tls: ssl.SSLContext | None = None,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when none is given)."""
    limits = limits or Limits()
    limits.check()
    server = LiveServer(out_dir, max_streams=limits.max_streams)
    host, port = check_listen(listen, secret)
    connections = _Connections(limits, _Meters(server))
    app = build_app(server, secret=secret, limits=limits, connections=connections)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_S, lingering_time=LINGER_S)
    await runner.setup()
    own_stop = stop is None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if own_stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    reaper: asyncio.Task[None] | None = None
    try:
        site = _GuardedSite(runner, host, port, connections, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            raise DatasetError(
                f"cannot listen on {listen}: {exc.strerror}; pick another --listen"
            ) from None
        adopted = await server.adopt_served_owners()
        reaper = asyncio.create_task(server.reap())
        bound = runner.addresses[0]
        url = f"{'https' if tls else 'http'}://{bound[0]}:{bound[1]}"
        log.info(
            "serve_listening", url=url, out=str(out_dir), secret=secret is not None,
            max_connections=limits.max_connections, max_streams=limits.max_streams,
            owners_adopted=adopted,
        )  # fmt: skip
        if on_bound is not None:
            on_bound(url)
        await stop.wait()
    finally:
        if own_stop:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await runner.cleanup()
        server.close()


def run_serve(
    out: Path,
    listen: str,
    *,
    limits: Limits,
    secret_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    on_bound: Callable[[str], None],
) -> None:
    """``hsx serve``'s whole life: the limits, the secret, the certificate and the listen
    address checked before anything is logged (a refusal is one line), then :func:`serve`
    until SIGINT or SIGTERM; ``on_bound`` hears the URL once it listens."""
    limits.check()
    secret = read_secret(secret_file, name="--secret-file")
    tls = tls_context(tls_cert, tls_key)
    check_listen(listen, secret)
    before, now = raise_nofile()
    log.info("serve_descriptors", soft_before=before, soft=now)
    # asyncio's own loop, not uvloop: uvloop has no loop.sendfile, and aiohttp then copies
    # every file through Python (bench/transport.py measured the server's CPU per GB).
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(out, listen, limits=limits, secret=secret, tls=tls, on_bound=on_bound))


__all__ = ["Limits", "build_app", "check_listen", "raise_nofile", "run_serve", "serve"]
