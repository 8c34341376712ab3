"""The one dump path: a dumper plans each pass and writes its parts and commits, checked
with the client's own protocol checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.errors import DumpError
from hsx_async.protocol import BF16_STORAGE, FP8, META_NAME, Storage, parse_meta
from hsx_async.server import rows as rows_module
from hsx_async.server.hook_core import ReqView, request_storage
from hsx_async.server.rows import BatchHidden
from tests.server.fp8 import FP8_ALL, FP8_ALL_V3, FP8_AUX, check_fp8_dump, read_bf16_rows
from tests.server.passes import (
    LAYERS,
    NS,
    H,
    K,
    batch_arrays,
    encoded_pass,
    expected_rows,
    finite_arrays,
    fp8_view,
    loader,
    make_dumper,
    names,
    pass_loader,
    plain,
    read_dump,
    view,
)

# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


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
    monkeypatch.setattr(rows_module, "_BLOCK_BYTES", 3 * (K + 1) * H * 2)
    monkeypatch.setattr(rows_module, "IOV_MAX", 2)
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
