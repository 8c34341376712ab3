"""The events log as the offline tools read it (issue 26): every valid-JSON line of an
unexpected shape is skipped with a warning, never a crash, wherever it is read
(``hsx report``, the report ``hsx run`` writes at its end, ``hsx status``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hsx_async.cli import main
from hsx_async.cli.handlers.run import print_report
from hsx_async.dataset.events import input_lines, read_events, shape_problem
from hsx_async.run.report.numbers import build_report, write_report

GOOD: list[dict[str, Any]] = [
    {"event": "start", "time": 100.0, "shard": "0/1", "samples": 0, "tokens": 0, "bytes": 0,
     "quarantined": 0, "retries": {}, "servers": {"http://s": 0}, "pid": 7},
    {"event": "tick", "time": 101.0, "shard": "0/1", "samples": 2, "tokens": 40, "bytes": 80,
     "quarantined": 1, "retries": {"http_500": 1}, "servers": {"http://s": 4}},
    {"event": "input", "time": 101.5, "shard": "0/1", "lines": 3},
    {"event": "end", "time": 102.0, "shard": "0/1", "samples": 2, "tokens": 40, "bytes": 80,
     "quarantined": 1, "retries": {"http_500": 1}, "servers": {"http://s": 4}, "stopped": False,
     "unfinished": 0},
]  # fmt: skip
TICK = GOOD[1]

# The variants the issue tried by hand (7 of 15 crashed hsx report), and a few more.
BAD: dict[str, Any] = {
    "a list": [1, 2],
    "a string": "tick",
    "a number": 3,
    "null": None,
    "no event": {k: v for k, v in TICK.items() if k != "event"},
    "unknown event": {**TICK, "event": "tock"},
    "no time": {k: v for k, v in TICK.items() if k != "time"},
    "time a string": {**TICK, "time": "yesterday"},
    "time true": {**TICK, "time": True},
    "time too large": {**TICK, "time": 1e300},
    "negative time": {**TICK, "time": -5},
    "no tokens": {k: v for k, v in TICK.items() if k != "tokens"},
    "samples a string": {**TICK, "samples": "2"},
    "negative bytes": {**TICK, "bytes": -1},
    "servers a list": {**TICK, "servers": ["http://s"]},
    "retries of strings": {**TICK, "retries": {"http_500": "one"}},
    "shard a number": {**TICK, "shard": 0},
    "input without lines": {"event": "input", "time": 101.0, "shard": "0/1"},
    "input lines a float": {"event": "input", "time": 101.0, "shard": "0/1", "lines": 2.5},
}


def _write(out: Path, records: list[Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "events.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    (out / "quarantine.jsonl").write_bytes(b'{"id": null, "line": 3, "reason": "not JSON"}\n')
    return out / "events.jsonl"


def test_every_line_hsx_run_writes_has_the_known_shape() -> None:
    assert [shape_problem(r) for r in GOOD] == ["", "", "", ""]


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_line_of_another_shape_is_skipped_with_a_warning(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "out", [*GOOD[:2], BAD[name], *GOOD[2:]])
    with capture_logs() as logs:
        assert read_events(path) == GOOD
    [warning] = [e for e in logs if e["event"] == "events_lines_skipped"]
    assert warning["log_level"] == "warning" and warning["lines"] == 1
    assert warning["first"].startswith("line 3: ")
    # every reader: hsx report (and the report hsx run writes when it ends), hsx status
    assert main(["report", str(tmp_path / "out"), "--no-png"]) == 0
    assert "events_lines_skipped" in capsys.readouterr().err
    print_report(tmp_path / "out")  # hsx run's end: a KeyError here exited 1
    assert "report: " in capsys.readouterr().out
    assert input_lines(tmp_path / "out") == {"0/1": 3}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=12,
)  # fmt: skip
# Near misses: a real record with one key replaced by any JSON value, or dropped.
_NEAR = st.builds(
    lambda base, key, value, drop: (
        {k: v for k, v in base.items() if k != key} if drop else {**base, key: value}
    ),
    st.sampled_from(GOOD),
    st.sampled_from(sorted({k for r in GOOD for k in r})),
    _JSON,
    st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_JSON, _NEAR, st.sampled_from(GOOD)), max_size=12))
def test_any_valid_json_lines_never_crash_a_reader(lines: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        _write(out, lines)
        kept = read_events(out / "events.jsonl")
        assert all(shape_problem(r) == "" for r in kept)
        assert len(kept) == sum(shape_problem(r) == "" for r in lines)
        build_report(out)
        input_lines(out)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_NEAR, st.sampled_from(GOOD)), min_size=1, max_size=8))
def test_any_valid_json_lines_never_crash_the_png(lines: list[Any]) -> None:
    pytest.importorskip("matplotlib")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        _write(out, lines)
        _, png, _ = write_report(out)
        assert png is not None and png.is_file()
