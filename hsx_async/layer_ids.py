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
  otherwise ``+1`` (gpt-oss).

Without ids every family captures ``[2, n // 2, n - 3]``. The table is keyed by the
``architectures`` entry of the model's ``config.json`` (what SGLang picks its model class
by) and proved against the installed SGLang's own methods in the real-SGLang test tier.

Pure: no torch, no SGLang; ``hsx check`` and ``hsx export`` use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Rule = Literal["plus_one", "plus_one_if_first_is_one", "as_is_if_max_is_num_layers"]

# SGLang 0.5.23 model classes (config.json "architectures") → their mapping rule.
SGLANG_RULES: Mapping[str, Rule] = {
    "LlamaForCausalLM": "plus_one",
    "Qwen2ForCausalLM": "plus_one",
    "Qwen3ForCausalLM": "plus_one",
    "Qwen3MoeForCausalLM": "plus_one",
    "Gemma3ForCausalLM": "plus_one",
    "Gemma4ForCausalLM": "plus_one",
    "Glm4MoeForCausalLM": "plus_one",
    "MiniMaxM2ForCausalLM": "plus_one",
    "ExaoneMoEForCausalLM": "plus_one",
    "DeepseekV2ForCausalLM": "plus_one_if_first_is_one",
    "DeepseekV3ForCausalLM": "plus_one_if_first_is_one",
    "Glm4MoeLiteForCausalLM": "plus_one_if_first_is_one",
    "GptOssForCausalLM": "as_is_if_max_is_num_layers",
}


def default_capture(num_layers: int) -> tuple[int, ...]:
    """What SGLang captures when the draft config names no ids."""
    return (2, num_layers // 2, num_layers - 3)


def sglang_capture(rule: Rule, draft_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """``layers_to_capture`` that SGLang 0.5.23 sets for ``draft_ids`` under ``rule``."""
    if draft_ids is None:
        return default_capture(num_layers)
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
