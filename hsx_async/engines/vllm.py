"""vLLM: ``POST /v1/completions`` with the prompt as token ids, ``max_tokens: 1`` (vLLM has
no prefill-only request; the one sampled token never runs through the model, so no row is
added) and ``kv_transfer_params: {"hsx_ns", "hsx_rid"}``; the hsx connector answers with the
same ``hsx_rid`` in the response's ``kv_transfer_params`` (proof that it took the request)
and dumps the pre-norm final state.

``hsx regenerate`` decodes through the same endpoint without the marks (an ordinary
completion the connector leaves alone), seeded per request, with ``return_token_ids`` so
the answer comes back as ids (vLLM ≥ 0.10.2: ``choices[0].token_ids``, and the prompt as
the server took it in ``prompt_token_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hsx_async.engines.engine import Decoded, Decoding, Engine, is_count
from hsx_async.errors import AnswerError, CacheHitError, DumpError, HookMissingError
from hsx_async.protocol import BF16_STORAGE, CUSTOM_PARAM_NS, Storage, storage_params

VLLM_PARAM_RID = "hsx_rid"


def vllm_body(rid: str, ns: str, input_ids: Any, storage: Storage = BF16_STORAGE) -> dict[str, Any]:
    """``POST /v1/completions`` for one marked prompt (``input_ids`` may be numpy)."""
    params = {CUSTOM_PARAM_NS: ns, VLLM_PARAM_RID: rid, **storage_params(storage)}
    return {
        "prompt": input_ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": params,
        "stream": False,
    }


def check_vllm_response(body: object, rid: str, num_tokens: int) -> None:
    """The vLLM form of PROTOCOL §2's response checks."""
    if not isinstance(body, Mapping):
        raise DumpError("response is not a JSON object")
    params = body.get("kv_transfer_params")
    got = params.get(VLLM_PARAM_RID) if isinstance(params, Mapping) else None
    if got is None:
        raise HookMissingError(
            f"response kv_transfer_params.hsx_rid is {got!r}, expected {rid!r}: is vLLM "
            "running with the hsx connector (deploy/vllm/launch.sh)?"
        )
    if got != rid:
        raise DumpError(
            f"response kv_transfer_params.hsx_rid is {got!r}, expected {rid!r}: is vLLM "
            "running with the hsx connector (deploy/vllm/launch.sh)?"
        )
    usage = body.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if not is_count(prompt) or prompt != num_tokens:
        raise DumpError(
            f"response usage.prompt_tokens is {prompt!r}, the request had {num_tokens} tokens"
        )
    assert isinstance(usage, Mapping)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if cached is not None and (not is_count(cached) or cached != 0):
        raise CacheHitError(
            f"response usage.prompt_tokens_details.cached_tokens is {cached!r}: a prefix-cache "
            "hit skips rows; start vLLM with --no-enable-prefix-caching"
        )


def _model(info: object) -> str:
    data = info.get("data") if isinstance(info, Mapping) else None
    if isinstance(data, list) and data and isinstance(data[0], Mapping):
        return str(data[0].get("root") or data[0].get("id") or "")
    return ""


def decode_body(rid: str, input_ids: Sequence[int], decoding: Decoding) -> dict[str, Any]:
    """A sampled ``POST /v1/completions`` of token ids, answered with token ids."""
    return {
        "prompt": list(input_ids),
        "max_tokens": decoding.max_new_tokens,
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        "seed": decoding.seed,
        "stop_token_ids": list(decoding.stop_ids),
        "return_token_ids": True,
        "request_id": rid,
        "stream": False,
    }


def parse_decode(body: object, rid: str, prompt_tokens: int) -> Decoded:
    """``choices[0].token_ids`` and its finish reason, of vLLM's answer to
    :func:`decode_body`."""

    def bad(why: str) -> AnswerError:
        return AnswerError(f"answer to {rid}: {why}")

    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(body, Mapping) or not isinstance(choices, list) or len(choices) != 1:
        raise bad("not one completion in choices")
    usage = body.get("usage")
    sent = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if not is_count(sent) or sent != prompt_tokens:
        raise bad(f"usage.prompt_tokens is {sent!r}, sent {prompt_tokens}")
    choice = choices[0]
    ids = choice.get("token_ids") if isinstance(choice, Mapping) else None
    if not isinstance(ids, list):
        raise bad(
            "choices[0].token_ids is not a list of token ids (vLLM older than 0.10.2 "
            "ignores return_token_ids)"
        )
    assert isinstance(choice, Mapping)
    prompt = choice.get("prompt_token_ids")
    if prompt is not None and (not isinstance(prompt, list) or len(prompt) != prompt_tokens):
        raise bad("choices[0].prompt_token_ids is not the prompt sent")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise bad(f"finish_reason is {finish!r}")
    return Decoded(ids, "stop" if finish == "stop" else "length")


ENGINE = Engine(
    name="vllm",
    generate_path="/v1/completions",
    build_body=vllm_body,
    check=check_vllm_response,
    model_info_path="/v1/models",
    model_of=_model,
    version_path="/version",
    no_cache_flag="--no-enable-prefix-caching",
    decode_path="/v1/completions",
    decode_body=decode_body,
    parse_decode=parse_decode,
    acks_mark=True,
    deploy="deploy/vllm",
)
