"""``hsx front speculators``: the part of vLLM's API speculators' online trainer calls.

speculators 0.9.0's trainer (``speculators/train/data.py``,
``data_generation/vllm_client.py``) asks ``/v1/completions`` for each sample (``prompt``:
the token ids, ``max_tokens=1``, ``return_token_ids``), checks the answer's
``choices[0].prompt_token_ids`` against its ids, and reads the sample from Mooncake Store at
the handle the answer's ``kv_transfer_params`` names (hs-connectors' ``MooncakeTransfer``).
This front answers those calls from hsx's own extraction path
(:mod:`hsx_async.front.extract`) and publishes each sample with
:mod:`hsx_async.front.mooncake`; a sample that fails is published as the reader's
``{handle}:error`` marker with the reason (the sample's or the server's fault), so the
trainer fails that sample fast instead of waiting out its timeout; with Mooncake's master
gone (no marker can be put either) the request is answered 503, which the trainer's
client raises. ``/metrics`` on the same port (:mod:`hsx_async.front.metrics`) counts each
outcome and fault and what Mooncake holds for the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.front.extract import (
    ExtractionFailed,
    Extractor,
    final_conversion,
)
from hsx_async.front.metrics import ERROR_MARKER, PUBLISHED, REFUSED, UNANSWERED, FrontMetrics
from hsx_async.front.mooncake import (
    UNREACHABLE,
    MooncakeError,
    MooncakeOptions,
    Publisher,
    error_manifest,
    pack,
)
from hsx_async.front.serving import front_app, listen_until, publishing
from hsx_async.protocol import PRE_NORM

log = structlog.get_logger("hsx.front")

MAX_REQUEST = 8 << 20  # a 32K-token prompt is ~200 KB of JSON
HANDLE_PREFIX = "hsx-"


@dataclass
class Front:
    extractor: Extractor
    publisher: Publisher
    model: str
    metrics: FrontMetrics

    async def completion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and the answer to one ``/v1/completions`` body."""
        problem = self._refusal(body)
        if problem is not None:
            status, message = problem
            self.metrics.answered(REFUSED)
            return status, _error(message, status)
        with self.metrics.request_latency.time():
            status, answer, outcome = await self._sample(body["prompt"])
        self.metrics.answered(outcome)
        return status, answer

    async def _sample(self, ids: list[int]) -> tuple[int, dict[str, Any], str]:
        rid = self.extractor.next_rid()
        handle = HANDLE_PREFIX + rid
        try:
            got = await self.extractor.extract(rid, ids)
            manifest, blob = pack(
                handle, {"hidden_states": got.hidden_states, "token_ids": got.token_ids}
            )
            await self._publish(self.publisher.put_sample, handle, blob)
            self.metrics.bytes_published.inc(len(blob))
            return 200, self._answer(rid, ids, manifest), PUBLISHED
        except ExtractionFailed as exc:
            self.metrics.failed(exc.cause, exc.kind)
            reason = str(exc)
        except MooncakeError as exc:
            self.metrics.failed("mooncake", exc.kind)
            if exc.kind == UNREACHABLE:  # no marker can be put either: say it at once
                log.warning("sample_failed", handle=handle, reason=str(exc))
                return 503, _error(str(exc), 503), UNANSWERED
            reason = str(exc)
        log.info("sample_failed", handle=handle, reason=reason)
        try:
            await self._publish(self.publisher.put_error, handle, reason)
        except MooncakeError as marker:  # the trainer could not read a marker: say it here
            return 503, _error(f"{reason}; and its error marker: {marker}", 503), UNANSWERED
        return 200, self._answer(rid, ids, error_manifest(handle)), ERROR_MARKER

    async def _publish(self, put: Callable[[str, Any], None], handle: str, what: Any) -> None:
        with self.metrics.publish_latency.time():
            await asyncio.to_thread(put, handle, what)

    def _refusal(self, body: dict[str, Any]) -> tuple[int, str] | None:
        if body.get("model") != self.model:
            return (
                404,
                f"The model `{body.get('model')}` does not exist; this front serves "
                f"`{self.model}`.",
            )
        prompt = body.get("prompt")
        if not (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            return 400, "prompt must be a non-empty list of token ids (hsx's front takes no text)"
        if body.get("max_tokens", 1) != 1:
            return 400, "max_tokens must be 1: the front extracts the prompt's hidden states only"
        return None

    def _answer(self, rid: str, ids: list[int], manifest: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "prompt_token_ids": ids,
                    "token_ids": [],
                }
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
            "kv_transfer_params": manifest,
        }


def _error(message: str, status: int) -> dict[str, Any]:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def build_app(front: Front) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        entry = {"id": front.model, "object": "model", "created": 0, "owned_by": "hsx"}
        return web.json_response({"object": "list", "data": [entry]})

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            front.metrics.answered(REFUSED)
            return web.json_response(_error("the body is not a JSON object", 400), status=400)
        status, answer = await front.completion(body)
        return web.json_response(answer, status=status)

    app = front_app(front.publisher, front.metrics, MAX_REQUEST)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def conversion(model: Path | None) -> FinalConversion:
    """To the pre-norm final state speculators reads; the norm from ``--model`` when given
    (needed when the servers dump the post-norm state)."""
    return final_conversion(PRE_NORM, model)


async def serve(
    config: Config,
    options: MooncakeOptions,
    *,
    listen: str,
    model_name: str,
    final: FinalConversion,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when none is given)."""
    async with publishing(config, options, final, listen=listen) as (extractor, publisher, m):
        front = Front(extractor, publisher, model_name, m)
        await listen_until(build_app(front), listen, on_bound, stop)


__all__ = ["Front", "build_app", "serve"]
