"""hsx's per-family layer-id rules (:mod:`hsx_async.layer_ids`) against the installed
SGLang's own ``set_eagle3_layers_to_capture``: each family's method is called on a
stand-in object (``sglang_probe.py``, run by the SGLang environment's Python), and every
class in ``sglang/srt/models`` that has the method must be in hsx's table or in its
explicit "not supported" list, so a drift in SGLang fails here."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.layer_ids import SGLANG_RULES, SGLANG_UNSUPPORTED, draft_ids, sglang_capture

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(300)]

PROBE = Path(__file__).with_name("sglang_probe.py")
# Multimodal classes that hand the ids to a text model: the class SGLang builds for it
# (their __init__), whose own method the probe runs behind the outer one.
INNER = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}
# Decoder stacks with a setter of their own, which their model class calls with the list
# it already mapped: they must store it as given (checked below), so they have no rule.
STACK_SETTERS = (
    "qwen2_moe.Qwen2MoeModel",
    "qwen3_next.Qwen3NextModel",
    "qwen3_5.Qwen3_5ForCausalLM",  # the stack of Qwen3.5 (qwen3_5_text.py holds the model)
)
# (ids, num_layers): the default, each rule's branches (first id 1 or not, the last layer
# reached or not), one id, and a 61-layer model (DeepSeek-V3 / Kimi-K2 size).
CASES: list[tuple[list[int] | None, int]] = [
    (None, 24),
    (None, 61),
    ([1, 11, 20], 24),
    ([2, 12, 21], 24),
    ([0, 5, 9], 24),
    ([4], 24),
    ([5, 10, 24], 24),
    ([1, 29, 57], 61),
    ([3, 31, 59], 61),
    ([2, 30, 58], 61),
]


@pytest.fixture(scope="module")
def probe(sglang_py: Path) -> dict[str, Any]:
    request = {
        "archs": sorted(SGLANG_RULES),
        "inner": INNER,
        "stacks": list(STACK_SETTERS),
        "cases": CASES,
    }
    done = subprocess.run(
        [str(sglang_py), str(PROBE), orjson.dumps(request).decode()],
        capture_output=True,
        timeout=240,
        check=False,
    )
    out = done.stdout.decode(errors="replace")
    lines = [line for line in out.splitlines() if line.startswith("HSX-PROBE ")]
    assert done.returncode == 0 and lines, (
        f"probe failed ({done.returncode}):\n{out[-2000:]}\n{done.stderr.decode()[-4000:]}"
    )
    result: dict[str, Any] = orjson.loads(lines[-1].removeprefix("HSX-PROBE "))
    return result


def test_the_probed_sglang_is_the_checked_version(probe: dict[str, Any]) -> None:
    assert probe["version"] == "0.5.23"


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_family_rule_equals_sglangs_own_method(probe: dict[str, Any], arch: str) -> None:
    rows = probe["results"][arch]
    assert rows is not None, f"{arch} is not registered in SGLang or has no such method"
    rule = SGLANG_RULES[arch]
    for ids, n, got in rows:
        want = list(sglang_capture(rule, ids, n))
        assert got == want, f"{arch} ({rule}), ids {ids}, {n} layers: SGLang sets {got}"


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_printed_ids_make_sglang_capture_the_layers(probe: dict[str, Any], arch: str) -> None:
    """The inverse, through SGLang's own result: the ids ``draft_ids`` prints for layers
    (2, 12, 21) of a 24-layer model are ids the probe fed SGLang and it captured those."""
    answer = draft_ids(arch, (2, 12, 21), 24)
    assert answer.ids is not None
    fed = {tuple(ids): got for ids, n, got in probe["results"][arch] if ids and n == 24}
    assert answer.ids in fed, f"{arch}: ids {answer.ids} not among the probed cases"
    assert fed[answer.ids] == [2, 12, 21]


def test_every_sglang_class_with_the_method_is_accounted_for(probe: dict[str, Any]) -> None:
    registered = set(probe["registered"])
    unknown = sorted(registered - set(SGLANG_RULES) - set(SGLANG_UNSUPPORTED))
    assert not unknown, (
        f"SGLang 0.5.23 classes with set_eagle3_layers_to_capture that hsx neither maps nor "
        f"lists as unsupported: {unknown} (add each to hsx_async/layer_ids.py)"
    )
    stale = sorted((set(SGLANG_RULES) | set(SGLANG_UNSUPPORTED)) - registered)
    assert not stale, f"hsx lists classes SGLang does not register with the method: {stale}"
    owners = {owner.removeprefix("sglang.srt.models.") for owner in probe["registered"].values()}
    defining = set(probe["defining"])
    # Every class defining the method in the source is a registered family's, a stack
    # setter, or a class of a module that does not import on this CPU (none today).
    loose = sorted(defining - owners - set(STACK_SETTERS))
    assert not loose, f"classes defining the method that no check covers: {loose}"


def test_stack_setters_store_the_list_as_given(probe: dict[str, Any]) -> None:
    assert set(probe["stacks"]) == set(STACK_SETTERS)
    for name, (stored, flagged) in probe["stacks"].items():
        assert stored == [1, 4, 6] and flagged == [1, 4, 6], name
