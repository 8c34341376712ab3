"""``hsx export``: SpecForge and speculators layouts, values, and resumption."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsx_async.cli import main
from hsx_async.dataset import export
from hsx_async.dataset.export import (
    EXPORT_LOG,
    SPECULATORS_ROWS,
    assign_indices,
    export_dataset,
    read_export_log,
    specforge_relpath,
    speculators_relpath,
)
from hsx_async.dataset.manifest import MANIFEST
from hsx_async.errors import DatasetError
from tests.dataset_factory import WrittenSample, pipeline_dataset, write_dataset


def _by_index(dest: Path) -> dict[int, str]:
    return {r.index: r.id for r in read_export_log(dest).values()}


def _mask(sample: WrittenSample) -> torch.Tensor:
    t = sample.entry.num_tokens
    mask = sample.loss_mask
    return torch.ones(t, dtype=torch.int64) if mask is None else mask.to(torch.int64)


def test_relpaths_match_the_trainers() -> None:
    assert specforge_relpath(0) == "rows_0-2000/data_0.ckpt"
    assert specforge_relpath(4123) == "rows_4000-6000/data_4123.ckpt"
    assert specforge_relpath(5, 2) == "rows_4-6/data_5.ckpt"
    assert speculators_relpath(17) == "hidden_states/hs_17.safetensors"


def test_specforge_export_loads_with_torch_load(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    written = write_dataset(src, num_samples=5, hidden_size=32, shards=2)
    result = export_dataset(src, dest, fmt="specforge", file_group_size=2)
    assert (result.total, result.written, result.skipped) == (5, 5, 0)
    assert sorted(p.parent.name for p in dest.rglob("*.ckpt")) == [
        "rows_0-2",
        "rows_0-2",
        "rows_2-4",
        "rows_2-4",
        "rows_4-6",
    ]
    by_id = {str(s.id): s for s in written}
    for index, sample_id in _by_index(dest).items():
        sample = by_id[sample_id]
        path = dest / specforge_relpath(index, 2)
        record = torch.load(path, weights_only=True)
        t, layers, size = sample.hidden.shape
        assert list(record) == ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]
        assert record["input_ids"].dtype == torch.int64
        assert torch.equal(record["input_ids"], sample.input_ids)
        assert torch.equal(record["loss_mask"], _mask(sample))
        assert record["hidden_state"].shape == (1, t, size)
        assert record["aux_hidden_state"].shape == (1, t, (layers - 1) * size)
        assert record["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(record["hidden_state"][0], sample.hidden[:, -1])
        assert torch.equal(
            record["aux_hidden_state"][0], sample.hidden[:, :-1].reshape(t, (layers - 1) * size)
        )
        # Compact: the file holds these tensors, not the mapping of the whole sample file.
        assert record["hidden_state"].untyped_storage().nbytes() == t * size * 2
        # SpecForge's own loader: torch.load(path, weights_only=False, mmap=True).
        mapped = torch.load(path, weights_only=False, mmap=True)
        assert torch.equal(mapped["aux_hidden_state"], record["aux_hidden_state"])


def test_speculators_export_loads_with_safetensors(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    written = write_dataset(src, num_samples=4, hidden_size=16, loss_mask="alternate")
    result = export_dataset(src, dest, fmt="speculators")
    assert result.written == 4
    by_id = {str(s.id): s for s in written}
    rows = [orjson.loads(line) for line in (dest / SPECULATORS_ROWS).read_bytes().splitlines()]
    assert len(rows) == 4
    for index, sample_id in _by_index(dest).items():
        sample = by_id[sample_id]
        path = dest / speculators_relpath(index)
        loaded = load_file(path)
        assert set(loaded) == {"hidden_states", "token_ids"}
        assert loaded["token_ids"].dtype == torch.int64
        assert torch.equal(loaded["token_ids"], sample.input_ids)
        assert loaded["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(loaded["hidden_states"], sample.hidden)
        # speculators' ArrowDataset: aux = [:, :-1].flatten(1), verifier last = [:, -1].
        t, layers, size = sample.hidden.shape
        assert loaded["hidden_states"][:, :-1].flatten(1).shape == (t, (layers - 1) * size)
        with safe_open(str(path), framework="pt") as fh:
            assert fh.metadata()["hsx_id"] == sample_id
        row = rows[index]
        assert row["input_ids"] == sample.input_ids.tolist()
        assert row["loss_mask"] == _mask(sample).tolist()
        assert (row["seq_len"], row["hsx_id"]) == (t, sample_id)


def _state(dest: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(dest)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in dest.rglob("*")
        if p.is_file() and p.name not in (EXPORT_LOG, SPECULATORS_ROWS)
    }


def test_rerun_skips_complete_outputs_and_redoes_the_rest(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=6, hidden_size=16)
    export_dataset(src, dest, fmt="specforge")
    before, indices = _state(dest), _by_index(dest)

    again = export_dataset(src, dest, fmt="specforge")
    assert (again.written, again.skipped) == (0, 6)
    assert _state(dest) == before

    # A lost file, a truncated one and a crash's leftover temporary file.
    (dest / specforge_relpath(1)).unlink()
    (dest / specforge_relpath(4)).write_bytes(b"torn")
    stale = dest / "rows_0-2000" / f"{export.TMP_PREFIX}data_9.ckpt"
    stale.write_bytes(b"partial")
    # ...and samples extracted since: they get indices after the existing ones.
    extra = write_dataset(src, num_samples=2, ids=["a-new", "b-new"], hidden_size=16, seed=50)
    third = export_dataset(src, dest, fmt="specforge")
    assert (third.total, third.written, third.skipped) == (8, 4, 4)
    assert not stale.exists()
    after = _by_index(dest)
    assert {i: after[i] for i in indices} == indices
    assert {after[6], after[7]} == {"a-new", "b-new"}
    for sample in extra:
        index = next(i for i, s in after.items() if s == sample.id)
        record = torch.load(dest / specforge_relpath(index), weights_only=True)
        assert torch.equal(record["hidden_state"][0], sample.hidden[:, -1])
    for index in (1, 4):
        record = torch.load(dest / specforge_relpath(index), weights_only=True)
        assert record["hidden_state"].shape[1] == record["input_ids"].shape[0]


def test_changed_source_samples_are_exported_again(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    write_dataset(src, num_samples=3, hidden_size=8, seed=0)
    export_dataset(src, dest, fmt="speculators")
    shutil.rmtree(src)
    fresh = write_dataset(src, num_samples=3, hidden_size=8, seed=7)
    result = export_dataset(src, dest, fmt="speculators")
    assert result.written == 3
    for index, sample_id in _by_index(dest).items():
        sample = next(s for s in fresh if s.id == sample_id)
        assert torch.equal(
            load_file(dest / speculators_relpath(index))["hidden_states"], sample.hidden
        )


def test_a_failed_write_leaves_no_output_and_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=4, hidden_size=8)
    real = export._write_specforge
    calls = 0

    def flaky(sample_path: Path, entry: object, tmp: Path) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            tmp.write_bytes(b"half a file")
            raise OSError(28, "No space left on device")
        real(sample_path, entry, tmp)  # type: ignore[arg-type]

    monkeypatch.setattr(export, "_write_specforge", flaky)
    with pytest.raises(OSError, match="No space"):
        export_dataset(src, dest, fmt="specforge")
    assert len(read_export_log(dest)) == 2
    assert not list(dest.rglob(f"{export.TMP_PREFIX}*"))
    assert len(list(dest.rglob("*.ckpt"))) == 2
    monkeypatch.setattr(export, "_write_specforge", real)
    result = export_dataset(src, dest, fmt="specforge")
    assert (result.written, result.skipped) == (2, 2)


def test_refuses_mixing_formats_and_stale_exports(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "x"
    write_dataset(src, num_samples=3, hidden_size=8)
    export_dataset(src, dest, fmt="specforge")
    with pytest.raises(DatasetError, match="holds a specforge export"):
        export_dataset(src, dest, fmt="speculators")
    with pytest.raises(DatasetError, match="holds a specforge export"):
        export_dataset(src, dest, fmt="specforge", file_group_size=10)
    manifest = src / f"{MANIFEST}.jsonl"
    manifest.write_bytes(b"".join(manifest.read_bytes().splitlines(keepends=True)[1:]))
    with pytest.raises(DatasetError, match="no longer in the dataset"):
        export_dataset(src, dest, fmt="specforge")
    with pytest.raises(DatasetError, match="unknown export format"):
        export_dataset(src, tmp_path / "y", fmt="eagle")
    with pytest.raises(DatasetError, match="dataset directory itself"):
        export_dataset(src, src, fmt="specforge")


def test_assign_indices_keeps_old_and_appends_new() -> None:
    done = {
        "b": export.ExportRecord(0, "b", "p", 1, "0" * 16),
        "z": export.ExportRecord(3, "z", "p", 1, "0" * 16),
    }
    assert assign_indices(["a", "b", "c", "z"], done) == {"a": 4, "b": 0, "c": 5, "z": 3}


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    write_dataset(src, num_samples=2, hidden_size=8)
    assert main(["export", str(src), "--format", "speculators", "--to", str(dest)]) == 0
    out = capsys.readouterr()
    assert "exported 2 samples" in out.out
    assert "save_to_disk" in out.out
    assert "2/2 samples" in out.err
    assert len(list((dest / "hidden_states").glob("hs_*.safetensors"))) == 2


async def test_exports_a_pipeline_dataset(tmp_path: Path, shm_root: Path) -> None:
    written = await pipeline_dataset(tmp_path, shm_root, num_samples=6, seed=8)
    export_dataset(written.out_dir, tmp_path / "sf", fmt="specforge")
    export_dataset(written.out_dir, tmp_path / "spec", fmt="speculators")
    rows = (tmp_path / "spec" / SPECULATORS_ROWS).read_bytes().splitlines()
    for index, sample_id in _by_index(tmp_path / "sf").items():
        ids, hidden, mask = written.expected(sample_id)
        t, k, size = hidden.shape[0], hidden.shape[1] - 1, hidden.shape[2]
        record = torch.load(tmp_path / "sf" / specforge_relpath(index), weights_only=True)
        assert torch.equal(record["input_ids"], ids)
        want_mask = torch.ones(t, dtype=torch.int64) if mask is None else mask.to(torch.int64)
        assert torch.equal(record["loss_mask"], want_mask)
        assert torch.equal(record["hidden_state"], hidden[None, :, -1])
        assert torch.equal(record["aux_hidden_state"], hidden[None, :, :k].reshape(1, t, k * size))
    for index, sample_id in _by_index(tmp_path / "spec").items():
        ids, hidden, mask = written.expected(sample_id)
        loaded = load_file(tmp_path / "spec" / speculators_relpath(index))
        assert torch.equal(loaded["token_ids"], ids)
        assert torch.equal(loaded["hidden_states"], hidden)
        assert orjson.loads(rows[index])["input_ids"] == ids.tolist()


def test_one_export_at_a_time_per_destination(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=2, hidden_size=8)
    dest.mkdir()
    fd = os.open(dest / export.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DatasetError, match="another hsx export"):
            export_dataset(src, dest, fmt="specforge")
    finally:
        os.close(fd)
    assert export_dataset(src, dest, fmt="specforge").written == 2
    (dest / export.EXPORT_INFO).write_bytes(b"{torn")
    with pytest.raises(DatasetError, match="not valid JSON"):
        export_dataset(src, dest, fmt="specforge")
