"""The vLLM connector's pure core: marks, layer plans, and a dump the client accepts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import parse_meta
from hsx_async.run.dump import validate_dump
from hsx_async.server.vllm.core import (
    Target,
    check_prefix_caching,
    dump_root,
    layer_plan,
    marked_target,
    write_dump,
)


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


def test_prefix_caching_and_root(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="--no-enable-prefix-caching"):
        check_prefix_caching(True)
    check_prefix_caching(False)
    monkeypatch.setenv("HSX_DUMP_ROOT", "relative/dir")
    with pytest.raises(ConfigError, match="relative"):
        dump_root()
    monkeypatch.setenv("HSX_DUMP_ROOT", "/dev/shm/x")
    assert dump_root() == Path("/dev/shm/x")


def test_a_written_dump_passes_the_clients_checks(shm_root: Path) -> None:
    plan = layer_plan([1, 3, 5, 6], 6, 8)
    rows = np.arange(5 * 4 * 8, dtype=np.int16)
    write_dump(shm_root, Target("w0", "r1"), rows.data.cast("B"), num_tokens=5, plan=plan,
               model="m", server="vllm 0.32.0")  # fmt: skip
    rid_dir = shm_root / "w0" / "r1"
    meta = parse_meta((rid_dir / "meta.json").read_bytes())
    assert meta.final_state == "pre_norm"
    meta_bytes = (rid_dir / "meta.json").read_bytes()
    dump = validate_dump(rid_dir, meta_bytes, rid="r1", num_tokens=5, hidden_size=8,
                         aux_layers=(1, 3, 5))  # fmt: skip
    assert dump.meta.parts == ((0, 5),)
    with pytest.raises(DumpError, match="bytes of rows"):
        write_dump(shm_root, Target("w0", "r2"), rows[:-1].data.cast("B"), num_tokens=5,
                   plan=plan, model="m", server="s")  # fmt: skip
    assert not (shm_root / "w0" / "r2").exists()
