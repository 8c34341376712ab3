"""The reference server's HTTP surface, pure: parse ``POST /generate``, build the answers.

Mirrors what SGLang accepts and returns for the requests hsx sends (PROTOCOL §2), and for
ordinary prefill-plus-greedy-decode traffic given as ``input_ids`` (the built-in model has
no tokenizer, so there is no ``text`` prompt and the ``text`` answer is empty).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from hsx_async.protocol import CUSTOM_PARAM_NS, NS_PATTERN, RID_PATTERN, valid_ns, valid_rid

# SGLang's default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class BadRequest(Exception):
    """The request is refused with 400; nothing is computed or written."""


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    ns: str | None  # None: ordinary traffic, dumps nothing


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


def _sampling(body: dict[str, Any]) -> tuple[int, str | None]:
    """(max_new_tokens, hsx_ns) from ``sampling_params``."""
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if type(max_new) is not int or max_new < 0:
        raise BadRequest(f"max_new_tokens is {max_new!r}, expected an integer >= 0")
    custom = params.get("custom_params") or {}
    if not isinstance(custom, dict):
        raise BadRequest("custom_params must be a JSON object")
    ns = custom.get(CUSTOM_PARAM_NS)
    if ns is not None and not valid_ns(ns):
        raise BadRequest(f"{CUSTOM_PARAM_NS} {ns!r} does not match {NS_PATTERN}")
    return max_new, ns


def parse_generate(body: object, *, vocab_size: int, max_positions: int | None) -> GenerateRequest:
    """A checked ``POST /generate`` body, or :class:`BadRequest` saying what to fix."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported")
    ids = _input_ids(body, vocab_size)
    max_new, ns = _sampling(body)
    rid = body.get("rid")
    if ns is not None:
        if not (isinstance(rid, str) and valid_rid(rid)):
            raise BadRequest(f"rid {rid!r} does not match {RID_PATTERN}")
        if max_new != 0:
            raise BadRequest(f"an hsx request must be prefill-only: max_new_tokens is {max_new}")
    elif rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise BadRequest(f"rid {rid!r} is not a string")
    if max_positions is not None and len(ids) + max_new > max_positions:
        raise BadRequest(
            f"{len(ids)} prompt tokens + max_new_tokens {max_new} exceed the model's "
            f"{max_positions} positions"
        )
    return GenerateRequest(rid=rid, input_ids=ids, max_new_tokens=max_new, ns=ns)


def generate_response(rid: str, prompt_tokens: int, output_ids: list[int]) -> dict[str, Any]:
    """SGLang's answer to a non-streaming ``POST /generate``."""
    n = len(output_ids)
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": 0,  # no prefix cache: every row is computed
            "finish_reason": {"type": "length", "length": n},
        },
    }


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error shape."""
    return {"error": {"message": message}}
