"""Parsing ``POST /generate`` (PROTOCOL §2) and building SGLang's answer, for the fake server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from hsx_async.errors import HsxRequestError
from hsx_async.protocol import CUSTOM_PARAM_NS, check_hsx_request
from hsx_async.server.fake.content import I64


class BadRequestError(Exception):
    """The request breaks PROTOCOL §2; answered 400, nothing is written."""


@dataclass(frozen=True)
class GenerateRequest:
    rid: str | None
    ns: str | None  # None: ordinary traffic, no dump
    input_ids: I64
    prompt_tokens: int
    # An hsx request's custom_params as sent: the storage it asks for (PROTOCOL §2).
    custom_params: dict[str, Any] = field(default_factory=dict)


def _parse_ids(raw: object, *, required: bool) -> I64:
    if raw is None and not required:
        return np.empty(0, dtype=np.int64)
    if not isinstance(raw, list) or not raw:
        raise BadRequestError("input_ids must be a non-empty list of token ids")
    try:
        ids = np.asarray(raw)
    except (OverflowError, ValueError):
        raise BadRequestError("input_ids must be a list of integers") from None
    # A float or bool anywhere changes the inferred dtype; values above int64 make it object.
    if ids.dtype != np.int64 or ids.ndim != 1 or int(ids.min()) < 0:
        raise BadRequestError("input_ids must be a list of integers ≥ 0")
    return ids


def _check_hsx(body: dict[str, Any], sampling: dict[str, Any], ns: object) -> None:
    try:
        check_hsx_request(ns, body.get("rid"), max_new_tokens=sampling.get("max_new_tokens"))
    except HsxRequestError as exc:
        raise BadRequestError(str(exc)) from None
    if body.get("stream"):
        raise BadRequestError("hsx requests must not stream")


def parse_generate(raw: bytes) -> GenerateRequest:
    """Validate a ``POST /generate`` body (PROTOCOL §2)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequestError("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequestError("body is not a JSON object")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise BadRequestError("sampling_params is not an object")
    custom = sampling.get("custom_params")
    ns = custom.get(CUSTOM_PARAM_NS) if isinstance(custom, dict) else None
    if ns is None:
        rid = body.get("rid")
        ids = _parse_ids(body.get("input_ids"), required=not isinstance(body.get("text"), str))
        tokens = ids.shape[0] or len(str(body.get("text")).split())
        return GenerateRequest(rid if isinstance(rid, str) else None, None, ids, tokens)
    _check_hsx(body, sampling, ns)
    ids = _parse_ids(body.get("input_ids"), required=True)
    params = dict(custom) if isinstance(custom, dict) else {}
    return GenerateRequest(body["rid"], ns, ids, int(ids.shape[0]), params)


def response_body(rid: str, prompt_tokens: int, fault: str | None) -> dict[str, Any]:
    """SGLang's non-streaming answer to a prefill-only request, with response faults."""
    meta = {
        "id": f"{rid}-not-mine" if fault == "wrong_rid" else rid,
        "prompt_tokens": prompt_tokens + (fault == "wrong_prompt_tokens"),
        "completion_tokens": 0,
        "cached_tokens": min(prompt_tokens, 16) if fault == "cached_tokens" else 0,
        "finish_reason": {"type": "length", "length": 0},
    }
    return {"text": "", "meta_info": meta}
