"""SGLang: ``POST /generate`` with ``max_new_tokens: 0`` (prefill only) and
``custom_params.hsx_ns`` (PROTOCOL §2); the hook dumps the post-norm final state.

``hsx regenerate`` decodes through the same endpoint with SGLang's sampling parameters
(``sampling_seed`` seeds one request) and reads ``output_ids`` and ``meta_info``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hsx_async.engines.engine import Decoded, Decoding, Engine, is_count
from hsx_async.errors import AnswerError
from hsx_async.protocol import check_response, generate_body


def _check(body: object, rid: str, num_tokens: int) -> None:
    check_response(body, rid=rid, num_tokens=num_tokens)


def _model(info: object) -> str:
    return str(info.get("model_path", "")) if isinstance(info, dict) else ""


def decode_body(rid: str, input_ids: Sequence[int], decoding: Decoding) -> dict[str, Any]:
    """A sampled ``POST /generate`` (no hsx namespace: nothing is dumped)."""
    return {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": {
            "max_new_tokens": decoding.max_new_tokens,
            "temperature": decoding.temperature,
            "top_p": decoding.top_p,
            "sampling_seed": decoding.seed,
            "stop_token_ids": list(decoding.stop_ids),
        },
        "stream": False,
    }


def parse_decode(body: object, rid: str, prompt_tokens: int) -> Decoded:
    """``output_ids`` and the finish reason of SGLang's answer to :func:`decode_body`."""

    def bad(why: str) -> AnswerError:
        return AnswerError(f"answer to {rid}: {why}")

    meta = body.get("meta_info") if isinstance(body, Mapping) else None
    if not isinstance(body, Mapping) or not isinstance(meta, Mapping):
        raise bad("no meta_info")
    if meta.get("id") != rid:
        raise bad(f"meta_info.id is {meta.get('id')!r}")
    sent = meta.get("prompt_tokens")
    if not is_count(sent) or sent != prompt_tokens:
        raise bad(f"meta_info.prompt_tokens is {sent!r}, sent {prompt_tokens}")
    ids = body.get("output_ids")
    if not isinstance(ids, list):
        raise bad("output_ids is not a list of token ids")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else None
    if kind not in ("stop", "length"):
        raise bad(f"finish_reason is {finish!r}")
    return Decoded(ids, "stop" if kind == "stop" else "length")


ENGINE = Engine(
    name="sglang",
    generate_path="/generate",
    build_body=generate_body,
    check=_check,
    model_info_path="/get_model_info",
    model_of=_model,
    version_path="/get_server_info",
    no_cache_flag="--disable-radix-cache",
    decode_path="/generate",
    decode_body=decode_body,
    parse_decode=parse_decode,
    acks_mark=False,
    deploy="deploy/sglang",
)
