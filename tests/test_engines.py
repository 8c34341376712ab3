"""Each engine's wire: the vLLM request and its response checks (SGLang's are in
tests/test_protocol.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from hsx_async.config import config_from_dict
from hsx_async.engines import ENGINES, check_vllm_response, vllm_body
from hsx_async.errors import ConfigError, DumpError


def reply(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "usage": {"prompt_tokens": 3, "prompt_tokens_details": None},
        "kv_transfer_params": {"hsx_ns": "w0", "hsx_rid": "r1"},
    }
    body.update(over)
    return body


def test_vllm_body_is_one_token_with_the_marks() -> None:
    body = vllm_body("r1", "w0", np.array([1, 2, 3], dtype=np.int64))
    assert body["max_tokens"] == 1 and body["kv_transfer_params"] == {
        "hsx_ns": "w0",
        "hsx_rid": "r1",
    }
    assert orjson.loads(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))["prompt"] == [
        1,
        2,
        3,
    ]


def test_vllm_response_checks() -> None:
    check_vllm_response(reply(), "r1", 3)
    check_vllm_response(
        reply(usage={"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}), "r1", 3
    )
    cases = [
        (reply(kv_transfer_params=None), "hsx connector"),
        (reply(kv_transfer_params={"hsx_rid": "other"}), "expected 'r1'"),
        (reply(usage={"prompt_tokens": 4}), "prompt_tokens is 4"),
        (reply(usage={"prompt_tokens": True}), "prompt_tokens is True"),
        (reply(usage=None), "prompt_tokens is None"),
        (reply(usage={"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}),
         "prefix-cache"),
        (reply(usage={"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": False}}),
         "prefix-cache"),
        ([], "not a JSON object"),
    ]  # fmt: skip
    for body, match in cases:
        with pytest.raises(DumpError, match=match):
            check_vllm_response(body, "r1", 3)


def test_engines_have_their_paths() -> None:
    assert ENGINES["sglang"].generate_path == "/generate"
    assert ENGINES["vllm"].generate_path == "/v1/completions"
    assert ENGINES["vllm"].model_of({"data": [{"id": "m", "root": "/models/m"}]}) == "/models/m"
    assert ENGINES["sglang"].model_of({"model_path": "/models/m"}) == "/models/m"


def _raw(**server: Any) -> dict[str, Any]:
    return {
        "server": {"urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"], **server},
        "input": {"path": "in.jsonl"},
        "output": {"dir": "out"},
        "model": {"hidden_size": 8, "aux_layers": [1]},
    }


def test_engine_config(tmp_path: Any) -> None:
    c = config_from_dict(_raw(), base=tmp_path)
    assert c.server.engine_of("http://127.0.0.1:2") == "sglang"
    c = config_from_dict(_raw(engine="vllm"), base=tmp_path)
    assert c.server.engine_of("http://127.0.0.1:1") == "vllm"
    c = config_from_dict(_raw(engines=["sglang", "vllm"]), base=tmp_path)
    assert [c.server.engine_of(u) for u in c.server.urls] == ["sglang", "vllm"]
    with pytest.raises(ConfigError, match=r"server\.engines"):
        config_from_dict(_raw(engines=["vllm"]), base=tmp_path)
    with pytest.raises(ConfigError, match=r"server\.engine"):
        config_from_dict(_raw(engine="trt"), base=tmp_path)
