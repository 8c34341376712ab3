"""The per-shard events log of ``hsx run`` (``events.jsonl``,
``events.shard-IIIII-of-NNNNN.jsonl``), as the offline tools read it.

``hsx run`` appends (:class:`hsx_async.run.report.RunRecorder`): ``start``, ``tick`` and
``end`` lines with the run's cumulative counts, and an ``input`` line once the feeder has
read the whole input, with the number of input lines that belong to the shard. Every line
of the input ends in the manifest or the quarantine, so ``hsx status`` knows what remains
from that count even after ``verify --repair`` dropped entries, and for every shard.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hsx_async.dataset.manifest import read_log

EVENTS = "events"
_EVENTS_FILE = re.compile(r"events(?:\.shard-[0-9]{5}-of-[0-9]{5})?\.jsonl")


def event_files(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if _EVENTS_FILE.fullmatch(p.name) and p.is_file())


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of one events log (a torn last line is left out)."""
    return [rec for _, rec in read_log(path)[0] if isinstance(rec, dict) and "time" in rec]


def input_lines(out_dir: Path, recorded: Any = None) -> dict[str, int]:
    """Input lines per shard (``"index/count"``), the latest count of each shard's log;
    ``recorded``: counts a merge carried over (provenance ``input_lines``)."""
    counts: dict[str, int] = {}
    if isinstance(recorded, dict):
        counts.update({str(k): int(v) for k, v in recorded.items() if isinstance(v, int)})
    for path in event_files(out_dir):
        for rec in read_events(path):
            if rec.get("event") == "input" and isinstance(rec.get("lines"), int):
                counts[str(rec.get("shard", "0/1"))] = rec["lines"]
    return counts
