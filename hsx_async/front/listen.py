"""A front's HTTP app served on ``--listen`` until told to stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import structlog
from aiohttp import web

from hsx_async.errors import ArgumentError
from hsx_async.net import listen_address

log = structlog.get_logger("hsx.front")


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
