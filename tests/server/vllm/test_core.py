"""The vLLM connector's pure core: marks, layer plans, and a dump the client accepts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
    Storage,
    parse_meta,
    storage_params,
)
from hsx_async.quantize import encode_rows
from hsx_async.run.dumps.dump import validate_dump
from hsx_async.server.hook_core import HookConfig
from hsx_async.server.vllm.core import (
    LayerPlan,
    Target,
    check_prefix_caching,
    hook_config,
    layer_plan,
    marked_target,
    parse_target_path,
    write_dump,
)
from tests.server.fp8 import check_fp8_dump


def test_marks() -> None:
    assert marked_target(None) is None
    assert marked_target({"hidden_states_path": "/x"}) is None  # someone else's params
    assert marked_target({"hsx_ns": "w0", "hsx_rid": "r-1"}) == Target("w0", "r-1")
    for bad in (
        {"hsx_ns": "../x", "hsx_rid": "r"},
        {"hsx_ns": "w0", "hsx_rid": "a/b"},
        {"hsx_ns": "w0"},
        {"hsx_rid": "r"},
        {"hsx_ns": ["w0"], "hsx_rid": "r"},
        {"hsx_ns": "w0", "hsx_rid": "r\n"},
    ):
        reason = marked_target(bad)
        assert isinstance(reason, str) and "does not match" in reason


def test_layer_plan() -> None:
    plan = layer_plan([2, 30, 58, 61], 61, 7168)
    assert plan.aux_layers == (2, 30, 58) and plan.capture_ids == (2, 30, 58, 61)
    with pytest.raises(ConfigError, match="followed by 61"):
        layer_plan([2, 30, 58], 61, 7168)
    with pytest.raises(ConfigError, match="followed by 61"):
        layer_plan(None, 61, 7168)
    with pytest.raises(ConfigError, match="strictly ascending"):
        layer_plan([30, 2, 61], 61, 7168)
    with pytest.raises(ConfigError, match="strictly ascending"):
        layer_plan([2, 2, 61], 61, 7168)
    with pytest.raises(ConfigError, match="negative layer"):
        layer_plan([-1, 2, 61], 61, 7168)


def test_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="--no-enable-prefix-caching"):
        check_prefix_caching(True)
    check_prefix_caching(False)


def config(root: Path, plan: LayerPlan, server: str = "vllm 0.32.0") -> HookConfig:
    return hook_config(root, plan, model="m", server=server)


def test_a_written_dump_passes_the_clients_checks(shm_root: Path) -> None:
    plan = layer_plan([1, 3, 5, 6], 6, 8)
    rows = np.arange(5 * 4 * 8, dtype=np.int16).view(np.uint8).reshape(5, -1)
    report = write_dump(config(shm_root, plan), Target("w0", "r1"), [rows], num_tokens=5,
                        plan=plan)  # fmt: skip
    assert report.committed == ["r1"] and report.rejects == []
    rid_dir = shm_root / "w0" / "r1"
    meta = parse_meta((rid_dir / "meta.json").read_bytes())
    assert meta.final_state == "pre_norm" and (meta.model, meta.server) == ("m", "vllm 0.32.0")
    meta_bytes = (rid_dir / "meta.json").read_bytes()
    dump = validate_dump(rid_dir, meta_bytes, rid="r1", num_tokens=5, hidden_size=8,
                         aux_layers=(1, 3, 5))  # fmt: skip
    assert dump.meta.parts == ((0, 5),)
    short = write_dump(config(shm_root, plan), Target("w0", "r2"), [rows[:-1]], num_tokens=5,
                       plan=plan)  # fmt: skip
    assert [r.rid for r in short.rejects] == ["r2"] and short.committed == []
    assert "uint8 (4, 64), expected uint8 (5, 64)" in short.rejects[0].reason
    assert not (shm_root / "w0" / "r2").exists()


# FP8 storage: L = 4 capture ids (aux 1, 3, 5 and the final state 6), H = 8.
VLLM_FP8_AUX = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT_OUTLIERS16)
VLLM_FP8_AUX_V3 = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT)


def test_marks_read_the_storage() -> None:
    params = {"hsx_ns": "w0", "hsx_rid": "r", **storage_params(VLLM_FP8_AUX_V3)}
    assert marked_target(params, 4) == Target("w0", "r", VLLM_FP8_AUX_V3)
    outliers = {"hsx_ns": "w0", "hsx_rid": "r", **storage_params(VLLM_FP8_AUX)}
    assert marked_target(outliers, 4) == Target("w0", "r", VLLM_FP8_AUX)
    assert marked_target(params) == Target("w0", "r")  # no layer count: bfloat16
    bad = marked_target({**params, "hsx_quantized": [0, 4]}, 4)
    assert isinstance(bad, Target) and bad.storage == BF16_STORAGE
    assert "past the 4 layer slots" in bad.note


def test_target_path_round_trips() -> None:
    for target in (
        Target("w0", "r-1"),
        Target("w0", "r-1", VLLM_FP8_AUX),
        Target("w0", "r-1", VLLM_FP8_AUX_V3),
    ):
        assert parse_target_path(target.path) == target
    assert (
        Target("w0", "r", VLLM_FP8_AUX).path == "w0/r/float8_e4m3fn:0,1,2:per_token_slot_outliers16"
    )
    assert parse_target_path("w0/r/float8_e4m3fn:0,1,2").storage == VLLM_FP8_AUX_V3
    for bad in ("w0", "../x/r", "w0/r/bfloat17:0", "w0/r/float8_e4m3fn:", "w0/r/x/y",
                "w0/r/float8_e4m3fn:0:per_block"):  # fmt: skip
        with pytest.raises(DumpError):
            parse_target_path(bad)


def test_an_fp8_dump_is_encode_rows_of_its_rows(shm_root: Path) -> None:
    plan = layer_plan([1, 3, 5, 6], 6, 8)
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.standard_normal((5, 4, 8))).to(torch.bfloat16)
    bits = rows.view(torch.int16).numpy().view(np.uint16)
    sections = [t.view(torch.uint8).reshape(5, -1).numpy() for t in encode_rows(rows, VLLM_FP8_AUX)]
    target = Target("w0", "q", VLLM_FP8_AUX)
    write_dump(config(shm_root, plan), target, sections, num_tokens=5, plan=plan)
    check_fp8_dump(shm_root / "w0" / "q", bits, VLLM_FP8_AUX, aux_layers=(1, 3, 5))
    meta = parse_meta((shm_root / "w0" / "q" / "meta.json").read_bytes())
    assert meta.final_state == "pre_norm"
    cut = write_dump(config(shm_root, plan), Target("w0", "q2", VLLM_FP8_AUX), sections[:2],
                     num_tokens=5, plan=plan)  # fmt: skip
    assert "encoded into 2 sections" in cut.rejects[0].reason
    assert not (shm_root / "w0" / "q2").exists()
