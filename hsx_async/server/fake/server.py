"""``hsx fake-server``: an SGLang stand-in that speaks PROTOCOL §2–3 with made-up numbers.

It dumps deterministic hidden states (:func:`expected_hidden_states`), batches and chunks
prefill like SGLang, can simulate GPU latency, and injects faults on demand, so the
client can be tested, benchmarked and tried without a GPU. Tests run it in-process with
:func:`running_fake_server`. The pieces: :mod:`.app` (HTTP, on the built-in servers' one
front end and one scheduler), :mod:`.engine` (a pass's rows, dumped through the dumper and
writer threads every hook uses), :mod:`.faults` (what a fault does: the fake's only
difference from a hook), :mod:`.content` (the numbers), :mod:`.options` (options, the
fault catalogue, stats).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import uvloop
from aiohttp import web

from hsx_async.server.fake.app import SERVER_NAME, build_app
from hsx_async.server.fake.content import expected_hidden_states
from hsx_async.server.fake.options import (
    ALL_FAULTS,
    BENIGN_FAULTS,
    FakeControl,
    FakeOptions,
    FakePaths,
    FakeStats,
    check_fault_policy,
)
from hsx_async.server.front import bind_listener

__all__ = [
    "ALL_FAULTS",
    "BENIGN_FAULTS",
    "SERVER_NAME",
    "FakeControl",
    "FakeOptions",
    "FakePaths",
    "FakeServerHandle",
    "FakeStats",
    "build_app",
    "expected_hidden_states",
    "running_fake_server",
]


class FakeServerHandle:
    """A fake server running in this event loop, with the knobs tests turn.

    ``stats`` and the fault/health knobs persist across :meth:`restart`; the queue, the
    requests in flight and pending late commits do not (like a real process restart).
    """

    def __init__(self, options: FakeOptions, host: str = "127.0.0.1", port: int = 0) -> None:
        self.options = options
        self.stats = FakeStats()
        self._control = FakeControl(options.fault_rate, options.faults)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("", "0.0.0.0", "::") else self._host
        return f"http://{host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Start serving (on the same port as before after a stop)."""
        if self._runner is not None:
            return
        sock = bind_listener(self._host, self._port)  # a taken port: one line, exit 2
        app = build_app(self.options, stats=self.stats, control=self._control)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._port = int(runner.addresses[0][1])
        self._runner = runner

    async def stop(self) -> None:
        """Stop like a killed process: connections refused until :meth:`start`."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> None:
        await self.stop()
        self.stats.restarts += 1
        await self.start()

    def set_faults(self, fault_rate: float, faults: tuple[str, ...] | None = None) -> None:
        """Change fault injection for requests that arrive from now on."""
        faults = self._control.faults if faults is None else tuple(faults)
        check_fault_policy(fault_rate, faults)
        self._control.fault_rate, self._control.faults = fault_rate, faults

    def set_healthy(self, healthy: bool) -> None:
        """``False``: ``GET /health`` answers 503 (requests are still served)."""
        self._control.healthy = healthy

    def set_rejects(self, rejects: bool) -> None:
        """``True``: every request is answered 400, the probe's too (``/health`` is 200)."""
        self._control.rejects = rejects

    def pause_passes(self) -> None:
        """Form no more forward passes: requests wait in the queue (a pass being written
        completes). Lets a test batch requests, or stop the server with requests queued."""
        self._control.passes_open.clear()

    def resume_passes(self) -> None:
        self._control.passes_open.set()


@contextlib.asynccontextmanager
async def running_fake_server(
    options: FakeOptions, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[FakeServerHandle]:
    """Serve ``options`` in this event loop (port 0: an ephemeral port) until the block ends."""
    handle = FakeServerHandle(options, host, port)
    await handle.start()
    try:
        yield handle
    finally:
        await handle.stop()


# --- command line -------------------------------------------------------------------------


def options_from_args(args: argparse.Namespace) -> FakeOptions:
    return FakeOptions(
        hidden_size=args.hidden_size,
        aux_layers=tuple(args.aux_layers),
        dump_root=args.dump_root,
        model=args.model,
        chunk_size=args.chunk_size,
        random_chunks=args.random_chunks,
        max_batch_tokens=args.max_batch_tokens,
        latency_base_ms=args.latency_base_ms,
        latency_per_token_us=args.latency_per_token_us,
        fault_rate=args.fault_rate,
        faults=tuple(args.faults),
        late_meta_s=args.late_meta_s,
        seed=args.seed,
        writer_threads=args.writer_threads,
    )


async def serve_until_signal(
    options: FakeOptions,
    host: str,
    port: int,
    ready: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with running_fake_server(options, host, port) as handle:
            if ready is not None:
                await ready(handle.url)
            await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _announce(url: str) -> None:
    print(f"hsx fake-server listening on {url}", flush=True)


def fake_server_command(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    uvloop.run(serve_until_signal(options, args.host, args.port, _announce))
    return 0
