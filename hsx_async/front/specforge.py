"""``hsx front specforge``: the capture endpoint SpecForge 0.2.0's online producer calls.

Read from SpecForge 0.2.0 (``specforge/inference/adapters/server_capture.py``,
``runtime/data_plane/mooncake_store.py``, ``algorithms/eagle3/providers.py``): the
producer's ``SGLangServerCaptureAdapter.produce_refs`` POSTs a (patched) SGLang's
``/generate`` with one entry per task: ``input_ids``, a fresh ``extra_key``,
``sampling_params {temperature: 0, max_new_tokens: 0}`` and ``spec_capture``:
``{store_id, sample_id, gen, replace, features: {"aux": name, "last_hidden": name},
passthrough: [{name, data, shape, dtype: "int64"}]}``. The server writes each feature as one
raw object at ``{store_id}/{sample_id}/g{gen}/{name}`` (what ``MooncakeFeatureStore`` reads
with ``get_into``, its shape and dtype from the ref) and answers, per row,
``meta_info["spec_capture"] = {store_id, sample_id, gen, features: {name: {shape, dtype}},
aux_layer_ids}`` or ``{..., "error": reason}``, which the producer turns into a retryable
``ServerCaptureFailure``. ``aux`` is the aux layers' states concatenated ``[1, L, n·H]``,
``last_hidden`` the **post-norm** final state ``[1, L, H]`` (the LM head's input).
``aux_layer_ids`` are the ids the server was launched with (``--spec-capture-aux-layer-ids``:
the drafter config's ``eagle_aux_hidden_state_layer_ids``), in SGLang's numbering for the
target's family, which is not hsx's (:mod:`hsx_async.layer_ids`): the front answers
``[model].aux_layers`` in that numbering, from ``--model``'s ``config.json``.

This front answers that call from hsx's own extraction path (:mod:`hsx_async.front.extract`:
``hsx run``'s admission, request, dump checks and fault attribution) in front of stock
SGLang, and publishes with :mod:`hsx_async.front.mooncake`. The producer checks the answer
itself (identity, every feature's sequence length, ``aux_layer_ids`` against its draft's
capture layers, the aux width and the target's hidden size): a mismatch there is its
``CaptureMismatchError`` and it aborts the keys. This front refuses first what it can see:
a request it cannot read (HTTP 400, as SGLang answers ``/generate``: the producer fails the
lease batch, retryable), and per task a ``spec_capture`` entry that is not SpecForge's (an
unknown artifact, a passthrough whose shape is not ``[1, L, ...]`` of its data), a prompt the
servers fail (the sample's or the server's fault) or Mooncake refusing a put (full, too
large, its master gone) — each as that task's ``{"error": reason}``.

Lifetime: every object is put hard-pinned into this process's Mooncake segment and stays
until SpecForge removes it (its producer's ``abort`` once the consumer acknowledged the
sample, or its ``discard_external_attempts``/``drain_pending_removals`` at shutdown), so the
front must stay up while the trainer runs; the segment bounds what is held: a full one is
that task's error. A task that fails part way has its objects removed; ``replace`` (a retry)
removes the keys a lost earlier answer may have left before putting; a first attempt whose
keys already hold objects is refused (Mooncake would keep the old bytes and say 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from aiohttp import web

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.dataset.target import read_target
from hsx_async.errors import ArgumentError, HsxError
from hsx_async.front.extract import Extracted, ExtractionFailed, Extractor
from hsx_async.front.metrics import ERROR_MARKER, PUBLISHED, REFUSED, FrontMetrics
from hsx_async.front.mooncake import MooncakeError, MooncakeOptions, Publisher
from hsx_async.front.serving import front_app, listen_until, publishing
from hsx_async.layer_ids import draft_ids

log = structlog.get_logger("hsx.front")

MAX_REQUEST = 64 << 20  # a lease batch of long prompts, ids twice (input_ids, passthrough)
AUX = "aux"  # the aux layers' states, concatenated
LAST_HIDDEN = "last_hidden"  # the post-norm final state
ARTIFACTS = (AUX, LAST_HIDDEN)
PASSTHROUGH_DTYPE = "int64"  # the only one SpecForge's adapter sends
TAKEN = "mooncake_key_taken"  # a first attempt's keys already hold objects


class RequestRefused(HsxError):
    """The ``/generate`` body is not SpecForge's capture request (an HTTP 400)."""


class CaptureRefused(HsxError):
    """One task's ``spec_capture`` entry is not SpecForge's (that task's error)."""


@dataclass(frozen=True)
class Capture:
    """One task's ``spec_capture`` entry."""

    store_id: str
    sample_id: str
    gen: int
    replace: bool
    features: dict[str, str]  # artifact (aux, last_hidden) -> feature name
    passthrough: dict[str, torch.Tensor]  # feature name -> int64 tensor of its shape

    def key(self, name: str) -> str:
        """``MooncakeFeatureStore._tkey``: ``{store_id}/{sample_id}/g{gen}/{name}``."""
        return f"{self.store_id}/{self.sample_id}/g{self.gen}/{name}"

    @property
    def names(self) -> list[str]:
        return [*self.features.values(), *self.passthrough]


def identity(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What an answer names, read as far as the entry allows (for an error answer)."""
    return {k: entry[k] for k in ("store_id", "sample_id", "gen") if k in entry}


def parse_capture(entry: Any, length: int) -> Capture:
    """The entry of a ``length``-token prompt; :class:`CaptureRefused` saying what is wrong."""
    if not isinstance(entry, dict):
        raise CaptureRefused(f"spec_capture entry is {type(entry).__name__}, not an object")
    store_id, sample_id, gen = entry.get("store_id"), entry.get("sample_id"), entry.get("gen")
    if not (isinstance(store_id, str) and store_id and isinstance(sample_id, str) and sample_id):
        raise CaptureRefused(
            f"spec_capture store_id {store_id!r} and sample_id {sample_id!r} must be "
            "non-empty strings"
        )
    if isinstance(gen, bool) or not isinstance(gen, int) or gen < 1:
        raise CaptureRefused(f"spec_capture gen {gen!r} is not a generation (an int >= 1)")
    features = entry.get("features", {})
    if not isinstance(features, dict) or not all(
        isinstance(v, str) and v for v in features.values()
    ):
        raise CaptureRefused(f"spec_capture features {features!r} is not {{artifact: name}}")
    unknown = sorted(set(features) - set(ARTIFACTS))
    if unknown:
        raise CaptureRefused(
            f"spec_capture asks for artifacts {unknown}: this capture gives {list(ARTIFACTS)}"
        )
    passthrough = {}
    for item in entry.get("passthrough", []):
        tensor_name, tensor = _passthrough(item, length)
        passthrough[tensor_name] = tensor
    names = [*features.values(), *passthrough]
    if not names:
        raise CaptureRefused("spec_capture names no feature")
    if len(set(names)) != len(names):
        raise CaptureRefused(f"spec_capture names a feature twice: {names}")
    return Capture(
        store_id, sample_id, gen, bool(entry.get("replace", False)), dict(features), passthrough
    )


def _passthrough(item: Any, length: int) -> tuple[str, torch.Tensor]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise CaptureRefused(f"spec_capture passthrough {item!r} has no name")
    name, data, shape = item["name"], item.get("data"), item.get("shape")
    if item.get("dtype", PASSTHROUGH_DTYPE) != PASSTHROUGH_DTYPE:
        raise CaptureRefused(
            f"passthrough {name!r} is {item.get('dtype')!r}; this capture stores int64 only"
        )
    if not (
        isinstance(shape, list)
        and len(shape) >= 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        and shape[:2] == [1, length]
    ):
        raise CaptureRefused(
            f"passthrough {name!r} has shape {shape!r}; SpecForge's is [1, {length}, ...] "
            f"for a {length}-token prompt"
        )
    if not isinstance(data, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in data
    ):
        raise CaptureRefused(f"passthrough {name!r} data is not a flat list of ints")
    tensor = torch.tensor(data, dtype=torch.int64)
    if tensor.numel() != torch.Size(shape).numel():
        raise CaptureRefused(f"passthrough {name!r} has {tensor.numel()} values for shape {shape}")
    return name, tensor.view(shape)


@dataclass(frozen=True)
class Task:
    input_ids: list[int]
    entry: Any  # its spec_capture entry, parsed per task


def parse_request(body: Any) -> tuple[list[Task], bool]:
    """The tasks of one ``/generate`` body and whether it was batched (a list of prompts);
    :class:`RequestRefused` when it is not SpecForge's capture request."""
    if not isinstance(body, dict):
        raise RequestRefused("the body is not a JSON object")
    ids, capture = body.get("input_ids"), body.get("spec_capture")
    if capture is None:
        raise RequestRefused(
            "no spec_capture in the request: this front only captures for SpecForge's "
            "producer (SGLangServerCaptureAdapter)"
        )
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts: list[Any] = list(ids) if batched and isinstance(ids, list) else [ids]
    entries: list[Any] = capture if isinstance(capture, list) else [capture]
    for prompt in prompts:
        if not (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            raise RequestRefused(
                "input_ids must be a non-empty list of token ids, or a list of them "
                "(hsx's front takes no text)"
            )
    if len(entries) != len(prompts):
        raise RequestRefused(
            f"{len(entries)} spec_capture entries for {len(prompts)} prompts: one each"
        )
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict) or sampling.get("max_new_tokens", 0) != 0:
        raise RequestRefused(
            "sampling_params.max_new_tokens must be 0: the front captures the prompt only"
        )
    return [Task(p, e) for p, e in zip(prompts, entries, strict=True)], batched


def capture_layer_ids(config: Config, model: Path | None) -> list[int]:
    """``[model].aux_layers`` in SpecForge's numbering (its drafter config's
    ``eagle_aux_hidden_state_layer_ids``, which its producer checks the answer's
    ``aux_layer_ids`` against), by SGLang's rule for the target's family
    (:mod:`hsx_async.layer_ids`); :class:`ArgumentError` when ``--model`` is missing or
    no ids give those layers."""
    if model is None:
        raise ArgumentError(
            "--model",
            "hsx front specforge needs the target's Hugging Face directory: its family "
            "decides the layer ids SpecForge's producer checks the capture against",
        )
    target = read_target(model)
    if target.architecture is None or target.num_layers is None:
        raise ArgumentError(
            "--model", f"{model}/config.json names no architecture or num_hidden_layers"
        )
    ids = draft_ids(target.architecture, config.model.aux_layers, target.num_layers)
    if ids.ids is None:
        raise ArgumentError("--model", ids.describe(config.model.aux_layers))
    return list(ids.ids)


def features(got: Extracted, capture: Capture) -> dict[str, torch.Tensor]:
    """The task's tensors by feature name, in SpecForge's online layout."""
    hidden = got.hidden_states  # [T, n_aux + 1, H]
    tokens, layers, size = hidden.shape
    artifacts = {
        AUX: lambda: hidden[:, :-1, :].reshape(1, tokens, (layers - 1) * size),
        LAST_HIDDEN: lambda: hidden[:, -1, :].reshape(1, tokens, size),
    }
    out = {name: artifacts[artifact]().contiguous() for artifact, name in capture.features.items()}
    out.update(capture.passthrough)
    return out


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class SpecForgeFront:
    extractor: Extractor
    publisher: Publisher
    aux_layer_ids: list[int]
    metrics: FrontMetrics

    async def generate(self, body: Any) -> tuple[int, Any]:
        """The status and the answer to one ``/generate`` body."""
        try:
            tasks, batched = parse_request(body)
        except RequestRefused as exc:
            self.metrics.answered(REFUSED)
            return 400, {"error": {"message": str(exc)}}
        rows = await asyncio.gather(*(self._task(task) for task in tasks))
        return 200, (rows if batched else rows[0])

    async def _task(self, task: Task) -> dict[str, Any]:
        rid = self.extractor.next_rid()
        with self.metrics.request_latency.time():
            result = await self._capture(rid, task)
        self.metrics.answered(ERROR_MARKER if "error" in result else PUBLISHED)
        length = len(task.input_ids)
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": rid,
                "prompt_tokens": length,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 0},
                "spec_capture": result,
            },
        }

    async def _capture(self, rid: str, task: Task) -> dict[str, Any]:
        named = identity(task.entry) if isinstance(task.entry, dict) else {}
        try:
            capture = parse_capture(task.entry, len(task.input_ids))
            got = await self.extractor.extract(rid, task.input_ids)
            tensors = features(got, capture)
            await self._publish(capture, tensors)
        except CaptureRefused as exc:
            self.metrics.failed("request", "spec_capture")
            return self._error(named, str(exc))
        except ExtractionFailed as exc:
            self.metrics.failed(exc.cause, exc.kind)
            return self._error(named, str(exc))
        except MooncakeError as exc:
            self.metrics.failed("mooncake", exc.kind)
            return self._error(named, str(exc))
        specs = {
            name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
            for name, t in tensors.items()
        }
        return {
            "store_id": capture.store_id,
            "sample_id": capture.sample_id,
            "gen": capture.gen,
            "features": specs,
            "aux_layer_ids": self.aux_layer_ids,
        }

    def _error(self, named: dict[str, Any], reason: str) -> dict[str, Any]:
        log.info("capture_failed", reason=reason, **named)
        return {**named, "error": reason}

    async def _publish(self, capture: Capture, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every feature at its key, or none: :class:`MooncakeError` after removing what
        was put."""
        with self.metrics.publish_latency.time():
            await asyncio.to_thread(self._put_all, capture, tensors)

    def _put_all(self, capture: Capture, tensors: Mapping[str, torch.Tensor]) -> None:
        keys = [capture.key(name) for name in capture.names]
        if capture.replace:  # a retry: what a lost answer's attempt left goes first
            for key in keys:
                self.publisher.remove(key)
        else:  # Mooncake keeps an old object on a put to its key, and says 0
            taken = self.publisher.taken(keys)
            if taken:
                raise MooncakeError(
                    f"{taken} are already in Mooncake and this is the task's first attempt "
                    "(no replace): another run with this store_id and run_id wrote them",
                    TAKEN,
                )
        put: list[str] = []
        try:
            for name, tensor in tensors.items():
                blob = raw(tensor)
                self.publisher.put_sample(capture.key(name), blob)
                put.append(capture.key(name))
                self.metrics.bytes_published.inc(len(blob))
        except MooncakeError:
            for key in put:
                self.publisher.remove(key)
            raise


def build_app(front: SpecForgeFront) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        status, answer = await front.generate(body)
        return web.json_response(answer, status=status)

    app = front_app(front.publisher, front.metrics, MAX_REQUEST)
    app.router.add_post("/generate", generate)
    return app


async def serve(
    config: Config,
    options: MooncakeOptions,
    *,
    listen: str,
    final: FinalConversion,
    layer_ids: Sequence[int],
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when none is given); ``layer_ids``:
    the aux layers as SpecForge numbers them (:func:`capture_layer_ids`)."""
    async with publishing(config, options, final, listen=listen) as (extractor, publisher, m):
        front = SpecForgeFront(extractor, publisher, list(layer_ids), m)
        await listen_until(build_app(front), listen, on_bound, stop)


__all__ = [
    "SpecForgeFront",
    "build_app",
    "capture_layer_ids",
    "parse_capture",
    "parse_request",
    "serve",
]
