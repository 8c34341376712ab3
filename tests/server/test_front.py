"""The one SGLang-shaped front end of the built-in servers: what POST /generate accepts
(the one request rule for marked requests) and what the servers answer."""

from __future__ import annotations

import socket

import orjson
import pytest

from hsx_async.errors import ArgumentError
from hsx_async.protocol import check_response, generate_body
from hsx_async.server.front import (
    BadRequest,
    GenerateRequest,
    bind_listener,
    error_body,
    generate_response,
    model_info,
    parse_generate,
)


def raw(body: object) -> bytes:
    return orjson.dumps(body)


def sp(**params: object) -> dict[str, object]:
    """A one-token prefill-only request with these sampling params."""
    return {"input_ids": [1], "sampling_params": {"max_new_tokens": 0, **params}}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{", "not valid JSON"),
        (b"[1]", "not a JSON object"),
        (
            b'{"rid": "a", "input_ids": [1], "sampling_params": {"max_new_tokens": 0, '
            b'"custom_params": {"hsx_ns": "n"}}, "stream": true}',
            "stream",
        ),
        (
            b'{"rid": "a", "input_ids": [1], "sampling_params": {"max_new_tokens": 1, '
            b'"custom_params": {"hsx_ns": "n"}}}',
            "max_new_tokens",
        ),
        (
            b'{"rid": "a", "input_ids": [1.5], "sampling_params": {"max_new_tokens": 0, '
            b'"custom_params": {"hsx_ns": "n"}}}',
            "input_ids",
        ),
        (
            b'{"rid": "a", "input_ids": [-1], "sampling_params": {"max_new_tokens": 0, '
            b'"custom_params": {"hsx_ns": "n"}}}',
            "input_ids",
        ),
        (
            b'{"rid": "a", "input_ids": [], "sampling_params": {"max_new_tokens": 0, '
            b'"custom_params": {"hsx_ns": "n"}}}',
            "input_ids",
        ),
        (
            b'{"rid": "a", "input_ids": [true], "sampling_params": {"max_new_tokens": 0, '
            b'"custom_params": {"hsx_ns": "n"}}}',
            "input_ids",
        ),
        (
            b'{"rid": "a", "input_ids": [99999999999999999999999], "sampling_params": '
            b'{"max_new_tokens": 0, "custom_params": {"hsx_ns": "n"}}}',
            "input_ids",
        ),
    ],
)
def test_parse_generate_rejects_broken_requests(body: bytes, reason: str) -> None:
    with pytest.raises(BadRequest, match=reason):
        parse_generate(body)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"input_ids": [[1, 2], [3]]}, "batched input_ids"),
        ({"input_ids": [1, 10]}, r"token id 10 is out of vocabulary \(vocab_size 10\)"),
        ({"input_ids": [1, True]}, "input_ids holds True"),
        ({"text": "no tokenizer here"}, "input_ids is required"),
        ({"input_ids": [1], "rid": 5}, "rid 5 is not a string"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens is -1"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens is True"),
        (sp(top_p=0), "top_p is 0"),
        (sp(temperature="hot"), "temperature"),
        (sp(stop_token_ids=[11]), "stop_token_ids"),
        (sp(sampling_seed=2**63), "sampling_seed"),
        (sp(custom_params=[1]), "custom_params"),
        ({"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 9}}, "exceed the model's 16"),
    ],
)
def test_a_model_bound_server_refuses(body: dict[str, object], reason: str) -> None:
    with pytest.raises(BadRequest, match=reason):
        parse_generate(raw(body), vocab_size=10, max_positions=16)


def test_an_hsx_request_is_parsed_with_its_marks() -> None:
    req = parse_generate(raw(generate_body("r-1", "w0", [3, 4, 5])), vocab_size=10)
    assert req == GenerateRequest(
        rid="r-1",
        input_ids=[3, 4, 5],
        max_new_tokens=0,
        ns="w0",
        custom_params={"hsx_ns": "w0"},
        prompt_tokens=3,
    )


def test_ordinary_requests_get_a_rid_and_text_only_where_allowed() -> None:
    plain = parse_generate(raw({"input_ids": [1, 2]}))
    assert plain.ns is None and len(plain.rid) == 32 and plain.max_new_tokens == 128
    text = parse_generate(raw({"text": "hello there you"}), text_prompts=True)
    assert (text.input_ids, text.prompt_tokens) == ([], 3)
    with pytest.raises(BadRequest, match="input_ids is required"):
        parse_generate(raw({"text": "hello"}))
    marked_text = generate_body("r", "w0", [1]) | {"text": "hi", "input_ids": None}
    with pytest.raises(BadRequest, match="input_ids is required"):  # never for an hsx request
        parse_generate(raw(marked_text), text_prompts=True)


def test_answers_are_sglangs() -> None:
    body = generate_response("r", 4)
    check_response(body, rid="r", num_tokens=4)
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    stopped = generate_response("r", 4, [7, 2], stopped=True)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert error_body("no", 400) == {"error": {"message": "no", "code": 400}}
    assert model_info("m", 8, (1, 3), extra=1) == {
        "model_path": "m",
        "is_generation": True,
        "hidden_size": 8,
        "hsx_aux_layers": [1, 3],
        "extra": 1,
    }


def test_a_taken_port_is_one_line_naming_the_address_and_the_option() -> None:
    with socket.socket() as owner:
        owner.bind(("127.0.0.1", 0))
        owner.listen(1)
        port = owner.getsockname()[1]
        with pytest.raises(ArgumentError) as caught:
            bind_listener("127.0.0.1", port)
    message = str(caught.value)
    assert message.startswith(f"argument --port: 127.0.0.1:{port} is in use")
    assert "free --port" in message and "\n" not in message


def test_a_free_port_is_bound_and_listening() -> None:
    sock = bind_listener("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the listener's backlog takes it
    finally:
        sock.close()


def test_a_host_that_names_no_address_is_one_line() -> None:
    with pytest.raises(ArgumentError, match=r"cannot listen on no-such-host\.invalid:0"):
        bind_listener("no-such-host.invalid", 0)
