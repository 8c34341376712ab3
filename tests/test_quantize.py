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
    OUTLIER_NONE,
    OUTLIERS,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
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
    quantize_outliers,
    rounding_error,
)
from tests.fp8_reference import reference_outliers16


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


LAYOUTS = [PER_TOKEN_SLOT, PER_TOKEN_SLOT_OUTLIERS16]


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(1, 63), seed=st.integers(0, 1000), scales=st.sampled_from(LAYOUTS))
def test_rows_quantize_independently_so_parts_and_blocks_agree(
    cut: int, seed: int, scales: str
) -> None:
    """Where a prompt is split (chunked prefill, the writer's blocks) changes no byte."""
    x = _rows(seed=seed)
    storage = Storage(FP8, (0, 1, 2), scales)
    whole = encode_rows(x, storage)
    pieces = [encode_rows(x[:cut], storage), encode_rows(x[cut:], storage)]
    for i, tensor in enumerate(whole):
        assert torch.equal(
            tensor.view(torch.uint8), torch.cat([p[i] for p in pieces]).view(torch.uint8)
        )


@pytest.mark.parametrize("scales", LAYOUTS)
@pytest.mark.parametrize("slots", [(0, 1, 2, 3), (0, 1, 2), (1, 3)])
def test_sections_have_the_storages_shapes_and_assemble_back(
    slots: tuple[int, ...], scales: str
) -> None:
    x = _rows(t=5)
    storage = Storage(FP8, slots, scales)
    sections = storage.sections(4, 256)
    tensors = encode_rows(x, storage)
    assert len(tensors) == len(sections)
    for tensor, section in zip(tensors, sections, strict=True):
        assert tensor.is_contiguous()
        assert tensor.numel() * tensor.element_size() == 5 * section.row_bytes
    assert storage.row_bytes(4, 256) == sum(s.row_bytes for s in sections)
    named = {section.name: tensor for section, tensor in zip(sections, tensors, strict=True)}
    back = assemble(
        named["hidden_states"],
        named["hidden_states_scales"].unsqueeze(-1),
        named.get("hidden_states_unquantized"),
        storage,
        torch.bfloat16,
        outlier_index=named.get("hidden_states_outlier_index"),
        outlier_values=named.get("hidden_states_outlier_values"),
    )
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
    """Kimi-K2.5's shape: 4 × 7168 values a token. The outliers layout adds 16 × (2 + 2)
    bytes per vector: 7,236 instead of 7,172 (+0.89 %)."""
    bf16 = BF16_STORAGE.row_bytes(4, 7168)
    assert Storage(FP8, (0, 1, 2, 3)).row_bytes(4, 7168) / bf16 == pytest.approx(0.5, abs=0.001)
    assert Storage(FP8, (0, 1, 2)).row_bytes(4, 7168) / bf16 == pytest.approx(0.625, abs=0.001)
    outliers = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)
    assert outliers.row_bytes(4, 7168) == 4 * 7236 == 28944
    assert outliers.row_bytes(4, 7168) / bf16 == pytest.approx(0.5047, abs=0.0001)
    assert Storage(FP8, (0, 1, 2, 3)).row_bytes(4, 7168) == 4 * 7172


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


@pytest.mark.parametrize("scales", LAYOUTS)
def test_storage_round_trips_through_metadata_and_request_params(scales: str) -> None:
    storage = Storage(FP8, (0, 2), scales)
    assert storage_from_metadata(storage_metadata(storage), "f") == storage
    assert storage_from_metadata({}, "f") == BF16_STORAGE
    assert requested_storage(storage_params(storage), 3) == (storage, "")
    assert storage_params(BF16_STORAGE) == {}
    assert parse_storage(None, None, "p") == BF16_STORAGE
    with pytest.raises(DumpError, match="f: quantized 'x' is not a list"):
        storage_from_metadata({"dtype": FP8, "quantized": "x"}, "f")
    assert storage_metadata(storage)["scales"] == scales


def test_version_3_keys_name_per_token_slot_and_only_that() -> None:
    """A version-3 client's request (hsx_dtype, hsx_quantized) gets the per_token_slot
    layout it reads; the outliers layout is asked for in hsx_storage, a key a version-3
    hook does not know: it dumps bfloat16 (the client quantizes) rather than FP8 of a
    layout the dataset does not hold."""
    old = {"hsx_dtype": FP8, "hsx_quantized": [0, 1]}
    assert requested_storage(old, 3) == (Storage(FP8, (0, 1), PER_TOKEN_SLOT), "")
    assert Storage(FP8, (0, 1)) == Storage(FP8, (0, 1), PER_TOKEN_SLOT)
    assert storage_params(Storage(FP8, (0, 1))) == old
    new = storage_params(Storage(FP8, (0, 1), PER_TOKEN_SLOT_OUTLIERS16))
    assert new == {
        "hsx_storage": {"dtype": FP8, "quantized": [0, 1], "scales": PER_TOKEN_SLOT_OUTLIERS16}
    }
    assert "hsx_dtype" not in new  # what a version-3 hook reads: absent, so bfloat16


def test_a_scale_layout_this_version_does_not_know_is_refused() -> None:
    """A file, dump or dataset naming another scale layout (per tensor, per block) would be
    dequantized wrongly: refused, saying which layouts this hsx reads."""
    meta = {"dtype": FP8, "quantized": "0,1", "scales": "per_tensor"}
    with pytest.raises(
        DumpError,
        match="f: scales is 'per_tensor'; this hsx reads 'per_token_slot_outliers16' and "
        "'per_token_slot' only",
    ):
        storage_from_metadata(meta, "f")
    with pytest.raises(ValueError, match="scales 'per_block' is not one of"):
        Storage(FP8, (0,), "per_block")
    with pytest.raises(ValueError, match="no scales"):
        Storage("bfloat16", (), PER_TOKEN_SLOT)
    # version 3 defines one layout: a protocol-3 meta.json naming the outliers one is wrong
    with pytest.raises(DumpError, match="which protocol 3 does not define"):
        parse_meta(
            orjson.dumps(
                {"protocol": 3, "rid": "r", "num_tokens": 1, "hidden_size": 4,
                 "aux_layers": [1], "dtype": FP8, "quantized": [0],
                 "scales": PER_TOKEN_SLOT_OUTLIERS16, "parts": [[0, 1]]}
            )
        )  # fmt: skip
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
        ({"hsx_storage": [FP8]}, "hsx_storage is"),
        ({"hsx_storage": {"dtype": FP8, "quantized": [0], "scales": "x"}}, "scales is 'x'"),
        (
            {"hsx_storage": {"dtype": FP8, "quantized": [7], "scales": PER_TOKEN_SLOT_OUTLIERS16}},
            "past the 4 layer slots",
        ),
    ],
)
def test_a_request_the_hook_cannot_honour_falls_back_to_bf16_with_a_reason(
    params: dict[str, object], why: str
) -> None:
    """The hook dumps bfloat16 then, and the client quantizes: no attempt is lost."""
    storage, reason = requested_storage(params, 4)
    assert storage == BF16_STORAGE
    assert why in reason


# -- the outliers layout (per_token_slot_outliers16, PROTOCOL §3 version 4) ---------------


def _sink_rows(t: int, hidden: int, ratio: float, seed: int, channels: int = 4) -> torch.Tensor:
    """Model-like rows [t, 4, H] whose token 0 carries ``channels`` massive channels
    ``ratio``× its median (an attention sink), both signs."""
    x = _rows(t=t, hidden=hidden, seed=seed).float()
    gen = torch.Generator().manual_seed(seed + 1)
    where = torch.randperm(hidden, generator=gen)[:channels]
    median = x[0].abs().median(dim=-1).values
    sign = torch.where(torch.arange(channels) % 2 == 0, 1.0, -1.0)
    x[0][:, where] = ratio * median.unsqueeze(-1) * sign
    return x.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    hidden=st.sampled_from([1, 5, 16, 17, 64, 300, 1024]),
    ratio=st.sampled_from([0.0, 1e3, 1e4, 3e4]),
    ties=st.booleans(),
)
def test_the_outliers_quantizer_is_byte_identical_to_an_independent_implementation(
    seed: int, hidden: int, ratio: float, ties: bool
) -> None:
    """PROTOCOL §3's rule written again from its text in numpy (tests/fp8_reference.py:
    sort, float32 division, an e4m3fn encoder of its own): the same bytes in every
    section, with massive channels, ties at the boundary (values repeated), zero vectors
    and fewer channels than outliers."""
    x = _sink_rows(6, hidden, ratio, seed, channels=min(4, hidden)) if ratio else _rows(
        t=6, hidden=hidden, seed=seed)  # fmt: skip
    if ties:  # every value of token 1 slot 0 the same; token 2 slot 1 a few values only
        x[1, 0] = x[1, 0, 0]
        x[2, 1] = x[2, 1].float().sign().to(torch.bfloat16) * 3
    x[3, 2] = 0
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    want = reference_outliers16(x.view(torch.int16).numpy().view("<u2"))
    assert bytes(_bits(q).numpy()) == want.q.tobytes()
    assert bytes(_bits(scale).numpy()) == want.scales.tobytes()
    assert bytes(_bits(index).numpy()) == want.channels.tobytes()
    assert bytes(_bits(values).numpy()) == want.values.tobytes()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), hidden=st.sampled_from([1, 7, 300]), ratio=st.sampled_from(
    [0.0, 1e4]))  # fmt: skip
def test_the_per_token_slot_quantizer_is_byte_identical_to_the_independent_one(
    seed: int, hidden: int, ratio: float
) -> None:
    """Version 3's layout is the same rule with no outliers (r = the largest |x|)."""
    x = _sink_rows(6, hidden, ratio, seed, channels=1) if ratio else _rows(
        t=6, hidden=hidden, seed=seed)  # fmt: skip
    x[3, 2] = 0
    q, scale = quantize(x)
    want = reference_outliers16(x.view(torch.int16).numpy().view("<u2"), k=0)
    assert bytes(_bits(q).numpy()) == want.q.tobytes()
    assert bytes(_bits(scale).numpy()) == want.scales.tobytes()


def test_massive_channels_no_longer_starve_the_rest_of_their_vector() -> None:
    """At 10,000× the median, one scale per vector stores a fifth of a sink row's other
    values as e4m3fn subnormals or zero; the outliers layout keeps the massive channels
    exact and the others as an ordinary row's (bench/fp8.py measures it at H 7168)."""
    x = _sink_rows(64, 1024, 1e4, seed=3)
    rest = torch.ones(1024, dtype=torch.bool)
    rest[x[0, 0].float().abs() > 100 * x[0, 0].float().abs().median()] = False
    assert int((~rest).sum()) == 4
    q_row, s_row = quantize(x)
    q, s, index, values = quantize_outliers(x, OUTLIERS)

    def subnormal_share(codes: torch.Tensor) -> float:
        return float((codes[0, :, rest].float().abs() < 2.0**-6).double().mean())

    def error(back: torch.Tensor, token: int) -> float:
        return float(_rel_rms(back[token, :, rest], x[token, :, rest]).mean())

    old = dequantize(q_row, s_row, torch.float32)
    new = dequantize(q, s, torch.float32, index, values)
    assert subnormal_share(q_row) > 0.15
    assert subnormal_share(q) < 0.002
    assert error(new, 0) < 1.2 * error(new, 1)  # within 1.2x of an ordinary row
    assert error(old, 0) > error(new, 0)
    # the massive channels themselves: exact
    assert torch.equal(new[0, :, ~rest], x[0, :, ~rest].float())


def test_outliers_are_the_channels_above_the_17th_largest_and_saturate_their_q() -> None:
    x = _sink_rows(4, 256, 3e4, seed=5)
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    mag = x.float().abs()
    r = mag.sort(dim=-1, descending=True).values[..., OUTLIERS]
    torch.testing.assert_close(scale, r / FP8_MAX, rtol=0, atol=0)
    idx = index.to(torch.int64)
    used = idx != 0xFFFF
    assert bool((used.sum(-1) == (mag > r.unsqueeze(-1)).sum(-1)).all())
    assert bool((idx[..., 1:] > idx[..., :-1])[used[..., 1:]].all())  # ascending
    got = torch.where(used, x.gather(-1, idx.clamp_max(255)), torch.zeros((), dtype=x.dtype))
    assert torch.equal(_bits(got), _bits(values))
    at = q.float().gather(-1, idx.clamp_max(255))
    assert bool((at[used].abs() == FP8_MAX).all())
    # and the largest of the rest is 448: the audit's check holds in this layout too
    rest = q.float().abs().scatter(-1, idx.clamp_max(255), 0.0)
    assert bool((rest.amax(-1) == FP8_MAX).all())


def test_fewer_channels_than_outliers_are_all_kept_exact() -> None:
    x = _rows(t=3, hidden=8)
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    assert bool((scale == SCALE_MIN).all())
    back = dequantize(q, scale, torch.float32, index, values)
    assert torch.equal(back, x.float())


def test_a_nan_is_an_outlier_and_more_nans_than_outliers_give_a_non_finite_scale() -> None:
    x = _rows(t=2, hidden=64)
    x[0, 0, 5] = float("nan")
    x[1, 0, :20] = float("nan")
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    assert math.isfinite(float(scale[0, 0])) and int(index[0, 0, 0]) <= 5
    assert bool(torch.isnan(values[0, 0].float()).any())
    assert not math.isfinite(float(scale[1, 0]))
    back = dequantize(q, scale, torch.float32, index, values)
    assert math.isnan(float(back[0, 0, 5]))
    assert bool(torch.isfinite(back[0, 1:]).all())


def test_a_damaged_outlier_index_is_ignored_by_the_reader_not_a_crash() -> None:
    """An index past the vector (a damaged file; verify --deep names it) is skipped."""
    x = _sink_rows(2, 64, 1e4, seed=1)
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    index[0, 0, 0] = 900
    back = dequantize(q, scale, torch.float32, index, values)
    assert bool(torch.isfinite(back).all())


def test_the_estimate_counts_the_exact_outliers() -> None:
    """rounding_error with the outlier sections: the massive channels are exact power, so a
    sink vector's estimated error is that of its whole energy, as measured."""
    x = _sink_rows(256, 1024, 1e3, seed=2)
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    measured = _rel_rms(dequantize(q, scale, torch.float32, index, values), x)
    estimate = rounding_error(q, scale, index, values)
    ratio = float(estimate.mean() / measured.mean())
    assert 0.85 < ratio < 1.15, ratio
    assert float(estimate[0].max()) < 1e-3  # the sink vectors: almost all energy exact


def test_more_infinities_than_outliers_give_an_infinite_scale_as_the_rule_does() -> None:
    """PROTOCOL §3: m = |x|, r the 17th largest: with more than 16 infinite values r, and
    so the scale, is infinite (the copy refuses it), and no channel is above r. (Turning
    ±inf into bfloat16's largest value first stored them as finite ±3.39e38.)"""
    x = _rows(t=2, hidden=64)
    x[0, 0, :20] = float("inf")
    x[1, 0, :10] = float("-inf")
    x[1, 0, 10:20] = float("inf")
    q, scale, index, values = quantize_outliers(x, OUTLIERS)
    assert math.isinf(float(scale[0, 0])) and math.isinf(float(scale[1, 0]))
    assert bool((index[:, 0] == OUTLIER_NONE).all())  # nothing is above an infinite r
    assert bool((values[:, 0].float() == 0).all())
    assert bool(torch.isfinite(scale[:, 1:]).all())  # the other slots keep their scales
    back = dequantize(q, scale, torch.float32, index, values)
    assert not bool(torch.isfinite(back[:, 0]).any())


def test_a_few_infinities_are_outliers_kept_as_they_are() -> None:
    x = _rows(t=1, hidden=64)
    x[0, 0, 3] = float("-inf")
    _, scale, index, values = quantize_outliers(x, OUTLIERS)
    assert math.isfinite(float(scale[0, 0]))
    assert 3 in index[0, 0].tolist()
    assert float(values[0, 0][index[0, 0] == 3]) == float("-inf")
