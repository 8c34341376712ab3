"""The SGLang settings the hook refuses to start with, each with its fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hsx_async.errors import ConfigError
from hsx_async.server.hook_core import HookConfig
from hsx_async.server.sglang.settings import ServerSettings, check_server_settings, server_problems
from tests.server.passes import LAYERS

GOOD = ServerSettings(
    radix_cache=False,
    attn_dp_size=1,
    pp_size=1,
    two_batch_overlap=False,
    moe_a2a_backend="none",
    aux_capture="eagle3",
    aux_layer_ids_flag=None,
    disaggregation_mode="null",
)
CFG = HookConfig(dump_root=Path("/dev/shm/hsx"), aux_layers=LAYERS, model="m", server="test")


def test_good_settings_pass() -> None:
    check_server_settings(GOOD, CFG)
    check_server_settings(dataclasses.replace(GOOD, aux_layer_ids_flag=(1, 4)), CFG)


@pytest.mark.parametrize(("dp", "attn_tp"), [(8, 1), (2, 1), (1, 8), (1, 1)])
def test_dp_attention_with_attention_tp_1_is_allowed(dp: int, attn_tp: int) -> None:
    """tp8/dp8: each DP leader sees only its own requests and unpadded local rows."""
    assert (
        server_problems(dataclasses.replace(GOOD, attn_dp_size=dp, attn_tp_size=attn_tp), CFG) == []
    )


def test_dp_attention_with_attention_tp_above_1_names_the_fix() -> None:
    bad = dataclasses.replace(GOOD, attn_dp_size=2, attn_tp_size=4)
    [problem] = server_problems(bad, CFG)
    assert "pad rows" in problem and "--tp 8 --dp 8 --enable-dp-attention" in problem
    assert "one server per" not in problem


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"radix_cache": True}, "--disable-radix-cache"),
        ({"attn_dp_size": 2, "attn_tp_size": 2}, "attention-TP size 2"),
        ({"pp_size": 2}, "pipeline parallelism"),
        ({"two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"moe_a2a_backend": "deepep"}, "DeepEP"),
        ({"moe_a2a_backend": "deepep_v2"}, "DeepEP"),
        ({"disaggregation_mode": "prefill"}, "PD disaggregation"),
        ({"aux_capture": None}, "--enable-return-aux-hidden-states"),
        ({"aux_capture": "dflash"}, "EAGLE3"),
        ({"aux_layer_ids_flag": (1, 2, 3)}, "--return-aux-hidden-state-layer-ids names 3"),
    ],
)
def test_bad_settings_are_refused(change: dict[str, object], fragment: str) -> None:
    bad = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    problems = server_problems(bad, CFG)
    assert len(problems) == 1
    assert fragment in problems[0]
    with pytest.raises(ConfigError, match="cannot dump hidden states"):
        check_server_settings(bad, CFG)


def test_all_problems_reported_at_once() -> None:
    bad = dataclasses.replace(GOOD, radix_cache=True, pp_size=4)
    with pytest.raises(ConfigError) as info:
        check_server_settings(bad, CFG)
    assert "--disable-radix-cache" in str(info.value)
    assert "--pp-size 4" in str(info.value)


# The hook's own capture path (SGLang 0.5.14-0.5.22: no capture-only aux mode there).
HOOK_PATH = dataclasses.replace(GOOD, capture="hook", aux_capture=None)


@pytest.mark.parametrize("algorithm", [None, "", "NONE"])
def test_the_hook_path_needs_no_aux_capture_setting(algorithm: str | None) -> None:
    assert (
        server_problems(dataclasses.replace(HOOK_PATH, speculative_algorithm=algorithm), CFG) == []
    )


def test_the_hook_path_refuses_a_speculative_algorithm() -> None:
    settings = dataclasses.replace(HOOK_PATH, speculative_algorithm="EAGLE3", radix_cache=True)
    with pytest.raises(ConfigError) as refused:
        check_server_settings(settings, CFG)
    message = str(refused.value)
    assert "--disable-radix-cache" in message
    assert "drop --speculative-algorithm EAGLE3 (and its draft model)" in message
    assert "before 0.5.23" in message and "--enable-return-aux-hidden-states" not in message


def test_the_hook_path_refuses_dp_attention_it_was_never_run_under() -> None:
    settings = dataclasses.replace(HOOK_PATH, attn_dp_size=8, attn_tp_size=1)
    [problem] = server_problems(settings, CFG)
    assert problem.startswith("DP attention (attention DP size 8) with the hsx hook is checked")
    assert "drop --enable-dp-attention on this release" in problem
    # The server path (0.5.23) runs it (tests/real_sglang/test_real_deepseek.py).
    assert (
        server_problems(dataclasses.replace(settings, capture="server", aux_capture="eagle3"), CFG)
        == []
    )
