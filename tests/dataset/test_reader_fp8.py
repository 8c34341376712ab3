"""The training-side Dataset over FP8 datasets: bf16 by default (dequantized per sample),
the stored sections with ``storage="raw"``, and every header check applied to them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hsx_async.dataset.reader import (
    HiddenStateDataset,
    PadCollator,
    read_header,
    read_sample,
)
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16_STORAGE, FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage
from tests.dataset_factory import fp8_storage, write_dataset, write_storage_provenance

AUX = (2, 30, 58)


def _dequantized(sections: tuple[torch.Tensor, ...], storage: Storage, layers: int) -> torch.Tensor:
    """What the reader must yield, from the stored sections by the formula of PROTOCOL §4:
    each quantized slot float32(q) × scale rounded once to bf16, kept slots as stored."""
    q, scales = sections[0], sections[1]  # scales [T, Lq]: the file's [T, Lq, 1]
    t, _, h = q.shape
    out = torch.empty((t, layers, h), dtype=torch.bfloat16)
    for j, slot in enumerate(storage.quantized):
        out[:, slot] = (q[:, j].float() * scales[:, j, None]).to(torch.bfloat16)
    for j, slot in enumerate(storage.kept(layers)):
        out[:, slot] = sections[2][:, j]
    return out


@pytest.mark.parametrize("quantize", ["all", "aux"])
def test_fp8_dataset_yields_bf16_as_a_bf16_dataset_does(tmp_path: Path, quantize: str) -> None:
    storage = fp8_storage(len(AUX) + 1, quantize)
    written = write_dataset(tmp_path, num_samples=4, hidden_size=64, storage=storage)
    ds = HiddenStateDataset(tmp_path)
    assert ds.storage == storage
    for sample in written:
        item = ds[ds.ids.index(sample.id)]
        want = _dequantized(sample.sections, storage, len(AUX) + 1)
        t = sample.entry.num_tokens
        assert item["hidden_states"].dtype == item["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], want[:, -1])
        assert torch.equal(item["aux_hidden_states"], want[:, :-1].reshape(t, 3 * 64))
        if quantize == "aux":  # the final slot is stored, and read, bit-exact
            assert torch.equal(item["hidden_states"], sample.hidden[:, -1])
        # ... and within FP8 rounding of the values before quantizing (3 mantissa bits).
        err = (want.float() - sample.hidden.float()).norm(dim=-1)
        rel = err / sample.hidden.float().norm(dim=-1)
        assert float(rel.max()) < 0.06
        assert 0.005 < float(rel[:, list(storage.quantized)].mean()) < 0.04
        assert torch.equal(item["input_ids"], sample.input_ids)


def test_raw_yields_the_stored_sections_as_views_of_the_file(tmp_path: Path) -> None:
    storage = fp8_storage(len(AUX) + 1, "aux")
    written = write_dataset(tmp_path, num_samples=3, hidden_size=32, storage=storage)
    ds = HiddenStateDataset(tmp_path, storage="raw")
    assert ds.storage.quantized == (0, 1, 2) and ds.storage.kept(4) == (3,)
    for sample in written:
        item = ds[ds.ids.index(sample.id)]
        t = sample.entry.num_tokens
        assert set(item) == {
            "input_ids",
            "loss_mask",
            "hidden_states",
            "hidden_states_scales",
            "hidden_states_unquantized",
        }
        q, scales, kept = sample.sections
        assert item["hidden_states"].dtype == torch.float8_e4m3fn
        assert item["hidden_states"].shape == (t, 3, 32)
        assert torch.equal(item["hidden_states"].view(torch.uint8), q.view(torch.uint8))
        assert item["hidden_states_scales"].dtype == torch.float32
        assert item["hidden_states_scales"].shape == (t, 3, 1)
        assert torch.equal(item["hidden_states_scales"], scales.view(t, 3, 1))
        assert torch.equal(item["hidden_states_unquantized"], kept)
        assert torch.equal(item["hidden_states_unquantized"][:, 0], sample.hidden[:, 3])
        # Views of one mapping, in file order: the scales follow the values directly.
        values, after = item["hidden_states"], item["hidden_states_scales"]
        assert after.data_ptr() - values.data_ptr() == t * 3 * 32
    # Collated like any other field: FP8 padding is zero bits (0.0).
    batch = PadCollator()([ds[0], ds[1]])
    assert batch["hidden_states"].dtype == torch.float8_e4m3fn
    longest = max(s.entry.num_tokens for s in written[:2])
    assert batch["hidden_states"].shape == (2, longest, 3, 32)
    assert batch["hidden_states_scales"].shape == (2, longest, 3, 1)


def test_raw_on_a_bf16_dataset_is_its_one_section(tmp_path: Path) -> None:
    (sample,) = write_dataset(tmp_path, num_samples=1, hidden_size=16)
    ds = HiddenStateDataset(tmp_path, storage="raw", fields=("input_ids", "hidden_states"))
    assert ds.storage == BF16_STORAGE
    item = ds[0]
    assert set(item) == {"input_ids", "hidden_states"}
    assert torch.equal(item["hidden_states"], sample.hidden)
    with pytest.raises(ValueError, match="storage is 'fp8'"):
        HiddenStateDataset(tmp_path, storage="fp8")  # type: ignore[arg-type]


def test_input_ids_alone_never_dequantize(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=1, storage=fp8_storage(4))
    item = HiddenStateDataset(tmp_path, fields=("input_ids",))[0]
    assert set(item) == {"input_ids"}


def _fp8_file(path: Path, tensors: dict[str, torch.Tensor], *, quantized: str = "0,1") -> Path:
    meta = {"id": "x", "aux_layers": "4", "protocol": "3", "dtype": FP8, "quantized": quantized}
    save_file(tensors, str(path), metadata=meta)
    return path


def _good(t: int = 3, h: int = 8, lq: int = 2) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(t, dtype=torch.int64),
        "hidden_states": torch.ones(t, lq, h).to(torch.float8_e4m3fn),
        "hidden_states_scales": torch.ones(t, lq, 1),
    }


@pytest.mark.parametrize(
    ("change", "quantized", "message"),
    [
        (
            {"hidden_states": torch.ones(3, 2, 8, dtype=torch.bfloat16)},
            "0,1",
            r"tensor hidden_states is BF16 \[3, 2, 8\], expected F8_E4M3",
        ),
        (
            {"hidden_states_scales": torch.ones(3, 2)},
            "0,1",
            r"tensor hidden_states_scales is F32 \[3, 2\], expected F32 of rank 3",
        ),
        (
            {"hidden_states_scales": torch.ones(3, 1, 1)},
            "0,1",
            r"hidden_states_scales has shape \[3, 1, 1\], expected \[3, 2, 1\]",
        ),
        (
            {"hidden_states_scales": torch.ones(3, 2, 1, dtype=torch.bfloat16)},
            "0,1",
            "tensor hidden_states_scales is BF16",
        ),
        ({}, "0", "hidden_states_unquantized is missing"),
        (
            {"hidden_states_unquantized": torch.ones(3, 1, 8, dtype=torch.bfloat16)},
            "0,1",
            "hidden_states_unquantized is unexpected",
        ),
        ({}, "0,2", "quantized slot 2 is past the 2 layer slots"),
        ({}, "1,0", "not ascending"),
    ],
)
def test_fp8_files_that_contradict_their_metadata_are_refused(
    tmp_path: Path, change: dict[str, torch.Tensor], quantized: str, message: str
) -> None:
    tensors = _good(lq=len(quantized.split(","))) | change
    path = _fp8_file(tmp_path / "bad.safetensors", tensors, quantized=quantized)
    with pytest.raises(DatasetError, match=message) as info:
        read_sample(path)
    assert str(path) in str(info.value)


def test_fp8_values_in_a_file_that_says_bf16_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    tensors = _good(lq=2)
    save_file(tensors, str(path), metadata={"aux_layers": "4"})
    with pytest.raises(DatasetError, match=r"hidden_states_scales is unexpected") as info:
        read_header(path)
    assert str(path) in str(info.value)
    save_file({k: tensors[k] for k in ("input_ids", "hidden_states")}, str(path),
              metadata={"aux_layers": "4"})  # fmt: skip
    with pytest.raises(DatasetError, match=r"tensor hidden_states is F8_E4M3 .*expected BF16"):
        read_header(path)


def test_a_good_handmade_fp8_file_reads(tmp_path: Path) -> None:
    tensors = _good(lq=1) | {"hidden_states_unquantized": torch.ones(3, 1, 8, dtype=torch.bfloat16)}
    path = _fp8_file(tmp_path / "ok.safetensors", tensors, quantized="0")
    header = read_header(path)
    assert header.storage == Storage(FP8, (0,))
    assert (header.num_tokens, header.num_layers, header.hidden_size) == (3, 2, 8)
    item = read_sample(path)
    assert item["aux_hidden_states"].shape == (3, 8)
    assert torch.equal(item["hidden_states"], torch.ones(3, 8, dtype=torch.bfloat16))


def test_a_file_of_another_storage_than_the_dataset_is_refused(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=2, storage=fp8_storage(4, "aux"))
    # provenance.json says all four slots: the files (three slots) are from another run.
    write_storage_provenance(tmp_path, fp8_storage(4, "all"), hidden_size=64, aux_layers=AUX)
    ds = HiddenStateDataset(tmp_path)
    with pytest.raises(DatasetError, match="but the dataset is float8_e4m3fn") as info:
        ds[0]
    assert str(ds.path(0)) in str(info.value)
    assert written[0].storage != ds.storage


def _sinks(index: int, hidden: torch.Tensor) -> None:
    """Token 0 an attention sink in every slot: 3 channels 10,000x its median."""
    median = hidden[0].float().abs().median(dim=-1).values
    hidden[0, :, [5, 40, 77]] = (1e4 * median).unsqueeze(-1).to(hidden.dtype)


def test_the_outliers_layout_reads_back_with_its_outliers_exact(tmp_path: Path) -> None:
    """PROTOCOL §3, version 4, by its formula: x at each outlier's channel, float32(q) ×
    scale rounded once elsewhere; the sink rows' massive channels come back exact, and raw
    yields the two outlier sections as stored (views of the file, in file order)."""
    storage = fp8_storage(len(AUX) + 1, "aux", PER_TOKEN_SLOT_OUTLIERS16)
    written = write_dataset(tmp_path, num_samples=3, hidden_size=128, storage=storage,
                            mutate=_sinks)  # fmt: skip
    ds, raw = HiddenStateDataset(tmp_path), HiddenStateDataset(tmp_path, storage="raw")
    assert ds.storage == raw.storage == storage
    for sample in written:
        q, scales, index, values, kept = sample.sections
        t = sample.entry.num_tokens
        want = torch.empty((t, 4, 128), dtype=torch.bfloat16)
        for j in range(3):
            slot = (q[:, j].float() * scales[:, j, None]).to(torch.bfloat16)
            for row in range(t):
                for k, channel in enumerate(index[row, j].tolist()):
                    if channel != 0xFFFF:
                        slot[row, channel] = values[row, j, k]
            want[:, j] = slot
        want[:, 3] = kept[:, 0]
        item = ds[ds.ids.index(sample.id)]
        assert torch.equal(item["hidden_states"], want[:, -1])
        assert torch.equal(item["aux_hidden_states"], want[:, :-1].reshape(t, 3 * 128))
        massive = item["aux_hidden_states"].reshape(t, 3, 128)[0][:, [5, 40, 77]]
        assert torch.equal(massive, sample.hidden[0, :3][:, [5, 40, 77]])
        stored = raw[raw.ids.index(sample.id)]
        assert set(stored) == {"input_ids", "loss_mask", "hidden_states",
                               "hidden_states_scales", "hidden_states_outlier_index",
                               "hidden_states_outlier_values",
                               "hidden_states_unquantized"}  # fmt: skip
        assert stored["hidden_states_outlier_index"].dtype == torch.uint16
        assert stored["hidden_states_outlier_index"].shape == (t, 3, 16)
        assert torch.equal(stored["hidden_states_outlier_index"].view(torch.int16),
                           index.view(torch.int16))  # fmt: skip
        assert torch.equal(stored["hidden_states_outlier_values"], values)
        after = stored["hidden_states_outlier_index"].data_ptr()
        assert after - stored["hidden_states_scales"].data_ptr() == t * 3 * 4
