"""FP8 datasets in ``hsx verify`` (``--deep``, ``--json``), ``hsx inspect``, ``hsx status``
and ``hsx merge``, in both layouts (PROTOCOL §3): clean data passes with its error per
layer slot, planted faults in the FP8 sections are found, vectors that massive channels
starve are reported, another storage is refused."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hsx_async.cli import main
from hsx_async.dataset.audit import audit_dataset, inspect_file
from hsx_async.dataset.inspection import dataset_status, verify_dataset
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.dataset.merge import merge
from hsx_async.errors import DatasetError
from hsx_async.protocol import FP8, PER_TOKEN_SLOT, PER_TOKEN_SLOT_OUTLIERS16
from hsx_async.quantize import dequantize
from tests.dataset_factory import fp8_storage, plant_nan, write_dataset

H = 64
NAMES = ["layer 2", "layer 30", "layer 58", "final"]
LAYOUTS = [PER_TOKEN_SLOT, PER_TOKEN_SLOT_OUTLIERS16]


def _measured_error(hidden: torch.Tensor, sections: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The actual relative RMS error of each quantized vector [T, Lq], from the originals."""
    q, scales = sections[0], sections[1]
    outliers = sections[2:4] if len(sections) >= 4 else (None, None)
    back = dequantize(q, scales, torch.float32, *outliers)
    lq = q.shape[1]
    orig = hidden[:, :lq].float()
    rel: torch.Tensor = (back - orig).norm(dim=-1) / orig.norm(dim=-1)
    return rel


@pytest.mark.parametrize("scales", LAYOUTS)
@pytest.mark.parametrize("quantize", ["all", "aux"])
def test_clean_fp8_dataset_passes_and_reports_its_error_per_slot(
    tmp_path: Path, quantize: str, scales: str
) -> None:
    storage = fp8_storage(4, quantize, scales)
    written = write_dataset(tmp_path, num_samples=6, hidden_size=H, storage=storage)
    report = audit_dataset(tmp_path)
    assert report.ok and report.warnings == [], report.format()
    assert report.storage == storage.describe()
    assert [layer.name for layer in report.layers] == NAMES
    measured = torch.cat([_measured_error(s.hidden, s.sections) for s in written])
    for slot, layer in enumerate(report.layers):
        if slot not in storage.quantized:
            assert layer.fp8_err_mean is None and layer.fp8_err_max is None
            continue
        assert layer.fp8_err_mean is not None and layer.fp8_err_max is not None
        # The estimate from the stored values alone tracks the error really made.
        assert layer.fp8_err_mean == pytest.approx(float(measured[:, slot].mean()), rel=0.15)
        assert layer.fp8_err_mean < layer.fp8_err_max < 0.06
        assert layer.fp8_subnormal is not None and layer.fp8_subnormal < 0.01
    text = report.format()
    assert f"storage: {storage.describe()}" in text
    assert "fp8 err mean" in text and "fp8 subnorm" in text and "deep audit: OK" in text
    final = next(line for line in text.splitlines() if line.startswith("  final "))
    assert (final.split()[-3:] == ["-", "-", "-"]) == (quantize == "aux"), final


def _bad_scales(index: int, sections: list[torch.Tensor]) -> None:
    if index == 1:
        sections[1][2, 1] = 0.0
        sections[1][3, 0] = -1.0
    if index == 2:
        sections[1][4, 2] = float("inf")


@pytest.mark.parametrize("scales", LAYOUTS)
def test_scales_not_finite_or_not_positive_are_problems(tmp_path: Path, scales: str) -> None:
    written = write_dataset(tmp_path, num_samples=3, hidden_size=H,
                            storage=fp8_storage(4, scales=scales),
                            mutate_sections=_bad_scales)  # fmt: skip
    report = audit_dataset(tmp_path)
    scale_problems = [p for p in report.problems if "FP8 scales" in p]
    assert len(scale_problems) == 2, report.problems
    by_file = {str(s.path): s for s in written}
    first, second = sorted(scale_problems)
    assert str(written[1].path) in first and str(written[2].path) in second
    assert "2 FP8 scales are non-finite or ≤ 0 (layer 2: 1, layer 30: 1" in first
    assert "first at token 2, layer 30" in first
    assert "first at token 4, layer 58" in second
    assert all(any(path in p for path in by_file) for p in report.problems)
    # A zero scale dequantizes to a zero row (but for its exact outliers), an infinite one
    # to Inf: also found.
    zero_row = any("all-zero rows in layer 30: 1" in p for p in report.problems)
    assert zero_row == (scales == PER_TOKEN_SLOT)
    assert any("Inf values" in p for p in report.problems)


def test_a_non_finite_row_quantizes_to_a_non_finite_scale(tmp_path: Path) -> None:
    def nan(index: int, hidden: torch.Tensor) -> None:
        if index == 0:
            plant_nan(hidden, 1, 3)

    write_dataset(tmp_path, num_samples=2, hidden_size=H, storage=fp8_storage(4), mutate=nan)
    report = audit_dataset(tmp_path)
    assert any(
        "1 FP8 scales are non-finite" in p and "token 1, final" in p for p in report.problems
    )
    assert any("NaN" in p for p in report.problems)


def test_a_non_finite_value_is_kept_as_an_outlier_and_found(tmp_path: Path) -> None:
    """The outliers layout ranks NaN as the largest magnitude: it is kept, as it was, in
    the outlier values (the scale stays finite), and both checks name it."""

    def nan(index: int, hidden: torch.Tensor) -> None:
        if index == 0:
            plant_nan(hidden, 1, 3)

    storage = fp8_storage(4, scales=PER_TOKEN_SLOT_OUTLIERS16)
    write_dataset(tmp_path, num_samples=2, hidden_size=H, storage=storage, mutate=nan)
    report = audit_dataset(tmp_path)
    assert not any("FP8 scales" in p for p in report.problems), report.problems
    assert any(
        "1 stored FP8 vectors have outliers that break the layout (final: 1)" in p
        and "token 1, final" in p
        and "non-finite value" in p
        for p in report.problems
    ), report.problems
    assert any("NaN" in p for p in report.problems)


def _off_scale(index: int, sections: list[torch.Tensor]) -> None:
    if index == 1:  # values halved, scales kept: not what hsx's quantizer writes
        q = sections[0]
        q[5, 0] = (q[5, 0].float() / 2).to(torch.float8_e4m3fn)
        sections[1][6, 3] *= 2  # a doubled scale leaves |q| at 448: not detectable here


@pytest.mark.parametrize("scales", LAYOUTS)
def test_vectors_whose_largest_value_is_not_448_are_problems(tmp_path: Path, scales: str) -> None:
    def off_scale(index: int, sections: list[torch.Tensor]) -> None:
        _off_scale(index, sections)
        if index == 1 and len(sections) > 2:  # ... outliers too: still ±448 where they are
            at = sections[2][5, 0].long()
            saturated = torch.sign(sections[3][5, 0].float()) * 448.0
            sections[0][5, 0, at] = saturated.to(sections[0].dtype)

    written = write_dataset(tmp_path, num_samples=2, hidden_size=H,
                            storage=fp8_storage(4, scales=scales),
                            mutate_sections=off_scale)  # fmt: skip
    report = audit_dataset(tmp_path)
    (problem,) = report.problems
    assert str(written[1].path) in problem
    assert "1 stored FP8 vectors have a largest |value| other than 448 (layer 2: 1)" in problem
    assert "first at token 5, layer 2" in problem


def test_all_zero_vectors_keep_the_scale_floor_and_are_no_off_scale(tmp_path: Path) -> None:
    def zero(index: int, hidden: torch.Tensor) -> None:
        hidden[2, 1] = 0
        hidden[3, 2] = 1e-40  # denormal-small: its scale is the floor, |q| < 448

    write_dataset(tmp_path, num_samples=1, hidden_size=H, storage=fp8_storage(4), mutate=zero)
    report = audit_dataset(tmp_path)
    assert not any("FP8" in p for p in report.problems), report.problems
    assert any("all-zero rows in layer 30: 1" in p for p in report.problems)


def test_verify_json_carries_the_storage_and_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = fp8_storage(4, "aux")
    write_dataset(tmp_path, num_samples=3, hidden_size=H, storage=storage)
    assert main(["verify", str(tmp_path), "--deep", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["verify"]["ok"] and out["verify"]["checked"] == 3
    deep = out["deep"]
    assert deep["ok"] and deep["storage"] == storage.describe()
    assert deep["storage"] == "float8_e4m3fn (slots 0,1,2; scales per_token_slot)"
    errors = [layer["fp8_rel_rms_error_mean"] for layer in deep["layers"]]
    assert errors[3] is None and all(0.005 < e < 0.05 for e in errors[:3])
    assert main(["verify", str(tmp_path), "--deep"]) == 0
    assert "fp8 err max" in capsys.readouterr().out


@pytest.mark.parametrize("scales", LAYOUTS)
def test_inspect_shows_the_sections_and_slots(tmp_path: Path, scales: str) -> None:
    storage = fp8_storage(4, "aux", scales)
    (sample,) = write_dataset(tmp_path, num_samples=1, hidden_size=H, storage=storage)
    text = inspect_file(sample.path)
    assert f"storage: float8_e4m3fn (slots 0,1,2; scales {scales})" in text
    assert f"hidden_states  F8_E4M3 [5, 3, {H}]  slots 0,1,2" in text
    assert "hidden_states_scales F32   [5, 3, 1]  slots 0,1,2" in text
    outliers = "hidden_states_outlier_index U16   [5, 3, 16]  slots 0,1,2 (the channels"
    assert (outliers in text) == (scales == PER_TOKEN_SLOT_OUTLIERS16), text
    assert (("hidden_states_outlier_values BF16  [5, 3, 16]  slots 0,1,2 (their values, exact)"
             in text) == (scales == PER_TOKEN_SLOT_OUTLIERS16))  # fmt: skip
    assert f"hidden_states_unquantized BF16  [5, 1, {H}]  slots 3" in text
    assert "fp8 err mean" in text and "problems: none" in text


def test_status_names_the_storage(tmp_path: Path) -> None:
    write_dataset(tmp_path / "a", num_samples=1, storage=fp8_storage(4))
    write_dataset(tmp_path / "b", num_samples=1)
    (tmp_path / "b" / "provenance.json").write_bytes(b'{"protocol": 2}')
    status = dataset_status(tmp_path / "a").format()
    assert "storage:     float8_e4m3fn (slots 0,1,2,3; scales per_token_slot)" in status
    assert "storage:     bfloat16" in dataset_status(tmp_path / "b").format()


def _handmade(out: Path, tensors: dict[str, torch.Tensor], quantized: str) -> str:
    rel = "data/00/x.safetensors"
    path = out / rel
    path.parent.mkdir(parents=True)
    meta = {"id": "x", "aux_layers": "4", "protocol": "3", "dtype": FP8, "quantized": quantized}
    save_file(tensors, str(path), metadata=meta)
    data = path.read_bytes()
    entry = ManifestEntry("x", rel, 3, len(data), xxhash.xxh3_64_hexdigest(data))
    (out / "manifest.jsonl").write_bytes(entry.to_line())
    return rel


def test_verify_checks_the_fp8_header_against_the_metadata(tmp_path: Path) -> None:
    base = {
        "input_ids": torch.arange(3, dtype=torch.int64),
        "hidden_states": torch.ones(3, 1, 8).to(torch.float8_e4m3fn),
        "hidden_states_scales": torch.ones(3, 1, 1),
    }
    rel = _handmade(tmp_path / "a", base, "0")  # slot 1 kept, but no unquantized tensor
    (problem,) = verify_dataset(tmp_path / "a").problems[rel]
    assert (
        "hidden_states_unquantized is missing; float8_e4m3fn (slots 0; scales per_token_slot) "
        "stores it" in problem
    )
    wrong = base | {"hidden_states_scales": torch.ones(3, 1)}
    rel = _handmade(tmp_path / "b", wrong, "0,1")
    problems = verify_dataset(tmp_path / "b").problems[rel]
    assert any(
        "hidden_states is F8_E4M3 [3, 1, 8], expected F8_E4M3 [3, 2, 8]" in p for p in problems
    )
    assert any("hidden_states_scales is F32 [3, 1], expected F32 [3, 2, 1]" in p for p in problems)
    good = base | {"hidden_states_unquantized": torch.ones(3, 1, 8, dtype=torch.bfloat16)}
    _handmade(tmp_path / "c", good, "0")
    assert verify_dataset(tmp_path / "c").ok


def test_merge_refuses_shards_of_another_storage(tmp_path: Path) -> None:
    write_dataset(tmp_path / "s0", num_samples=2, storage=fp8_storage(4))
    write_dataset(tmp_path / "s1", num_samples=2, storage=fp8_storage(4, "aux"), seed=5,
                  ids=["t0", "t1"])  # fmt: skip
    with pytest.raises(DatasetError) as info:
        merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "merged")
    message = str(info.value)
    assert "\n" not in message
    assert "stores hidden states as float8_e4m3fn (slots 0,1,2; scales per_token_slot)" in message
    assert "one dataset holds one storage" in message
    assert not (tmp_path / "merged" / "manifest.jsonl").exists()
    result = merge([tmp_path / "s0"], tmp_path / "merged")
    assert result.copied == 2
    # ... and a destination holding one storage takes no shard of another.
    with pytest.raises(DatasetError, match="merged stores hidden states as float8_e4m3fn"):
        merge([tmp_path / "s1"], tmp_path / "merged")


def test_merge_refuses_shards_of_another_layout(tmp_path: Path) -> None:
    write_dataset(tmp_path / "s0", num_samples=2, storage=fp8_storage(4))
    write_dataset(tmp_path / "s1", num_samples=2, seed=5, ids=["t0", "t1"],
                  storage=fp8_storage(4, scales=PER_TOKEN_SLOT_OUTLIERS16))  # fmt: skip
    with pytest.raises(DatasetError, match=r"scales per_token_slot_outliers16.*one dataset holds"):
        merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "merged")


def _sinks(index: int, hidden: torch.Tensor) -> None:
    """Attention-sink rows: token 0 of every slot with 4 channels 10,000x the median."""
    median = hidden[0].float().abs().median(dim=-1).values
    hidden[0, :, [3, 17, 40, 55]] = (1e4 * median).unsqueeze(-1).to(hidden.dtype)


@pytest.mark.parametrize("scales", LAYOUTS)
def test_vectors_that_massive_channels_starve_are_a_warning(tmp_path: Path, scales: str) -> None:
    """One scale per vector, set by a sink token's massive channels, leaves a fifth of the
    vector's other values as subnormals or zero: the deep audit says so and names the
    layout that keeps them; the outliers layout holds them (no warning)."""
    storage = fp8_storage(4, scales=scales)
    write_dataset(tmp_path, num_samples=2, hidden_size=256, storage=storage, mutate=_sinks)
    report = audit_dataset(tmp_path)
    assert report.ok, report.problems
    starved = [w for w in report.warnings if "subnormals or zero" in w]
    if scales == PER_TOKEN_SLOT:
        (warning,) = starved
        assert "8 FP8 vectors store more than 5% of their values as e4m3fn subnormals" in warning
        assert "layer 2: 2, layer 30: 2, layer 58: 2, final: 2" in warning
        assert "per_token_slot_outliers16 layout" in warning
        assert all(layer.fp8_subnormal and layer.fp8_subnormal > 1e-3 for layer in report.layers)
    else:
        assert starved == [], report.warnings
        assert all(layer.fp8_subnormal is not None and layer.fp8_subnormal < 1e-3
                   for layer in report.layers)  # fmt: skip


def _bad_outliers(index: int, sections: list[torch.Tensor]) -> None:
    q, index_, values = sections[0], sections[2], sections[3]
    if index == 0:
        swapped = index_[1, 0, :2].to(torch.int32).flip(0)  # not ascending
        index_[1, 0, :2] = swapped.to(torch.uint16)
        index_[2, 1, 0] = H + 3  # past the hidden size (and not the unused mark)
    if index == 1:
        q[3, 2, index_[3, 2, 0].long()] = torch.tensor(1.0).to(q.dtype)  # not saturated
        values[4, 0, -1] = 1.0  # an unused entry with a value
        index_[4, 0, -1] = 0xFFFF


def test_outliers_that_break_the_layout_are_problems(tmp_path: Path) -> None:
    storage = fp8_storage(4, scales=PER_TOKEN_SLOT_OUTLIERS16)
    written = write_dataset(tmp_path, num_samples=2, hidden_size=H, storage=storage,
                            mutate_sections=_bad_outliers)  # fmt: skip
    report = audit_dataset(tmp_path)
    found = [
        next(p for p in report.problems if str(w.path) in p and "outliers that break" in p)
        for w in written
    ]
    assert "2 stored FP8 vectors have outliers" in found[0]
    assert "(layer 2: 1, layer 30: 1); first at token 1, layer 2" in found[0]
    assert "(layer 2: 1, layer 58: 1); first at token 3, layer 58" in found[1]
