"""The family rules and their inverse (the real-SGLang tier proves the rules against the
installed SGLang's own ``set_eagle3_layers_to_capture``)."""

from __future__ import annotations

import pytest

from hsx_async.layer_ids import (
    SGLANG_RULES,
    SGLANG_UNSUPPORTED,
    architecture_of,
    default_capture,
    draft_ids,
    num_layers_of,
    sglang_capture,
)


def test_llama_ids_are_one_below_the_captured_layers() -> None:
    got = draft_ids("LlamaForCausalLM", (2, 16, 29), 32)
    assert got.ids == (1, 15, 28)
    assert sglang_capture("plus_one", got.ids, 32) == (2, 16, 29)
    assert "[1, 15, 28]" in got.describe((2, 16, 29))


def test_deepseek_ids_are_as_given_unless_the_first_is_one() -> None:
    # Kimi-K2.x / DeepSeek-V3 (61 layers): the seed job's "3, 31, 59" are captured as given.
    assert draft_ids("DeepseekV3ForCausalLM", (3, 31, 59), 61).ids == (3, 31, 59)
    # Layer 2 first: ids [1, ...] trigger the +1 branch.
    assert draft_ids("DeepseekV3ForCausalLM", (2, 30, 58), 61).ids in {(1, 29, 57), (2, 30, 58)}
    assert sglang_capture("plus_one_if_first_is_one", (1, 29, 57), 61) == (2, 30, 58)
    assert sglang_capture("plus_one_if_first_is_one", (2, 30, 58), 61) == (2, 30, 58)
    # Layer 1 first cannot be expressed: [0, ...] is as-is and [1, ...] is shifted.
    none = draft_ids("DeepseekV3ForCausalLM", (1, 30, 58), 61)
    assert none.ids is None
    assert "maps no ids" in none.describe((1, 30, 58))


def test_gpt_oss_keeps_ids_that_reach_the_last_layer() -> None:
    assert sglang_capture("as_is_if_max_is_num_layers", (2, 12, 24), 24) == (2, 12, 24)
    assert sglang_capture("as_is_if_max_is_num_layers", (1, 11, 20), 24) == (2, 12, 21)
    assert draft_ids("GptOssForCausalLM", (2, 12, 21), 24).ids == (1, 11, 20)


def test_unknown_family_says_so() -> None:
    got = draft_ids("MysteryForCausalLM", (2, 3, 4), 8)
    assert got.ids is None and got.rule is None
    assert "unknown to hsx's table" in got.describe((2, 3, 4))


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_every_family_round_trips_its_default_layers(arch: str) -> None:
    want = default_capture(40)
    got = draft_ids(arch, want, 40)
    assert got.ids is not None
    assert sglang_capture(SGLANG_RULES[arch], got.ids, 40) == want


def test_config_lookups() -> None:
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 61},
    }
    assert architecture_of(cfg) == "KimiK25ForConditionalGeneration"
    assert num_layers_of(cfg) == 61
    assert architecture_of({}) is None and num_layers_of({"num_hidden_layers": True}) is None


def test_minimax_m3_vl_shifts_its_default_too() -> None:
    assert sglang_capture("plus_one_default_too", None, 24) == (3, 13, 22)
    assert sglang_capture("plus_one_default_too", (1, 11, 20), 24) == (2, 12, 21)
    got = draft_ids("MiniMaxM3SparseForConditionalGeneration", (3, 13, 22), 24)
    assert got.ids == (2, 12, 21)


def test_unsupported_class_says_why() -> None:
    got = draft_ids("LlamaForCausalLMEagle3", (2, 3, 4), 8)
    assert got.ids is None and got.rule is None
    assert "not supported by hsx: a draft/MTP head" in got.describe((2, 3, 4))
    assert not set(SGLANG_RULES) & set(SGLANG_UNSUPPORTED)
