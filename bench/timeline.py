"""A run's timeline from its JSON log (a bench script's ``--keep-logs``, or any ``hsx run``
with ``[daemon] log_format = "json"``): each event's time since ``run_started``.

    python bench/timeline.py bench/results/logs/pair-0-1.log
    python bench/timeline.py --all LOG [LOG ...]     # every event, not only the milestones

The milestones say where a short run's fixed cost goes: the input read and counted, the
first server's identity pinned and the server admitted (issue 24's probe), each sample
committed, the end. Lines that are not JSON (a traceback, a progress line) are skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson

MILESTONES = (
    "run_started",
    "input_counted",
    "job_identity_pinned",
    "server_admitted",
    "server_out_of_rotation",
    "sample_done",
    "sample_quarantined",
    "run_finished",
)
_SHOWN = ("id", "server", "kind", "tokens", "bytes", "samples", "cpu_s")


@dataclass(frozen=True)
class Event:
    ms: float  # since run_started
    name: str
    detail: str


def timeline(lines: Iterable[bytes], *, every: bool = False) -> list[Event]:
    """The events of one run, from ``run_started`` on (an earlier run in the same log is
    left out: the last ``run_started`` begins the timeline)."""
    stamped: list[tuple[float, str, str]] = []
    for line in lines:
        if not line.startswith(b"{"):
            continue
        try:
            event = orjson.loads(line)
            name, stamp = event["event"], datetime.fromisoformat(event["timestamp"])
        except (ValueError, KeyError, TypeError):
            continue
        if name == "run_started":
            stamped = []
        if every or name in MILESTONES:
            detail = " ".join(f"{k}={event[k]}" for k in _SHOWN if k in event)
            stamped.append((stamp.timestamp(), name, detail))
    if not stamped or stamped[0][1] != "run_started":
        return []
    t0 = stamped[0][0]
    return [Event((t - t0) * 1000, name, detail) for t, name, detail in stamped]


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--all", action="store_true", help="every event, not only the milestones")
    args = p.parse_args(argv)
    for log in args.logs:
        events = timeline(log.read_bytes().splitlines(), every=args.all)
        print(f"{log}:" + ("" if events else " no run_started in it"))
        for e in events:
            print(f"  {e.ms:9.1f} ms  {e.name:24s} {e.detail}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
