"""``hsx serve OUT``: a live dataset for trainers on other nodes (PROTOCOL §6.4).

Runs on the node that holds the output directory, beside (or after) ``hsx run``. It makes
the leases and acknowledgements of remote readers in the very logs a local reader uses
(:class:`~hsx_async.dataset.live.LocalSource`, one per consumer), and sends sample files
with ``sendfile`` from the page cache. It holds no state of its own that matters: killed
and started again, it goes on from the logs; a reader retries through the gap.

Bounded everywhere (:mod:`hsx_async.dataset.live.wire`): bodies, leases, acks, the long poll,
and at most ``--max-streams`` files in flight at once (more wait their turn).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsx_async.dataset.export.plan import dataset_facts
from hsx_async.dataset.layout import manifest_path_problem
from hsx_async.dataset.live.follow import DatasetFollower
from hsx_async.dataset.live.ledger import read_registry
from hsx_async.dataset.live.sources import LocalSource
from hsx_async.dataset.live.wire import (
    ACK,
    FILE,
    INFO,
    LEASE,
    MAX_BODY,
    RELEASE,
    RENEW,
    REPLAY,
    WIRE_VERSION,
    Caller,
    WireError,
    caller,
    id_list,
    lease_request,
    renew_timeout,
)
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError
from hsx_async.logs import configure_logging
from hsx_async.net import listen_address, listen_ok

log = structlog.get_logger("hsx.serve")

LONG_POLL_S = 0.2  # between looks while a lease waits for a sample
MAX_STREAMS = 8


@dataclass
class _Consumer:
    """One consumer's source, used by one call at a time, and each owner's last answers
    (a repeated ``call`` gets its answer again)."""

    source: LocalSource
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answers: dict[str, collections.OrderedDict[str, dict[str, Any]]] = field(default_factory=dict)
    stats: tuple[int, int, int] = (0, 0, 0)  # lag, acked, live leases: after the last call


def _stats(source: LocalSource) -> tuple[int, int, int]:
    committed = set(source.follower.state.entries)
    state = source.log.state
    acked = len(state.acked.get(0, set()) & committed)
    return len(committed) - acked, acked, sum(state.held(0, time.time()).values())


class LiveServer:
    def __init__(self, out_dir: Path, *, max_streams: int = MAX_STREAMS) -> None:
        if not out_dir.is_dir():
            raise DatasetError(f"{out_dir} is not a directory; give an output directory")
        self.out_dir = out_dir
        self.consumers: dict[str, _Consumer] = {}
        self.follower = DatasetFollower(out_dir)  # which files may be sent
        self._follow_lock = asyncio.Lock()
        self.streams = asyncio.Semaphore(max_streams)
        self.registry = CollectorRegistry(auto_describe=True)
        self.files_sent = Counter("hsx_serve_files", "Sample files sent", registry=self.registry)
        self.bytes_sent = Counter("hsx_serve_bytes", "Sample bytes sent", registry=self.registry)
        self.registry.register(_ServeCollector(self))

    def _consumer(self, name: str) -> _Consumer:
        found = self.consumers.get(name)
        if found is None:
            found = self.consumers[name] = _Consumer(LocalSource(self.out_dir, name))
        return found

    async def _once(
        self, who: Caller, call: Callable[[_Consumer], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Run ``call`` for ``who`` unless it repeats one of the owner's last calls."""
        consumer = self._consumer(who.consumer)
        async with consumer.lock:
            answers = consumer.answers.setdefault(who.owner, collections.OrderedDict())
            if who.call in answers:
                return answers[who.call]
            answer = await call(consumer)
            answers[who.call] = answer
            while len(answers) > REPLAY:
                answers.popitem(last=False)
            consumer.stats = await asyncio.to_thread(_stats, consumer.source)
            return answer

    # -- handlers -------------------------------------------------------------------------

    async def lease(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, req = caller(raw), lease_request(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            deadline = time.monotonic() + req.wait
            while True:
                leased = await asyncio.to_thread(
                    consumer.source.lease, who.owner, req.rank, req.epoch, req.count, req.timeout
                )
                if leased.entries or leased.ended or time.monotonic() >= deadline:
                    return {
                        "entries": [orjson.loads(e.to_line()) for e in leased.entries],
                        "ended": leased.ended,
                    }
                await asyncio.sleep(LONG_POLL_S)  # a poll of logs other processes append to

        return await self._once(who, call)

    async def ack(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids) = caller(raw), id_list(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            await asyncio.to_thread(consumer.source.ack, who.owner, epoch, ids)
            return {"acked": len(ids)}

        return await self._once(who, call)

    async def release(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, (epoch, ids) = caller(raw), id_list(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            await asyncio.to_thread(consumer.source.release, who.owner, epoch, ids)
            return {}

        return await self._once(who, call)

    async def renew(self, raw: dict[str, Any]) -> dict[str, Any]:
        who, timeout = caller(raw), renew_timeout(raw)

        async def call(consumer: _Consumer) -> dict[str, Any]:
            until = time.time() + timeout
            await asyncio.to_thread(consumer.source.renew, who.owner, until)
            return {}

        return await self._once(who, call)

    async def info(self) -> dict[str, Any]:
        def facts() -> dict[str, Any]:
            followed = self.follower.refresh()
            first = [followed.entries[followed.order[0]]] if followed.order else []
            f = dataset_facts(self.out_dir, first)
            registry = read_registry(self.out_dir)
            return {
                "protocol": WIRE_VERSION,
                "facts": {
                    "aux_layers": None if f.aux_layers is None else list(f.aux_layers),
                    "hidden_size": f.hidden_size,
                    "final_state": f.final_state,
                    "storage": {"dtype": f.storage.dtype, "quantized": list(f.storage.quantized)},
                    "provenance": f.provenance,
                },
                "registry": None if registry is None else orjson.loads(registry.to_json()),
            }

        async with self._follow_lock:
            return await asyncio.to_thread(facts)

    async def sample_file(self, rel: str) -> tuple[Path, ManifestEntry]:
        problem = manifest_path_problem(rel)
        if problem:
            raise WireError(problem)
        async with self._follow_lock:
            followed = await asyncio.to_thread(self.follower.refresh)
        entry = next((e for e in followed.entries.values() if e.path == rel), None)
        if entry is None or rel in followed.retired:
            raise FileNotFoundError(rel)
        return self.out_dir / rel, entry


class _ServeCollector(Collector):
    """Per consumer: its lag, acknowledged samples and live leases (after its last call)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        families = [
            GaugeMetricFamily(name, doc, labels=["consumer"])
            for name, doc in (
                ("hsx_consumer_lag_samples", "Committed samples not acknowledged"),
                ("hsx_consumer_acked_samples", "Samples acknowledged (epoch 0)"),
                ("hsx_consumer_leases", "Live leases of the consumer"),
            )
        ]
        for name, consumer in self.server.consumers.items():
            for family, value in zip(families, consumer.stats, strict=True):
                family.add_metric([name], value)
        yield from families


# -- the aiohttp application ----------------------------------------------------------------


def build_app(server: LiveServer) -> web.Application:
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
            except (WireError, DatasetError) as exc:
                status = 400 if isinstance(exc, WireError) else 409
                return web.json_response({"error": str(exc)}, status=status, dumps=_dumps)
            return web.json_response(answer, dumps=_dumps)

        return route

    async def info(_: web.Request) -> web.Response:
        return web.json_response(await server.info(), dumps=_dumps)

    async def file(request: web.Request) -> web.StreamResponse:
        try:
            path, entry = await server.sample_file(request.query.get("path", ""))
        except WireError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except FileNotFoundError:
            return web.json_response({"error": "no such sample in the dataset"}, status=404)
        async with server.streams:  # sent while held: at most max_streams at once
            response = _SentFile(path, chunk_size=1 << 20)
            await response.prepare(request)
            server.files_sent.inc()
            server.bytes_sent.inc(entry.size)
            return response

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(server.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_get(INFO, info)
    app.router.add_get(FILE, file)
    app.router.add_post(LEASE, post(server.lease))
    app.router.add_post(ACK, post(server.ack))
    app.router.add_post(RELEASE, post(server.release))
    app.router.add_post(RENEW, post(server.renew))
    app.router.add_get("/metrics", metrics)
    return app


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


async def serve(
    out_dir: Path,
    listen: str,
    *,
    max_streams: int = MAX_STREAMS,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when none is given)."""
    server = LiveServer(out_dir, max_streams=max_streams)
    if not listen or not listen_ok(listen):
        raise DatasetError(
            f"--listen {listen!r} is not HOST:PORT (e.g. 127.0.0.1:9470, 0.0.0.0:9470)"
        )
    host, port = listen_address(listen)
    runner = web.AppRunner(build_app(server), access_log=None)
    await runner.setup()
    own_stop = stop is None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if own_stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise DatasetError(
                f"cannot listen on {listen}: {exc.strerror}; pick another --listen"
            ) from None
        bound = runner.addresses[0]
        url = f"http://{bound[0]}:{bound[1]}"
        log.info("serve_listening", url=url, out=str(out_dir))
        if on_bound is not None:
            on_bound(url)
        await stop.wait()
    finally:
        if own_stop:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await runner.cleanup()


def serve_command(args: argparse.Namespace) -> int:
    """``hsx serve`` (``hsx_async.cli.serve``)."""
    configure_logging("auto", "info")
    out = Path(args.out)

    def announce(url: str) -> None:
        print(f"hsx serve: {out} on {url}", flush=True)

    # asyncio's own loop, not uvloop: uvloop has no loop.sendfile, and aiohttp then copies
    # every file through Python (bench/transport.py measured the server's CPU per GB).
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(out, args.listen, max_streams=args.max_streams, on_bound=announce))
    return 0


__all__ = ["LiveServer", "build_app", "serve", "serve_command"]
