"""The one FP8 quantizer (hsx_async/quantize.py) and the storage it serves (protocol.Storage)."""

from __future__ import annotations

import math

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.errors import DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    Storage,
    parse_meta,
    parse_storage,
    requested_storage,
    storage_from_metadata,
    storage_metadata,
    storage_params,
)
from hsx_async.quantize import (
    FP8_MAX,
    SCALE_MIN,
    assemble,
    dequantize,
    encode_rows,
    quantize,
    rounding_error,
)


def _rows(t: int = 64, layers: int = 4, hidden: int = 256, seed: int = 0) -> torch.Tensor:
    """Hidden states as models make them: slots differing in magnitude by orders, heavy
    tails (a few channels 20× the rest), one outlier token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((t, layers, hidden), generator=gen)
    x[..., :4] *= 20.0
    x *= torch.logspace(-2, 2, layers).view(1, layers, 1)
    x[0] *= 50.0
    return x.to(torch.bfloat16)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return ((a - b).square().sum(-1) / b.square().sum(-1)).sqrt()


def test_every_vector_is_scaled_to_the_full_range() -> None:
    """Each (token, slot) vector's largest magnitude is stored as ±448 and its scale is
    amax / 448: a scale per vector, not per token or per tensor."""
    x = _rows()
    q, scale = quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == x.shape[:-1]
    assert bool((q.float().abs().amax(-1) == FP8_MAX).all())
    torch.testing.assert_close(scale, x.float().abs().amax(-1) / FP8_MAX, rtol=0, atol=0)


def test_round_trip_error_is_what_e4m3_allows() -> None:
    """3 mantissa bits: each element is off by at most 1/16 of its magnitude (half a
    step), so a vector's relative RMS error stays under 1/16, and is ~2.5 % typically."""
    x = _rows()
    q, scale = quantize(x)
    back = dequantize(q, scale, torch.float32)
    err = _rel_rms(back, x)
    assert float(err.max()) < 1 / 16
    assert 0.01 < float(err.mean()) < 0.04
    cos = torch.nn.functional.cosine_similarity(back, x.float(), dim=-1)
    assert float(cos.min()) > 0.998


def test_the_estimate_from_stored_values_tracks_the_measured_error() -> None:
    """rounding_error needs only q; on model-like rows it is within 15 % of the truth
    (3–4 % here, and on plain Gaussian rows)."""
    x = _rows(t=256)
    q, scale = quantize(x)
    measured = _rel_rms(dequantize(q, scale, torch.float32), x)
    estimate = rounding_error(q)
    ratio = float(estimate.mean() / measured.mean())
    assert 0.85 < ratio < 1.15


def test_zero_vectors_get_a_finite_positive_scale_and_stay_zero() -> None:
    x = torch.zeros((3, 2, 16), dtype=torch.bfloat16)
    q, scale = quantize(x)
    assert bool((scale == SCALE_MIN).all())
    assert bool((dequantize(q, scale) == 0).all())


def test_values_that_would_round_past_448_saturate_instead_of_becoming_nan() -> None:
    """x / scale may land a hair above 448 after rounding; the clamp keeps it finite on
    every implementation (CPU torch saturates, others turn an overflow into NaN)."""
    x = torch.tensor([[1.0, -1.0, 0.999, 3e-3]], dtype=torch.float32)
    q, _ = quantize(x)
    assert bool(torch.isfinite(q.float()).all())
    assert q.float()[0, 0] == FP8_MAX and q.float()[0, 1] == -FP8_MAX


def test_a_non_finite_input_gives_a_non_finite_scale() -> None:
    """What verify --deep reports: the quantizer does not hide a NaN in the rows."""
    x = torch.ones((2, 8))
    x[1, 3] = float("nan")
    _, scale = quantize(x)
    assert math.isfinite(float(scale[0])) and math.isnan(float(scale[1]))


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(1, 63), seed=st.integers(0, 1000))
def test_rows_quantize_independently_so_parts_and_blocks_agree(cut: int, seed: int) -> None:
    """Where a prompt is split (chunked prefill, the writer's blocks) changes no byte."""
    x = _rows(seed=seed)
    storage = Storage(FP8, (0, 1, 2))
    whole = encode_rows(x, storage)
    pieces = [encode_rows(x[:cut], storage), encode_rows(x[cut:], storage)]
    for i, tensor in enumerate(whole):
        assert torch.equal(
            tensor.view(torch.uint8), torch.cat([p[i] for p in pieces]).view(torch.uint8)
        )


@pytest.mark.parametrize("slots", [(0, 1, 2, 3), (0, 1, 2), (1, 3)])
def test_sections_have_the_storages_shapes_and_assemble_back(slots: tuple[int, ...]) -> None:
    x = _rows(t=5)
    storage = Storage(FP8, slots)
    sections = storage.sections(4, 256)
    tensors = encode_rows(x, storage)
    assert len(tensors) == len(sections)
    for tensor, section in zip(tensors, sections, strict=True):
        assert tensor.is_contiguous()
        assert tensor.numel() * tensor.element_size() == 5 * section.row_bytes
    assert storage.row_bytes(4, 256) == sum(s.row_bytes for s in sections)
    q, scales = tensors[0], tensors[1]
    kept = tensors[2] if len(tensors) == 3 else None
    back = assemble(q, scales.unsqueeze(-1), kept, storage)
    for slot in range(4):
        if slot in slots:
            assert float(_rel_rms(back[:, slot], x[:, slot]).max()) < 1 / 16
        else:  # the kept slots are the very bytes
            assert torch.equal(back[:, slot], x[:, slot])


def test_bf16_storage_encodes_the_rows_unchanged() -> None:
    x = _rows(t=3)
    (out,) = encode_rows(x, BF16_STORAGE)
    assert torch.equal(out, x)
    assert BF16_STORAGE.row_bytes(4, 256) == 4 * 256 * 2


def test_fp8_all_slots_is_about_half_the_bytes_of_bf16() -> None:
    """Kimi-K2.5's shape: 4 × 7168 values a token."""
    bf16 = BF16_STORAGE.row_bytes(4, 7168)
    assert Storage(FP8, (0, 1, 2, 3)).row_bytes(4, 7168) / bf16 == pytest.approx(0.5, abs=0.001)
    assert Storage(FP8, (0, 1, 2)).row_bytes(4, 7168) / bf16 == pytest.approx(0.625, abs=0.001)


@pytest.mark.parametrize(
    ("dtype", "slots", "match"),
    [
        ("bfloat16", (0,), "quantizes no slot"),
        (FP8, (), "not ascending"),
        (FP8, (2, 1), "not ascending"),
        (FP8, (1, 1), "not ascending"),
        (FP8, (-1, 0), "not ascending"),
        ("float16", (), "is not one of"),
    ],
)
def test_storage_refuses_what_no_file_could_hold(
    dtype: str, slots: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Storage(dtype, slots)


def test_storage_round_trips_through_metadata_and_request_params() -> None:
    storage = Storage(FP8, (0, 2))
    assert storage_from_metadata(storage_metadata(storage), "f") == storage
    assert storage_from_metadata({}, "f") == BF16_STORAGE
    assert requested_storage(storage_params(storage), 3) == (storage, "")
    assert storage_params(BF16_STORAGE) == {}
    assert parse_storage(None, None, "p") == BF16_STORAGE
    with pytest.raises(DumpError, match="f: quantized 'x' is not a list"):
        storage_from_metadata({"dtype": FP8, "quantized": "x"}, "f")
    assert storage_metadata(storage)["scales"] == "per_token_slot"


def test_a_scale_layout_this_version_does_not_know_is_refused() -> None:
    """A file, dump or dataset naming another scale layout (per tensor, per block) would be
    dequantized wrongly: refused, saying which layout this hsx reads."""
    meta = {"dtype": FP8, "quantized": "0,1", "scales": "per_tensor"}
    with pytest.raises(
        DumpError, match="f: scales is 'per_tensor'; this hsx reads 'per_token_slot'"
    ):
        storage_from_metadata(meta, "f")
    with pytest.raises(DumpError, match=r"meta\.json: scales is 'per_block'"):
        parse_meta(
            orjson.dumps(
                {"protocol": 3, "rid": "r", "num_tokens": 1, "hidden_size": 4,
                 "aux_layers": [1], "dtype": FP8, "quantized": [0], "scales": "per_block",
                 "parts": [[0, 1]]}
            )
        )  # fmt: skip


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"hsx_dtype": "float16"}, "expected one of"),
        ({"hsx_dtype": FP8}, "expected a list of slot indices"),
        ({"hsx_dtype": FP8, "hsx_quantized": [0, 9]}, "past the 4 layer slots"),
        ({"hsx_dtype": FP8, "hsx_quantized": [True]}, "expected a list"),
    ],
)
def test_a_request_the_hook_cannot_honour_falls_back_to_bf16_with_a_reason(
    params: dict[str, object], why: str
) -> None:
    """The hook dumps bfloat16 then, and the client quantizes: no attempt is lost."""
    storage, reason = requested_storage(params, 4)
    assert storage == BF16_STORAGE
    assert why in reason
