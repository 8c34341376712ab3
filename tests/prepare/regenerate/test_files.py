"""What a resumed ``hsx regenerate`` reads back from its output and quarantine: the rules
of every hsx log (``dataset.manifest``), streamed a line at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx_async.dataset.manifest import QuarantineEntry, iter_log, read_log
from hsx_async.errors import DatasetError
from hsx_async.prepare.regenerate.files import quarantined, written_ids


def test_a_torn_last_line_is_not_done(tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    out.write_bytes(b'{"id": "a", "messages": []}\n\n{"id": 7, "messages": []}\n{"id": "b", "mes')
    assert written_ids(out) == {"a", "7"}
    assert list(iter_log(out)) == read_log(out)[0]  # the same lines as the whole-file read
    assert written_ids(tmp_path / "missing.jsonl") == set()


def test_a_line_that_is_not_json_or_no_object_is_one_line_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    out.write_bytes(b'{"id": "a"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"regen\.jsonl:2 is not valid JSON"):
        written_ids(out)
    out.write_bytes(b'{"id": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"regen\.jsonl:2 is not a JSON object.*--out"):
        written_ids(out)


def test_the_quarantine_owns_ids_by_the_runs_rule(tmp_path: Path) -> None:
    """A repeated id's line does not own the id (its first line does, wherever it
    ended); an unreadable line has no id; every line is done."""
    q = tmp_path / "regen.quarantine.jsonl"
    entries = [
        QuarantineEntry("x", 4, "no assistant turn"),
        QuarantineEntry("y", 9, "duplicate id 'y' (first on input line 3)", duplicate_of=2),
        QuarantineEntry(None, 11, "not JSON"),
    ]
    q.write_bytes(b"".join(e.to_line() for e in entries) + b'{"id": "z", "li')
    assert quarantined(q) == ({"x"}, {4, 9, 11})
    q.write_bytes(b'{"id": "x", "line": "four", "reason": "r"}\n')
    with pytest.raises(DatasetError, match=r"quarantine\.jsonl:1: quarantine line"):
        quarantined(q)
