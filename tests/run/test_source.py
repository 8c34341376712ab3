"""Reading samples (PROTOCOL §1): every line is a Sample or a quarantine reason, never a crash."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_async.dataset.layout import canonical_id, shard_of_id
from hsx_async.errors import InputError
from hsx_async.run.source import (
    TOO_LONG,
    BadLine,
    Item,
    Sample,
    SampleReader,
    count_pending,
    parse_line,
    require_samples,
    shard_of,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
_MISSING = object()


def _line(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _write(path: Path, lines: list[bytes], *, newline: bytes = b"\n", final: bool = True) -> Path:
    data = newline.join(lines) + (newline if final and lines else b"")
    path.write_bytes(data)
    return path


def _bad(item: Item) -> BadLine:
    assert isinstance(item, BadLine), item
    assert item.reason
    return item


def _good(item: Item) -> Sample:
    assert isinstance(item, Sample), item
    return item


# --- parse_line: examples ---------------------------------------------------------------


def test_sample_with_defaults() -> None:
    s = _good(parse_line(b'{"input_ids": [1, 2, 3]}', 7, 8))
    assert (s.id, s.line, s.num_tokens, s.loss_mask) == (7, 7, 3, None)
    assert s.input_ids.dtype == np.int64
    assert s.input_ids.tolist() == [1, 2, 3]


def test_sample_with_id_and_mask() -> None:
    s = _good(parse_line(_line(id="s-1", input_ids=[5, INT64_MAX], loss_mask=[0, 1]), 0, 8))
    assert s.id == "s-1"
    assert s.input_ids.tolist() == [5, INT64_MAX]
    assert s.loss_mask is not None
    assert s.loss_mask.dtype == np.uint8
    assert s.loss_mask.tolist() == [0, 1]


def test_integer_id_and_null_mask() -> None:
    s = _good(parse_line(_line(id=UINT64_MAX, input_ids=[0], loss_mask=None), 0, 8))
    assert (s.id, s.loss_mask) == (UINT64_MAX, None)


@pytest.mark.parametrize(
    ("raw", "has_id", "reason"),
    [
        (b"", False, "blank line"),
        (b"   \t", False, "blank line"),
        (b"{", False, "not valid JSON"),
        (b"[1, 2]", False, "not a JSON object but list"),
        (b'"text"', False, "not a JSON object but str"),
        (b"null", False, "not a JSON object but NoneType"),
        (b'{"input_ids": [NaN]}', False, "not valid JSON"),
        (b'{"input_ids": [Infinity]}', False, "not valid JSON"),
        (b'{"input_ids": [-Infinity]}', False, "not valid JSON"),
        (b'{"input_ids": [1e400]}', False, "not valid JSON"),
        (b'{"input_ids": [1]} {"input_ids": [2]}', False, "not valid JSON"),
        (b'{"input_ids": [1], "id": "\xff"}', False, "not valid JSON"),
        (b'{"input_ids": [1], "id": "\\ud800"}', False, "not valid JSON"),
        (b'\xef\xbb\xbf{"input_ids": [1]}', False, "not valid JSON"),
        (_line(id=True, input_ids=[1]), False, "id True is not a string or integer"),
        (_line(id=1.5, input_ids=[1]), False, "id 1.5 is not a string or integer"),
        (_line(id=None, input_ids=[1]), False, "id None is not"),
        (_line(id=["a"], input_ids=[1]), False, "is not a string or integer"),
        (_line(id="", input_ids=[1]), False, "id is an empty string"),
        (_line(id=-3, input_ids=[1]), False, "id -3 is negative"),
        (_line(id=UINT64_MAX + 1, input_ids=[1]), False, "is not a string or integer"),
        (_line(), True, "input_ids is missing or not a list"),
        (_line(input_ids="1 2 3"), True, "input_ids is missing or not a list"),
        (_line(input_ids={"0": 1}), True, "input_ids is missing or not a list"),
        (_line(input_ids=[]), True, "input_ids is empty"),
        (_line(input_ids=[1] * 9), True, "9 tokens, more than input.max_tokens (8)"),
        (_line(input_ids=[1, 2.0]), True, "holds 2.0, not an integer"),
        (_line(input_ids=[1, True]), True, "holds True, not an integer"),
        (_line(input_ids=[1, "2"]), True, "holds '2', not an integer"),
        (_line(input_ids=[1, None]), True, "holds None, not an integer"),
        (_line(input_ids=[[1]]), True, "not an integer"),
        (_line(input_ids=[1, -1]), True, "negative id -1"),
        (_line(input_ids=[INT64_MAX + 1]), True, "beyond int64"),
        (_line(input_ids=[UINT64_MAX]), True, "beyond int64"),
        (_line(input_ids=[UINT64_MAX + 1]), True, "not an integer"),  # orjson: a float
        (_line(input_ids=[-(2**64)]), True, "not an integer"),
        (_line(input_ids=[1, 2], loss_mask=[1]), True, "loss_mask has 1 entries, input_ids has 2"),
        (_line(input_ids=[1], loss_mask=[2]), True, "other than 0 or 1"),
        (_line(input_ids=[1], loss_mask=[True]), True, "other than 0 or 1"),
        (_line(input_ids=[1], loss_mask=[1.0]), True, "other than 0 or 1"),
        (_line(input_ids=[1], loss_mask="1"), True, "loss_mask is not a list"),
    ],
)
def test_bad_lines(raw: bytes, has_id: bool, reason: str) -> None:
    bad = _bad(parse_line(raw, 4, 8))
    assert bad.line == 4
    assert (bad.id is not None) == has_id
    assert reason in bad.reason


def test_bad_tokens_keep_the_id_for_the_quarantine() -> None:
    assert _bad(parse_line(_line(id="x", input_ids=[]), 3, 8)).id == "x"
    assert _bad(parse_line(_line(input_ids=[]), 3, 8)).id == 3


@pytest.mark.parametrize(
    ("depth", "reason", "inside"),
    [
        (500, "not a JSON object but list", "not an integer"),  # within orjson's limit
        (2_000, "not valid JSON", "not valid JSON"),  # orjson: depth limit exceeded
        (10_000, "not valid JSON", "not valid JSON"),
    ],
)
def test_deep_nesting_is_a_bad_line(depth: int, reason: str, inside: str) -> None:
    deep = b"[" * depth + b"]" * depth
    assert reason in _bad(parse_line(deep, 0, 8)).reason
    assert inside in _bad(parse_line(b'{"input_ids": [' + deep + b"]}", 0, 8)).reason


def test_huge_line_of_ints_is_checked_without_crashing() -> None:
    raw = _line(input_ids=list(range(100_000)))
    assert "more than input.max_tokens" in _bad(parse_line(raw, 0, 50_000)).reason
    assert _good(parse_line(raw, 0, 100_000)).num_tokens == 100_000


# --- parse_line: properties -------------------------------------------------------------


@FAST
@given(st.binary(max_size=300), st.integers(0, 10**9))
def test_arbitrary_bytes_give_an_item(raw: bytes, line: int) -> None:
    item = parse_line(raw, line, 16)
    assert item.line == line
    assert isinstance(item, Sample | BadLine)
    if isinstance(item, BadLine):
        assert item.reason


_PREFIXES = st.sampled_from([b"", b'{"input_ids": [', b'{"id": "', b'{"input_ids": [1], "id": '])


@FAST
@given(_PREFIXES, st.binary(max_size=100))
def test_json_like_garbage_gives_an_item(prefix: bytes, tail: bytes) -> None:
    item = parse_line(prefix + tail, 1, 16)
    assert isinstance(item, Sample | BadLine)
    if isinstance(item, BadLine):
        assert item.reason


_TOKEN = st.integers(0, INT64_MAX)
_ANY_SCALAR = st.one_of(
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
_ANY = st.recursive(_ANY_SCALAR, lambda s: st.lists(s, max_size=3), max_leaves=5)
_ID = st.one_of(
    st.just(_MISSING),
    st.text(max_size=6),
    st.integers(-(2**65), 2**65),
    _ANY,
)


@st.composite
def _objects(draw: st.DrawFn) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    ids = draw(
        st.one_of(
            st.lists(_TOKEN, max_size=12),
            st.lists(st.one_of(_TOKEN, _ANY_SCALAR), max_size=12),
            _ANY,
            st.just(_MISSING),
        )
    )
    if ids is not _MISSING:
        obj["input_ids"] = ids
    n = len(ids) if isinstance(ids, list) else draw(st.integers(0, 4))
    mask = draw(
        st.one_of(
            st.just(_MISSING),
            st.none(),
            st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n),
            st.lists(st.one_of(st.sampled_from([0, 1, 2, -1]), _ANY_SCALAR), max_size=12),
            _ANY,
        )
    )
    if mask is not _MISSING:
        obj["loss_mask"] = mask
    sid = draw(_ID)
    if sid is not _MISSING:
        obj["id"] = sid
    return obj


def _has_non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    return False


def _is_int(x: object, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _expected_id(obj: dict[str, Any], line: int) -> object:
    """The id parse_line must report, or _MISSING when the id itself is unusable."""
    if "id" not in obj:
        return line
    sid = obj["id"]
    if _is_int(sid, 0, UINT64_MAX) or (isinstance(sid, str) and sid):
        return sid
    return _MISSING


def _tokens_ok(ids: object, max_tokens: int) -> bool:
    return (
        isinstance(ids, list)
        and 1 <= len(ids) <= max_tokens
        and all(_is_int(x, 0, INT64_MAX) for x in ids)
    )


def _mask_ok(mask: object, n: int) -> bool:
    return mask is None or (
        isinstance(mask, list) and len(mask) == n and all(_is_int(x, 0, 1) for x in mask)
    )


@FAST
@given(_objects(), st.integers(1, 12), st.integers(0, 1000))
def test_random_objects_match_the_rules(obj: dict[str, Any], max_tokens: int, line: int) -> None:
    # The stdlib writes NaN/Infinity literals and integers of any size, as a careless
    # producer would; orjson must refuse the former and turn huge integers into floats.
    item = parse_line(json.dumps(obj).encode(), line, max_tokens)
    assert item.line == line
    if _has_non_finite(obj):
        assert "not valid JSON" in _bad(item).reason
        return
    sid = _expected_id(obj, line)
    if sid is _MISSING:
        assert _bad(item).id is None
        return
    ids = obj.get("input_ids")
    if not (_tokens_ok(ids, max_tokens) and _mask_ok(obj.get("loss_mask"), len(ids or []))):
        assert _bad(item).id == sid
        return
    sample = _good(item)
    assert sample.id == sid
    assert sample.input_ids.tolist() == ids
    mask = obj.get("loss_mask")
    assert (sample.loss_mask is None) == (mask is None)
    if sample.loss_mask is not None:
        assert sample.loss_mask.tolist() == mask


# --- shard_of ---------------------------------------------------------------------------


@FAST
@given(st.one_of(st.integers(0, UINT64_MAX), st.text(min_size=1)), st.integers(1, 64))
def test_shard_of_is_stable_and_by_canonical_id(sid: int | str, count: int) -> None:
    ids = np.array([1], dtype=np.int64)
    a = shard_of(Sample(sid, 0, ids, None), count)
    b = shard_of(Sample(canonical_id(sid), 99, ids, None), count)
    assert a == b
    assert 0 <= a < count


def test_shard_of_bad_lines_is_by_line() -> None:
    assert [shard_of(BadLine(n, "x", "r"), 4) for n in range(6)] == [0, 1, 2, 3, 0, 1]


def test_shard_of_spreads_samples() -> None:
    ids = np.array([1], dtype=np.int64)
    shards = {shard_of(Sample(f"s{i}", i, ids, None), 4) for i in range(200)}
    assert shards == {0, 1, 2, 3}


# --- SampleReader -----------------------------------------------------------------------


def test_reader_mixed_file(tmp_path: Path) -> None:
    lines = [
        _line(input_ids=[1]),  # 0: id 0
        b"not json",  # 1
        _line(id="a", input_ids=[1, 2]),  # 2
        _line(id="a", input_ids=[3]),  # 3: duplicate of 2
        _line(id=0, input_ids=[4]),  # 4: duplicate of line 0's default id
        _line(id="5", input_ids=[]),  # 5: bad tokens, keeps its id
        _line(id=5, input_ids=[5]),  # 6: "5" was taken by line 5
        _line(input_ids=[6], loss_mask=[1]),  # 7
    ]
    path = _write(tmp_path / "in.jsonl", lines)
    items = list(SampleReader(path, 8).iter_sync())
    assert [i.line for i in items] == list(range(8))
    assert [type(i).__name__ for i in items] == [
        "Sample", "BadLine", "Sample", "BadLine", "BadLine", "BadLine", "BadLine", "Sample"
    ]  # fmt: skip
    dup = _bad(items[3])
    assert (dup.id, dup.duplicate_of, dup.own_id) == ("a", 2, None)  # keeps its id (issue 17)
    assert "duplicate id 'a' (first on line 3)" in dup.reason  # 1-based for a person
    assert "duplicate id '0' (first on line 1)" in _bad(items[4]).reason
    assert _bad(items[5]).id == "5"
    assert "(first on line 6)" in _bad(items[6]).reason
    assert _good(items[7]).loss_mask is not None


async def test_async_items_equal_iter_sync_across_batches(tmp_path: Path) -> None:
    lines = [
        _line(input_ids=[i % 7 + 1]) if i % 5 else b"{broken" for i in range(1300)
    ]  # > 2 batches of 512 lines
    path = _write(tmp_path / "in.jsonl", lines)
    sync = list(SampleReader(path, 8).iter_sync())
    got = [item async for item in SampleReader(path, 8).items()]
    assert [i.line for i in got] == list(range(1300))
    assert [(type(i), i.line, i.id) for i in got] == [(type(i), i.line, i.id) for i in sync]
    assert sum(isinstance(i, BadLine) for i in got) == 260


async def test_the_first_sample_comes_after_one_lines_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first batches grow from one line: a run's first request need not wait for 512
    lines (up to 4 MiB of JSON) to be parsed."""
    from hsx_async.run import source as source_module

    path = _write(tmp_path / "in.jsonl", [_line(input_ids=[i + 1]) for i in range(600)])
    parsed: list[int] = []
    real = source_module.parse_line

    def counted(raw: bytes, line: int, max_tokens: int) -> Item:
        parsed.append(line)
        return real(raw, line, max_tokens)

    monkeypatch.setattr(source_module, "parse_line", counted)
    items = SampleReader(path, 8).items()
    first = await anext(items)
    assert _good(first).line == 0 and parsed == [0]
    rest = [item async for item in items]
    assert [i.line for i in rest] == list(range(1, 600))


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("final", [True, False])
def test_line_endings_and_last_line_without_newline(
    tmp_path: Path, newline: bytes, final: bool
) -> None:
    lines = [_line(input_ids=[1]), _line(input_ids=[2])]
    path = _write(tmp_path / "in.jsonl", lines, newline=newline, final=final)
    items = [_good(i) for i in SampleReader(path, 8).iter_sync()]
    assert [s.input_ids.tolist() for s in items] == [[1], [2]]


def test_empty_file(tmp_path: Path) -> None:
    assert list(SampleReader(_write(tmp_path / "in.jsonl", []), 8).iter_sync()) == []


async def test_over_long_line_is_skipped_and_the_next_lines_survive(tmp_path: Path) -> None:
    reader_limit = SampleReader(tmp_path / "x", 4).max_line_bytes
    assert reader_limit > 1 << 20
    huge = b'{"input_ids": [' + b"1," * (reader_limit // 2) + b"1]}"
    lines = [_line(input_ids=[1]), huge, _line(input_ids=[2]), huge]  # the last one at EOF
    path = _write(tmp_path / "in.jsonl", lines, final=False)
    items = [item async for item in SampleReader(path, 4).items()]
    assert [i.line for i in items] == [0, 1, 2, 3]
    assert _good(items[2]).input_ids.tolist() == [2]
    for bad in (items[1], items[3]):
        assert _bad(bad).id is None
        assert f"longer than {reader_limit} bytes" in _bad(bad).reason


def test_line_exactly_at_the_limit_is_read(tmp_path: Path) -> None:
    line = _line(input_ids=[1, 2, 3])
    path = _write(tmp_path / "in.jsonl", [line, line + b" ", b'{"input_ids":[4]}'])
    reader = SampleReader(path, 8)
    reader.max_line_bytes = len(line)
    items = list(reader.iter_sync())
    assert _good(items[0]).input_ids.tolist() == [1, 2, 3]
    assert "longer than" in _bad(items[1]).reason
    assert _good(items[2]).input_ids.tolist() == [4]


def test_empty_line_is_reported_as_blank(tmp_path: Path) -> None:
    path = _write(tmp_path / "in.jsonl", [_line(input_ids=[1]), b"", _line(input_ids=[2])])
    items = list(SampleReader(path, 8).iter_sync())
    assert [i.line for i in items] == [0, 1, 2]
    assert "blank line" in _bad(items[1]).reason


def test_a_line_that_spells_the_marker_is_not_taken_for_an_over_long_one(tmp_path: Path) -> None:
    path = _write(tmp_path / "in.jsonl", [TOO_LONG, _line(input_ids=[1])])
    items = list(SampleReader(path, 8).iter_sync())
    assert "not valid JSON" in _bad(items[0]).reason


def test_raw_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "in.jsonl", [b"a", b"", b"x" * 50, b"b"], newline=b"\r\n")
    reader = SampleReader(path, 8)
    reader.max_line_bytes = 20
    got = list(reader.raw_lines())
    assert [n for n, _ in got] == [0, 1, 2, 3]
    assert [raw for _, raw in got if raw is not TOO_LONG] == [b"a", b"", b"b"]
    assert got[2][1] is TOO_LONG


def test_count_pending(tmp_path: Path) -> None:
    lines = [
        _line(input_ids=[1, 2]),  # id 0
        _line(id="a", input_ids=[1, 2, 3]),
        _line(id="done", input_ids=[1]),
        b"{broken",
        _line(id=True, input_ids=[1]),
        _line(id="q", loss_mask=[1]),  # no input_ids: not counted
        _line(id="b", input_ids=[9] * 5),
    ]
    reader = SampleReader(_write(tmp_path / "in.jsonl", lines), 8)
    done = {"done"}
    assert count_pending(reader, 0, 1, lambda sid, _line: str(sid) in done) == (3, 10)
    per_shard = [count_pending(reader, i, 3, lambda *_: False) for i in range(3)]
    assert sum(s for s, _ in per_shard) == 4
    assert sum(t for _, t in per_shard) == 11
    for i, (samples, _) in enumerate(per_shard):
        assert samples == sum(shard_of_id(s, 3) == i for s in (0, "a", "done", "b"))


def test_missing_input_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"cannot read input.path .*nope.jsonl"):
        list(SampleReader(tmp_path / "nope.jsonl", 8).iter_sync())
    with pytest.raises(InputError, match=r"cannot read input\.path"):
        list(SampleReader(tmp_path, 8).iter_sync())  # a directory


def test_an_input_with_no_sample_is_refused_and_one_with_a_line_is_not(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    for blank in (b"", b"\n", b" \t\r\n" * 300_000):  # the last one spans chunks
        path.write_bytes(blank)
        with pytest.raises(InputError, match=r"input\.path .* holds no sample"):
            require_samples(path)
    path.write_bytes(b"\n" * (3 << 20) + b'{"input_ids": [1]}\n')  # found past the first chunk
    require_samples(path)
    with pytest.raises(InputError, match=r"cannot read input\.path"):
        require_samples(tmp_path)  # open_input's refusals come first


async def test_missing_input_is_an_input_error_async(tmp_path: Path) -> None:
    with pytest.raises(InputError):
        _ = [i async for i in SampleReader(tmp_path / "nope.jsonl", 8).items()]


# --- SampleReader: property over mixed files --------------------------------------------

_LIMIT = 96
_POOL_IDS = st.sampled_from([_MISSING, "a", "b", 0, 1, "1", 2])


@st.composite
def _file_line(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["good", "good", "bad_tokens", "bytes", "blank", "long"]))
    if kind == "bytes":
        raw = draw(st.binary(min_size=1, max_size=40))
        return raw.replace(b"\n", b"").replace(b"\r", b"") or b"x"
    if kind == "blank":
        return draw(st.sampled_from([b"", b" ", b"\t "]))
    if kind == "long":
        return b'{"input_ids": [' + b"1," * draw(st.integers(_LIMIT // 2, 200)) + b"1]}"
    obj: dict[str, Any] = {"input_ids": draw(st.lists(_TOKEN, min_size=1, max_size=2))}
    if kind == "bad_tokens":
        obj["input_ids"] = []
    sid = draw(_POOL_IDS)
    if sid is not _MISSING:
        obj["id"] = sid
    return json.dumps(obj).encode()


def _check_stream(lines: list[bytes], items: list[Item]) -> None:
    assert [i.line for i in items] == list(range(len(lines)))
    first: dict[str, int] = {}
    for raw, item in zip(lines, items, strict=True):
        if len(raw) > _LIMIT:
            assert _bad(item).id is None
            assert "longer than" in _bad(item).reason
            continue
        alone = parse_line(raw, item.line, 8)
        if alone.id is None:
            assert item == alone
            continue
        key = canonical_id(alone.id)
        seen = first.setdefault(key, item.line)
        if seen != item.line:
            assert _bad(item).duplicate_of == seen and _bad(item).own_id is None
            assert f"(first on line {seen + 1})" in _bad(item).reason
        elif isinstance(alone, Sample):
            sample = _good(item)
            assert sample.id == alone.id
            assert sample.input_ids.tolist() == alone.input_ids.tolist()
        else:
            assert item == alone
    ided = [
        canonical_id(own)
        for i in items
        if (own := i.own_id if isinstance(i, BadLine) else i.id) is not None
    ]
    assert len(ided) == len(set(ided)), "an id reaches manifest + quarantine twice"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_file_line(), max_size=25), st.sampled_from([b"\n", b"\r\n"]), st.booleans())
def test_every_line_is_reported_exactly_once(
    lines: list[bytes], newline: bytes, final: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "in.jsonl", lines, newline=newline, final=final)
        reader = SampleReader(path, 8)
        reader.max_line_bytes = _LIMIT  # small, so over-long lines stay cheap to generate
        if not final and lines and lines[-1] == b"":
            lines = lines[:-1]  # "a\n" with no final newline after "" is just one line
        _check_stream(lines, list(reader.iter_sync()))
