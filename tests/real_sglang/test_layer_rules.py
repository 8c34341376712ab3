"""hsx's per-family layer-id rules (:mod:`hsx_async.layer_ids`) against the installed
SGLang's own ``set_eagle3_layers_to_capture``: each family's method is called on a
stand-in object (``sglang_probe.py``, run by the SGLang environment's Python), and every
class in ``sglang/srt/models`` that has the method must be in hsx's table or in its
explicit "not supported" list, so a drift in SGLang fails here."""

from __future__ import annotations

from typing import Any

import pytest

from hsx_async.layer_ids import SGLANG_RULES, SGLANG_UNSUPPORTED, draft_ids, sglang_capture
from tests.real_sglang.layer_probe import STACK_SETTERS

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(300)]


def test_the_probed_sglang_is_the_checked_version(
    layer_probe: dict[str, Any], sglang_version: str
) -> None:
    assert layer_probe["version"] == sglang_version


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_family_rule_equals_sglangs_own_method(layer_probe: dict[str, Any], arch: str) -> None:
    rows = layer_probe["results"][arch]
    assert rows is not None, f"{arch} is not registered in SGLang or has no such method"
    rule = SGLANG_RULES[arch]
    for ids, n, got in rows:
        want = list(sglang_capture(rule, ids, n))
        assert got == want, f"{arch} ({rule}), ids {ids}, {n} layers: SGLang sets {got}"


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_printed_ids_make_sglang_capture_the_layers(layer_probe: dict[str, Any], arch: str) -> None:
    """The inverse, through SGLang's own result: the ids ``draft_ids`` prints for layers
    (2, 12, 21) of a 24-layer model are ids the probe fed SGLang and it captured those."""
    answer = draft_ids(arch, (2, 12, 21), 24)
    assert answer.ids is not None
    fed = {tuple(ids): got for ids, n, got in layer_probe["results"][arch] if ids and n == 24}
    assert answer.ids in fed, f"{arch}: ids {answer.ids} not among the probed cases"
    assert fed[answer.ids] == [2, 12, 21]


def test_every_sglang_class_with_the_method_is_accounted_for(layer_probe: dict[str, Any]) -> None:
    registered = set(layer_probe["registered"])
    unknown = sorted(registered - set(SGLANG_RULES) - set(SGLANG_UNSUPPORTED))
    assert not unknown, (
        f"SGLang 0.5.23 classes with set_eagle3_layers_to_capture that hsx neither maps nor "
        f"lists as unsupported: {unknown} (add each to hsx_async/layer_ids.py)"
    )
    stale = sorted((set(SGLANG_RULES) | set(SGLANG_UNSUPPORTED)) - registered)
    assert not stale, f"hsx lists classes SGLang does not register with the method: {stale}"
    owners = {
        owner.removeprefix("sglang.srt.models.") for owner in layer_probe["registered"].values()
    }
    defining = set(layer_probe["defining"])
    # Every class defining the method in the source is a registered family's, a stack
    # setter, or a class of a module that does not import on this CPU (none today).
    loose = sorted(defining - owners - set(STACK_SETTERS))
    assert not loose, f"classes defining the method that no check covers: {loose}"


def test_stack_setters_store_the_list_as_given(layer_probe: dict[str, Any]) -> None:
    assert set(layer_probe["stacks"]) == set(STACK_SETTERS)
    for name, (stored, flagged) in layer_probe["stacks"].items():
        assert stored == [1, 4, 6] and flagged == [1, 4, 6], name
