"""The job report: ``report.json`` and a one-page ``report.png`` for an output directory.

Where the numbers come from, all of it durable in the output directory:

- ``manifest*.jsonl`` and ``quarantine*.jsonl``: samples, tokens, bytes written, and each
  quarantined line's reason (grouped into kinds);
- ``events*.jsonl`` (one per shard, written by :class:`RunRecorder` during ``hsx run``):
  a ``start`` line per run, a ``tick`` line every second for the first minute and every
  ten seconds after (wall-clock time and the run's cumulative samples, tokens, bytes,
  quarantined, failed attempts by kind and requests per server; with a spool, its fill and
  each consumer's lag) and an ``end`` line. A run killed before its ``end`` line still has
  its last tick. The log is an append-only JSONL
  file (a torn last line is cut on reopen, like the manifest's); ~300 bytes a tick, ~10 MB
  for 70 hours.

``hsx report OUT`` rebuilds both files at any time, also while a run is going and for
shards written into one directory. The PNG needs matplotlib (``pip install
-e '.[plot]'`` in the clone); without it only the JSON is written and a hint says so.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from hsx_async.dataset.durable import write_atomic
from hsx_async.dataset.events import EVENTS, event_files, input_lines, read_events
from hsx_async.dataset.inspection import require_dataset
from hsx_async.dataset.manifest import (
    AppendLog,
    ManifestEntry,
    QuarantineEntry,
    log_name,
    read_manifest,
    read_quarantine,
    retired_paths,
)
from hsx_async.dataset.provenance import directory_lock, read_provenance
from hsx_async.dataset.quarantine import reason_of
from hsx_async.errors import DatasetError

if TYPE_CHECKING:
    from hsx_async.run.servers.pool import Server

log = structlog.get_logger("hsx.report")

_RUN_EVENTS = ("start", "tick", "end")  # the lines with the run's counts
REPORT_JSON = "report.json"
REPORT_PNG = "report.png"
# hsx is installed from a clone (README quickstart: pip install -e .), so is its extra.
PLOT_HINT = "for report.png install matplotlib: pip install -e '.[plot]' in the hsx clone"
_FAST_TICKS_S = 60.0  # tick every second this long, then every _SLOW_TICK_S
_SLOW_TICK_S = 10.0


# -- recording (during hsx run) ------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """The run's cumulative counts at one moment."""

    samples: int
    tokens: int
    bytes: int
    quarantined: int
    retries: dict[str, int]  # failed attempts by kind
    servers: dict[str, int]  # requests sent, by server (URL as displayed)
    # With a spool (PROTOCOL §6): bytes held, the limit, seconds paused for room, and each
    # consumer's lag (committed samples of this shard it has not acknowledged).
    spool: dict[str, Any] | None = None


class RunRecorder:
    """Appends this run's ``start``/``tick``/``end`` lines to its shard's events log, and
    the events between ticks (``input``; ``server_out``/``server_back``: a server left
    rotation with its reason, or came back).

    Blocking file calls go to a thread; one ``fsync`` per line (at most one a second).
    The log is a record, not the data: a full disk (ENOSPC) or any other failure to
    append it never stops the run. The failed lines wait (the latest tick replaces an
    older one) and are written once the disk takes them again; a torn line is cut when
    the log is reopened.
    """

    def __init__(
        self, out_dir: Path, shard_index: int, shard_count: int, snapshot: Callable[[], Tick]
    ) -> None:
        self.path = out_dir / log_name(EVENTS, shard_index, shard_count)
        self.snapshot = snapshot
        self.shard = f"{shard_index}/{shard_count}"
        self._log: AppendLog | None = None
        self._started = time.monotonic()
        self._pending: list[dict[str, Any]] = []  # events not yet appended
        self.spells = ServerSpells()  # this run's spells out of rotation, as noted
        self._failing = False

    @classmethod
    def at(cls, path: Path, snapshot: Callable[[], Tick]) -> RunRecorder:
        """A recorder appending to ``path`` (``hsx regenerate``'s log beside its output)."""
        recorder = cls(path.parent, 0, 1, snapshot)
        recorder.path = path
        return recorder

    def _append(self, records: list[dict[str, Any]]) -> bool:
        """Append ``records`` (blocking); False, and logged once, when the disk refuses."""
        try:
            if self._log is None:
                self._log = AppendLog(self.path)
            self._log.append([orjson.dumps(r) + b"\n" for r in records])
        except (OSError, DatasetError) as exc:
            if self._log is not None:
                self._log.close()  # reopened next time: the torn tail is cut then
                self._log = None
            if not self._failing:
                self._failing = True
                log.warning(
                    "events_log_not_written",
                    path=str(self.path),
                    error=str(exc),
                    note="the run goes on; the job report misses what is not written",
                )
            return False
        if self._failing:
            self._failing = False
            log.info("events_log_written_again", path=str(self.path))
        return True

    async def _write(self, record: dict[str, Any]) -> None:
        """Append the pending events and ``record``; keep what failed for later (a tick
        is superseded by the next one: only the events are kept)."""
        batch = [*self._pending, record]
        self._pending = []
        if not await asyncio.to_thread(self._append, batch):
            self._pending = [r for r in batch if r.get("event") not in ("tick", "start")]

    def note(self, event: str, **fields: Any) -> None:
        """An event to append with the next line (called on the event loop)."""
        record = {"event": event, "time": round(time.time(), 3), "shard": self.shard, **fields}
        self._pending.append(record)
        self.spells.add(record)

    def server_changed(self, server: Server, in_rotation: bool) -> None:
        """A server left rotation, was refused again, or came back (a
        :class:`~hsx_async.run.servers.pool.ServerPool` ``on_change`` listener)."""
        self.note(
            "server_back" if in_rotation else "server_out",
            server=server.display,
            kind=server.out_kind,
            reason="" if in_rotation else server.last_error,
        )

    def _record(self, event: str, **extra: Any) -> dict[str, Any]:
        tick = self.snapshot()
        return {
            "event": event,
            "time": round(time.time(), 3),
            "shard": self.shard,
            "samples": tick.samples,
            "tokens": tick.tokens,
            "bytes": tick.bytes,
            "quarantined": tick.quarantined,
            "retries": tick.retries,
            "servers": tick.servers,
            **({} if tick.spool is None else {"spool": tick.spool}),
            **extra,
        }

    async def start(
        self, before: Mapping[str, int] | None = None, *, began: float | None = None
    ) -> None:
        """The ``start`` line; ``before``: what the shard's logs held at the start (samples,
        tokens, bytes, quarantined), so a run killed after its last tick is counted whole
        by the next one's start (:func:`_run_summaries`); ``began``: when the command's
        run began (epoch seconds), the line's time, so the report's duration and rate are
        the terminal's (its start-up checks and resume counted in both)."""
        self._started = time.monotonic()
        extra = {"before": dict(before)} if before else {}
        record = self._record("start", pid=os.getpid(), **extra)
        if began is not None:
            record["time"] = round(began, 3)
        await self._write(record)

    async def run(self) -> None:
        """Tick until cancelled (a long-lived task of the daemon's TaskGroup)."""
        while True:
            elapsed = time.monotonic() - self._started
            await asyncio.sleep(1.0 if elapsed < _FAST_TICKS_S else _SLOW_TICK_S)
            await self._write(self._record("tick"))

    async def input_read(self, lines: int) -> None:
        """The feeder read the whole input: ``lines`` of it belong to this shard."""
        self.note("input", lines=lines)
        await self._write(self._record("tick"))

    def finish(self, *, stopped: bool, unfinished: int) -> None:
        """The ``end`` line (blocking; called once the run is over)."""
        try:
            self._append(
                [*self._pending, self._record("end", stopped=stopped, unfinished=unfinished)]
            )
            self._pending = []
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


# -- building the report -------------------------------------------------------------------


def _read_runs(out_dir: Path) -> list[list[dict[str, Any]]]:
    """Each run's records in time order (a run: a ``start`` line and what follows it)."""
    runs: list[list[dict[str, Any]]] = []
    for path in event_files(out_dir):
        current: list[dict[str, Any]] | None = None
        for rec in read_events(path):
            if rec.get("event") not in _RUN_EVENTS:
                continue
            if rec.get("event") == "start" or current is None:
                current = []
                runs.append(current)
            current.append(rec)
    runs.sort(key=lambda r: float(r[0]["time"]))
    return runs


def _rate_series(runs: list[list[dict[str, Any]]], t0: float) -> list[dict[str, float]]:
    """Tokens, samples and bytes per second between consecutive records of each run."""
    points = []
    for index, run in enumerate(runs):
        for a, b in itertools.pairwise(run):
            dt_s = float(b["time"]) - float(a["time"])
            if dt_s <= 0:
                continue
            points.append(
                {
                    "run": index,  # into "runs": the plot draws each run apart
                    "t": round(float(b["time"]) - t0, 3),
                    "tokens_per_s": (b["tokens"] - a["tokens"]) / dt_s,
                    "samples_per_s": (b["samples"] - a["samples"]) / dt_s,
                    "bytes_per_s": (b["bytes"] - a["bytes"]) / dt_s,
                }
            )
    return points


def _spool(runs: list[list[dict[str, Any]]], t0: float) -> dict[str, Any] | None:
    """The spool's fill and each consumer's lag over time, from the records that have them
    (a run with ``[output].consumers`` or ``retention = "acked"``); None: no such run.
    With shards in one directory, each shard's points are its own (``shard``)."""
    points, peak_lag = [], Counter[str]()
    peak = limit = 0
    paused = 0.0
    for index, run in enumerate(runs):
        last_paused = 0.0
        for rec in run:
            spool = rec.get("spool")
            if not isinstance(spool, dict):
                continue
            lag = {str(k): int(v) for k, v in (spool.get("lag") or {}).items()}
            held, cap = int(spool.get("held", 0)), int(spool.get("limit", 0))
            points.append({"run": index, "shard": rec.get("shard", "0/1"),
                           "t": round(float(rec["time"]) - t0, 3), "held": held,
                           "limit": cap, "lag": lag})  # fmt: skip
            peak, limit = max(peak, held), max(limit, cap)
            for name, behind in lag.items():
                peak_lag[name] = max(peak_lag[name], behind)
            last_paused = float(spool.get("paused_s", 0.0))
        paused += last_paused  # cumulative within a run
    if not points:
        return None
    last = points[-1]
    return {
        "limit": limit,
        "peak_held": peak,
        "held": last["held"],
        "paused_s": round(paused, 1),
        "peak_lag": dict(peak_lag),
        "lag": last["lag"],
        "series": points,
    }


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="seconds")


_COUNTS = ("samples", "tokens", "bytes", "quarantined")


def _run_summary(run: list[dict[str, Any]], after: Mapping[str, Any] | None) -> dict[str, Any]:
    """One run's line; ``after``: what its shard held when the next run of it started (or
    holds now, for the last run), when known."""
    first, last = run[0], run[-1]
    ended = last.get("event") == "end"
    counts = {key: int(last[key]) for key in _COUNTS}
    before = first.get("before")
    if not ended and isinstance(before, Mapping) and after is not None:
        # Killed: what it committed after its last tick is in the logs the next start read.
        for key in _COUNTS:
            counts[key] = max(counts[key], int(after.get(key, 0)) - int(before.get(key, 0)))
    return {
        "shard": first.get("shard", "0/1"),
        "started": _iso(float(first["time"])),
        "ended": _iso(float(last["time"])) if ended else None,
        "seconds": round(float(last["time"]) - float(first["time"]), 3),
        **counts,
        "outcome": ("stopped" if last.get("stopped") else "finished")
        if ended
        else "killed or still running",
    }


def _run_summaries(
    runs: list[list[dict[str, Any]]], now: Mapping[str, int]
) -> list[dict[str, Any]]:
    """Each run's line. A run of a job in one shard that was killed is counted up to the
    next run's start (its ``before``), or, the last one, up to what the logs hold ``now``
    (before, per-run counts fell short of the dataset by what it wrote after its last
    tick). With shards in one directory, ``before`` is not recorded: last ticks."""
    lines = []
    for index, run in enumerate(runs):
        later = runs[index + 1][0].get("before") if index + 1 < len(runs) else now
        lines.append(_run_summary(run, later if isinstance(later, Mapping) else None))
    return lines


def _summed(runs: list[list[dict[str, Any]]], key: str) -> dict[str, int]:
    """A per-run cumulative mapping (retries, servers), added up over the runs."""
    total: Counter[str] = Counter()
    for run in runs:
        total.update({k: int(v) for k, v in run[-1].get(key, {}).items()})
    return dict(total.most_common())


class ServerSpells:
    """Each time a server left rotation (or was refused again, for a new kind of reason),
    why, and when it came back (``back`` None: not in that run) — folded from events
    records in order. One rule for the job report (read back from the events logs) and
    for the summary of ``hsx regenerate`` (as the recorder notes them)."""

    def __init__(self) -> None:
        self.spells: list[dict[str, Any]] = []
        # server → the spells of its outage not ended yet (one per reason it was refused
        # for): its return ends them all, so none reads "not back" once it is back.
        self._open: dict[str, list[dict[str, Any]]] = {}

    def add(self, rec: Mapping[str, Any]) -> None:
        server, event = rec.get("server"), rec.get("event")
        if event == "start":
            self._open.clear()  # a new run: every server is examined afresh
        if not isinstance(server, str):
            return
        if event == "server_out":
            outage = self._open.setdefault(server, [])
            if outage and outage[-1]["kind"] == rec.get("kind"):
                return  # the same spell, refused again
            spell = {
                "server": server,
                "kind": str(rec.get("kind", "")),
                "reason": str(rec.get("reason", "")),
                "out": _iso(float(rec["time"])),
                "back": None,
            }
            self.spells.append(spell)
            outage.append(spell)
        elif event == "server_back":
            for spell in self._open.pop(server, []):
                spell["back"] = _iso(float(rec["time"]))


def servers_out(out_dir: Path) -> list[dict[str, Any]]:
    """Every spell out of rotation of the directory's runs, shard by shard (a shard's
    ``server_back`` ends only that shard's spell)."""
    spells: list[dict[str, Any]] = []
    for path in event_files(out_dir):
        fold = ServerSpells()
        for rec in read_events(path):
            fold.add(rec)
        spells += fold.spells
    return spells


def _held_now(manifest: list[ManifestEntry], quarantine: list[QuarantineEntry]) -> dict[str, int]:
    """What the logs hold, as a start line's ``before`` counts it (load_done)."""
    return {
        "samples": len(manifest),
        "tokens": sum(e.num_tokens for e in manifest),
        "bytes": sum(e.size for e in manifest),
        "quarantined": len(quarantine),
    }


def build_report(out_dir: Path) -> dict[str, Any]:
    """Every number of the report, from the files of ``out_dir`` (an hsx dataset: the
    rule of status, verify and export)."""
    require_dataset(out_dir)
    manifest = read_manifest(out_dir, retired=True)  # a retired sample was written (and used)
    gone = retired_paths(out_dir)
    quarantine = read_quarantine(out_dir)
    runs = _read_runs(out_dir)
    t0 = float(runs[0][0]["time"]) if runs else 0.0
    lines = input_lines(out_dir, (read_provenance(out_dir) or {}).get("input_lines"))
    reasons = [reason_of(q) for q in quarantine]
    kinds = Counter((r.cause, r.kind, r.retriable) for r in reasons)
    return {
        "dataset": str(out_dir),
        "generated": _iso(time.time()),
        "totals": {
            "samples": len(manifest),
            "tokens": sum(e.num_tokens for e in manifest),
            "bytes": sum(e.size for e in manifest if e.path not in gone),  # on disk now
            "retired": len(gone),  # deleted by the spool once every consumer had them
            "quarantined": len(quarantine),
            # every input line, once a run has read the whole input (None before)
            "input_lines": sum(lines.values()) if lines else None,
        },
        "runs": _run_summaries(runs, _held_now(manifest, quarantine)),
        "rate": _rate_series(runs, t0),
        "quarantine_reasons": dict(Counter(r.kind for r in reasons).most_common()),
        # by cause, kind and whether a rerun may pass (cause null: a line written before it)
        "quarantine_kinds": [
            {"cause": c, "kind": k, "retriable": r, "count": n}
            for (c, k, r), n in kinds.most_common()
        ],
        "servers": _summed(runs, "servers"),
        "retries": _summed(runs, "retries"),
        "servers_out": servers_out(out_dir),
        "spool": _spool(runs, t0),  # None: no run kept a spool
    }


def write_report(out_dir: Path, *, png: bool = True) -> tuple[Path, Path | None, str]:
    """Write ``report.json`` (and ``report.png`` when matplotlib is there).

    Returns (json path, png path or None, a hint when the PNG was not drawn)."""
    report = build_report(out_dir)
    json_path = out_dir / REPORT_JSON
    # Under the directory's lock, as every top-level record: a run's start-up removes what
    # a writer killed mid-write left (remove_stale_temps), and no writer is live then.
    with directory_lock(out_dir):
        write_atomic(json_path, orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        if not png:
            return json_path, None, ""
        try:
            from hsx_async.run.report.plot import render  # noqa: PLC0415 - matplotlib is optional
        except ImportError:
            return json_path, None, PLOT_HINT
        png_path = out_dir / REPORT_PNG
        render(report, png_path)
    return json_path, png_path, ""
