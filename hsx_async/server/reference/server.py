"""``hsx reference-server``: SGLang's hsx protocol with real hidden states, on the CPU.

An aiohttp server that speaks PROTOCOL §2–3 like SGLang with the hsx hook, but computes
the hidden states with a Hugging Face ``transformers`` causal LM: by default a tiny Llama
built from a fixed seed (no download), or ``--model PATH`` for a local checkpoint. Requests
are batched into packed forward passes and long prompts are prefilled in chunks (the one
scheduler of the built-in servers, :mod:`hsx_async.server.sched`, behind the one
SGLang-shaped front end, :mod:`hsx_async.server.front`), so a dataset written through it can be
checked, row for row, against one plain forward pass of the same model
(:func:`reference_hidden_states`).

torch and transformers are imported inside functions: the CLI imports this module to build
its parser.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import uvloop
from aiohttp import web

from hsx_async import __version__
from hsx_async.errors import ConfigError
from hsx_async.protocol import DEFAULT_DUMP_ROOT
from hsx_async.protocol import parse_aux_layers as protocol_parse_aux_layers
from hsx_async.server.front import (
    BadRequest,
    bind_listener,
    error_response,
    generate_response,
    json_response,
    model_info,
    parse_generate,
    server_info,
)
from hsx_async.server.hook_core import dump_root_from_env
from hsx_async.server.reference import model as reference_model
from hsx_async.server.reference.model import PackedEngine, default_aux_layers, text_config
from hsx_async.server.reference.passes import PassRunner
from hsx_async.server.reference.sampling import TokenPicker
from hsx_async.server.sched import (
    DuplicateRid,
    Job,
    PassFailed,
    Scheduler,
    SchedulerStats,
    ServerClosing,
)

__all__ = [
    "ReferenceOptions",
    "ReferenceServer",
    "build_app",
    "build_default_model",
    "parse_aux_layers",
    "reference_hidden_states",
    "running_reference_server",
]

SERVER_NAME = f"hsx-reference {__version__}"
# Long prompts as JSON: ~7 bytes a token; SGLang takes far more than aiohttp's 1 MiB default.
MAX_BODY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ReferenceOptions:
    model: str | None = None  # a local Hugging Face model directory; None: the tiny Llama
    aux_layers: tuple[int, ...] | None = None  # None: default_aux_layers() of the model
    dump_root: Path = Path(DEFAULT_DUMP_ROOT)
    chunk_size: int = 64  # most rows of one request in one pass (chunked prefill)
    max_batch_tokens: int = 256  # most rows of one pass, all requests together
    seed: int = 0  # weights of the built-in model
    threads: int | None = None  # torch intra-op threads; None: leave torch's setting

    def __post_init__(self) -> None:
        for key in ("chunk_size", "max_batch_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"is {getattr(self, key)}, expected at least 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"is {self.threads}, expected at least 1")


@dataclass
class _State:
    engine: PackedEngine
    scheduler: Scheduler
    options: ReferenceOptions
    model_name: str


_STATE = web.AppKey("hsx_reference", _State)


def build_default_model(seed: int = 0) -> Any:
    """The built-in tiny Llama (see :func:`.reference_model.build_default_model`)."""
    return reference_model.build_default_model(seed)


def reference_hidden_states(
    model: Any, input_ids: Sequence[int] | np.ndarray[Any, Any], aux_layers: Sequence[int]
) -> torch.Tensor:
    """The ground truth: [T, L, H] bfloat16 from ONE unchunked, unbatched forward of
    ``model`` (see :func:`.reference_model.reference_hidden_states`)."""
    return reference_model.reference_hidden_states(model, input_ids, aux_layers)


def _load(options: ReferenceOptions) -> tuple[Any, str]:
    if options.model is None:
        seed = options.seed
        return reference_model.build_default_model(seed), reference_model.default_model_name(seed)
    return reference_model.load_model(options.model), options.model


def build_app(options: ReferenceOptions) -> web.Application:
    """The server, model loaded (blocking: seconds for a real checkpoint)."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model, model_name = _load(options)
    aux = options.aux_layers
    if aux is None:
        aux = default_aux_layers(text_config(model).num_hidden_layers)
    engine = PackedEngine(model, aux)
    runner = PassRunner(engine, options.dump_root, model_name, SERVER_NAME)
    scheduler = Scheduler(
        runner,
        chunk_size=options.chunk_size,
        max_batch_tokens=options.max_batch_tokens,
        on_drop=runner.drop,
    )
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[_STATE] = _State(engine, scheduler, options, model_name)
    app.router.add_post("/generate", _generate)
    app.router.add_get("/health", _health)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/get_server_info", _server_info)
    app.cleanup_ctx.append(_scheduler_task)
    # on_shutdown runs before aiohttp waits for in-flight handlers: release them at once.
    app.on_shutdown.append(_close_scheduler)
    return app


async def _scheduler_task(app: web.Application) -> AsyncIterator[None]:
    scheduler = app[_STATE].scheduler
    task = asyncio.create_task(scheduler.run(), name="hsx-reference-scheduler")
    yield
    scheduler.close()
    await task  # the pass in flight finishes: no thread writes after the server is gone


async def _close_scheduler(app: web.Application) -> None:
    app[_STATE].scheduler.close()


async def _generate(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    engine = state.engine
    try:
        req = parse_generate(
            await request.read(), vocab_size=engine.vocab_size, max_positions=engine.max_positions
        )
    except BadRequest as exc:
        return error_response(400, str(exc))
    job = Job(
        req.rid,
        list(req.input_ids),
        req.max_new_tokens,
        req.ns,
        custom_params=req.custom_params,
        stop_ids=req.sampling.stop_token_ids,
    )
    if req.max_new_tokens and not req.sampling.greedy:
        job.picker = TokenPicker(req.sampling)
    try:
        done = await state.scheduler.submit(job)
    except DuplicateRid as exc:
        return error_response(400, str(exc))
    except ServerClosing as exc:
        return error_response(503, str(exc))
    except PassFailed as exc:
        return error_response(500, str(exc))
    return json_response(
        generate_response(req.rid, done.prompt_tokens, done.output_ids, done.stopped)
    )


async def _health(request: web.Request) -> web.Response:
    running = request.app[_STATE].scheduler.running
    return web.Response(status=200 if running else 503)


async def _model_info(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    engine = state.engine
    return json_response(
        model_info(
            state.model_name,
            engine.hidden_size,
            engine.aux_layers,
            tokenizer_path=None,
            num_hidden_layers=engine.num_hidden_layers,
            # What provenance.json records as the dataset's final norm (PROTOCOL §4).
            hsx_final_norm=engine.final_norm,
        )
    )


async def _server_info(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    return json_response(
        server_info(
            version=__version__,
            model_path=state.model_name,
            dump_root=state.options.dump_root,
            hidden_size=state.engine.hidden_size,
            aux_layers=state.engine.aux_layers,
            chunk_size=state.options.chunk_size,
            max_batch_tokens=state.options.max_batch_tokens,
            server=SERVER_NAME,
            hsx_reference_stats=state.scheduler.stats.to_json(),
        )
    )


@dataclass(frozen=True)
class ReferenceServer:
    """A running reference server, for tests and ``hsx demo``."""

    url: str
    hidden_size: int
    aux_layers: tuple[int, ...]
    model_name: str
    model: Any  # the transformers model: feed it to reference_hidden_states()
    scheduler: Scheduler  # pause()/resume()/wait_queued() to shape batches in a test

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats


@asynccontextmanager
async def running_reference_server(
    options: ReferenceOptions, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[ReferenceServer]:
    """Serve until the block exits; ``port=0`` picks a free port (see ``.url``)."""
    sock = bind_listener(host, port)  # before the model loads: a taken port fails at once
    try:
        app = await asyncio.to_thread(build_app, options)  # model loading stays off the loop
    except BaseException:
        sock.close()
        raise
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        bound_host, bound_port = runner.addresses[0][:2]
        state = app[_STATE]
        yield ReferenceServer(
            url=f"http://{bound_host}:{bound_port}",
            hidden_size=state.engine.hidden_size,
            aux_layers=state.engine.aux_layers,
            model_name=state.model_name,
            model=state.engine.model,
            scheduler=state.scheduler,
        )
    finally:
        await runner.cleanup()


def parse_aux_layers(text: str) -> tuple[int, ...]:
    """``"1,3,5"`` → ``(1, 3, 5)``, by the one aux-layer rule (the model's size is checked
    when it is loaded)."""
    return protocol_parse_aux_layers(text, key="aux_layers")


def options_from_args(args: argparse.Namespace) -> ReferenceOptions:
    """The command line's options; the dump root defaults to ``HSX_DUMP_ROOT``, read the
    one way every hook reads it."""
    return ReferenceOptions(
        model=args.model,
        aux_layers=None if args.aux_layers is None else parse_aux_layers(args.aux_layers),
        dump_root=args.dump_root or dump_root_from_env(os.environ),
        chunk_size=args.chunk_size,
        max_batch_tokens=args.max_batch_tokens,
        seed=args.seed,
        threads=args.threads,
    )


def reference_server_command(args: argparse.Namespace) -> int:
    uvloop.run(_serve(options_from_args(args), args.host, args.port))
    return 0


async def _serve(options: ReferenceOptions, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log = structlog.get_logger("hsx.reference")
    async with running_reference_server(options, host, port) as server:
        log.info(
            "reference_server.listening",
            url=server.url,
            model=server.model_name,
            hidden_size=server.hidden_size,
            aux_layers=list(server.aux_layers),
            dump_root=str(options.dump_root),
        )
        await stop.wait()
    log.info("reference_server.stopped", **server.stats.to_json())
