"""Dataset file names and the safetensors layout (PROTOCOL §4), checked with the real library."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from hsx_async.dataset.layout import (
    ALIGN,
    FileLayout,
    build_layout,
    canonical_id,
    data_relpath,
    sample_key,
)

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_KEY_CHARS = re.compile(r"[A-Za-z0-9._~-]+")
_IDS = st.one_of(st.integers(0, 2**64 - 1), st.text(min_size=1, max_size=300))


def load_sample(path: Path) -> tuple[dict[str, npt.NDArray[Any]], dict[str, str]]:
    """A sample file read by safetensors itself: every tensor as numpy (``hidden_states``
    as its raw bf16 bits in uint16, since numpy has no bfloat16) and the metadata."""
    import torch

    out: dict[str, npt.NDArray[Any]] = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for name in f.keys():  # noqa: SIM118 - safe_open has keys() but no __iter__
            tensor = f.get_tensor(name)
            if tensor.dtype == torch.bfloat16:
                out[name] = tensor.view(torch.int16).numpy().view(np.uint16)
            else:
                out[name] = tensor.numpy()
    with safe_open(str(path), framework="numpy") as f:  # the numpy reader agrees
        for name in ("input_ids", "loss_mask"):
            if name in out:
                np.testing.assert_array_equal(f.get_tensor(name), out[name])
    return out, meta


def sample_bytes(
    layout: FileLayout,
    input_ids: npt.NDArray[np.int64],
    hidden: npt.NDArray[np.uint16],
    mask: npt.NDArray[np.uint8] | None,
) -> bytes:
    """What the writer must produce: header, ids (LE int64), hidden bf16 bits, mask."""
    tail = b"" if mask is None else mask.astype(np.uint8).tobytes()
    return layout.header + input_ids.astype("<i8").tobytes() + hidden.astype("<u2").tobytes() + tail


# --- keys -------------------------------------------------------------------------------


def test_canonical_id() -> None:
    assert canonical_id(5) == canonical_id("5") == "5"


@pytest.mark.parametrize("sid", ["abc", "a.b-c_d", "0", 12345, "x" * 100])
def test_safe_ids_are_their_own_key(sid: str | int) -> None:
    assert sample_key(sid) == str(sid)


@pytest.mark.parametrize(
    "sid", ["x" * 101, ".hidden", "..", ".", "-a", "a/b", "a b", "../../etc", "é", "a\x00", "~"]
)
def test_unsafe_ids_get_a_hashed_key(sid: str) -> None:
    key = sample_key(sid)
    assert key != sid
    assert re.fullmatch(r"[A-Za-z0-9._-]{0,80}~[0-9a-f]{16}", key)


def test_keys_never_start_with_dot_or_dash() -> None:
    for sid in (".hidden", "..", ".", "-a"):
        assert sample_key(sid)[0].isalnum() or sample_key(sid)[0] == "_", sid


def test_ids_that_sanitise_alike_get_distinct_keys() -> None:
    keys = {sample_key(s) for s in ["a/b", "a b", "a:b", "a_b", "a\\b", "a?b"]}
    assert len(keys) == 6
    long_a, long_b = "y" * 150 + "a", "y" * 150 + "b"
    assert sample_key(long_a) != sample_key(long_b)


@FAST
@given(_IDS)
def test_keys_are_file_name_safe(sid: int | str) -> None:
    key = sample_key(sid)
    assert _KEY_CHARS.fullmatch(key)
    assert key not in (".", "..")
    assert len(key) <= 120
    assert len(Path(data_relpath(key)).name.encode()) <= 255
    assert key == sample_key(canonical_id(sid))


@FAST
@given(st.lists(_IDS, min_size=2, max_size=20, unique_by=canonical_id))
def test_distinct_ids_never_share_a_key(ids: list[int | str]) -> None:
    keys = [sample_key(s) for s in ids]
    assert len(set(keys)) == len(keys)


_NEAR = st.text(alphabet="ab/._~-", min_size=1, max_size=8)


@FAST
@given(_NEAR, _NEAR)
def test_near_identical_ids_never_share_a_key(a: str, b: str) -> None:
    if a != b:
        assert sample_key(a) != sample_key(b)


def test_data_relpath() -> None:
    rel = data_relpath("abc")
    assert re.fullmatch(r"data/[0-9a-f]{2}/abc\.safetensors", rel)
    assert data_relpath("abc") == rel
    buckets = {data_relpath(f"k{i}").split("/")[1] for i in range(2000)}
    assert len(buckets) > 200  # the 256-way fan-out is used


# --- layout -----------------------------------------------------------------------------


def _parse_header(layout: FileLayout) -> dict[str, Any]:
    n = int.from_bytes(layout.header[:8], "little")
    assert n == len(layout.header) - 8
    body = layout.header[8:]
    assert body.rstrip(b" ") == body.rstrip()  # padded with spaces only
    parsed: dict[str, Any] = orjson.loads(body)
    return parsed


@FAST
@given(
    sid=_IDS,
    t=st.integers(1, 70_000),
    hidden=st.integers(1, 16_384),
    aux=st.lists(st.integers(0, 200), min_size=1, max_size=5),
    mask=st.booleans(),
)
def test_layout_offsets(sid: int | str, t: int, hidden: int, aux: list[int], mask: bool) -> None:
    lay = build_layout(
        sample_id=sid, num_tokens=t, hidden_size=hidden, aux_layers=aux, has_loss_mask=mask
    )
    layers = len(aux) + 1
    assert lay.hidden_offset % ALIGN == 0
    assert len(lay.header) % 8 == 0
    assert lay.hidden_offset == len(lay.header) + 8 * t
    assert lay.hidden_bytes == t * layers * hidden * 2
    assert lay.mask_bytes == (t if mask else 0)
    assert lay.total_bytes == lay.hidden_offset + lay.hidden_bytes + lay.mask_bytes
    header = _parse_header(lay)
    assert header["__metadata__"] == {
        "id": canonical_id(sid),
        "aux_layers": ",".join(map(str, aux)),
        "protocol": "4",
        "final_state": "post_norm",
    }
    assert header["input_ids"] == {"dtype": "I64", "shape": [t], "data_offsets": [0, 8 * t]}
    end = 8 * t + lay.hidden_bytes
    assert header["hidden_states"] == {
        "dtype": "BF16",
        "shape": [t, layers, hidden],
        "data_offsets": [8 * t, end],
    }
    if mask:
        assert header["loss_mask"] == {"dtype": "U8", "shape": [t], "data_offsets": [end, end + t]}
    else:
        assert "loss_mask" not in header


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sid=_IDS,
    t=st.integers(1, 40),
    hidden=st.integers(1, 48),
    aux=st.lists(st.integers(0, 80), min_size=1, max_size=4),
    with_mask=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_file_loads_with_safetensors(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    sid: int | str,
    t: int,
    hidden: int,
    aux: list[int],
    with_mask: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    layers = len(aux) + 1
    ids = rng.integers(0, 2**63 - 1, size=t, dtype=np.int64)
    # Any 16 bits, NaN patterns included: the file must carry them unchanged.
    hid = rng.integers(0, 2**16, size=(t, layers, hidden)).astype(np.uint16)
    mask = rng.integers(0, 2, size=t, dtype=np.uint8) if with_mask else None
    lay = build_layout(
        sample_id=sid, num_tokens=t, hidden_size=hidden, aux_layers=aux, has_loss_mask=with_mask
    )
    data = sample_bytes(lay, ids, hid, mask)
    assert len(data) == lay.total_bytes
    assert data[lay.hidden_offset : lay.hidden_offset + 2] == hid.reshape(-1)[:1].tobytes()
    path = tmp_path_factory.getbasetemp() / "hypothesis-sample.safetensors"
    path.write_bytes(data)  # one file, rewritten per example
    tensors, meta = load_sample(path)
    assert meta == {
        "id": canonical_id(sid),
        "aux_layers": ",".join(map(str, aux)),
        "protocol": "4",
        "final_state": "post_norm",
    }
    np.testing.assert_array_equal(tensors["input_ids"], ids)
    np.testing.assert_array_equal(tensors["hidden_states"], hid)
    if mask is None:
        assert set(tensors) == {"input_ids", "hidden_states"}
    else:
        np.testing.assert_array_equal(tensors["loss_mask"], mask)


def test_real_model_shape_is_aligned(tmp_path: Path) -> None:
    """EAGLE-3 on a 7168-wide model with three aux layers: the production layout."""
    lay = build_layout(
        sample_id="s-81", num_tokens=3, hidden_size=7168, aux_layers=(2, 30, 58), has_loss_mask=True
    )
    assert lay.hidden_offset == ALIGN
    ids = np.array([1, 2, 3], dtype=np.int64)
    hid = (np.arange(3 * 4 * 7168) % 65536).astype(np.uint16).reshape(3, 4, 7168)
    mask = np.array([0, 1, 1], dtype=np.uint8)
    path = tmp_path / "s.safetensors"
    path.write_bytes(sample_bytes(lay, ids, hid, mask))
    tensors, meta = load_sample(path)
    assert meta["aux_layers"] == "2,30,58"
    np.testing.assert_array_equal(tensors["hidden_states"], hid)
    np.testing.assert_array_equal(tensors["loss_mask"], mask)
