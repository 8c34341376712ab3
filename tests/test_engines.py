"""Each engine's wire: the vLLM request and its response checks (SGLang's are in
tests/test_protocol.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from hsx_async.config import config_from_dict
from hsx_async.engines import ENGINES, Decoded, Decoding, check_vllm_response, vllm_body
from hsx_async.errors import AnswerError, ConfigError, DumpError
from hsx_async.run.servers.faults import fault_of


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


DECODING = Decoding(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=42, stop_ids=(1, 7))


def test_decode_bodies_carry_the_sampling_and_no_marks() -> None:
    sglang = ENGINES["sglang"].decode_body("rid-1", [5, 6], DECODING)
    assert sglang == {
        "rid": "rid-1", "input_ids": [5, 6], "stream": False,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9,
                            "sampling_seed": 42, "stop_token_ids": [1, 7]},
    }  # fmt: skip
    vllm = ENGINES["vllm"].decode_body("rid-1", [5, 6], DECODING)
    assert vllm == {
        "prompt": [5, 6], "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 42,
        "stop_token_ids": [1, 7], "return_token_ids": True, "request_id": "rid-1",
        "stream": False,
    }  # fmt: skip
    assert "kv_transfer_params" not in vllm  # an ordinary completion: nothing is dumped
    assert ENGINES["vllm"].decode_path == "/v1/completions"
    assert ENGINES["sglang"].decode_path == "/generate"


def _sglang_answer(**meta: Any) -> dict[str, Any]:
    info = {"id": "r", "prompt_tokens": 3, "finish_reason": {"type": "stop"}, **meta}
    return {"output_ids": [5, 6, 1], "meta_info": info}


def _vllm_answer(**choice: Any) -> dict[str, Any]:
    one = {"token_ids": [5, 6], "prompt_token_ids": [9, 9, 9], "finish_reason": "length"}
    return {"choices": [{**one, **choice}], "usage": {"prompt_tokens": 3}}


def test_decode_answers_are_parsed_per_engine() -> None:
    parse = ENGINES["sglang"].parse_decode
    assert parse(_sglang_answer(), "r", 3) == Decoded([5, 6, 1], "stop")
    parse = ENGINES["vllm"].parse_decode
    assert parse(_vllm_answer(), "r", 3) == Decoded([5, 6], "length")
    assert parse(_vllm_answer(prompt_token_ids=None), "r", 3).finish == "length"


@pytest.mark.parametrize(
    ("name", "body", "match"),
    [
        ("sglang", _sglang_answer(id="other"), "meta_info.id"),
        ("sglang", _sglang_answer(prompt_tokens=4), "prompt_tokens is 4"),
        ("sglang", _sglang_answer(prompt_tokens=True), "prompt_tokens is True"),
        ("sglang", _sglang_answer(finish_reason={"type": "abort"}), "finish_reason"),
        ("sglang", {"output_ids": "5", "meta_info": _sglang_answer()["meta_info"]}, "not a list"),
        ("sglang", [], "no meta_info"),
        ("vllm", {"choices": [], "usage": {"prompt_tokens": 3}}, "not one completion"),
        ("vllm", {**_vllm_answer(), "usage": {"prompt_tokens": 2}}, "prompt_tokens is 2"),
        ("vllm", _vllm_answer(token_ids=None), "older than 0.10.2"),
        ("vllm", _vllm_answer(prompt_token_ids=[1]), "not the prompt sent"),
        ("vllm", _vllm_answer(finish_reason="abort"), "finish_reason"),
        ("vllm", "text", "not one completion"),
    ],
)
def test_a_malformed_decode_answer_is_the_servers_fault(name: str, body: Any, match: str) -> None:
    with pytest.raises(AnswerError, match=match):
        ENGINES[name].parse_decode(body, "r", 3)
    assert fault_of(AnswerError("x")).cause == "server"
