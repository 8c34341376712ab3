"""The server hook's pure core: its settings from the environment, which requests it
dumps and the per-pass planning of their parts. No file is touched: the dumps it plans are
tested in test_dumper.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import BF16_STORAGE, FP8
from hsx_async.server.hook_core import (
    DEFAULT_PASS_ROWS,
    DEVICE_STACK_BY_DTYPE,
    DumpRegistry,
    HookConfig,
    PartWrite,
    ReqView,
    dump_root_from_env,
    request_storage,
    uniform_storage,
)
from tests.server.fp8 import FP8_ALL, FP8_AUX
from tests.server.passes import NS, fp8_params, fp8_view, plain, view

# --------------------------------------------------------------------------------------
# Config and settings
# --------------------------------------------------------------------------------------


def test_config_from_env_defaults() -> None:
    cfg = HookConfig.from_env({"HSX_AUX_LAYERS": " 2, 30 ,58 "}, server="sglang 0.5.23")
    assert cfg.dump_root == Path("/dev/shm/hsx")
    assert cfg.aux_layers == (2, 30, 58)
    assert cfg.model is None
    assert cfg.server == "sglang 0.5.23"


def test_config_from_env_overrides() -> None:
    cfg = HookConfig.from_env(
        {"HSX_AUX_LAYERS": "0", "HSX_DUMP_ROOT": "/mnt/shm/x", "HSX_MODEL_NAME": "m"}, server="s"
    )
    assert (cfg.dump_root, cfg.aux_layers, cfg.model) == (Path("/mnt/shm/x"), (0,), "m")


def test_device_stack_unset_follows_the_measured_default_per_dtype() -> None:
    """Issue 40: on an H200 the device stack dumped faster for both dtypes measured (7.85
    against 6.92 GB/s for bfloat16, 8.26 against 5.42 for float32): it is the default."""
    cfg = HookConfig.from_env({"HSX_AUX_LAYERS": "2"}, server="s")
    assert cfg.device_stack is None
    assert DEVICE_STACK_BY_DTYPE["bfloat16"] and DEVICE_STACK_BY_DTYPE["float32"]
    for dtype in ("bfloat16", "torch.bfloat16", "float32", "torch.float32", "float16"):
        assert cfg.device_stack_for(dtype) is True
    assert cfg.device_stack_for("float64") is False  # not measured, not in the table


@pytest.mark.parametrize(("text", "stack"), [("0", False), ("off", False), ("1", True)])
def test_device_stack_set_overrides_the_default(text: str, stack: bool) -> None:
    cfg = HookConfig.from_env({"HSX_AUX_LAYERS": "2", "HSX_DEVICE_STACK": text}, server="s")
    assert cfg.device_stack is stack
    assert {cfg.device_stack_for(d) for d in ("bfloat16", "float32", "float64")} == {stack}


def test_pass_rows_default_and_override() -> None:
    cfg = HookConfig.from_env({"HSX_AUX_LAYERS": "2"}, server="s")
    assert cfg.pass_rows == DEFAULT_PASS_ROWS == 16384
    env = {"HSX_AUX_LAYERS": "2", "HSX_PASS_ROWS": " 8192 "}
    assert HookConfig.from_env(env, server="s").pass_rows == 8192
    env["HSX_PASS_ROWS"] = "0"
    assert HookConfig.from_env(env, server="s").pass_rows == 0


@pytest.mark.parametrize(
    ("env", "key", "fragment"),
    [
        ({"HSX_AUX_LAYERS": "2", "HSX_PASS_ROWS": "-1"}, "HSX_PASS_ROWS", "out of range"),
        ({"HSX_AUX_LAYERS": "2", "HSX_PASS_ROWS": "16k"}, "HSX_PASS_ROWS", "not an integer"),
        ({"HSX_AUX_LAYERS": "2", "HSX_DEVICE_STACK": "auto"}, "HSX_DEVICE_STACK", "not a switch"),
        ({}, "HSX_AUX_LAYERS", "is not set"),
        ({"HSX_AUX_LAYERS": "  "}, "HSX_AUX_LAYERS", "is not set"),
        ({"HSX_AUX_LAYERS": "2,x"}, "HSX_AUX_LAYERS", "not a comma-separated list"),
        ({"HSX_AUX_LAYERS": "2,,3"}, "HSX_AUX_LAYERS", "not a comma-separated list"),
        ({"HSX_AUX_LAYERS": "-1,3"}, "HSX_AUX_LAYERS", "negative"),
        ({"HSX_AUX_LAYERS": "30,2"}, "HSX_AUX_LAYERS", "ascending"),
        ({"HSX_AUX_LAYERS": "2,2"}, "HSX_AUX_LAYERS", "ascending"),
        ({"HSX_AUX_LAYERS": "2", "HSX_DUMP_ROOT": "shm/hsx"}, "HSX_DUMP_ROOT", "relative"),
    ],
)
def test_config_from_env_rejects(env: dict[str, str], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        HookConfig.from_env(env, server="s")
    assert info.value.key == key


@pytest.mark.parametrize(
    ("env", "root"),
    [
        ({}, Path("/dev/shm/hsx")),
        ({"HSX_DUMP_ROOT": ""}, Path("/dev/shm/hsx")),
        ({"HSX_DUMP_ROOT": "  "}, Path("/dev/shm/hsx")),
        ({"HSX_DUMP_ROOT": " /mnt/shm/x "}, Path("/mnt/shm/x")),
    ],
)
def test_dump_root_unset_or_blank_is_the_default(env: dict[str, str], root: Path) -> None:
    """HSX_DUMP_ROOT is read one way by every hook and server (it was three: blank as the
    default, blank as an error, and a read of its own)."""
    assert dump_root_from_env(env) == root


@pytest.mark.parametrize("text", ["shm/hsx", ".", "~/hsx"])
def test_relative_dump_root_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="relative; give the absolute dump root") as info:
        dump_root_from_env({"HSX_DUMP_ROOT": text})
    assert info.value.key == "HSX_DUMP_ROOT"


# --------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------


def test_mixed_batch_offsets() -> None:
    reg = DumpRegistry()
    plan = reg.plan([plain(3), view("a", 5), plain(1), view("b", 2)])
    assert plan.total_rows == 11
    assert plan.writes == [
        PartWrite(NS, "a", batch_row=3, start=0, end=5, last=True),
        PartWrite(NS, "b", batch_row=9, start=0, end=2, last=True),
    ]
    assert plan.rejects == []


def test_unmarked_requests_are_untouched() -> None:
    reg = DumpRegistry()
    plan = reg.plan([plain(4), plain(2)])
    assert (plan.writes, plan.rejects, plan.total_rows, len(reg)) == ([], [], 6, 0)


def test_chunked_prompt_commits_after_last_chunk() -> None:
    reg = DumpRegistry()
    p1 = reg.plan([view("a", 4, num_tokens=10, last=False)])
    assert p1.writes == [PartWrite(NS, "a", 0, 0, 4, last=False)]
    assert reg.record(p1.writes[0]) is None
    p2 = reg.plan([plain(2), view("a", 4, start=4, num_tokens=10, last=False)])
    assert p2.writes == [PartWrite(NS, "a", 2, 4, 8, last=False)]
    assert reg.record(p2.writes[0]) is None
    p3 = reg.plan([view("a", 2, start=8, num_tokens=10, last=True)])
    done = reg.record(p3.writes[0])
    assert done is not None
    assert done.parts == [(0, 4), (4, 8), (8, 10)]
    assert done.complete
    assert "a" not in reg


def test_retracted_request_starts_over() -> None:
    reg = DumpRegistry()
    reg.record(reg.plan([view("a", 4, num_tokens=10, last=False)]).writes[0])
    # The pass that computed rows [4, 8) is discarded: the request was retracted.
    plan = reg.plan([view("a", 4, start=4, num_tokens=10, last=False, retracted=True)])
    assert (plan.writes, plan.rejects) == ([], [])
    assert "a" not in reg
    # Rescheduled from row 0, in one pass this time.
    plan = reg.plan([view("a", 10)])
    assert plan.writes == [PartWrite(NS, "a", 0, 0, 10, last=True)]
    done = reg.record(plan.writes[0])
    assert done is not None and done.parts == [(0, 10)]


@pytest.mark.parametrize("last", [True, False])
def test_aborted_request_never_commits(last: bool) -> None:
    reg = DumpRegistry()
    reg.record(reg.plan([view("a", 4, num_tokens=10, last=False)]).writes[0])
    plan = reg.plan([view("a", 4, start=4, num_tokens=10, last=last, aborted=True)])
    assert (plan.writes, plan.rejects) == ([], [])
    assert "a" not in reg


def test_aborted_first_pass_writes_nothing() -> None:
    reg = DumpRegistry()
    plan = reg.plan([view("a", 3, aborted=True), view("b", 2)])
    assert [w.rid for w in plan.writes] == ["b"]
    assert plan.writes[0].batch_row == 3


@pytest.mark.parametrize(
    ("req", "fragment"),
    [
        (view("a", 2, ns="../etc"), "hsx_ns '../etc' does not match"),
        (view("a", 2, ns="w/0"), "hsx_ns"),
        (view("a", 2, ns=""), "hsx_ns"),
        (view("a", 2, ns=5), "hsx_ns"),
        (view("../a", 2), "does not match"),
        (view("a/b", 2), "does not match"),
        (view(".a", 2), "does not match"),
        (view("a" * 129, 2), "does not match"),
        (view(None, 2), "does not match"),
    ],
)
def test_bad_names_write_nothing(req: ReqView, fragment: str) -> None:
    reg = DumpRegistry()
    plan = reg.plan([req, view("ok", 1)])
    assert [w.rid for w in plan.writes] == ["ok"]
    assert len(plan.rejects) == 1
    assert fragment in plan.rejects[0].reason
    assert len(reg) == 1  # only "ok"


def test_rejected_name_is_shortened_for_the_log() -> None:
    plan = DumpRegistry().plan([view("x" * 500, 1)])
    assert len(plan.rejects[0].rid) <= 80


def test_not_prefill_only_is_reported_once_and_keeps_no_state() -> None:
    reg = DumpRegistry()
    plan = reg.plan([view("a", 3, num_tokens=9, max_new_tokens=16, last=False)])
    assert plan.writes == []
    assert "max_new_tokens is 16" in plan.rejects[0].reason
    assert "a" not in reg
    # Later chunks, and decode steps mixed into prefill passes, are skipped silently.
    for start, rows in ((3, 3), (6, 3), (9, 1), (10, 1)):
        later = reg.plan([view("a", rows, start=start, num_tokens=9, max_new_tokens=16)])
        assert (later.writes, later.rejects) == ([], [])
    assert len(reg) == 0


def test_bad_names_are_reported_on_the_first_pass_only() -> None:
    reg = DumpRegistry()
    assert len(reg.plan([view("../a", 2, num_tokens=4, last=False)]).rejects) == 1
    later = reg.plan([view("../a", 2, start=2, num_tokens=4)])
    assert (later.writes, later.rejects, len(reg)) == ([], [], 0)


def test_prefix_cache_hit_is_refused() -> None:
    reg = DumpRegistry()
    plan = reg.plan([view("a", 4, start=6, num_tokens=10)])
    assert plan.writes == []
    assert "--disable-radix-cache" in plan.rejects[0].reason
    assert "a" not in reg


def test_gap_between_chunks_poisons_the_request() -> None:
    reg = DumpRegistry()
    reg.record(reg.plan([view("a", 4, num_tokens=12, last=False)]).writes[0])
    gap = reg.plan([view("a", 4, start=5, num_tokens=12, last=False)])
    assert gap.writes == []
    assert "[5, 9)" in gap.rejects[0].reason
    # Later chunks are skipped without another log line; the last one forgets the rid.
    assert reg.plan([view("a", 3, start=9, num_tokens=12, last=True)]).rejects == []
    assert "a" not in reg


def test_last_chunk_short_of_the_prompt_is_refused() -> None:
    reg = DumpRegistry()
    plan = reg.plan([view("a", 4, num_tokens=10, last=True)])
    assert plan.writes == []
    assert "last chunk ends at row 4" in plan.rejects[0].reason
    assert "a" not in reg


def test_rows_past_the_prompt_are_refused() -> None:
    reg = DumpRegistry()
    plan = reg.plan([view("a", 12, num_tokens=10, last=False)])
    assert plan.writes == []
    assert "of 10" in plan.rejects[0].reason


def test_registry_cap_evicts_oldest() -> None:
    reg = DumpRegistry(max_open=2)
    for rid in ("a", "b"):
        reg.record(reg.plan([view(rid, 2, num_tokens=4, last=False)]).writes[0])
    plan = reg.plan([view("c", 2, num_tokens=4, last=False)])
    assert [r.rid for r in plan.rejects] == ["a"]
    assert "evicted" in plan.rejects[0].reason
    assert "a" not in reg and "b" in reg and "c" in reg
    # The evicted request's next chunk no longer continues a known dump.
    again = reg.plan([view("a", 2, start=2, num_tokens=4)])
    assert again.writes == [] and "--disable-radix-cache" in again.rejects[0].reason


def test_record_unknown_part_raises() -> None:
    with pytest.raises(DumpError, match="no dump in progress"):
        DumpRegistry().record(PartWrite(NS, "a", 0, 0, 1, last=True))


def test_registry_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_open"):
        DumpRegistry(max_open=0)


def test_request_storage_reads_the_custom_params() -> None:
    assert request_storage(None, 3) == (BF16_STORAGE, "")
    assert request_storage({"hsx_ns": NS}, 3) == (BF16_STORAGE, "")
    assert request_storage(fp8_params(FP8_AUX), 3) == (FP8_AUX, "")
    for bad, fragment in (
        ({"hsx_dtype": "float8_e5m2", "hsx_quantized": [0]}, "float8_e5m2"),
        ({"hsx_dtype": FP8, "hsx_quantized": [0, 3]}, "past the 3 layer slots"),
        ({"hsx_dtype": FP8, "hsx_quantized": [1, 0]}, "ascending"),
        ({"hsx_dtype": FP8}, "expected a list of slot indices"),
    ):
        storage, why = request_storage({"hsx_ns": NS, **bad}, 3)
        assert storage == BF16_STORAGE and fragment in why


def test_uniform_storage_of_a_pass() -> None:
    a, b = fp8_view("a", 1, FP8_ALL), fp8_view("b", 1, FP8_ALL)
    assert uniform_storage([plain(2), a, b]) == FP8_ALL
    assert uniform_storage([a, fp8_view("c", 1, FP8_AUX)]) is None
    assert uniform_storage([a, view("d", 1)]) is None  # a bfloat16 request in the pass
    assert uniform_storage([view("d", 1), plain(1)]) is None
    assert uniform_storage([dataclasses.replace(view("d", 1), aborted=True), a]) == FP8_ALL
