"""The fake server's aiohttp application: one simulated SGLang process (PROTOCOL §2–3).

The one SGLang-shaped front end (:mod:`hsx_async.server.front`) and the one scheduler
(:mod:`hsx_async.server.sched`) of the built-in servers, with :class:`.engine.FakeEngine`
as the forward pass; what is the fake's own is its faults: HTTP-level ones here, dump and
answer ones in :mod:`.faults`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hsx_async import __version__
from hsx_async.errors import HsxError
from hsx_async.protocol import CUSTOM_PARAM_NS
from hsx_async.server.dumpwrite import commit_meta
from hsx_async.server.fake.content import content_table
from hsx_async.server.fake.engine import FakeEngine
from hsx_async.server.fake.faults import DumpFaults, faulty_answer
from hsx_async.server.fake.options import (
    FakeControl,
    FakeOptions,
    FakeStats,
    draw_fault,
    random_cuts,
)
from hsx_async.server.front import (
    BadRequest,
    GenerateRequest,
    error_response,
    generate_response,
    json_response,
    model_info,
    parse_generate,
    server_info,
)
from hsx_async.server.hook_core import request_storage
from hsx_async.server.sched import DuplicateRid, Job, PassFailed, Scheduler, ServerClosing

SERVER_NAME = f"hsx-fake {__version__}"
_log = logging.getLogger(__name__)
# aiohttp's default (1 MiB) would refuse prompts above ~150k tokens.
_MAX_BODY = 64 * 1024 * 1024


def _drop(request: web.Request) -> web.Response:
    """Close the connection without an answer (aiohttp then has nothing to write to)."""
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=500)


@dataclass
class _State:
    """One simulated server process: everything a restart wipes (stats and knobs excepted)."""

    options: FakeOptions
    stats: FakeStats
    control: FakeControl
    faults: DumpFaults
    engine: FakeEngine | None = None
    scheduler: Scheduler | None = None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


_STATE = web.AppKey("hsx_fake_state", _State)


async def _late_commit(state: _State, ns: str, rid: str) -> None:
    await asyncio.sleep(state.options.late_meta_s)  # the injected delay itself
    meta = state.faults.withheld.pop(rid, None)
    if meta is None:
        return
    try:
        await asyncio.to_thread(commit_meta, state.options.dump_root, ns, rid, meta)
    except (HsxError, OSError) as exc:
        _log.warning("late meta.json of rid %s not written: %s", rid, exc)
        return
    state.stats.note_committed(rid)


def _job(state: _State, req: GenerateRequest) -> Job:
    """The request as the scheduler takes it, with the storage and chunking it gets."""
    assert req.ns is not None
    options = state.options
    custom = req.custom_params
    if not options.honour_storage:  # an older hook: it never read the request's storage
        custom = {CUSTOM_PARAM_NS: req.ns}
    storage, why = request_storage(custom, len(options.aux_layers) + 1)
    state.stats.note_storage(storage, why)
    if why:
        _log.warning("rid %s dumped as bfloat16 (the client quantizes): %s", req.rid, why)
    cuts = random_cuts(options.seed, req.rid, req.prompt_tokens) if options.random_chunks else ()
    return Job(req.rid, req.input_ids, 0, req.ns, custom_params=custom, cuts=cuts)


async def _serve_hsx(request: web.Request, state: _State, req: GenerateRequest) -> web.Response:
    assert state.scheduler is not None and req.ns is not None
    fault = draw_fault(state.options.seed, req.rid, state.control.fault_rate, state.control.faults)
    state.stats.note_received(req.rid, fault)
    if fault == "http_500":
        return error_response(500, "injected fault http_500")
    if fault == "drop_before":
        return _drop(request)
    if fault == "hang":
        await state.stopping.wait()
        return _drop(request)
    state.faults.arm(req.rid, fault)
    try:
        await state.scheduler.submit(_job(state, req))
    except ServerClosing:
        return _drop(request)
    except DuplicateRid as exc:
        return error_response(400, str(exc))
    except PassFailed as exc:
        return error_response(500, str(exc))
    finally:
        state.faults.disarm(req.rid)
    if fault == "drop_after":
        return _drop(request)
    if fault == "late_meta":
        state.spawn(_late_commit(state, req.ns, req.rid))
    return json_response(faulty_answer(generate_response(req.rid, req.prompt_tokens), fault))


async def _generate(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    state.stats.requests += 1
    try:
        # vocab_size: an id past it is a 400, as an engine refuses an id past its vocabulary.
        req = parse_generate(
            await request.read(), vocab_size=state.options.vocab_size or None, text_prompts=True
        )
    except BadRequest as exc:
        state.stats.bad_requests += 1
        return error_response(400, str(exc))
    if state.control.rejects:  # an engine that refuses whatever it is sent
        state.stats.bad_requests += 1
        return error_response(400, "refused (set by the test)")
    if req.ns is None or not state.options.hook:
        # Ordinary traffic, or a server started without the hsx hook: answered at once,
        # nothing computed or dumped.
        return json_response(generate_response(req.rid, req.prompt_tokens))
    return await _serve_hsx(request, state, req)


async def _health(request: web.Request) -> web.Response:
    if not request.app[_STATE].control.healthy:
        return error_response(503, "unhealthy (set by the test)")
    return web.Response(status=200)


async def _model_info(request: web.Request) -> web.Response:
    o = request.app[_STATE].options
    return json_response(model_info(o.model, o.hidden_size, o.aux_layers))


async def _server_info(request: web.Request) -> web.Response:
    o = request.app[_STATE].options
    return json_response(
        server_info(
            version=f"fake-{__version__}",
            model_path=o.model,
            dump_root=o.dump_root,
            hidden_size=o.hidden_size,
            aux_layers=o.aux_layers,
            chunk_size=o.chunk_size,
            max_batch_tokens=o.max_batch_tokens,
        )
    )


async def _stats(request: web.Request) -> web.Response:
    return json_response(request.app[_STATE].stats.to_json())


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    """The simulated process: its engine (writer threads) and scheduler live while the app
    does. At stop it "dies": hung and in-flight requests lose their connections, late
    commits never happen; a pass being written finishes first (it cannot be interrupted)."""
    state = app[_STATE]
    o = state.options
    # Build the content table now (~0.2 s at hidden 7168), not in the first request.
    await asyncio.to_thread(content_table, o.hidden_size, len(o.aux_layers) + 1, o.weights)
    state.engine = engine = FakeEngine(o, state.stats, state.faults, SERVER_NAME)
    state.scheduler = scheduler = Scheduler(
        engine.step,
        chunk_size=o.chunk_size,
        max_batch_tokens=o.max_batch_tokens,
        on_drop=engine.drop,
        latency=(o.latency_base_ms, o.latency_per_token_us),
        overlap=True,
        gate=state.control.passes_open,
    )
    runner = asyncio.create_task(scheduler.run(), name="hsx-fake-scheduler")
    try:
        yield
    finally:
        scheduler.close()
        await runner  # the pass in flight finishes: no thread writes after the server is gone
        await asyncio.to_thread(engine.close)


async def _on_shutdown(app: web.Application) -> None:
    # Before aiohttp waits for in-flight handlers: release them at once.
    state = app[_STATE]
    state.stopping.set()
    tasks = list(state.tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if state.scheduler is not None:
        state.scheduler.close()


def build_app(
    options: FakeOptions,
    *,
    stats: FakeStats | None = None,
    control: FakeControl | None = None,
) -> web.Application:
    """The aiohttp application of one fake server process."""
    app = web.Application(client_max_size=_MAX_BODY)
    app[_STATE] = _State(
        options=options,
        stats=stats if stats is not None else FakeStats(),
        control=control or FakeControl(options.fault_rate, options.faults),
        faults=DumpFaults(options),
    )
    paths = options.paths
    app.router.add_post(paths.generate, _generate)
    app.router.add_get("/health", _health)
    app.router.add_get(paths.model_info, _model_info)
    app.router.add_get(paths.server_info, _server_info)
    app.router.add_get("/hsx_fake/stats", _stats)
    app.cleanup_ctx.append(_lifetime)
    app.on_shutdown.append(_on_shutdown)
    return app
