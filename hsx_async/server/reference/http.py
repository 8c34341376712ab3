"""The reference server's HTTP surface, pure: parse ``POST /generate``, build the answers.

Mirrors what SGLang accepts and returns for the requests hsx sends (PROTOCOL §2), and for
ordinary prefill-plus-greedy-decode traffic given as ``input_ids`` (the built-in model has
no tokenizer, so there is no ``text`` prompt and the ``text`` answer is empty).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from hsx_async.errors import HsxRequestError
from hsx_async.protocol import CUSTOM_PARAM_NS, check_hsx_request

# SGLang's default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class BadRequest(Exception):
    """The request is refused with 400; nothing is computed or written."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """SGLang's sampling parameters that the reference server honours when it decodes."""

    # 0 is greedy. SGLang's default is 1.0; this server decodes greedily unless asked,
    # so ordinary test traffic stays deterministic.
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
    input_ids: list[int]
    max_new_tokens: int
    ns: str | None  # None: ordinary traffic, dumps nothing
    sampling: Sampling = Sampling()
    # As sent: the hook reads the storage an hsx request asks for from it (PROTOCOL §2).
    custom_params: dict[str, Any] = field(default_factory=dict)


def _input_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required: this server has no tokenizer for text prompts")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids")
    if isinstance(ids[0], list):
        raise BadRequest("batched input_ids (a list of prompts) are not supported: send one each")
    for token in ids:
        # type() is int: JSON true/false would pass an isinstance check.
        if type(token) is not int or not 0 <= token < vocab_size:
            raise BadRequest(f"input_ids holds {token!r}, expected token ids in [0, {vocab_size})")
    return ids


def _sampling(body: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    """(max_new_tokens, hsx_ns, custom_params) from ``sampling_params``."""
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if type(max_new) is not int or max_new < 0:
        raise BadRequest(f"max_new_tokens is {max_new!r}, expected an integer >= 0")
    custom = params.get("custom_params") or {}
    if not isinstance(custom, dict):
        raise BadRequest("custom_params must be a JSON object")
    return max_new, custom.get(CUSTOM_PARAM_NS), custom


def _number(params: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadRequest(f"{key} is {value!r}, expected a number in [{low:g}, {high:g}]")
    return float(value)


def parse_sampling(params: dict[str, Any], vocab_size: int) -> Sampling:
    """temperature, top_p, sampling_seed and stop_token_ids, checked like SGLang does."""
    temperature = _number(params, "temperature", 0.0, 0.0, 100.0)
    top_p = _number(params, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p is 0, expected a number in (0, 1]")
    seed = params.get("sampling_seed")
    if seed is not None and (type(seed) is not int or not -(2**63) <= seed < 2**63):
        raise BadRequest(f"sampling_seed is {seed!r}, expected a 64-bit integer")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or any(
        type(t) is not int or not 0 <= t < vocab_size for t in stops
    ):
        raise BadRequest(f"stop_token_ids is {stops!r}, expected token ids in [0, {vocab_size})")
    return Sampling(temperature, top_p, seed, frozenset(stops))


def parse_generate(body: object, *, vocab_size: int, max_positions: int | None) -> GenerateRequest:
    """A checked ``POST /generate`` body, or :class:`BadRequest` saying what to fix."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported")
    ids = _input_ids(body, vocab_size)
    max_new, ns, custom = _sampling(body)
    rid = body.get("rid")
    if ns is not None:
        try:
            ns, rid = check_hsx_request(ns, rid, max_new_tokens=max_new)
        except HsxRequestError as exc:
            raise BadRequest(str(exc)) from None
    elif rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise BadRequest(f"rid {rid!r} is not a string")
    if max_positions is not None and len(ids) + max_new > max_positions:
        raise BadRequest(
            f"{len(ids)} prompt tokens + max_new_tokens {max_new} exceed the model's "
            f"{max_positions} positions"
        )
    sampling = parse_sampling(body.get("sampling_params") or {}, vocab_size)
    return GenerateRequest(
        rid=rid,
        input_ids=ids,
        max_new_tokens=max_new,
        ns=ns,
        sampling=sampling,
        custom_params=custom,
    )


def generate_response(
    rid: str, prompt_tokens: int, output_ids: list[int], stopped: bool = False
) -> dict[str, Any]:
    """SGLang's answer to a non-streaming ``POST /generate``: ``stopped`` when the last
    output token is a stop token (SGLang keeps it in ``output_ids``), else the length cap."""
    n = len(output_ids)
    finish: dict[str, Any] = (
        {"type": "stop", "matched": output_ids[-1]}
        if stopped and output_ids
        else {"type": "length", "length": n}
    )
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": 0,  # no prefix cache: every row is computed
            "finish_reason": finish,
        },
    }


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error shape."""
    return {"error": {"message": message}}
