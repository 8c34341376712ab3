"""The one SGLang-shaped HTTP front end of the built-in servers (fake and reference): what
``POST /generate`` accepts, what it and the info endpoints answer (PROTOCOL §2), as SGLang
does for the requests hsx sends and for ordinary prefill-plus-decode traffic.

A marked request (``custom_params.hsx_ns``) is judged by the one request rule every hook
applies (:func:`hsx_async.protocol.check_hsx_request`); a request that breaks it, or is not
a well-formed request at all, is answered 400 with the reason, and nothing is computed or
written. Neither built-in server streams. Parsing is pure; the answers are aiohttp
responses.
"""

from __future__ import annotations

import errno
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from hsx_async.errors import ArgumentError, HsxRequestError
from hsx_async.protocol import PROTOCOL_VERSION, check_hsx_request, marked_ns, shown

# SGLang's default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class BadRequest(Exception):
    """The request is refused with 400; nothing is computed or written."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """SGLang's sampling parameters that a server honours when it decodes."""

    # 0 is greedy. SGLang's default is 1.0; the built-in servers decode greedily unless
    # asked, so ordinary test traffic stays deterministic.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # SGLang's sampling_seed
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]  # empty for a text prompt (``text_prompts``)
    max_new_tokens: int
    ns: str | None  # None: ordinary traffic, dumps nothing
    sampling: Sampling = Sampling()
    # As sent: the dumper reads the storage an hsx request asks for from it (PROTOCOL §2).
    custom_params: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0


def parse_generate(
    raw: bytes,
    *,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    text_prompts: bool = False,
) -> GenerateRequest:
    """A checked ``POST /generate`` body, or :class:`BadRequest` saying what to fix.
    ``vocab_size``/``max_positions``: the model's bounds, where there is a model;
    ``text_prompts``: an ordinary request may give ``text`` instead of token ids (the fake
    server counts its words as tokens)."""
    body = _json_object(raw)
    if body.get("stream"):
        raise BadRequest("stream=true is not supported: send a non-streaming request")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    max_new, custom = _max_new_tokens(params), params.get("custom_params") or {}
    if not isinstance(custom, dict):
        raise BadRequest("custom_params must be a JSON object")
    ns, rid = marked_ns(custom), body.get("rid")
    text = body.get("text")
    ids: list[int] = []
    if not (text_prompts and ns is None and isinstance(text, str) and "input_ids" not in body):
        ids, text = _input_ids(body.get("input_ids"), vocab_size), None
    if ns is not None:
        try:
            ns, rid = check_hsx_request(ns, rid, max_new_tokens=max_new)
        except HsxRequestError as exc:
            raise BadRequest(str(exc)) from None
    rid = _rid(rid) if ns is None else rid
    if max_positions is not None and len(ids) + max_new > max_positions:
        raise BadRequest(
            f"{len(ids)} prompt tokens + max_new_tokens {max_new} exceed the model's "
            f"{max_positions} positions"
        )
    return GenerateRequest(
        rid=str(rid),
        input_ids=ids,
        max_new_tokens=max_new,
        ns=ns if isinstance(ns, str) else None,
        sampling=parse_sampling(params, vocab_size),
        custom_params=custom,
        prompt_tokens=len(ids) if text is None else len(str(text).split()),
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body is not a JSON object")
    return body


def _rid(rid: object) -> str:
    """An ordinary request's rid: SGLang makes one up when none is given."""
    if rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest(f"rid {shown(rid)} is not a string")
    return rid


def _max_new_tokens(params: Mapping[str, Any]) -> int:
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    # type() is int: JSON true/false would pass an isinstance check.
    if type(max_new) is not int or max_new < 0:
        raise BadRequest(f"max_new_tokens is {shown(max_new)}, expected an integer >= 0")
    return max_new


def _input_ids(ids: object, vocab_size: int | None) -> list[int]:
    if ids is None:
        raise BadRequest("input_ids is required: send the prompt as token ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids")
    if isinstance(ids[0], list):
        raise BadRequest("batched input_ids (a list of prompts) are not supported: send one each")
    for token in ids:
        # type() is int: JSON true/false would pass an isinstance check; an id past int64
        # is no token of any vocabulary.
        if type(token) is not int or not 0 <= token < 2**63:
            raise BadRequest(f"input_ids holds {shown(token)}, expected token ids ≥ 0")
        if vocab_size is not None and token >= vocab_size:
            raise BadRequest(
                f"token id {token} is out of vocabulary (vocab_size {vocab_size}): send ids "
                f"in [0, {vocab_size})"
            )
    return ids


def _number(params: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadRequest(f"{key} is {shown(value)}, expected a number in [{low:g}, {high:g}]")
    return float(value)


def parse_sampling(params: Mapping[str, Any], vocab_size: int | None = None) -> Sampling:
    """temperature, top_p, sampling_seed and stop_token_ids, checked like SGLang does."""
    temperature = _number(params, "temperature", 0.0, 0.0, 100.0)
    top_p = _number(params, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p is 0, expected a number in (0, 1]")
    seed = params.get("sampling_seed")
    if seed is not None and (type(seed) is not int or not -(2**63) <= seed < 2**63):
        raise BadRequest(f"sampling_seed is {shown(seed)}, expected a 64-bit integer")
    stops = params.get("stop_token_ids") or []
    top = vocab_size if vocab_size is not None else 2**63
    if not isinstance(stops, list) or any(type(t) is not int or not 0 <= t < top for t in stops):
        span = f"[0, {vocab_size})" if vocab_size is not None else "≥ 0"
        raise BadRequest(f"stop_token_ids is {shown(stops)}, expected token ids {span}")
    return Sampling(temperature, top_p, seed, frozenset(stops))


# --------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------


def generate_response(
    rid: str, prompt_tokens: int, output_ids: Sequence[int] = (), stopped: bool = False
) -> dict[str, Any]:
    """SGLang's answer to a non-streaming ``POST /generate``: ``stopped`` when the last
    output token is a stop token (SGLang keeps it in ``output_ids``), else the length cap."""
    out = list(output_ids)
    finish: dict[str, Any] = (
        {"type": "stop", "matched": out[-1]}
        if stopped and out
        else {"type": "length", "length": len(out)}
    )
    return {
        "text": "",
        "output_ids": out,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(out),
            "cached_tokens": 0,  # no prefix cache: every row is computed
            "finish_reason": finish,
        },
    }


def error_body(message: str, status: int) -> dict[str, Any]:
    """SGLang's error shape."""
    return {"error": {"message": message, "code": status}}


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response(error_body(message, status), status)


def model_info(
    model_path: str, hidden_size: int, aux_layers: Sequence[int], **extra: object
) -> dict[str, Any]:
    """``GET /get_model_info``: SGLang's keys, and the layers the server dumps."""
    return {
        "model_path": model_path,
        "is_generation": True,
        "hidden_size": hidden_size,
        "hsx_aux_layers": list(aux_layers),
        **extra,
    }


def server_info(
    *,
    version: str,
    model_path: str,
    dump_root: Path,
    hidden_size: int,
    aux_layers: Sequence[int],
    chunk_size: int,
    max_batch_tokens: int,
    **extra: object,
) -> dict[str, Any]:
    """``GET /get_server_info``: SGLang's keys the client reads, and what the server dumps
    where (``hsx check`` compares them with the job's config)."""
    return {
        "version": version,
        "model_path": model_path,
        "hsx_protocol": PROTOCOL_VERSION,
        "hsx_dump_root": str(dump_root),
        "hidden_size": hidden_size,
        "hsx_aux_layers": list(aux_layers),
        "disable_radix_cache": True,
        "chunked_prefill_size": chunk_size or -1,
        "max_prefill_tokens": max_batch_tokens,
        **extra,
    }


def bind_listener(host: str, port: int) -> socket.socket:
    """The built-in servers' listening socket, bound before anything slow (a model load) so
    that a taken port is refused at once: :class:`ArgumentError` naming the address and the
    option to change (exit 2), never a traceback. Serve it with ``web.SockSite``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:  # socket.gaierror: a host that names no address
        raise _listen_error(host, port, exc) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _listen_error(host, port, exc) from None
    sock.setblocking(False)
    return sock


def _listen_error(host: str, port: int, exc: OSError) -> ArgumentError:
    where = f"{host or '*'}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ArgumentError(
            "--port",
            f"{where} is in use (another server is listening there, and hsx run would talk "
            "to it): stop that one, or give this one a free --port and the job's "
            "server.urls the same port",
        )
    return ArgumentError(
        "--port", f"cannot listen on {where}: {exc.strerror or exc}; give another --host/--port"
    )
