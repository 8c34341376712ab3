"""provenance.json's final-state record: one kind per dataset, learnt from the first dump."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.provenance import (
    PROVENANCE,
    FinalStateGuard,
    dataset_final_state,
    parse_final_norm,
    read_provenance,
)
from hsx_async.errors import DatasetError, DumpError


def test_first_dump_sets_the_kind_and_another_kind_fails(tmp_path: Path) -> None:
    (tmp_path / PROVENANCE).write_bytes(orjson.dumps({"protocol": 2, "model": "m"}))
    guard = FinalStateGuard(tmp_path)
    assert guard.kind is None
    guard.accept("post_norm")
    assert read_provenance(tmp_path) == {"protocol": 2, "model": "m", "final_state": "post_norm"}
    guard.accept("post_norm")
    with pytest.raises(DumpError, match="holds the pre_norm final state but this dataset holds"):
        guard.accept("pre_norm")
    # A resumed run starts from the recorded kind.
    with pytest.raises(DumpError, match="one dataset holds one kind"):
        FinalStateGuard(tmp_path).accept("pre_norm")


def test_version_1_datasets_hold_post_norm(tmp_path: Path) -> None:
    assert dataset_final_state({"protocol": 1}) == "post_norm"
    assert dataset_final_state({"protocol": 2}) is None
    assert dataset_final_state(None) is None
    with pytest.raises(DatasetError, match="final_state is 'both'"):
        dataset_final_state({"protocol": 2, "final_state": "both"})
    (tmp_path / PROVENANCE).write_bytes(orjson.dumps({"protocol": 1}))
    with pytest.raises(DumpError):
        FinalStateGuard(tmp_path).accept("pre_norm")


def test_final_norm_is_kept_only_when_well_formed() -> None:
    assert parse_final_norm({"kind": "rms", "eps": 1e-5}) == {"kind": "rms", "eps": 1e-5}
    assert parse_final_norm({"kind": "rms_one_plus", "eps": 1}) == {
        "kind": "rms_one_plus",
        "eps": 1.0,
    }
    for bad in (None, {"kind": "layer", "eps": 1e-5}, {"kind": "rms", "eps": True}, [1]):
        assert parse_final_norm(bad) is None
