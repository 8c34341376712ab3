"""Every server rule is written once and applied everywhere (issue 25): the aux-layer rule,
the "is this a valid hsx request?" rule and the HSX_DUMP_ROOT read give the same answer,
with the same reason text, at every entry point that applies them — the client's config,
both production hooks, the reference server and the fake server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from hsx_async.cli import build_parser
from hsx_async.config import config_from_dict
from hsx_async.errors import ConfigError, HsxRequestError
from hsx_async.protocol import check_aux_layers, check_hsx_request, generate_body
from hsx_async.server.fake.options import FakeOptions
from hsx_async.server.front import BadRequest, parse_generate
from hsx_async.server.hook_core import DumpRegistry, HookConfig, ReqView, dump_root_from_env
from hsx_async.server.reference.server import options_from_args as reference_options
from hsx_async.server.reference.server import parse_aux_layers as reference_layers
from hsx_async.server.sglang.hook import apply_capture_layers, wants_dump
from hsx_async.server.vllm.core import layer_plan, marked_target

# --------------------------------------------------------------------------------------
# The aux-layer rule
# --------------------------------------------------------------------------------------

N = 61  # a DeepSeek-V3-sized model


def _client(layers: list[int]) -> None:
    raw = {
        "server": {"urls": ["http://127.0.0.1:30000"]},
        "input": {"path": "s.jsonl"},
        "output": {"dir": "/tmp/o"},
        "model": {"hidden_size": 16, "aux_layers": layers},
    }
    config_from_dict(raw, base=Path("/tmp"))


def _sglang_env(layers: list[int]) -> None:
    env = {"HSX_AUX_LAYERS": ",".join(map(str, layers))}
    HookConfig.from_env(env, server="sglang test")


def _sglang_capture(layers: list[int]) -> None:
    stack = SimpleNamespace(layers_to_capture=[2, 30, 58], layers=[SimpleNamespace()] * N)
    apply_capture_layers(stack, layers)


def _vllm(layers: list[int]) -> None:
    layer_plan([*layers, N], N, 7168)


def _reference(layers: list[int]) -> None:
    reference_layers(",".join(map(str, layers)))


def _fake(layers: list[int]) -> None:
    FakeOptions(aux_layers=tuple(layers))


ENTRY_POINTS: dict[str, Callable[[list[int]], None]] = {
    "client config": _client,
    "SGLang hook, HSX_AUX_LAYERS": _sglang_env,
    "SGLang hook, capture": _sglang_capture,
    "vLLM connector": _vllm,
    "reference server": _reference,
    "fake server": _fake,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(
    "layers", [[30, 2, 58], [2, 30, 30], [-1, 2], []], ids=["order", "twice", "negative", "empty"]
)
def test_every_side_refuses_what_the_rule_refuses_with_its_reason(
    entry: str, layers: list[int]
) -> None:
    """Before issue 25 the client accepted [30, 2, 58], which both hooks refused; the fake
    server checked only >= 0, the reference server not the order."""
    with pytest.raises(ConfigError) as rule:
        check_aux_layers(layers, key="k")
    reason = str(rule.value).removeprefix("config key 'k': ")
    if not layers and entry == "SGLang hook, HSX_AUX_LAYERS":
        reason = "is not set"  # an empty variable means "unset" there
    if not layers and entry == "vLLM connector":
        reason = "hsx needs the aux layers followed by 61"  # vLLM's ids end with n
    with pytest.raises(ConfigError) as got:
        ENTRY_POINTS[entry](layers)
    assert reason in str(got.value)


@pytest.mark.parametrize("entry", ["SGLang hook, capture", "vLLM connector"])
def test_where_the_model_size_is_known_the_range_is_checked(entry: str) -> None:
    with pytest.raises(ConfigError, match=f"does not fit a model with {N} layers") as got:
        ENTRY_POINTS[entry]([2, 30, N])
    assert "e.g. [2, 30, 58]" in str(got.value)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_side_accepts_what_the_rule_accepts(entry: str) -> None:
    ENTRY_POINTS[entry]([2, 30, 58])


# --------------------------------------------------------------------------------------
# "Is this a valid hsx request?"
# --------------------------------------------------------------------------------------

BAD_REQUESTS = [
    pytest.param("../x", "r1", 0, id="ns"),
    pytest.param("w0", "a/b", 0, id="rid"),
    pytest.param("w0", "r1\n", 0, id="rid-newline"),
    pytest.param("w0", "r1", 5, id="not-prefill-only"),
]


def _sglang_reason(ns: str, rid: str, max_new: int) -> str:
    view = ReqView(rid=rid, ns=ns, num_tokens=2, max_new_tokens=max_new, start=0, rows=2)
    assert not wants_dump(rid, {"hsx_ns": ns}, max_new)
    [reject] = DumpRegistry().plan([view]).rejects
    return reject.reason


def _http_reason(body: dict[str, Any], **model: Any) -> str:
    """What the built-in servers' one front end answers (400) to ``body``."""
    with pytest.raises(BadRequest) as got:
        parse_generate(orjson.dumps(body), **model)
    return str(got.value)


@pytest.mark.parametrize(("ns", "rid", "max_new"), BAD_REQUESTS)
def test_every_hook_and_server_refuses_a_bad_request_with_the_one_reason(
    ns: str, rid: str, max_new: int
) -> None:
    with pytest.raises(HsxRequestError) as rule:
        check_hsx_request(ns, rid, max_new_tokens=max_new)
    reason = str(rule.value)
    body = generate_body(rid, ns, [1, 2])
    body["sampling_params"]["max_new_tokens"] = max_new
    reasons = {
        "sglang": _sglang_reason(ns, rid, max_new),
        "fake server": _http_reason(body, text_prompts=True),
        "reference server": _http_reason(body, vocab_size=10, max_positions=64),
    }
    if max_new == 0:  # the vLLM form has no prefill-only field
        vllm = marked_target({"hsx_ns": ns, "hsx_rid": rid})
        assert isinstance(vllm, str)
        reasons["vllm"] = vllm
    assert reasons == dict.fromkeys(reasons, reason)


def test_a_good_request_passes_everywhere() -> None:
    assert check_hsx_request("w0", "r1", max_new_tokens=0) == ("w0", "r1")
    assert wants_dump("r1", {"hsx_ns": "w0"}, 0)
    assert DumpRegistry().plan([ReqView("r1", "w0", 2, 0, 0, 2)]).rejects == []
    assert parse_generate(orjson.dumps(generate_body("r1", "w0", [1, 2]))).ns == "w0"
    assert not isinstance(marked_target({"hsx_ns": "w0", "hsx_rid": "r1"}), str)


# --------------------------------------------------------------------------------------
# HSX_DUMP_ROOT, read one way
# --------------------------------------------------------------------------------------


def _reference_root(env: dict[str, str]) -> Path:
    args = build_parser().parse_args(["reference-server"])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HSX_DUMP_ROOT", raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        return reference_options(args).dump_root


def _sglang_root(env: dict[str, str]) -> Path:
    return HookConfig.from_env({"HSX_AUX_LAYERS": "1", **env}, server="s").dump_root


ROOT_READERS: dict[str, Callable[[dict[str, str]], Path]] = {
    "the one read": dump_root_from_env,
    "SGLang hook": _sglang_root,
    "reference server": _reference_root,
}


@pytest.mark.parametrize("reader", ROOT_READERS)
@pytest.mark.parametrize(
    ("env", "root"),
    [
        ({}, "/dev/shm/hsx"),
        ({"HSX_DUMP_ROOT": " "}, "/dev/shm/hsx"),
        ({"HSX_DUMP_ROOT": "/x/y"}, "/x/y"),
    ],
)
def test_the_dump_root_is_read_one_way(reader: str, env: dict[str, str], root: str) -> None:
    """It was read three ways: blank as the default (SGLang hook), blank as an error (the
    vLLM connector, which now calls dump_root_from_env), and a read of its own (the
    reference server's --dump-root default)."""
    assert ROOT_READERS[reader](env) == Path(root)


@pytest.mark.parametrize("reader", ROOT_READERS)
def test_a_relative_dump_root_is_refused_everywhere(reader: str) -> None:
    with pytest.raises(ConfigError, match="'shm/x' is relative; give the absolute dump root"):
        ROOT_READERS[reader]({"HSX_DUMP_ROOT": "shm/x"})
