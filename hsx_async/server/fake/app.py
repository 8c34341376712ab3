"""The fake server's aiohttp application: one simulated SGLang process (PROTOCOL §2–3)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from hsx_async import __version__
from hsx_async.errors import HsxError
from hsx_async.protocol import BF16_STORAGE, PROTOCOL_VERSION
from hsx_async.server.fake.content import content_table
from hsx_async.server.fake.options import (
    FakeControl,
    FakeOptions,
    FakeStats,
    draw_fault,
    random_cuts,
    writer_threads,
)
from hsx_async.server.fake.request import (
    BadRequestError,
    GenerateRequest,
    parse_generate,
    response_body,
)
from hsx_async.server.fake.sched import DumpSpec, Job, Scheduler, ServerStopped, commit
from hsx_async.server.hook_core import request_storage

SERVER_NAME = f"hsx-fake {__version__}"
_log = logging.getLogger(__name__)
# aiohttp's default (1 MiB) would refuse prompts above ~150k tokens.
_MAX_BODY = 64 * 1024 * 1024


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)


def _drop(request: web.Request) -> web.Response:
    """Close the connection without an answer (aiohttp then has nothing to write to)."""
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=500)


@dataclass
class _State:
    """One simulated server process: everything a restart wipes (stats and knobs excepted)."""

    options: FakeOptions
    spec: DumpSpec
    stats: FakeStats
    control: FakeControl
    scheduler: Scheduler
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


_STATE = web.AppKey("hsx_fake_state", _State)


async def _late_commit(state: _State, job: Job) -> None:
    await asyncio.sleep(state.options.late_meta_s)  # the injected delay itself
    try:
        await asyncio.to_thread(commit, state.spec, job)
    except (HsxError, OSError) as exc:
        _log.warning("late meta.json of rid %s not written: %s", job.rid, exc)
        return
    state.stats.note_committed(job.rid)


async def _serve_hsx(request: web.Request, state: _State, req: GenerateRequest) -> web.Response:
    assert req.rid is not None and req.ns is not None  # checked by parse_generate
    control, options = state.control, state.options
    fault = draw_fault(options.seed, req.rid, control.fault_rate, control.faults)
    state.stats.note_received(req.rid, fault)
    if fault == "http_500":
        return _error(500, "injected fault http_500")
    if fault == "drop_before":
        return _drop(request)
    if fault == "hang":
        await state.stopping.wait()
        return _drop(request)
    cuts = random_cuts(options.seed, req.rid, req.prompt_tokens) if options.random_chunks else ()
    storage, why = request_storage(req.custom_params, len(state.spec.aux_layers) + 1)
    if not options.honour_storage:
        storage, why = BF16_STORAGE, ""  # an older hook: it never read the request's storage
    state.stats.note_storage(storage, why)
    if why:
        _log.warning("rid %s dumped as bfloat16 (the client quantizes): %s", req.rid, why)
    job = Job(
        rid=req.rid,
        ns=req.ns,
        input_ids=req.input_ids,
        fault=fault,
        cuts=(*cuts[:-1], req.prompt_tokens),
        done=asyncio.get_running_loop().create_future(),
        storage=storage,
    )
    state.scheduler.submit(job)
    try:
        await job.done
    except ServerStopped:
        return _drop(request)
    if job.error is not None:
        return _error(500, job.error)
    if fault == "drop_after":
        return _drop(request)
    if fault == "late_meta":
        state.spawn(_late_commit(state, job))
    return _json(response_body(req.rid, req.prompt_tokens, fault))


async def _generate(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    state.stats.requests += 1
    try:
        req = parse_generate(await request.read())
    except BadRequestError as exc:
        state.stats.bad_requests += 1
        return _error(400, str(exc))
    vocab = state.options.vocab_size
    if vocab and req.input_ids.size and int(req.input_ids.max()) >= vocab:
        state.stats.bad_requests += 1
        bad = int(req.input_ids.max())
        return _error(400, f"token id {bad} is out of vocabulary (vocab_size {vocab})")
    if req.ns is None or not state.options.hook:
        return _json(
            response_body(req.rid or f"fake-{state.stats.requests}", req.prompt_tokens, None)
        )
    return await _serve_hsx(request, state, req)


async def _health(request: web.Request) -> web.Response:
    if not request.app[_STATE].control.healthy:
        return _error(503, "unhealthy (set by the test)")
    return web.Response(status=200)


async def _model_info(request: web.Request) -> web.Response:
    o = request.app[_STATE].options
    return _json(
        {
            "model_path": o.model,
            "is_generation": True,
            "hidden_size": o.hidden_size,
            "hsx_aux_layers": list(o.aux_layers),
        }
    )


async def _server_info(request: web.Request) -> web.Response:
    o = request.app[_STATE].options
    return _json(
        {
            "version": f"fake-{__version__}",
            "model_path": o.model,
            "hsx_protocol": PROTOCOL_VERSION,
            "hsx_dump_root": str(o.dump_root),
            "hidden_size": o.hidden_size,
            "hsx_aux_layers": list(o.aux_layers),
            "disable_radix_cache": True,
            "chunked_prefill_size": o.chunk_size or -1,
            "max_prefill_tokens": o.max_batch_tokens,
        }
    )


async def _stats(request: web.Request) -> web.Response:
    return _json(request.app[_STATE].stats.to_json())


async def _on_startup(app: web.Application) -> None:
    state = app[_STATE]
    # Build the content table now (~0.2 s at hidden 7168), not in the first request.
    await asyncio.to_thread(content_table, state.spec.hidden_size, len(state.spec.aux_layers) + 1)
    state.spawn(state.scheduler.run())


async def _on_shutdown(app: web.Application) -> None:
    """The process "dies": hung and in-flight requests lose their connections, late
    commits never happen; a pass being written finishes first (it cannot be interrupted)."""
    state = app[_STATE]
    state.stopping.set()
    tasks = list(state.tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    state.scheduler.fail_all()


def build_app(
    options: FakeOptions,
    *,
    stats: FakeStats | None = None,
    control: FakeControl | None = None,
) -> web.Application:
    """The aiohttp application of one fake server process."""
    spec = DumpSpec(
        root=options.dump_root,
        hidden_size=options.hidden_size,
        aux_layers=options.aux_layers,
        model=options.model,
        server=SERVER_NAME,
    )
    stats = stats if stats is not None else FakeStats()
    control = control or FakeControl(options.fault_rate, options.faults)
    scheduler = Scheduler(
        spec,
        stats,
        max_batch_tokens=options.max_batch_tokens,
        chunk_size=options.chunk_size,
        latency=(options.latency_base_ms, options.latency_per_token_us),
        writer_threads=writer_threads(options),
        gate=control.passes_open,
    )
    app = web.Application(client_max_size=_MAX_BODY)
    app[_STATE] = _State(
        options=options,
        spec=spec,
        stats=stats,
        control=control,
        scheduler=scheduler,
    )
    app.router.add_post("/generate", _generate)
    app.router.add_get("/health", _health)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/hsx_fake/stats", _stats)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    return app
