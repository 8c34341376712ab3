"""The files of one ``hsx regenerate`` output, and what a resume reads back from them.

Beside ``<stem>.jsonl`` (one line per regenerated conversation): ``<stem>.quarantine.jsonl``
(each refused conversation, 0-based ``line``, as ``hsx run``'s quarantine),
``<stem>.meta.json`` (the sampling settings; a resume with other settings is refused),
``<stem>.events.jsonl`` (the run's events, as ``hsx run``'s), ``<stem>.summary.json``, and
``.<name>.lock`` (one regenerate per output at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import exclusive_lock, write_atomic
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import iter_log, quarantine_entries
from hsx_async.errors import ConfigError, DatasetError


@dataclass(frozen=True, slots=True)
class RegenPaths:
    out: Path
    quarantine: Path
    meta: Path
    events: Path
    summary: Path
    lock: Path

    @classmethod
    def beside(cls, out: Path) -> RegenPaths:
        stem = out.name.removesuffix(".jsonl")
        return cls(
            out,
            out.with_name(f"{stem}.quarantine.jsonl"),
            out.with_name(f"{stem}.meta.json"),
            out.with_name(f"{stem}.events.jsonl"),
            out.with_name(f"{stem}.summary.json"),
            out.with_name(f".{out.name}.lock"),
        )


def written_ids(path: Path) -> set[str]:
    """The ids of the conversations already in an output file (complete lines only),
    read as every hsx log is read (:func:`~hsx_async.dataset.manifest.iter_log`)."""
    ids: set[str] = set()
    for number, rec in iter_log(path):
        if not isinstance(rec, dict):
            raise DatasetError(
                f"{path}:{number} is not a JSON object; this is not hsx regenerate output: "
                "give another --out"
            )
        if rec.get("id") is not None:
            ids.add(canonical_id(rec["id"]))
    return ids


def quarantined(path: Path) -> tuple[set[str], set[int]]:
    """The ids a quarantine file owns and its 0-based input lines, by the rule of a run's
    resume (:func:`~hsx_async.dataset.manifest.load_done`: a repeated id's line does not
    own the id)."""
    entries = list(quarantine_entries(path))
    ids = {canonical_id(q.own_id) for q in entries if q.own_id is not None}
    return ids, {q.line for q in entries}


@contextlib.contextmanager
def output_lock(paths: RegenPaths) -> Iterator[None]:
    """One regenerate per output (:func:`exclusive_lock` beside it); an output directory
    that cannot be made or written is one line, not a traceback."""
    busy = (
        f"another hsx regenerate is writing to {paths.out}; wait for it to finish, or give "
        "this one another --out"
    )
    try:
        paths.lock.parent.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        stack.enter_context(exclusive_lock(paths.lock, busy))
    except OSError as exc:
        raise DatasetError(
            f"cannot write --out in {paths.lock.parent}: {exc.strerror or exc}; give another --out"
        ) from None
    with stack:
        yield


def check_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write the settings once; a resume must use the same ones."""
    if path.exists():
        old = orjson.loads(path.read_bytes())
        if old != meta:
            changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            raise ConfigError(
                "regenerate",
                f"{path} was written with other settings ({', '.join(changed)}); "
                "use them again to resume, or write to a new --out",
            )
        return
    write_atomic(path, orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
