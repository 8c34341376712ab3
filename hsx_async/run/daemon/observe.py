"""What the operator sees: ``/metrics`` and ``/status`` over HTTP, and a progress line.

The HTTP endpoint binds to loopback by default (``daemon.metrics_listen``); it exposes
counts and server URLs, nothing else. In a terminal the progress line redraws in place; in
a pipe it becomes a ``progress`` log event every ``daemon.progress_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hsx_async.errors import ConfigError
from hsx_async.net import bind_failure, listen_address
from hsx_async.units import eta_text, human_bytes

log = structlog.get_logger("hsx.observe")
StatusFn = Callable[[], dict[str, Any]]


def build_app(registry: CollectorRegistry, status_fn: StatusFn) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)  # the gauges read the live state as they are collected
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(status_fn()), content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app


async def serve_http(
    listen: str,
    registry: CollectorRegistry,
    status_fn: StatusFn,
    on_bound: Callable[[str], None] | None = None,
) -> None:
    """Serve until cancelled (a long-lived task of the daemon's TaskGroup)."""
    host, port = listen_address(listen)
    runner = web.AppRunner(build_app(registry, status_fn), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # taken since the start-up check (listen_problem)
            raise ConfigError("", bind_failure(listen, exc)) from None
        bound = runner.addresses[0]
        url = f"http://{bound[0]}:{bound[1]}"
        log.info("metrics_listening", url=url)
        if on_bound is not None:
            on_bound(url)
        await asyncio.Event().wait()  # until cancelled
    finally:
        await runner.cleanup()


def progress_line(s: dict[str, Any]) -> str:
    total = s.get("total_samples")
    done = s["done"] + s["quarantined"] + s["skipped"]
    share = f"{done}/{total}" if total else str(done)
    pct = f" {100 * done / total:5.1f}%" if total else ""
    spool = s.get("spool") or {}
    paused = " PAUSED (spool full)" if spool.get("waiting") else " PAUSED (disk)"
    paused = paused if s.get("paused") else ""
    if spool.get("limit"):
        paused = f" | spool {human_bytes(spool['held'])}/{human_bytes(spool['limit'])}" + paused
    return (
        f"{share} samples{pct} | {s['tokens_per_s']:,.0f} tok/s | "
        f"{human_bytes(s['bytes_per_s'])}/s | {human_bytes(s['bytes'])} | "
        f"q {s['quarantined']} | {in_flight_text(s)} | "
        f"ETA {eta_text(s.get('eta_s'))}{paused}"
    )


def in_flight_text(s: dict[str, Any]) -> str:
    """Samples between send and durable write, split: at the servers (at most
    ``workers.concurrency``) and the rest, dumped and waiting for or in the writers."""
    total = s["in_flight"]
    at_servers = sum(srv.get("in_flight", 0) for srv in s.get("servers", []))
    return f"in flight {total} ({at_servers} at servers, {max(0, total - at_servers)} writing)"


async def progress_loop(
    status_fn: StatusFn,
    interval: float | Callable[[], float],
    *,
    stream: TextIO | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Redraw a progress bar on a TTY (every second), or log a line per ``interval``
    (a callable is asked before each line, so the interval can change while it runs)."""
    out = stream or sys.stderr
    tty = out.isatty()
    try:
        while True:
            await sleep(1.0 if tty else interval() if callable(interval) else interval)
            snap = status_fn()
            if tty:
                out.write("\r\x1b[2K" + progress_line(snap))
                out.flush()
            else:
                log.info("progress", **{k: v for k, v in snap.items() if k != "servers"})
    finally:
        if tty:  # clear the last frame: the run's summary line replaces it
            out.write("\r\x1b[2K")
            out.flush()
