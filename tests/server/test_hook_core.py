"""The server hook's pure core: config, settings checks, per-pass planning, part layout and
the dump files it writes (checked with the client's own protocol checks)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    META_NAME,
    Storage,
    check_meta,
    check_part_sizes,
    parse_meta,
    parse_part_name,
    row_bytes,
    storage_params,
)
from hsx_async.server import hook_core
from hsx_async.server.hook_core import (
    BatchHidden,
    DumpRegistry,
    EncodedPass,
    HookConfig,
    PartWrite,
    PassRows,
    PrefillDumper,
    ReqView,
    ServerSettings,
    assemble_rows,
    check_hidden,
    check_server_settings,
    encode_bits,
    parse_aux_layers,
    request_namespace,
    request_storage,
    server_problems,
    uniform_storage,
    wants_dump,
)
from tests.server.fp8 import FP8_ALL, FP8_ALL_V3, FP8_AUX, check_fp8_dump, read_bf16_rows

NS = "w0"
H = 4
LAYERS = (2, 5)
K = len(LAYERS)


def view(
    rid: object,
    rows: int,
    *,
    start: int = 0,
    num_tokens: int | None = None,
    ns: object | None = NS,
    max_new_tokens: object = 0,
    last: bool = True,
    retracted: bool = False,
    aborted: bool = False,
) -> ReqView:
    return ReqView(
        rid=rid,
        ns=ns,
        num_tokens=num_tokens if num_tokens is not None else start + rows,
        max_new_tokens=max_new_tokens,
        start=start,
        rows=rows,
        last_chunk=last,
        retracted=retracted,
        aborted=aborted,
    )


def plain(rows: int) -> ReqView:
    """Ordinary traffic: no hsx_ns."""
    return view("user-req", rows, ns=None, max_new_tokens=128)


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


@pytest.mark.parametrize(
    ("env", "key", "fragment"),
    [
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


def test_parse_aux_layers() -> None:
    assert parse_aux_layers("1,2,3") == (1, 2, 3)


GOOD = ServerSettings(
    radix_cache=False,
    attn_dp_size=1,
    pp_size=1,
    two_batch_overlap=False,
    moe_a2a_backend="none",
    aux_capture="eagle3",
    aux_layer_ids_flag=None,
    disaggregation_mode="null",
)
CFG = HookConfig(dump_root=Path("/dev/shm/hsx"), aux_layers=LAYERS, model="m", server="test")


def test_good_settings_pass() -> None:
    check_server_settings(GOOD, CFG)
    check_server_settings(dataclasses.replace(GOOD, aux_layer_ids_flag=(1, 4)), CFG)


@pytest.mark.parametrize(("dp", "attn_tp"), [(8, 1), (2, 1), (1, 8), (1, 1)])
def test_dp_attention_with_attention_tp_1_is_allowed(dp: int, attn_tp: int) -> None:
    """tp8/dp8: each DP leader sees only its own requests and unpadded local rows."""
    assert (
        server_problems(dataclasses.replace(GOOD, attn_dp_size=dp, attn_tp_size=attn_tp), CFG) == []
    )


def test_dp_attention_with_attention_tp_above_1_names_the_fix() -> None:
    bad = dataclasses.replace(GOOD, attn_dp_size=2, attn_tp_size=4)
    [problem] = server_problems(bad, CFG)
    assert "pad rows" in problem and "--tp 8 --dp 8 --enable-dp-attention" in problem
    assert "one server per" not in problem


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"radix_cache": True}, "--disable-radix-cache"),
        ({"attn_dp_size": 2, "attn_tp_size": 2}, "attention-TP size 2"),
        ({"pp_size": 2}, "pipeline parallelism"),
        ({"two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"moe_a2a_backend": "deepep"}, "DeepEP"),
        ({"moe_a2a_backend": "deepep_v2"}, "DeepEP"),
        ({"disaggregation_mode": "prefill"}, "PD disaggregation"),
        ({"aux_capture": None}, "--enable-return-aux-hidden-states"),
        ({"aux_capture": "dflash"}, "EAGLE3"),
        ({"aux_layer_ids_flag": (1, 2, 3)}, "--return-aux-hidden-state-layer-ids names 3"),
    ],
)
def test_bad_settings_are_refused(change: dict[str, object], fragment: str) -> None:
    bad = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    problems = server_problems(bad, CFG)
    assert len(problems) == 1
    assert fragment in problems[0]
    with pytest.raises(ConfigError, match="cannot dump hidden states"):
        check_server_settings(bad, CFG)


def test_all_problems_reported_at_once() -> None:
    bad = dataclasses.replace(GOOD, radix_cache=True, pp_size=4)
    with pytest.raises(ConfigError) as info:
        check_server_settings(bad, CFG)
    assert "--disable-radix-cache" in str(info.value)
    assert "--pp-size 4" in str(info.value)


# --------------------------------------------------------------------------------------
# Marking
# --------------------------------------------------------------------------------------


def test_request_namespace() -> None:
    assert request_namespace(None) is None
    assert request_namespace({}) is None
    assert request_namespace({"other": 1}) is None
    assert request_namespace({"hsx_ns": "w0"}) == "w0"
    assert request_namespace({"hsx_ns": 7}) == 7
    assert request_namespace(["hsx_ns"]) is None


@pytest.mark.parametrize(
    ("rid", "params", "max_new", "expected"),
    [
        ("r1", {"hsx_ns": "w0"}, 0, True),
        ("r1", {"hsx_ns": "w0"}, 1, False),
        ("r1", {"hsx_ns": "w0"}, None, False),
        ("r1", None, 0, False),
        ("r1", {"hsx_ns": "../w0"}, 0, False),
        ("../r1", {"hsx_ns": "w0"}, 0, False),
        ("r1\n", {"hsx_ns": "w0"}, 0, False),
        (17, {"hsx_ns": "w0"}, 0, False),
    ],
)
def test_wants_dump(rid: object, params: object, max_new: object, expected: bool) -> None:
    assert wants_dump(rid, params, max_new) is expected


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
        (view("a", 2, ns="../etc"), "not a valid namespace"),
        (view("a", 2, ns="w/0"), "not a valid namespace"),
        (view("a", 2, ns=""), "not a valid namespace"),
        (view("a", 2, ns=5), "not a valid namespace"),
        (view("../a", 2), "rid is not valid"),
        (view("a/b", 2), "rid is not valid"),
        (view(".a", 2), "rid is not valid"),
        (view("a" * 129, 2), "rid is not valid"),
        (view(None, 2), "rid is not valid"),
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


# --------------------------------------------------------------------------------------
# Row layout
# --------------------------------------------------------------------------------------


def batch_arrays(total: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Distinct bit patterns for every (row, slice, column): aux [T, K*H], final [T, H]."""
    rng = np.random.default_rng(seed)
    aux = rng.integers(0, 2**16, size=(total, K * H), dtype=np.uint16)
    final = rng.integers(0, 2**16, size=(total, H), dtype=np.uint16)
    return aux, final


def expected_rows(aux: np.ndarray, final: np.ndarray, row: int, count: int) -> np.ndarray:
    out = np.zeros((count, K + 1, H), dtype=np.uint16)
    for r in range(count):
        for k in range(K):
            out[r, k] = aux[row + r, k * H : (k + 1) * H]
        out[r, K] = final[row + r]
    return out


def test_assemble_rows_layout() -> None:
    aux, final = batch_arrays(7)
    hidden = BatchHidden(aux=aux, final=final, aux_layers=LAYERS)
    got = assemble_rows(hidden, 2, 3)
    assert got.shape == (3, K + 1, H)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected_rows(aux, final, 2, 3))


def test_assemble_rows_from_a_full_stack_view() -> None:
    """Servers that hold [T, L, H] pass views; the result is the same stack."""
    rng = np.random.default_rng(3)
    full = rng.integers(0, 2**16, size=(5, K + 1, H), dtype=np.uint16).view(np.int16)
    hidden = BatchHidden(aux=full[:, :K, :], final=full[:, K, :], aux_layers=LAYERS)
    check_hidden(hidden, 5)
    np.testing.assert_array_equal(assemble_rows(hidden, 1, 4).view(np.int16), full[1:5])


@pytest.mark.parametrize(
    ("aux_shape", "final_shape", "dtype", "fragment"),
    [
        ((6, K * H), (5, H), np.uint16, "produced 6 aux and 5 final rows"),
        ((5, K * H), (5, H), np.float32, "expected little-endian bfloat16"),
        ((5, K * H), (5, H), ">u2", "expected little-endian bfloat16"),
        ((5, 3 * H), (5, H), np.uint16, "expected 2 layers"),
        ((5, K, H, 1), (5, H), np.uint16, "expected [T, K*H]"),
        ((5, K * H), (5, H, 1), np.uint16, "expected [T, K*H]"),
    ],
)
def test_check_hidden_rejects(
    aux_shape: tuple[int, ...], final_shape: tuple[int, ...], dtype: object, fragment: str
) -> None:
    hidden = BatchHidden(
        aux=np.zeros(aux_shape, dtype=dtype),  # type: ignore[call-overload]
        final=np.zeros(final_shape, dtype=dtype),  # type: ignore[call-overload]
        aux_layers=LAYERS,
    )
    with pytest.raises(DumpError, match=re.escape(fragment)):
        check_hidden(hidden, 5)


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def make_dumper(root: Path, max_open: int = 64) -> PrefillDumper:
    cfg = HookConfig(
        dump_root=root, aux_layers=LAYERS, model=None, server="sglang test", max_open=max_open
    )
    return PrefillDumper(cfg, model="tiny-model")


def loader(aux: np.ndarray, final: np.ndarray) -> Callable[[], BatchHidden]:
    return lambda: BatchHidden(aux=aux, final=final, aux_layers=LAYERS)


def read_dump(root: Path, rid: str) -> tuple[np.ndarray, int]:
    """The committed dump of ``rid``, checked as the client checks it; (rows, num_tokens)."""
    d = root / NS / rid
    meta = parse_meta((d / META_NAME).read_bytes())
    check_meta(meta, rid=rid, num_tokens=meta.num_tokens, hidden_size=H, aux_layers=LAYERS)
    sizes = {
        span: (d / name).stat().st_size
        for name in names(d)
        if (span := parse_part_name(name)) is not None
    }
    check_part_sizes(meta, sizes, row_bytes(H, LAYERS))
    assert meta.model == "tiny-model" and meta.server == "sglang test"
    assert not [n for n in names(d) if n.startswith(".")]
    parts = [
        np.fromfile(d / f"part-{s:010d}-{e:010d}.bin", dtype="<u2").reshape(e - s, K + 1, H)
        for s, e in meta.parts
    ]
    return np.concatenate(parts), meta.num_tokens


def test_dump_batch_writes_parts_and_commits(shm_root: Path) -> None:
    dumper = make_dumper(shm_root)
    # Pass 1: ordinary request, first chunk of "long", all of "short".
    aux1, final1 = batch_arrays(3 + 4 + 2, seed=1)
    reqs1 = [plain(3), view("long", 4, num_tokens=6, last=False), view("short", 2)]
    r1 = dumper.dump_batch(reqs1, loader(aux1, final1))
    assert (r1.committed, r1.rejects) == (["short"], [])
    assert not (shm_root / NS / "long" / META_NAME).exists()
    # Pass 2: last chunk of "long".
    aux2, final2 = batch_arrays(2, seed=2)
    r2 = dumper.dump_batch([view("long", 2, start=4, num_tokens=6)], loader(aux2, final2))
    assert (r2.committed, r2.rejects) == (["long"], [])

    rows, n = read_dump(shm_root, "long")
    assert n == 6
    want = np.concatenate([expected_rows(aux1, final1, 3, 4), expected_rows(aux2, final2, 0, 2)])
    np.testing.assert_array_equal(rows, want)
    rows, n = read_dump(shm_root, "short")
    np.testing.assert_array_equal(rows, expected_rows(aux1, final1, 7, 2))
    assert sorted(names(shm_root / NS)) == ["long", "short"]


def test_dump_batch_does_not_load_without_marked_rows(shm_root: Path) -> None:
    def boom() -> BatchHidden:
        raise AssertionError("loaded hidden states for a pass with nothing to dump")

    report = make_dumper(shm_root).dump_batch([plain(5), view("bad/rid", 2)], boom)
    assert report.parts == [] and len(report.rejects) == 1
    assert names(shm_root) == []


def test_refused_load_poisons_the_pass(shm_root: Path) -> None:
    dumper = make_dumper(shm_root)

    def refuse() -> BatchHidden:
        raise DumpError("ran through a CUDA graph")

    report = dumper.dump_batch([view("a", 2, num_tokens=4, last=False), view("b", 1)], refuse)
    assert [r.rid for r in report.rejects] == ["a", "b"]
    assert all("CUDA graph" in r.reason for r in report.rejects)
    assert "b" not in dumper.registry
    # "a" stays refused: its last chunk writes nothing.
    aux, final = batch_arrays(2)
    later = dumper.dump_batch([view("a", 2, start=2, num_tokens=4)], loader(aux, final))
    assert (later.parts, later.committed, later.rejects) == ([], [], [])
    assert names(shm_root) == []


def test_wrong_row_count_is_refused(shm_root: Path) -> None:
    aux, final = batch_arrays(4)
    report = make_dumper(shm_root).dump_batch([view("a", 3)], loader(aux, final))
    assert report.parts == []
    assert "produced 4 aux" in report.rejects[0].reason


def test_write_failure_is_reported_and_poisons(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("not a directory")
    aux, final = batch_arrays(2)
    dumper = make_dumper(root)
    report = dumper.dump_batch([view("a", 2, num_tokens=4, last=False)], loader(aux, final))
    assert report.parts == []
    assert "writing part-0000000000-0000000002.bin" in report.rejects[0].reason
    assert dumper.registry.plan([view("a", 2, start=2, num_tokens=4)]).writes == []


def test_planted_symlink_cannot_redirect_writes(shm_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (shm_root / NS).symlink_to(outside)
    aux, final = batch_arrays(2)
    report = make_dumper(shm_root).dump_batch([view("a", 2)], loader(aux, final))
    assert report.committed == []
    assert "not a plain directory" in report.rejects[0].reason
    assert names(outside) == []


def test_retracted_request_rewrites_same_parts(shm_root: Path) -> None:
    dumper = make_dumper(shm_root)
    aux, final = batch_arrays(4, seed=5)
    dumper.dump_batch([view("a", 4, num_tokens=8, last=False)], loader(aux, final))
    dumper.dump_batch(
        [view("a", 4, start=4, num_tokens=8, retracted=True)], loader(*batch_arrays(4))
    )
    aux2, final2 = batch_arrays(8, seed=6)
    r = dumper.dump_batch(
        [view("a", 4, num_tokens=8, last=False), view("b", 4)], loader(aux2, final2)
    )
    assert r.committed == ["b"]
    aux3, final3 = batch_arrays(4, seed=7)
    r = dumper.dump_batch([view("a", 4, start=4, num_tokens=8)], loader(aux3, final3))
    assert r.committed == ["a"]
    rows, _ = read_dump(shm_root, "a")
    want = np.concatenate([expected_rows(aux2, final2, 0, 4), expected_rows(aux3, final3, 0, 4)])
    np.testing.assert_array_equal(rows, want)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    chunk=st.integers(1, 17),
    seed=st.integers(0, 2**16),
)
def test_any_chunking_reassembles_every_prompt(
    lengths: list[int], chunk: int, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Prompts cut into passes of at most ``chunk`` tokens, several per pass, with an
    ordinary request in between: each committed dump is exactly its prompt's rows."""
    root = tmp_path_factory.mktemp("dumps")
    dumper = make_dumper(root)
    rng = np.random.default_rng(seed)
    truth = {
        f"r{i}": (
            rng.integers(0, 2**16, (n, K * H), np.uint16),
            rng.integers(0, 2**16, (n, H), np.uint16),
        )
        for i, n in enumerate(lengths)
    }
    done = {rid: 0 for rid in truth}
    committed: list[str] = []
    while any(done[rid] < len(truth[rid][0]) for rid in truth):
        reqs: list[ReqView] = [plain(1)]
        aux_rows, final_rows = [np.zeros((1, K * H), np.uint16)], [np.zeros((1, H), np.uint16)]
        budget = chunk
        for rid, (aux, final) in truth.items():
            n, start = len(aux), done[rid]
            take = min(n - start, budget)
            if take == 0:
                continue
            reqs.append(view(rid, take, start=start, num_tokens=n, last=start + take == n))
            aux_rows.append(aux[start : start + take])
            final_rows.append(final[start : start + take])
            done[rid] += take
            budget -= take
            if budget == 0:
                break
        report = dumper.dump_batch(
            reqs, loader(np.concatenate(aux_rows), np.concatenate(final_rows))
        )
        assert report.rejects == []
        committed += report.committed
    assert sorted(committed) == sorted(truth)
    for rid, (aux, final) in truth.items():
        rows, n = read_dump(root, rid)
        np.testing.assert_array_equal(rows, expected_rows(aux, final, 0, n))


# --------------------------------------------------------------------------------------
# FP8 storage (PROTOCOL §3, version 3)
# --------------------------------------------------------------------------------------


def finite_arrays(total: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Finite bfloat16 rows of very different magnitudes per (row, slice): aux [T, K*H],
    final [T, H], as bit patterns."""
    rng = np.random.default_rng(seed)
    gains = 10.0 ** rng.uniform(-3, 3, size=(total, K + 1, 1))
    rows = torch.from_numpy(rng.standard_normal((total, K + 1, H)) * gains).to(torch.bfloat16)
    bits = rows.view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(bits[:, :K].reshape(total, K * H)), np.ascontiguousarray(bits[:, K])


def fp8_params(storage: Storage) -> dict[str, object]:
    return {"hsx_ns": NS, **storage_params(storage)}


def fp8_view(rid: str, rows: int, storage: Storage, **kw: Any) -> ReqView:
    got, note = request_storage(fp8_params(storage), K + 1)
    assert (got, note) == (storage, "")
    return dataclasses.replace(view(rid, rows, **kw), storage=got)


def encoded_pass(aux: np.ndarray, final: np.ndarray, storage: Storage) -> EncodedPass:
    """The pass as a device would hand it over: every row's sections, [T, row bytes]."""
    rows = assemble_rows(BatchHidden(aux=aux, final=final, aux_layers=LAYERS), 0, len(aux))
    t = rows.shape[0]
    sections = tuple(
        np.frombuffer(b, dtype=np.uint8).reshape(t, -1) for b in encode_bits(rows, storage)
    )
    return EncodedPass(storage=storage, sections=sections, aux_layers=LAYERS, hidden_size=H)


def pass_loader(
    aux: np.ndarray, final: np.ndarray, encoded: Storage | None
) -> Callable[[], PassRows]:
    """The pass's rows as bfloat16, or already encoded for ``encoded``."""
    hidden: PassRows = (
        BatchHidden(aux=aux, final=final, aux_layers=LAYERS)
        if encoded is None
        else encoded_pass(aux, final, encoded)
    )
    return lambda: hidden


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


@pytest.mark.parametrize(
    "storage", [FP8_ALL, FP8_AUX, FP8_ALL_V3], ids=["all", "aux", "all-per_token_slot"]
)
@pytest.mark.parametrize("encoded", [False, True], ids=["host", "device"])
def test_fp8_parts_are_encode_rows_of_the_bf16_dump(
    shm_root: Path, storage: Storage, encoded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same two chunked passes, once for a bfloat16 request and once for an FP8 one:
    the FP8 parts are exactly encode_rows of the bfloat16 parts, whether the rows arrive as
    bfloat16 (quantized on the host, here in blocks of 3 rows and writev lists of 2
    buffers) or already encoded where they were produced."""
    monkeypatch.setattr(hook_core, "_ENCODE_BLOCK_BYTES", 3 * (K + 1) * H * 2)
    monkeypatch.setattr(hook_core, "IOV_MAX", 2)
    dumper = make_dumper(shm_root)
    passes = [finite_arrays(2 + 4, seed=1), finite_arrays(2, seed=2)]
    for rid, fp8 in (("bf", False), ("q", True)):

        def mk(rows: int, **kw: Any) -> ReqView:
            return fp8_view(rid, rows, storage, **kw) if fp8 else view(rid, rows, **kw)  # noqa: B023

        reqs = [[plain(2), mk(4, num_tokens=6, last=False)], [mk(2, start=4, num_tokens=6)]]
        for pass_reqs, (aux, final) in zip(reqs, passes, strict=True):
            load = pass_loader(aux, final, storage if fp8 and encoded else None)
            report = dumper.dump_batch(pass_reqs, load)
            assert report.rejects == [] and report.notes == []
    bf16 = read_bf16_rows(shm_root / NS / "bf")
    parts = check_fp8_dump(shm_root / NS / "q", bf16, storage, aux_layers=LAYERS)
    assert parts == [(0, 4), (4, 6)]
    assert parse_meta((shm_root / NS / "q" / META_NAME).read_bytes()).model == "tiny-model"


def test_unusable_fp8_request_is_dumped_bf16_and_noted_once(shm_root: Path) -> None:
    dumper = make_dumper(shm_root)
    bad = {"hsx_ns": NS, "hsx_dtype": FP8, "hsx_quantized": [0, 7]}
    storage, why = request_storage(bad, K + 1)
    assert storage == BF16_STORAGE and why

    def bad_view(rows: int, **kw: Any) -> ReqView:
        return dataclasses.replace(view("r", rows, **kw), storage=storage, storage_note=why)

    (aux1, final1), (aux2, final2) = finite_arrays(3, seed=1), finite_arrays(2, seed=2)
    r1 = dumper.dump_batch([bad_view(3, num_tokens=5, last=False)], loader(aux1, final1))
    r2 = dumper.dump_batch([bad_view(2, start=3, num_tokens=5)], loader(aux2, final2))
    assert [(n.rid, "past the 3 layer slots" in n.reason) for n in r1.notes] == [("r", True)]
    assert "dumped as bfloat16" in r1.notes[0].reason
    assert r2.notes == [] and r2.committed == ["r"]
    rows, _ = read_dump(shm_root, "r")  # a plain bfloat16 dump, checked as the client does
    want = np.concatenate([expected_rows(aux1, final1, 0, 3), expected_rows(aux2, final2, 0, 2)])
    np.testing.assert_array_equal(rows, want)


def test_encoded_pass_must_match_its_requests(shm_root: Path) -> None:
    dumper = make_dumper(shm_root)
    aux, final = finite_arrays(3)
    other = dumper.dump_batch(
        [fp8_view("a", 3, FP8_AUX)], lambda: encoded_pass(aux, final, FP8_ALL)
    )
    assert [r.rid for r in other.rejects] == ["a"]
    assert "encoded as float8_e4m3fn (slots 0,1,2; scales" in other.rejects[0].reason
    short = encoded_pass(aux, final, FP8_ALL)
    short = dataclasses.replace(short, sections=(short.sections[0][:2], *short.sections[1:]))
    cut = dumper.dump_batch([fp8_view("b", 3, FP8_ALL)], lambda: short)
    assert "encoded section hidden_states is uint8 (2, 12)" in cut.rejects[0].reason
    missing = dataclasses.replace(short, sections=short.sections[1:])
    gone = dumper.dump_batch([fp8_view("c", 3, FP8_ALL)], lambda: missing)
    assert f"encoded into {len(short.sections) - 1} sections" in gone.rejects[0].reason
    assert not (shm_root / NS).exists()  # refused before any file was written
