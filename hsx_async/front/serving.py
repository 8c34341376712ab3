"""What every front serves with: its extractor, Mooncake publisher and metrics
(:func:`publishing`), the ``/health`` and ``/metrics`` routes (:func:`front_app`), and the
app served on ``--listen`` until told to stop (:func:`listen_until`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.errors import ArgumentError
from hsx_async.front.extract import Extractor, check_config, extracting
from hsx_async.front.metrics import FrontMetrics
from hsx_async.front.mooncake import MooncakeOptions, Publisher
from hsx_async.net import listen_address, listen_ok

log = structlog.get_logger("hsx.front")


@contextlib.asynccontextmanager
async def publishing(
    config: Config, options: MooncakeOptions, final: FinalConversion, *, listen: str
) -> AsyncIterator[tuple[Extractor, Publisher, FrontMetrics]]:
    """The front's extractor (its servers admitted beside it), its Mooncake client and
    segment (closed last: what it holds goes with it) and its metrics; ``listen`` is checked
    first (:class:`ArgumentError`)."""
    if not listen_ok(listen):
        raise ArgumentError("--listen", f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    check_config(config)
    publisher = await asyncio.to_thread(Publisher, options)
    try:
        async with extracting(config, final, config.output.dir / "front") as extractor:
            yield extractor, publisher, FrontMetrics(publisher.held)
    finally:
        await asyncio.to_thread(publisher.close)


def front_app(publisher: Publisher, metrics: FrontMetrics, max_request: int) -> web.Application:
    """An app with ``/health`` and ``/metrics``; the trainer's routes are added to it."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def scrape(_: web.Request) -> web.Response:
        # What the trainer removed. Mooncake's existence check takes a short read lease: a
        # plain (unforced) remove by the trainer meanwhile fails and is retried, as after
        # its own reads.
        await asyncio.to_thread(publisher.refresh_held)
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=max_request)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", scrape)
    return app


async def listen_until(
    app: web.Application,
    listen: str,
    on_bound: Callable[[str], None] | None,
    stop: asyncio.Event | None,
) -> None:
    """Serve ``app`` on ``listen`` (HOST:PORT) until ``stop`` is set, or SIGINT/SIGTERM when
    none is given; :class:`ArgumentError` naming ``--listen`` when it cannot be bound.
    ``on_bound`` gets the URL once it listens."""
    host, port = listen_address(listen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    own_stop = stop is None
    stop = stop or asyncio.Event()
    if own_stop:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ArgumentError(
                "--listen", f"cannot listen on {listen}: {exc.strerror}; pick another"
            ) from None
        bound = runner.addresses[0]
        url = f"http://{bound[0]}:{bound[1]}"
        log.info("front_listening", url=url)
        if on_bound is not None:
            on_bound(url)
        await stop.wait()
    finally:
        await runner.cleanup()
