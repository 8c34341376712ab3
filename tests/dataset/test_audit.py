"""Deep audit and ``hsx inspect``: planted faults are found, clean data passes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hsx_async.cli import main
from hsx_async.dataset import audit
from hsx_async.dataset.audit import audit_dataset, inspect_file, scan_file
from hsx_async.dataset.manifest import read_manifest
from tests.dataset_factory import (
    pipeline_dataset,
    plant_duplicate_layer,
    plant_nan,
    plant_zero_row,
    synthetic_hidden,
    synthetic_ids,
    write_dataset,
    write_sample,
)

H = 64


def test_clean_dataset_passes_with_per_layer_norms(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=6, hidden_size=H, shards=2)
    report = audit_dataset(tmp_path)
    assert report.ok, report.format()
    assert report.problems == [] and report.warnings == []
    assert (report.samples_total, report.samples_audited) == (6, 6)
    tokens = sum(s.entry.num_tokens for s in written)
    assert report.tokens_audited == tokens
    assert report.bytes_audited == sum(s.entry.size for s in written)
    assert [layer.name for layer in report.layers] == ["layer 2", "layer 30", "layer 58", "final"]
    assert all(layer.rows == tokens for layer in report.layers)
    # The factory's scales: aux layer i ~ 4(i+1)·sqrt(H), final ~ sqrt(H).
    for layer, scale in zip(report.layers, (4, 8, 12, 1), strict=True):
        assert layer.mean_norm == pytest.approx(scale * math.sqrt(H), rel=0.1)
        assert layer.mean_norm <= layer.max_norm
    text = report.format()
    assert "deep audit: OK" in text
    assert "layer 30" in text


def _faulty(index: int, hidden: torch.Tensor) -> None:
    if index == 1:
        plant_nan(hidden, 3, 2)
        plant_nan(hidden, 4, 0, value=float("inf"))
        plant_nan(hidden, 4, 1, value=float("-inf"))
    if index == 2:
        plant_zero_row(hidden, 5, 1)
        plant_zero_row(hidden, 6, 3)
    if index == 3:
        plant_duplicate_layer(hidden, 0, 1)


def test_planted_faults_are_problems(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=5, hidden_size=H, mutate=_faulty, shards=3)
    report = audit_dataset(tmp_path)
    assert not report.ok
    assert len(report.problems) == 3, report.problems
    nonfinite, zero, duplicate = sorted(report.problems, key=lambda p: p.split("'")[1])[0:3]
    assert str(written[1].path) in nonfinite
    assert "1 NaN and 2 Inf values" in nonfinite
    assert "layer 2: 1, layer 30: 1, layer 58: 1" in nonfinite
    assert "first at token 3, layer 58" in nonfinite
    assert str(written[2].path) in zero
    assert "layer 30: 1, final: 1" in zero and "first at token 5, layer 30" in zero
    assert str(written[3].path) in duplicate
    t = written[3].entry.num_tokens
    assert f"layer 2 and layer 30 are identical in {t} of {t} rows" in duplicate
    by_name = {layer.name: layer for layer in report.layers}
    assert (by_name["layer 58"].nan, by_name["layer 2"].inf, by_name["layer 30"].inf) == (1, 1, 1)
    assert (by_name["layer 30"].zero_rows, by_name["final"].zero_rows) == (1, 1)
    assert "deep audit: 3 problem(s)" in report.format()


def test_faults_are_found_across_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "CHUNK_ELEMENTS", 4 * H * 3)  # 3 tokens per chunk

    def late(index: int, hidden: torch.Tensor) -> None:
        plant_nan(hidden, 10, 3)
        plant_nan(hidden, 16, 0)
        plant_zero_row(hidden, 13, 2)

    (sample,) = write_dataset(tmp_path, num_samples=1, lengths=[17], hidden_size=H, mutate=late)
    stats = scan_file(sample.path)
    assert stats.nan.tolist() == [1, 0, 0, 1]
    assert stats.first_nonfinite == (10, 3)
    assert stats.first_zero_row == (13, 2)
    assert stats.rows.tolist() == [16, 17, 17, 16]
    whole = scan_file(sample.path)
    monkeypatch.setattr(audit, "CHUNK_ELEMENTS", 1 << 21)
    assert scan_file(sample.path).norm_sum == pytest.approx(whole.norm_sum)


def test_norm_outliers_and_depth_order_are_warnings(tmp_path: Path) -> None:
    def unnormed_final(index: int, hidden: torch.Tensor) -> None:
        if index == 4:
            hidden[:, 3, :] *= 40  # a final state saved before the norm

    write_dataset(tmp_path / "a", num_samples=8, hidden_size=H, mutate=unnormed_final)
    report = audit_dataset(tmp_path / "a")
    assert report.ok
    assert len(report.warnings) == 1
    assert "s0004" in report.warnings[0] and "final" in report.warnings[0]

    def swapped(index: int, hidden: torch.Tensor) -> None:
        hidden[:, [0, 2], :] = hidden[:, [2, 0], :]  # aux layers stored in the wrong order

    write_dataset(tmp_path / "b", num_samples=3, hidden_size=H, mutate=swapped)
    report = audit_dataset(tmp_path / "b")
    assert report.ok
    assert any("layer 58 has mean row norm" in w for w in report.warnings), report.warnings


def test_sample_fraction_is_stable_and_plot_is_written(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=30, hidden_size=16, lengths=[3] * 30)
    plot = tmp_path / "plots" / "norms.png"
    first = audit_dataset(tmp_path, sample_fraction=0.3, plot_path=plot, seed=4)
    second = audit_dataset(tmp_path, sample_fraction=0.3, seed=4)
    assert 2 <= first.samples_audited <= 20
    assert first.samples_audited == second.samples_audited
    assert first.tokens_audited == second.tokens_audited
    assert first.plot_path == plot
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"row-norm plot: {plot}" in first.format()
    assert audit_dataset(tmp_path, sample_fraction=1e-9).samples_audited == 1


def test_unreadable_and_mixed_samples_are_problems(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=4, hidden_size=H)
    written[0].path.unlink()
    with written[1].path.open("ab") as fh:
        fh.write(b"extra")
    written[2].path.write_bytes(b"\x00" * written[2].entry.size)
    write_sample(
        tmp_path,
        "wide",
        input_ids=synthetic_ids(4, seed=0),
        hidden=synthetic_hidden(4, 2 * H, 4, seed=0),
        loss_mask=None,
    )
    report = audit_dataset(tmp_path, workers=1)
    text = "\n".join(report.problems)
    assert len(report.problems) == 4, text
    assert "missing" in text
    assert "the manifest says" in text
    assert "not a readable safetensors file" in text or "not an hsx sample" in text
    assert "mixed configs" in text


def test_inspect_file_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = write_dataset(tmp_path, num_samples=2, hidden_size=H, mutate=_faulty)
    clean, broken = written[0], written[1]
    text = inspect_file(clean.path)
    assert "aux_layers=2,30,58" in text and "id=s0000" in text
    assert f"BF16  [5, 4, {H}]" in text
    assert "4 KiB aligned" in text
    assert "problems: none" in text
    assert "  loss_mask      U8    [5]  " in text and "ones of 5" in text
    hidden = clean.hidden.float()
    low = f"{float(hidden[:, 0].min()):.4g}"
    assert low in text
    assert main(["inspect", str(broken.path)]) == 0
    out = capsys.readouterr().out
    # Issue 39: "loss_mask U8 [5] absent (all ones)" described a tensor the file lacks.
    [mask] = [line for line in out.splitlines() if "loss_mask" in line]
    t = broken.hidden.shape[0]
    assert mask == f"  loss_mask      not stored (the input gave none): readers yield {t} ones"
    assert "1 NaN and 2 Inf values" in out
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 2


async def test_pipeline_dataset_is_clean_until_damaged(tmp_path: Path, shm_root: Path) -> None:
    written = await pipeline_dataset(tmp_path, shm_root, num_samples=8, seed=4)
    report = audit_dataset(written.out_dir)
    assert report.ok and report.warnings == [], report.format()
    assert report.samples_audited == 8
    assert [layer.name for layer in report.layers] == ["layer 1", "layer 3", "layer 5", "final"]

    # Damage one file in place, as a bad copy or a buggy server would.
    entry = next(e for e in read_manifest(written.out_dir) if e.num_tokens >= 3)
    path = written.out_dir / entry.path
    layers, size = len(written.aux_layers) + 1, written.hidden_size
    with path.open("r+b") as fh:
        offset = 8 + int.from_bytes(fh.read(8), "little") + 8 * entry.num_tokens
        fh.seek(offset + 2 * (1 * layers * size + 2 * size + 5))  # token 1, layer 5
        fh.write(b"\xc0\x7f")  # bf16 NaN
        fh.seek(offset + 2 * (2 * layers * size))  # token 2, layer 1: a zero row
        fh.write(b"\x00" * 2 * size)
    report = audit_dataset(written.out_dir)
    assert len(report.problems) == 2, report.problems
    assert all(str(path) in p for p in report.problems)
    assert "1 NaN and 0 Inf values in layer 5: 1; first at token 1, layer 5" in report.problems[0]
    assert "all-zero rows in layer 1: 1" in report.problems[1]
