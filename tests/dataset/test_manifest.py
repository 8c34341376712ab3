"""manifest.jsonl / quarantine.jsonl: durable appends, torn-line repair, corruption reports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_async.dataset.layout import data_relpath, sample_key
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    AppendLog,
    ManifestEntry,
    QuarantineEntry,
    load_done,
    log_files,
    log_name,
    read_log,
    read_manifest,
    read_quarantine,
    shard_index_of,
)
from hsx_async.errors import DatasetError

XXH = "0123456789abcdef"


def _entry(i: int | str, path: str | None = None) -> ManifestEntry:
    return ManifestEntry(i, path or data_relpath(sample_key(i)), 10, 1000 + len(str(i)), XXH)


@pytest.fixture
def log(tmp_path: Path) -> Iterator[AppendLog]:
    lg = AppendLog(tmp_path / "manifest.jsonl")
    try:
        yield lg
    finally:
        lg.close()


# --- names ------------------------------------------------------------------------------


def test_log_names() -> None:
    assert log_name(MANIFEST) == "manifest.jsonl"
    assert log_name(QUARANTINE, 3, 16) == "quarantine.shard-00003-of-00016.jsonl"
    assert shard_index_of(Path(log_name(QUARANTINE, 3, 16))) == 3
    assert shard_index_of(Path("manifest.jsonl")) == 0


def test_log_files_finds_every_shard_and_nothing_else(tmp_path: Path) -> None:
    for name in [
        "manifest.jsonl",
        "manifest.shard-00001-of-00002.jsonl",
        "manifest.shard-00000-of-00002.jsonl",
        "quarantine.jsonl",
        "manifest.jsonl.bak",
        "manifest.shard-1-of-2.jsonl",
        "xmanifest.jsonl",
    ]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "manifest.shard-00002-of-00004.jsonl").mkdir()
    (tmp_path / "manifest.shard-00003-of-00004.jsonl").symlink_to(tmp_path / "manifest.jsonl")
    assert [p.name for p in log_files(tmp_path, MANIFEST)] == [
        "manifest.jsonl",
        "manifest.shard-00000-of-00002.jsonl",
        "manifest.shard-00001-of-00002.jsonl",
    ]
    assert [p.name for p in log_files(tmp_path, QUARANTINE)] == ["quarantine.jsonl"]
    assert log_files(tmp_path / "missing", MANIFEST) == []


def test_log_files_ignores_a_name_with_a_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "manifest.jsonl\n").write_bytes(_entry(1).to_line())
    assert log_files(tmp_path, MANIFEST) == []


# --- append and read --------------------------------------------------------------------


def test_append_then_read(tmp_path: Path, log: AppendLog) -> None:
    entries = [_entry(1), _entry("a/b"), _entry(2**64 - 1)]
    log.append([entries[0].to_line()])
    log.append([e.to_line() for e in entries[1:]], sync=False)
    log.append([])  # nothing to write is not an error
    assert read_manifest(tmp_path) == entries
    raw = orjson.loads((tmp_path / "manifest.jsonl").read_bytes().splitlines()[0])
    assert raw == {"id": 1, "path": data_relpath("1"), "num_tokens": 10, "bytes": 1001,
                   "xxh3_64": XXH}  # fmt: skip


def test_quarantine_round_trip(tmp_path: Path) -> None:
    q = AppendLog(tmp_path / "quarantine.jsonl")
    try:
        entries = [QuarantineEntry(None, 3, "not valid JSON"), QuarantineEntry("x", 4, "empty")]
        q.append(e.to_line() for e in entries)
    finally:
        q.close()
    assert read_quarantine(tmp_path) == entries


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.builds(
            lambda sid, *rest: ManifestEntry(sid, data_relpath(sample_key(sid)), *rest),
            st.one_of(st.integers(0, 2**64 - 1), st.text(max_size=20)),
            st.integers(0, 2**40),
            st.integers(0, 2**50),
            st.integers(0, 2**64 - 1).map("{:016x}".format),
        ),
        max_size=8,
    )
)
def test_manifest_lines_round_trip(entries: list[ManifestEntry]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        lg = AppendLog(Path(tmp) / "manifest.jsonl")
        try:
            lg.append((e.to_line() for e in entries), sync=False)
        finally:
            lg.close()
        assert read_manifest(Path(tmp)) == entries


def test_reading_a_missing_log(tmp_path: Path) -> None:
    assert read_log(tmp_path / "manifest.jsonl") == ([], False)
    assert read_manifest(tmp_path) == []
    assert load_done(tmp_path).ids == frozenset()


def test_blank_lines_are_skipped_and_numbers_stay_true(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(b"\n" + _entry(1).to_line() + b"  \n" + b"{bad\n")
    with pytest.raises(DatasetError, match=rf"{path}:4 is not valid JSON"):
        read_manifest(tmp_path)


# --- torn lines -------------------------------------------------------------------------


def test_torn_last_line_is_ignored_on_read(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(_entry(1).to_line() + _entry(2).to_line()[:20])
    records, torn = read_log(path)
    assert torn
    assert len(records) == 1
    assert read_manifest(tmp_path) == [_entry(1)]


def test_opening_cuts_a_torn_last_line_so_the_next_append_is_clean(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(_entry(1).to_line() + b'{"id": 2, "pa')
    lg = AppendLog(path)
    try:
        assert path.read_bytes() == _entry(1).to_line()
        lg.append([_entry(3).to_line()])
    finally:
        lg.close()
    assert read_manifest(tmp_path) == [_entry(1), _entry(3)]
    assert read_log(path)[1] is False


def test_opening_cuts_a_torn_only_line(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(b'{"id": 1')
    AppendLog(path).close()
    assert path.read_bytes() == b""


def test_torn_line_after_more_than_a_mebibyte_of_lines(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    good = b"".join(_entry(i).to_line() for i in range(20_000))
    assert len(good) > 1 << 20
    path.write_bytes(good + b'{"id": "torn"')
    AppendLog(path).close()
    assert path.read_bytes() == good


def test_torn_line_over_a_mebibyte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(_entry(1).to_line() + b"x" * ((1 << 20) + 10))
    with pytest.raises(DatasetError, match="over 1 MiB and torn"):
        AppendLog(path)
    assert path.stat().st_size > 1 << 20  # nothing was cut


def test_a_log_that_ends_cleanly_is_not_touched(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    data = _entry(1).to_line() + _entry(2).to_line()
    path.write_bytes(data)
    AppendLog(path).close()
    assert path.read_bytes() == data


# --- corruption -------------------------------------------------------------------------


def test_corrupt_middle_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(_entry(1).to_line() + b"\x00\x00garbage\n" + _entry(2).to_line())
    with pytest.raises(DatasetError, match=rf"{path}:2 is not valid JSON.*run again"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"id": 1, "path": "p", "num_tokens": 1, "bytes": 2}, "missing or mistypes"),
        ({"id": 1, "path": "p", "num_tokens": "x", "bytes": 2, "xxh3_64": XXH}, "mistypes"),
        ({"id": 1, "path": "p", "num_tokens": 1, "bytes": None, "xxh3_64": XXH}, "mistypes"),
        ({"id": True, "path": "p", "num_tokens": 1, "bytes": 2, "xxh3_64": XXH}, "id True"),
        ({"id": None, "path": "p", "num_tokens": 1, "bytes": 2, "xxh3_64": XXH}, "id None"),
        ({"id": 1, "path": "p", "num_tokens": 1, "bytes": 2, "xxh3_64": "abc"}, "16 hex"),
        ({"id": 1, "path": "p", "num_tokens": 1, "bytes": 2, "xxh3_64": XXH.upper()}, "16 hex"),
        ([1, 2, 3], "missing or mistypes"),
        ("text", "missing or mistypes"),
    ],
)
def test_bad_manifest_record_names_file_and_line(
    tmp_path: Path, record: object, match: str
) -> None:
    path = tmp_path / "manifest.shard-00000-of-00002.jsonl"
    path.write_bytes(_entry(1).to_line() + orjson.dumps(record) + b"\n")
    with pytest.raises(DatasetError, match=match) as info:
        read_manifest(tmp_path)
    assert f"{path}:2" in str(info.value)


def test_xxh3_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    record = {"id": 1, "path": "p", "num_tokens": 1, "bytes": 2, "xxh3_64": XXH + "\n"}
    (tmp_path / "manifest.jsonl").write_bytes(orjson.dumps(record) + b"\n")
    with pytest.raises(DatasetError):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "record", [{"id": 1, "line": 2}, {"id": 1.5, "line": 2, "reason": "r"}, {"line": 2}, [1]]
)
def test_bad_quarantine_record(tmp_path: Path, record: object) -> None:
    path = tmp_path / "quarantine.jsonl"
    path.write_bytes(orjson.dumps(record) + b"\n")
    with pytest.raises(DatasetError, match=rf"{path}:1"):
        read_quarantine(tmp_path)


# --- what a resumed run skips -----------------------------------------------------------


def test_load_done_unions_every_shard(tmp_path: Path) -> None:
    (tmp_path / log_name(MANIFEST, 0, 2)).write_bytes(_entry(5).to_line())
    (tmp_path / log_name(MANIFEST, 1, 2)).write_bytes(_entry("b").to_line())
    (tmp_path / log_name(QUARANTINE, 0, 2)).write_bytes(
        QuarantineEntry("q", 7, "r").to_line() + QuarantineEntry(None, 9, "bad JSON").to_line()
    )
    done = load_done(tmp_path)
    assert done.ids == frozenset({"5", "b", "q"})
    assert done.lines == frozenset({7, 9})
    assert [e.id for e in done.manifest] == [5, "b"]
    assert done.is_done("5", 100)  # ids compare by their text
    assert done.is_done(5, 100)
    assert done.is_done("new", 9)  # a quarantined line without an id
    assert not done.is_done("new", 8)
