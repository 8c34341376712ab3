"""The packed object and manifest of :mod:`hsx_async.front.mooncake` (hs-connectors 0.9.0's
format; speculators' own reader reads it in tests/front/test_speculators.py), without
Mooncake."""

from __future__ import annotations

import sys

import orjson
import pytest
import torch

from hsx_async.front.mooncake import (
    ALIGN,
    MAX_REASON,
    MooncakeError,
    MooncakeOptions,
    Publisher,
    error_manifest,
    error_payload,
    pack,
)


def test_sections_start_at_64_byte_offsets_in_order() -> None:
    hidden = torch.randn(5, 4, 3).to(torch.bfloat16)  # 120 bytes: the next section moves on
    ids = torch.arange(5, dtype=torch.int64)
    manifest, blob = pack("hsx-a", {"hidden_states": hidden, "token_ids": ids})
    specs = manifest["tensors"]
    assert list(specs) == ["hidden_states", "token_ids"]
    assert specs["hidden_states"] == {
        "shape": [5, 4, 3],
        "dtype": "torch.bfloat16",
        "nbytes": 120,
        "offset": 0,
    }
    assert specs["token_ids"] == {"shape": [5], "dtype": "torch.int64", "nbytes": 40, "offset": 128}
    assert manifest["handle"] == "hsx-a" and manifest["version"] == 1
    assert manifest["metadata"] == {
        "num_tokens": 5,
        "total_aligned_bytes": 192,
        "extract_mode": "prompt_only",
    }
    assert len(blob) == 192 and len(blob) % ALIGN == 0
    for name, tensor in (("hidden_states", hidden), ("token_ids", ids)):
        spec = specs[name]
        raw = blob[spec["offset"] : spec["offset"] + spec["nbytes"]]
        back = torch.frombuffer(bytearray(raw), dtype=tensor.dtype).view(tensor.shape)
        assert torch.equal(back, tensor)
    assert blob[120:128] == bytes(8) and blob[168:] == bytes(24)  # padding is zeros


def test_an_aligned_section_gets_no_padding() -> None:
    manifest, blob = pack("h", {"token_ids": torch.arange(8, dtype=torch.int64)})
    assert manifest["metadata"]["total_aligned_bytes"] == len(blob) == 64


def test_the_error_marker_is_the_readers_json_and_bounded() -> None:
    assert orjson.loads(error_payload("sample fault (x): y")) == {"error": "sample fault (x): y"}
    assert len(orjson.loads(error_payload("z" * 10_000))["error"]) == MAX_REASON
    manifest = error_manifest("hsx-b")
    assert manifest["handle"] == "hsx-b" and manifest["version"] == 1


def test_without_mooncake_the_publisher_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if absent
    with pytest.raises(MooncakeError, match="pip install mooncake-transfer-engine-non-cuda"):
        Publisher(MooncakeOptions(master="127.0.0.1:1"))


def test_a_segment_below_mooncakes_least_is_refused_before_setup() -> None:
    with pytest.raises(MooncakeError, match="raise --mooncake-segment-mib to 16"):
        Publisher(MooncakeOptions(master="127.0.0.1:1", segment_bytes=1 << 20))
