"""``hsx export`` of FP8 datasets: speculators gets the dataset's own FP8 bytes in the layout
hs-connectors' ``FP8Transfer`` reads, where nothing must be recomputed; bfloat16 otherwise,
and always for SpecForge; what was written is recorded, so a resumed export never mixes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsx_async.cli import main
from hsx_async.dataset.export import (
    EXPORT_INFO,
    export_dataset,
    specforge_relpath,
    speculators_relpath,
)
from hsx_async.dataset.reader import HiddenStateDataset, hidden_bf16, read_hidden
from hsx_async.dataset.target import pre_from_post
from hsx_async.errors import DatasetError
from hsx_async.protocol import PER_TOKEN_SLOT_OUTLIERS16
from hsx_async.quantize import quantize
from tests.dataset.test_export import model_dir
from tests.dataset_factory import WrittenSample, fp8_storage, write_dataset

H = 32


def _pre_norm_fp8(src: Path, quantize: str = "all") -> list[WrittenSample]:
    return write_dataset(src, num_samples=4, hidden_size=H, storage=fp8_storage(4, quantize),
                         final_state="pre_norm")  # fmt: skip


def _dataset_bf16(sample: WrittenSample) -> torch.Tensor:
    """[T, L, H] bf16 as hsx's reader yields the sample."""
    header, stored = read_hidden(sample.path)
    return hidden_bf16(header, stored).clone()


def _their_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """hs-connectors 0.9.0's formula (fp8_utils.dequantize_fp8_tensor), restated."""
    return q.to(torch.bfloat16) * scales.to(torch.bfloat16)


def _raw_bytes(path: Path, name: str) -> bytes:
    with safe_open(str(path), framework="pt") as fh:
        return bytes(fh.get_tensor(name).contiguous().view(torch.uint8).numpy())


def test_speculators_gets_the_datasets_fp8_bytes(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    written = _pre_norm_fp8(src)
    result = export_dataset(src, dest, fmt="speculators")
    assert (result.dtype, result.dtype_why, result.converted) == ("float8_e4m3fn", "", False)
    info = orjson.loads((dest / EXPORT_INFO).read_bytes())
    assert info["hidden_states_dtype"] == "float8_e4m3fn"
    by_id = {str(s.id): s for s in written}
    ds = HiddenStateDataset(src)
    for index in range(4):
        path = dest / speculators_relpath(index)
        with safe_open(str(path), framework="pt") as fh:
            sample = by_id[fh.metadata()["hsx_id"]]
            assert fh.metadata()["dtype"] == "float8_e4m3fn"
        loaded = load_file(path)
        t = sample.entry.num_tokens
        assert set(loaded) == {"hidden_states", "hidden_states_scales", "token_ids"}
        assert loaded["hidden_states"].dtype == torch.float8_e4m3fn
        assert loaded["hidden_states"].shape == (t, 4, H)
        assert loaded["hidden_states_scales"].dtype == torch.float32
        assert loaded["hidden_states_scales"].shape == (t, 4, 1)
        # Bytes copied, nothing requantized.
        for name in ("hidden_states", "hidden_states_scales"):
            assert _raw_bytes(path, name) == _raw_bytes(sample.path, name)
        # Their dequantization is hsx's but for the bf16 rounding of the scale (2⁻⁹).
        theirs = _their_dequantize(loaded["hidden_states"], loaded["hidden_states_scales"])
        ours = _dataset_bf16(sample)
        assert torch.allclose(theirs.float(), ours.float(), rtol=2**-7, atol=0)
        item = ds[ds.ids.index(sample.id)]
        assert torch.equal(item["hidden_states"], ours[:, -1])
    # Half the bytes, plus a float32 scale per (token, slot): (H + 4) / 2H.
    export_dataset(src, tmp_path / "spec-bf16", fmt="speculators", dtype="bfloat16")
    fp8, bf16 = _hidden_bytes(dest), _hidden_bytes(tmp_path / "spec-bf16")
    assert fp8 / bf16 == pytest.approx((H + 4) / (2 * H))


def _hidden_bytes(dest: Path) -> int:
    total = 0
    for path in (dest / "hidden_states").iterdir():
        loaded = load_file(path)
        total += sum(v.nbytes for k, v in loaded.items() if k != "token_ids")
    return total


def test_bfloat16_when_slots_are_kept_or_asked_for(tmp_path: Path) -> None:
    src = tmp_path / "aux"
    written = _pre_norm_fp8(src, "aux")
    result = export_dataset(src, tmp_path / "a", fmt="speculators")
    assert result.dtype == "bfloat16"
    assert "keeps slot(s) 3 in bfloat16" in result.dtype_why
    for index in range(4):
        loaded = load_file(tmp_path / "a" / speculators_relpath(index))
        assert set(loaded) == {"hidden_states", "token_ids"}
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        assert torch.equal(loaded["hidden_states"], _dataset_bf16(sample))
        assert torch.equal(loaded["hidden_states"][:, -1], sample.hidden[:, -1])  # kept exact
    assert "--dtype float8_e4m3fn writes FP8 anyway, quantizing slot(s) 3 here" in (
        result.dtype_why
    )
    # Asked for: FP8, the aux slots' bytes copied, the kept final quantized by the export.
    result = export_dataset(src, tmp_path / "b", fmt="speculators", dtype="float8_e4m3fn")
    assert (result.dtype, result.requantized) == ("float8_e4m3fn", (3,))
    for index in range(4):
        path = tmp_path / "b" / speculators_relpath(index)
        loaded = load_file(path)
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        q, scales = loaded["hidden_states"], loaded["hidden_states_scales"]
        assert q.dtype == torch.float8_e4m3fn and q.shape[1:] == (4, H)
        with safe_open(str(sample.path), framework="pt") as fh:
            src_q, src_s = fh.get_tensor("hidden_states"), fh.get_tensor("hidden_states_scales")
        assert torch.equal(q[:, :3].view(torch.uint8), src_q.view(torch.uint8))
        assert torch.equal(scales[:, :3], src_s)
        want_q, want_s = quantize(sample.hidden[:, -1])
        assert torch.equal(q[:, 3].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales[:, 3, 0], want_s)


def test_a_post_norm_fp8_dataset_is_converted_in_bfloat16(tmp_path: Path) -> None:
    src = tmp_path / "out"
    written = write_dataset(src, num_samples=3, hidden_size=H, storage=fp8_storage(4))
    model, weight = model_dir(tmp_path / "model", H)
    result = export_dataset(src, tmp_path / "spec", fmt="speculators", model=model)
    assert result.converted and result.dtype == "bfloat16"
    assert "post_norm final state" in result.dtype_why
    with pytest.raises(DatasetError, match=r"SpecForge 0\.2\.0's loader reads no FP8"):
        export_dataset(src, tmp_path / "sf", fmt="specforge", dtype="float8_e4m3fn")
    for index in range(3):
        loaded = load_file(tmp_path / "spec" / speculators_relpath(index))
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        ours = _dataset_bf16(sample)
        assert loaded["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(loaded["hidden_states"][:, :-1], ours[:, :-1])
        assert torch.equal(loaded["hidden_states"][:, -1], pre_from_post(ours[:, -1], weight))


def test_fp8_asked_for_quantizes_the_converted_final_and_a_bf16_dataset(tmp_path: Path) -> None:
    """--dtype float8_e4m3fn: a post-norm FP8 dataset's aux bytes are copied and its final
    state, converted to pre-norm, quantized once more (within FP8 rounding of the bf16
    export's values); a bf16 dataset is quantized whole."""
    src = tmp_path / "out"
    written = write_dataset(src, num_samples=3, hidden_size=H, storage=fp8_storage(4))
    model, weight = model_dir(tmp_path / "model", H)
    result = export_dataset(src, tmp_path / "spec", fmt="speculators", model=model,
                            dtype="float8_e4m3fn")  # fmt: skip
    assert result.converted and (result.dtype, result.requantized) == ("float8_e4m3fn", (3,))
    for index in range(3):
        loaded = load_file(tmp_path / "spec" / speculators_relpath(index))
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        q, scales = loaded["hidden_states"], loaded["hidden_states_scales"]
        with safe_open(str(sample.path), framework="pt") as fh:
            src_q = fh.get_tensor("hidden_states")
        assert torch.equal(q[:, :3].view(torch.uint8), src_q[:, :3].view(torch.uint8))
        pre = pre_from_post(_dataset_bf16(sample)[:, -1], weight)
        want_q, want_s = quantize(pre)
        assert torch.equal(q[:, 3].view(torch.uint8), want_q.view(torch.uint8))
        theirs = _their_dequantize(q[:, 3], scales[:, 3]).float()
        err = (theirs - pre.float()).norm(dim=-1) / pre.float().norm(dim=-1)
        assert float(err.max()) < 1 / 16
    bf16_src = tmp_path / "bf16"
    plain = write_dataset(bf16_src, num_samples=2, hidden_size=H, final_state="pre_norm")
    result = export_dataset(bf16_src, tmp_path / "spec-bf16", fmt="speculators",
                            dtype="float8_e4m3fn")  # fmt: skip
    assert (result.dtype, result.requantized) == ("float8_e4m3fn", (0, 1, 2, 3))
    for index in range(2):
        loaded = load_file(tmp_path / "spec-bf16" / speculators_relpath(index))
        sample = next(s for s in plain if torch.equal(s.input_ids, loaded["token_ids"]))
        want_q, want_s = quantize(sample.hidden)
        assert torch.equal(loaded["hidden_states"].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(loaded["hidden_states_scales"][..., 0], want_s)


def test_specforge_gets_the_dequantized_bfloat16(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    written = write_dataset(src, num_samples=3, hidden_size=H, storage=fp8_storage(4))
    result = export_dataset(src, dest, fmt="specforge")
    assert result.dtype == "bfloat16"
    for index in range(3):
        record = torch.load(dest / specforge_relpath(index), weights_only=True)
        sample = next(s for s in written if torch.equal(s.input_ids, record["input_ids"]))
        ours = _dataset_bf16(sample)
        t = sample.entry.num_tokens
        assert record["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(record["hidden_state"][0], ours[:, -1])
        assert torch.equal(record["aux_hidden_state"][0], ours[:, :-1].reshape(t, 3 * H))
        assert record["hidden_state"].untyped_storage().nbytes() == t * H * 2


def test_a_resumed_export_never_mixes_dtypes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    _pre_norm_fp8(src)
    argv = ["export", str(src), "--format", "speculators", "--to", str(dest)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hidden states written as float8_e4m3fn" in out
    assert "--hidden-states-backend fp8" in out
    assert main([*argv, "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "written as float8_e4m3fn, this one would write bfloat16" in err
    assert main([*argv, "--dtype", "float8_e4m3fn"]) == 0
    assert "0 written" in capsys.readouterr().out
    # An export made before hsx knew FP8 holds bfloat16: auto would now write FP8.
    info = orjson.loads((dest / EXPORT_INFO).read_bytes())
    del info["hidden_states_dtype"]
    (dest / EXPORT_INFO).write_bytes(orjson.dumps(info))
    with pytest.raises(DatasetError, match="Pass --dtype bfloat16 to extend it"):
        export_dataset(src, dest, fmt="speculators")


def _sinks(index: int, hidden: torch.Tensor) -> None:
    """Token 0 of every slot an attention sink: 2 channels 10,000x its median."""
    median = hidden[0].float().abs().median(dim=-1).values
    hidden[0, :, [3, 20]] = (1e4 * median).unsqueeze(-1).to(hidden.dtype)


def test_the_outliers_layout_goes_to_speculators_in_bfloat16_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FP8Transfer reads one scale per (token, slot) and no outliers: a pre-norm, all-FP8
    dataset of the outliers layout is exported as bfloat16 (exactly what hsx's reader
    yields: the outliers exact) by default, saying why and what --dtype float8_e4m3fn
    does instead."""
    src = tmp_path / "out"
    storage = fp8_storage(4, scales=PER_TOKEN_SLOT_OUTLIERS16)
    written = write_dataset(src, num_samples=3, hidden_size=H, storage=storage,
                            final_state="pre_norm", mutate=_sinks)  # fmt: skip
    argv = ["export", str(src), "--format", "speculators", "--to", str(tmp_path / "a")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hidden states written as bfloat16" in out
    assert "scales per_token_slot_outliers16" in out and "one scale per token and layer" in out
    assert "--dtype float8_e4m3fn writes FP8 anyway, quantizing slot(s) 0,1,2,3 here" in out
    for index in range(3):
        loaded = load_file(tmp_path / "a" / speculators_relpath(index))
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        assert set(loaded) == {"hidden_states", "token_ids"}
        assert torch.equal(loaded["hidden_states"], _dataset_bf16(sample))
        assert torch.equal(loaded["hidden_states"][0, :, [3, 20]], sample.hidden[0, :, [3, 20]])


def test_fp8_asked_for_requantizes_the_outliers_layout_per_token_slot(tmp_path: Path) -> None:
    """--dtype float8_e4m3fn: every slot quantized again, one scale per (token, slot), from
    the values the bf16 export writes (nothing copied: no byte of the dataset is in that
    layout); the sink rows' other values starve again, as speculators' own FP8 would."""
    src = tmp_path / "out"
    storage = fp8_storage(4, scales=PER_TOKEN_SLOT_OUTLIERS16)
    written = write_dataset(src, num_samples=3, hidden_size=H, storage=storage,
                            final_state="pre_norm", mutate=_sinks)  # fmt: skip
    result = export_dataset(src, tmp_path / "b", fmt="speculators", dtype="float8_e4m3fn")
    assert (result.dtype, result.requantized) == ("float8_e4m3fn", (0, 1, 2, 3))
    for index in range(3):
        loaded = load_file(tmp_path / "b" / speculators_relpath(index))
        sample = next(s for s in written if torch.equal(s.input_ids, loaded["token_ids"]))
        want_q, want_s = quantize(_dataset_bf16(sample))
        assert torch.equal(loaded["hidden_states"].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(loaded["hidden_states_scales"][..., 0], want_s)
        assert set(loaded) == {"hidden_states", "hidden_states_scales", "token_ids"}
