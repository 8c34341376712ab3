"""The per-shard events log of ``hsx run`` (``events.jsonl``,
``events.shard-IIIII-of-NNNNN.jsonl``), as the offline tools read it.

``hsx run`` appends (:class:`hsx_async.run.report.numbers.RunRecorder`): ``start``, ``tick`` and
``end`` lines with the run's cumulative counts, and an ``input`` line once the feeder has
read the whole input, with the number of input lines that belong to the shard. Every line
of the input ends in the manifest or the quarantine, so ``hsx status`` knows what remains
from that count even after ``verify --repair`` dropped entries, and for every shard.
Between them, ``server_out`` and ``server_back`` lines say when a server left rotation,
why, and when it came back (the job report lists them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import structlog

from hsx_async.dataset.manifest import read_log

EVENTS = "events"
_EVENTS_FILE = re.compile(r"events(?:\.shard-[0-9]{5}-of-[0-9]{5})?\.jsonl")
_SHARD = re.compile(r"[0-9]+/[0-9]+")
_COUNTS = ("samples", "tokens", "bytes", "quarantined")  # of start, tick and end lines
_MAPS = ("retries", "servers")  # name → count

log = structlog.get_logger("hsx.events")


def event_files(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if _EVENTS_FILE.fullmatch(p.name) and p.is_file())


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of one events log (a torn last line is left out), each of the
    shape :class:`~hsx_async.run.report.numbers.RunRecorder` writes. A line of any other shape
    (the log is advice, not data: a hand edit, another version) is skipped with a
    warning, so every reader can index what it reads."""
    events, skipped = [], []
    for number, rec in read_log(path)[0]:
        problem = shape_problem(rec)
        if problem:
            skipped.append(f"line {number}: {problem}")
        else:
            events.append(rec)
    if skipped:
        log.warning("events_lines_skipped", path=str(path), lines=len(skipped), first=skipped[0])
    return events


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_LAST_TIME = 32503680000.0  # 3000-01-01: a larger epoch is no time hsx wrote


def _is_time(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0.0 <= value <= _LAST_TIME


# A server left rotation (or was refused again, for a new kind of reason) / came back:
# ``server`` (its URL as displayed), ``kind`` (a fault kind), ``reason``.
SERVER_EVENTS = ("server_out", "server_back")


def shape_problem(rec: object) -> str:
    """'' for an events record of a known shape, else what is wrong with it."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    event = rec.get("event")
    if event not in ("start", "tick", "end", "input", *SERVER_EVENTS):
        return f"unknown event {event!r}"
    if not _is_time(rec.get("time")):
        return f"time {rec.get('time')!r} is not an epoch in seconds"
    shard = rec.get("shard", "0/1")
    if not isinstance(shard, str) or not _SHARD.fullmatch(shard):
        return f"shard {shard!r} is not INDEX/COUNT"
    if event == "input":
        return "" if _is_count(rec.get("lines")) else f"lines {rec.get('lines')!r} is not a count"
    if event in SERVER_EVENTS:
        texts = ("server", "kind", "reason")
        bad = [k for k in texts if not isinstance(rec.get(k, ""), str)]
        return f"{bad[0]} {rec.get(bad[0])!r} is not a string" if bad else ""
    for key in _COUNTS:
        if not _is_count(rec.get(key)):
            return f"{key} {rec.get(key)!r} is not a count"
    for key in _MAPS:
        value = rec.get(key, {})
        if not isinstance(value, dict) or not all(_is_count(v) for v in value.values()):
            return f"{key} is not a map of counts"
    return ""


def input_lines(out_dir: Path, recorded: Any = None) -> dict[str, int]:
    """Input lines per shard (``"index/count"``), the latest count of each shard's log;
    ``recorded``: counts a merge carried over (provenance ``input_lines``)."""
    counts: dict[str, int] = {}
    if isinstance(recorded, dict):
        counts.update({str(k): int(v) for k, v in recorded.items() if isinstance(v, int)})
    for path in event_files(out_dir):
        for rec in read_events(path):
            if rec["event"] == "input":
                counts[rec.get("shard", "0/1")] = rec["lines"]
    return counts
