"""What "aux layer k" means in each tool, and the draft-config ids that make SGLang serve
the layers a dataset holds.

hsx numbers layers like SGLang's ``layers_to_capture``: k is the residual stream entering
decoder layer k (Hugging Face ``hidden_states[k]``). A drafter's config names its layers
with ``eagle_aux_hidden_state_layer_ids``, which SGLang 0.5.23 maps to ``layers_to_capture``
through the target model's ``set_eagle3_layers_to_capture``, differently per family:

- ``plus_one``: ``[i + 1 for i in ids]`` (Llama, Qwen2/3, Qwen3-MoE, Gemma 3/4, GLM-4-MoE,
  MiniMax, EXAONE, …);
- ``plus_one_if_first_is_one``: ``+1`` only when ``ids[0] == 1``, otherwise the ids as given
  (DeepSeek-V2/V3, Kimi-K2.x, GLM-4-MoE-Lite);
- ``as_is_if_max_is_num_layers``: the ids as given when ``max(ids) == num_layers``,
  otherwise ``+1`` (gpt-oss);
- ``plus_one_default_too``: ``+1``, and its default is shifted as well (MiniMax-M3-VL).

Without ids every other family captures ``[2, n // 2, n - 3]``. The table is keyed by the
``architectures`` entry of the model's ``config.json`` (what SGLang picks its model class
by) and proved against the installed SGLang's own methods in the real-SGLang test tier
(tests/real_sglang/test_layer_rules.py), which also fails on a class with the method that
is neither in :data:`SGLANG_RULES` nor in :data:`SGLANG_UNSUPPORTED`.

Pure: no torch, no SGLang; ``hsx check`` and ``hsx export`` use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Rule = Literal[
    "plus_one", "plus_one_if_first_is_one", "as_is_if_max_is_num_layers", "plus_one_default_too"
]


def _rules(rule: Rule, archs: str) -> dict[str, Rule]:
    return dict.fromkeys(archs.split(), rule)


# SGLang 0.5.23 target-model classes (config.json "architectures", as registered in
# sglang.srt.models) → their rule. Each entry is proved in tests/real_sglang against the
# installed SGLang's own method; a class that gains or changes one fails there.
SGLANG_RULES: Mapping[str, Rule] = {
    **_rules(
        "plus_one",
        # Llama-style families (llama.py and the classes built on it).
        "LlamaForCausalLM Llama4ForCausalLM Llama4ForConditionalGeneration MistralForCausalLM "
        "Ministral3ForCausalLM Phi3ForCausalLM InternLM3ForCausalLM IQuestCoderForCausalLM "
        "TeleFLMForCausalLM ApertusForCausalLM "
        # Qwen families, text and vision-language (Qwen3-VL's class also serves Qwen3.5,
        # InternS1-Pro, InternS2 and Cosmos3).
        "Qwen2ForCausalLM Qwen2MoeForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM "
        "Qwen3NextForCausalLM Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM MellumForCausalLM "
        "Qwen2_5_VLForConditionalGeneration Qwen3VLForConditionalGeneration "
        "Qwen3VLMoeForConditionalGeneration Qwen3_5ForConditionalGeneration "
        "Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration "
        "InternS1ProForConditionalGeneration InternS2MobiusForConditionalGeneration "
        "InternS2PreviewForConditionalGeneration Cosmos3ForConditionalGeneration "
        # Gemma 3/4, GLM-4-MoE, GLM-5-Next, MiniMax, EXAONE, Bailing/Sarvam, LongCat.
        "Gemma3ForCausalLM Gemma3ForConditionalGeneration Gemma4ForCausalLM "
        "Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration "
        "Glm4MoeForCausalLM Glm5NextForConditionalGeneration MiniMaxM2ForCausalLM "
        "MiniMaxM3SparseForCausalLM ExaoneMoEForCausalLM ExaoneMoeForCausalLM "
        "BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM "
        "SarvamMoEForCausalLM LongcatFlashForCausalLM",
    ),
    **_rules(
        "plus_one_if_first_is_one",
        # deepseek_v2.py and the classes built on it (Kimi-K2.x hands the ids to its
        # DeepSeek-V3 text model), GLM-4-MoE-Lite.
        "DeepseekV2ForCausalLM DeepseekV3ForCausalLM DeepseekV32ForCausalLM "
        "KimiK25ForConditionalGeneration GlmMoeDsaForCausalLM MistralLarge3ForCausalLM "
        "Glm4MoeLiteForCausalLM",
    ),
    **_rules("as_is_if_max_is_num_layers", "GptOssForCausalLM"),
    # MiniMax-M3's vision-language class shifts its default layers too.
    **_rules("plus_one_default_too", "MiniMaxM3SparseForConditionalGeneration"),
}

# Classes of SGLang 0.5.23 that have a set_eagle3_layers_to_capture but get no rule here,
# and why. The real-SGLang tier fails on a class that is in neither mapping.
SGLANG_UNSUPPORTED: Mapping[str, str] = {
    # Draft, MTP and NextN heads: what is trained, never the target hsx dumps from.
    **dict.fromkeys(
        [
            "LlamaForCausalLMEagle",
            "LlamaForCausalLMEagle3",
            "MistralForCausalLMEagle",
            "Qwen2ForCausalLMEagle",
            "MistralLarge3ForCausalLMEagle",
            "DeepseekV3ForCausalLMNextN",
            "GlmMoeDsaForCausalLMNextN",
            "Glm4MoeForCausalLMNextN",
            "Glm4MoeLiteForCausalLMNextN",
            "Glm5NextForConditionalGenerationNextN",
            "LongcatFlashForCausalLMNextN",
            "ExaoneMoEForCausalLMMTP",
            "Qwen3MoeForCausalLMMTP",
            "Qwen3NextForCausalLMMTP",
            "Gemma4AssistantForCausalLM",
            "Gemma4UnifiedAssistantForCausalLM",
        ],
        "a draft/MTP head, not a target model",
    ),
    "EmbeddingGemmaModel": "an embedding model: nothing to draft for",
    # Hands the ids to a MindSpore model outside SGLang, whose numbering SGLang's code
    # does not show.
    "MindSporeForCausalLM": "SGLang passes the ids to a MindSpore model outside its code",
}


def default_capture(num_layers: int) -> tuple[int, ...]:
    """What SGLang captures when the draft config names no ids."""
    return (2, num_layers // 2, num_layers - 3)


def sglang_capture(rule: Rule, draft_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """``layers_to_capture`` that SGLang 0.5.23 sets for ``draft_ids`` under ``rule``."""
    if draft_ids is None:
        default = default_capture(num_layers)
        return tuple(k + 1 for k in default) if rule == "plus_one_default_too" else default
    ids = list(draft_ids)
    if rule == "plus_one_if_first_is_one" and not (ids and ids[0] == 1):
        return tuple(ids)
    if rule == "as_is_if_max_is_num_layers" and ids and max(ids) == num_layers:
        return tuple(ids)
    return tuple(i + 1 for i in ids)


@dataclass(frozen=True)
class DraftIds:
    """The answer for one model: the ids to write into the drafter's config, or why none
    exist. ``ids`` is None with ``reason`` set when the family's rule cannot express the
    dataset's layers (or the family is unknown)."""

    architecture: str
    rule: Rule | None
    ids: tuple[int, ...] | None
    reason: str = ""

    def describe(self, aux_layers: Sequence[int]) -> str:
        layers = ", ".join(map(str, aux_layers))
        if self.ids is None:
            return f"{self.architecture}: no draft-config ids give layers [{layers}]: {self.reason}"
        ids = ", ".join(map(str, self.ids))
        return (
            f'{self.architecture}: put "eagle_aux_hidden_state_layer_ids": [{ids}] in the '
            f"drafter's config so SGLang 0.5.23 captures layers [{layers}] (hsx numbering: "
            "the residual stream entering layer k)"
        )


def draft_ids(architecture: str, aux_layers: Sequence[int], num_layers: int) -> DraftIds:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang capture ``aux_layers``."""
    rule = SGLANG_RULES.get(architecture)
    if rule is None:
        why = SGLANG_UNSUPPORTED.get(architecture)
        if why is not None:
            return DraftIds(architecture, None, None, f"not supported by hsx: {why}")
        known = ", ".join(sorted(SGLANG_RULES))
        return DraftIds(architecture, None, None, f"unknown to hsx's table (known: {known})")
    want = tuple(aux_layers)
    for candidate in _candidates(want, num_layers):
        if min(candidate, default=0) >= 0 and sglang_capture(rule, candidate, num_layers) == want:
            return DraftIds(architecture, rule, candidate)
    return DraftIds(architecture, rule, None, f"rule {rule!r} maps no ids onto them")


def _candidates(want: tuple[int, ...], num_layers: int) -> list[tuple[int, ...]]:
    # Every rule is "as is" or "+1", so the answer is one of these two.
    del num_layers
    return [tuple(k - 1 for k in want), want]


def architecture_of(config: Mapping[str, Any]) -> str | None:
    """The model class SGLang would pick from a ``config.json`` mapping."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def num_layers_of(config: Mapping[str, Any]) -> int | None:
    """``num_hidden_layers`` of the decoder (multimodal configs nest it in ``text_config``)."""
    for scope in (config, config.get("text_config")):
        if isinstance(scope, Mapping):
            n = scope.get("num_hidden_layers")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None
