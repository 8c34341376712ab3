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
    record_server,
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


def test_a_new_kind_is_written_with_the_first_server_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx_async.dataset import provenance

    writes: list[dict[str, object]] = []
    real = provenance.write_provenance

    def counted(out_dir: Path, data: bytes) -> None:
        writes.append(orjson.loads(data))
        real(out_dir, data)

    monkeypatch.setattr(provenance, "write_provenance", counted)
    assert FinalStateGuard(tmp_path).kind is None  # a new dataset
    guard = FinalStateGuard(tmp_path)
    identity = {"engine": "sglang", "model": "m", "final_state": "pre_norm"}
    record_server(tmp_path, "http://a", identity, identity, final_state="pre_norm")
    guard.accept("pre_norm", recorded=True)  # the caller wrote it: nothing more
    assert len(writes) == 1 and writes[0]["final_state"] == "pre_norm"
    assert read_provenance(tmp_path) == writes[0] and guard.kind == "pre_norm"
    with pytest.raises(DumpError, match="holds the post_norm final state"):
        guard.accept("post_norm", recorded=True)  # a kind once known is checked as ever
    assert FinalStateGuard(tmp_path).kind == "pre_norm" and len(writes) == 1


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
