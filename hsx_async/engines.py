"""The inference engines hsx speaks to, and how each one's wire differs (PROTOCOL §2).

Everything after the HTTP call — dump validation, writer, manifest, resume, metrics — is the
same for every engine; only the request, the response checks and the info endpoints differ:

- **sglang**: ``POST /generate`` with ``max_new_tokens: 0`` (prefill only) and
  ``custom_params.hsx_ns``; the hook dumps the post-norm final state.
- **vllm**: ``POST /v1/completions`` with the prompt as token ids, ``max_tokens: 1`` (vLLM
  has no prefill-only request; the one sampled token never runs through the model, so no
  row is added) and ``kv_transfer_params: {"hsx_ns", "hsx_rid"}``; the hsx connector answers
  with the same ``hsx_rid`` in the response's ``kv_transfer_params`` (proof that it took the
  request) and dumps the pre-norm final state.

Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hsx_async.errors import DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    CUSTOM_PARAM_NS,
    Storage,
    check_response,
    generate_body,
    storage_params,
)

EngineName = Literal["sglang", "vllm"]
ENGINE_NAMES: tuple[EngineName, ...] = ("sglang", "vllm")
VLLM_PARAM_RID = "hsx_rid"


@dataclass(frozen=True)
class Engine:
    name: EngineName
    generate_path: str
    build_body: Callable[[str, str, Any, Storage], dict[str, Any]]
    check: Callable[[object, str, int], None]
    model_info_path: str
    model_of: Callable[[object], str]
    version_path: str
    # Where a prefix-cache hit would be reported, and the flag that prevents it.
    no_cache_flag: str


def _sglang_check(body: object, rid: str, num_tokens: int) -> None:
    check_response(body, rid=rid, num_tokens=num_tokens)


def _sglang_model(info: object) -> str:
    return str(info.get("model_path", "")) if isinstance(info, dict) else ""


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


def _is_count(value: object) -> bool:
    return type(value) is int  # bool is an int subclass: True must not pass as 1


def check_vllm_response(body: object, rid: str, num_tokens: int) -> None:
    """The vLLM form of PROTOCOL §2's response checks."""
    if not isinstance(body, Mapping):
        raise DumpError("response is not a JSON object")
    params = body.get("kv_transfer_params")
    got = params.get(VLLM_PARAM_RID) if isinstance(params, Mapping) else None
    if got != rid:
        raise DumpError(
            f"response kv_transfer_params.hsx_rid is {got!r}, expected {rid!r}: is vLLM "
            "running with the hsx connector (deploy/vllm/launch.sh)?"
        )
    usage = body.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if not _is_count(prompt) or prompt != num_tokens:
        raise DumpError(
            f"response usage.prompt_tokens is {prompt!r}, the request had {num_tokens} tokens"
        )
    assert isinstance(usage, Mapping)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if cached is not None and (not _is_count(cached) or cached != 0):
        raise DumpError(
            f"response usage.prompt_tokens_details.cached_tokens is {cached!r}: a prefix-cache "
            "hit skips rows; start vLLM with --no-enable-prefix-caching"
        )


def _vllm_model(info: object) -> str:
    data = info.get("data") if isinstance(info, Mapping) else None
    if isinstance(data, list) and data and isinstance(data[0], Mapping):
        return str(data[0].get("root") or data[0].get("id") or "")
    return ""


ENGINES: Mapping[EngineName, Engine] = {
    "sglang": Engine(
        "sglang",
        "/generate",
        generate_body,
        _sglang_check,
        "/get_model_info",
        _sglang_model,
        "/get_server_info",
        "--disable-radix-cache",
    ),
    "vllm": Engine(
        "vllm",
        "/v1/completions",
        vllm_body,
        check_vllm_response,
        "/v1/models",
        _vllm_model,
        "/version",
        "--no-enable-prefix-caching",
    ),
}


def engine(name: EngineName) -> Engine:
    return ENGINES[name]
