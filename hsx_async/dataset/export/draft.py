"""``draft-config.json``, written beside every export: the ``eagle_config`` block of the
drafter's config with ``eagle_aux_hidden_state_layer_ids`` in SGLang's (and SpecForge's)
numbering for the target's family (:mod:`hsx_async.layer_ids`), so serving captures exactly
the dataset's layers."""

from __future__ import annotations

from typing import Any

from hsx_async.dataset.export.format import ExportFormat
from hsx_async.dataset.export.plan import DatasetFacts
from hsx_async.dataset.target import TargetModel
from hsx_async.layer_ids import DraftIds, draft_ids

DRAFT_CONFIG = "draft-config.json"


def draft_ids_for(target: TargetModel | None, facts: DatasetFacts) -> DraftIds | None:
    if facts.aux_layers is None:
        return None
    if target is None or target.architecture is None or target.num_layers is None:
        return None
    return draft_ids(target.architecture, facts.aux_layers, target.num_layers)


def describe_ids(ids: DraftIds | None, facts: DatasetFacts) -> str:
    """The ids line ``hsx export`` prints (and ``draft-config.json`` keeps)."""
    if facts.aux_layers is None:
        return "the dataset is empty: no aux layers to name"
    if ids is None:
        return (
            "draft-config ids unknown: give --model PATH (the target's Hugging Face "
            "directory) so hsx knows the model family"
        )
    return ids.describe(facts.aux_layers)


def draft_config(fmt: ExportFormat, ids: DraftIds | None, facts: DatasetFacts) -> dict[str, Any]:
    """``draft-config.json``: the drafter config's ``eagle_config`` block (SGLang and
    SpecForge read ``eagle_config.eagle_aux_hidden_state_layer_ids``) and what it means."""
    aux = list(facts.aux_layers or ())
    expressible = ids is not None and ids.ids is not None
    about: dict[str, Any] = {
        "aux_layers": aux,
        "numbering": "hsx aux layer k is the residual stream entering decoder layer k "
        "(Hugging Face hidden_states[k]); eagle_aux_hidden_state_layer_ids are in SGLang "
        "0.5.23's draft-config numbering for the target's family, which SpecForge uses too",
        "architecture": None if ids is None else ids.architecture,
        "rule": None if ids is None else ids.rule,
        "ids_line": describe_ids(ids, facts),
        "final_state": fmt.final_state,
    }
    about |= fmt.draft_keys(aux)
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(ids.ids) if expressible else None,  # type: ignore[union-attr, arg-type]
            "use_aux_hidden_state": True,
        },
        "hsx": about,
    }
