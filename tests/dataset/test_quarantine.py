"""A quarantine is retriable (issue 24): lines put back by kind, or all, with their history
kept; never while a run writes the directory. Its lines carry their reason's cause, kind
and retriable as fields (issue 38); lines written before them are read from their prose."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.manifest import (
    QuarantineEntry,
    Reason,
    load_done,
    read_log,
    read_quarantine,
)
from hsx_async.dataset.provenance import shard_lock
from hsx_async.dataset.quarantine import (
    attempts_reason,
    input_reason,
    kinds,
    reason_kind,
    reason_of,
    refused_reason,
    retried_before,
    retry,
)
from hsx_async.errors import DatasetError

REASONS = [
    attempts_reason(5, "http://127.0.0.1:9/x: HTTP 503: busy"),
    attempts_reason(5, "http://127.0.0.1:9/x: HTTP 503: overloaded"),
    attempts_reason(3, "no meta.json in /dev/shm/a/b 2 s after the response (dump.timeout)"),
    refused_reason("http://127.0.0.1:9: HTTP 400: token id 99 is out of vocabulary"),
    "not valid JSON: unexpected character",
]


def _quarantine(out: Path, name: str = "quarantine.jsonl", reasons: list[str] = REASONS) -> None:
    out.mkdir(exist_ok=True)
    lines = [QuarantineEntry(f"s{i}", i, r).to_line() for i, r in enumerate(reasons)]
    (out / name).write_bytes(b"".join(lines))


def test_an_old_lines_reason_is_read_from_its_prose() -> None:
    """A line written before the fields: retriable when the pipeline wrote it (its
    prefixes), its kind the prose without particulars, its cause not recorded."""
    read = [reason_of(QuarantineEntry("s", 0, r)) for r in REASONS]
    assert [r.retriable for r in read] == [True, True, True, True, False]
    assert [r.kind for r in read] == [reason_kind(r) for r in REASONS]
    assert {r.cause for r in read} == {None}


def test_kinds_count_each_problem_once(tmp_path: Path) -> None:
    _quarantine(tmp_path)
    found = {k.kind: (k.count, k.retriable) for k in kinds(tmp_path)}
    assert found[reason_kind(REASONS[0])] == (2, True)  # two 503s are one kind
    assert found[reason_kind(REASONS[4])] == (1, False)


def test_retry_puts_the_pipelines_lines_back_and_keeps_the_history(tmp_path: Path) -> None:
    _quarantine(tmp_path)
    result = retry(tmp_path)
    assert (result.lines, result.kept) == (4, 1)
    (left,) = read_quarantine(tmp_path)
    assert left.reason == REASONS[4]  # the input's own fault stays
    assert load_done(tmp_path).lines == {4}  # the next run redoes lines 0-3
    history = [rec for _, rec in read_log(tmp_path / "quarantine-retried.jsonl")[0]]
    assert [h["reason"] for h in history] == REASONS[:4] and all("retried" in h for h in history)
    assert retried_before(tmp_path) == 4
    assert retry(tmp_path).lines == 0  # nothing left to put back


def test_retry_by_kind_or_everything(tmp_path: Path) -> None:
    _quarantine(tmp_path)
    assert retry(tmp_path, kinds=["HTTP 503"]).lines == 2  # the two 503s (a substring)
    assert len(read_quarantine(tmp_path)) == 3
    assert retry(tmp_path, everything=True).lines == 3
    assert read_quarantine(tmp_path) == []
    assert retried_before(tmp_path) == 5


def test_each_shards_log_keeps_its_own_history(tmp_path: Path) -> None:
    for i in range(2):
        _quarantine(
            tmp_path, f"quarantine.shard-0000{i}-of-00002.jsonl", REASONS[i * 2 : i * 2 + 2]
        )
    assert retry(tmp_path).lines == 4
    names = sorted(p.name for p in tmp_path.glob("quarantine-retried*"))
    assert names == [
        "quarantine-retried.shard-00000-of-00002.jsonl",
        "quarantine-retried.shard-00001-of-00002.jsonl",
    ]


def test_retry_is_refused_while_a_run_writes_the_directory(tmp_path: Path) -> None:
    _quarantine(tmp_path)
    with shard_lock(tmp_path, 0), pytest.raises(DatasetError, match="another hsx process"):
        retry(tmp_path)
    assert len(read_quarantine(tmp_path)) == len(REASONS)


def test_a_crash_between_history_and_rewrite_loses_no_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history is appended (and fsynced) before the log is rewritten: a crash in
    between leaves a line in both, never in neither."""
    from hsx_async.dataset import quarantine as module

    def crash(path: Path, data: bytes) -> None:
        raise OSError("killed")

    _quarantine(tmp_path)
    monkeypatch.setattr(module, "write_atomic", crash)
    with pytest.raises(OSError, match="killed"):
        retry(tmp_path)
    assert len(read_quarantine(tmp_path)) == len(REASONS)
    history = (tmp_path / "quarantine-retried.jsonl").read_bytes().splitlines()
    assert [orjson.loads(h)["id"] for h in history] == ["s0", "s1", "s2", "s3"]


def test_not_a_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not a directory"):
        retry(tmp_path / "nope")


def test_the_command_lists_retries_and_refuses_what_is_not_a_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hsx_async.cli import main

    _quarantine(tmp_path / "out")
    assert main(["quarantine", str(tmp_path / "out")]) == 0
    listed = capsys.readouterr().out
    assert "5 quarantined, 4 after failed attempts" in listed and "retriable" in listed
    assert main(["quarantine", str(tmp_path / "out"), "--kind", "refused"]) == 0
    assert "1 lines put back" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        assert main(["quarantine", str(path), "--retry"]) == 2
        assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback


def test_the_listing_suggests_retry_only_when_something_can_be_retried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: `--retry` was suggested for a quarantine of the input's own faults only,
    and for an empty one; it would have put nothing back."""
    from hsx_async.cli import main

    out = tmp_path / "out"
    _quarantine(out, reasons=[REASONS[4], REASONS[4]])
    assert main(["quarantine", str(out)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "2 quarantined, 0 after failed attempts; nothing for --retry to put back (the input's "
        "own faults would be quarantined again; --all puts them back anyway); 0 put back before"
    )
    _quarantine(out, reasons=[])
    assert main(["quarantine", str(out)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "0 quarantined, 0 after failed attempts; nothing to put back; 0 put back before"


# -- structured lines (issue 38) ---------------------------------------------------------

# Two dumps broken differently, one 5xx, one refusal, one duplicate: as the pipeline and the
# intake write them now (cause, kind, retriable beside the prose).
STRUCTURED = [
    Reason(attempts_reason(3, "part-0000000000-0000000016.bin has 10 bytes, expected 12"),
           "server", "bad_dump", retriable=True),
    Reason(attempts_reason(3, "part-0000000016-0000000030.bin: 1 FP8 scales are negative"),
           "server", "bad_dump", retriable=True),
    Reason(attempts_reason(3, "http://127.0.0.1:9/x: HTTP 503: busy"), "server", "http_5xx",
           retriable=True),
    Reason(refused_reason("HTTP 400: token id 99"), "sample", "rejected", retriable=True),
    input_reason("duplicate id 'a' (first on line 1)", duplicate=True),
]  # fmt: skip


def _structured(out: Path, reasons: list[Reason] = STRUCTURED, first: int = 0) -> None:
    out.mkdir(exist_ok=True)
    lines = [QuarantineEntry.of(f"n{i}", first + i, r).to_line() for i, r in enumerate(reasons)]
    with (out / "quarantine.jsonl").open("ab") as fh:
        fh.write(b"".join(lines))


def test_a_line_carries_its_reasons_fields_and_reads_back_the_same(tmp_path: Path) -> None:
    _structured(tmp_path)
    raw = [orjson.loads(line) for line in (tmp_path / "quarantine.jsonl").read_bytes().splitlines()]
    assert raw[0]["cause"] == "server" and raw[0]["kind"] == "bad_dump"
    assert raw[0]["retriable"] is True and raw[0]["reason"] == STRUCTURED[0].text
    assert [reason_of(q) for q in read_quarantine(tmp_path)] == STRUCTURED


def test_kinds_come_from_the_fields_not_the_prose(tmp_path: Path) -> None:
    """Two broken dumps whose prose differs are one kind (the prose's regex made two)."""
    _structured(tmp_path)
    found = {(k.cause, k.kind, k.retriable): k.count for k in kinds(tmp_path)}
    assert found == {
        ("server", "bad_dump", True): 2,
        ("server", "http_5xx", True): 1,
        ("sample", "rejected", True): 1,
        ("sample", "duplicate_id", False): 1,
    }


def test_retry_chooses_by_the_fields(tmp_path: Path) -> None:
    """--kind matches a line's kind; the default puts back what its field says is
    retriable, whatever its prose (a prefix no longer decides)."""
    odd = [
        Reason("turn 2: 3 attempts failed; last: HTTP 500", "server", "http_5xx", retriable=True),
        Reason("3 attempts failed; last: looks like the pipeline's", "sample", "bad_input",
               retriable=False),
    ]  # fmt: skip
    _structured(tmp_path)
    _structured(tmp_path, odd, first=len(STRUCTURED))
    assert retry(tmp_path, kinds=["bad_dump"]).by_kind == {"bad_dump": 2}
    done = retry(tmp_path)
    assert done.by_kind == {"http_5xx": 2, "rejected": 1} and done.kept == 2
    assert {reason_of(q).kind for q in read_quarantine(tmp_path)} == {"duplicate_id", "bad_input"}
    history = [rec for _, rec in read_log(tmp_path / "quarantine-retried.jsonl")[0]]
    assert all(h["kind"] and "retried" in h for h in history)  # the fields kept in the history


def test_old_and_new_lines_read_side_by_side(tmp_path: Path) -> None:
    _quarantine(tmp_path)
    _structured(tmp_path, first=len(REASONS))
    found = {(k.cause, k.kind): k.count for k in kinds(tmp_path)}
    assert found[None, reason_kind(REASONS[0])] == 2 and found["server", "bad_dump"] == 2
    assert retry(tmp_path).lines == 4 + 4  # retriable: old by prose, new by field


@pytest.mark.parametrize(
    "fields",
    [
        {"cause": "weather", "kind": "http_5xx", "retriable": True},
        {"cause": "server", "kind": "", "retriable": True},
        {"cause": "server", "kind": 5, "retriable": True},
        {"cause": "server", "kind": "http_5xx", "retriable": "yes"},
        {"cause": "server", "retriable": True},  # kind missing
        {"kind": "http_5xx"},  # retriable missing
    ],
)
def test_a_line_with_broken_fields_is_refused_naming_it(
    tmp_path: Path, fields: dict[str, object]
) -> None:
    line = {"id": "x", "line": 0, "reason": "whatever", **fields}
    (tmp_path / "quarantine.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    with pytest.raises(DatasetError, match=r"quarantine.jsonl:1: quarantine line has cause "):
        read_quarantine(tmp_path)


def test_the_listing_shows_cause_and_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hsx_async.cli import main

    _structured(tmp_path / "out")
    assert main(["quarantine", str(tmp_path / "out")]) == 0
    listed = capsys.readouterr().out
    assert "       2  retriable  server  bad_dump" in listed
    assert "       1  input      sample  duplicate_id" in listed
    assert "5 quarantined, 4 after failed attempts" in listed
    assert main(["quarantine", str(tmp_path / "out"), "--kind", "http_5xx"]) == 0
    assert "put back: 1  http_5xx" in capsys.readouterr().out
