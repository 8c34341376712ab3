"""The quarantine: samples that could not be made, and the kinds of reason why.

``quarantine*.jsonl`` (PROTOCOL §4) holds one line per input line that did not become a
sample, with its reason. :func:`reason_kind` strips a reason of its particulars (ids,
numbers, paths, the server it happened on), so the same problem counts once however many
samples met it: the job report's bars, the Prometheus failure labels and ``hsx status``
use it.

A quarantine is not final: once its cause is fixed, :func:`retry` (``hsx quarantine OUT
--retry``) puts lines back — those quarantined after attempts, or by reason kind, or all
— and the next ``hsx run`` extracts them again. The lines put back are kept, with the
time, in ``quarantine-retried*.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import write_atomic
from hsx_async.dataset.manifest import (
    QUARANTINE,
    AppendLog,
    log_files,
    log_name,
    read_log,
    read_quarantine,
    shard_count_of,
    shard_index_of,
)
from hsx_async.dataset.provenance import directory_lock, shard_lock
from hsx_async.errors import DatasetError


def reason_kind(reason: str) -> str:
    """A quarantine reason without its particulars: what a bar in the chart is named."""
    text = re.sub(r"^\d+ attempts failed; last: ", "", reason)
    exhausted = text != reason
    text = re.sub(r"^https?://\S+?: ", "", text)  # the server a retried attempt went to
    text = re.split(r"[:(;]", text, maxsplit=1)[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|/\S+", "…", text)
    # HTTP status codes stay (a handful of kinds, and the code is what to act on).
    text = re.sub(r"(HTTP \d{3}\b)|\d+", lambda m: m.group(1) or "N", text).strip() or "other"
    if len(text) > 60:
        text = text[:59] + "…"
    return f"retries exhausted: {text}" if exhausted else text


# -- reasons the pipeline gives (one rule: run/retry writes them, this module reads them) --

_ATTEMPTS = re.compile(r"^\d+ attempts failed; last: ")
_REFUSED = "the server refused the sample itself, not retried: "
RETRIED = "quarantine-retried"  # the history: every line put back, with when


def attempts_reason(count: int, last: str) -> str:
    """The reason of a sample quarantined after ``count`` charged attempts."""
    return f"{count} attempts failed; last: {last}"


def refused_reason(last: str) -> str:
    """The reason of a sample whose content the server refused (a 4xx, not retried)."""
    return f"{_REFUSED}{last}"


def after_attempts(reason: str) -> bool:
    """Whether a quarantine reason is the pipeline's (the sample was sent and failed), as
    opposed to the input's (not a sample at all: bad JSON, a duplicate id, too long),
    which a rerun would quarantine again as it is."""
    return bool(_ATTEMPTS.match(reason)) or reason.startswith(_REFUSED)


@dataclass(frozen=True)
class Kind:
    kind: str
    count: int
    retriable: bool  # quarantined after attempts (a fixed cause may make them pass)


def kinds(out_dir: Path) -> list[Kind]:
    """The quarantine's lines by reason kind, most first."""
    counts: Counter[tuple[str, bool]] = Counter(
        (reason_kind(q.reason), after_attempts(q.reason)) for q in read_quarantine(out_dir)
    )
    return [Kind(k, n, r) for (k, r), n in counts.most_common()]


def retried_before(out_dir: Path) -> int:
    """Lines put back by earlier retries (the history)."""
    return sum(len(read_log(path)[0]) for path in _history_files(out_dir))


def _history_files(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob(f"{RETRIED}*.jsonl")) if out_dir.is_dir() else []


@dataclass(frozen=True)
class Retried:
    lines: int  # put back
    kept: int  # still quarantined
    by_kind: dict[str, int]


def retry(out_dir: Path, *, kinds: Sequence[str] = (), everything: bool = False) -> Retried:
    """Put quarantined lines back, so the next ``hsx run`` extracts them again: those
    quarantined after attempts (default), those whose reason kind contains one of
    ``kinds``, or ``everything``. Each line put back is first appended, with the time, to
    the history (``quarantine-retried*.jsonl``, fsynced), then the quarantine log is
    rewritten without it (temp file, fsync, rename): a crash in between leaves a line in
    both, never in neither. Refused while a run holds the directory (its shard locks)."""
    if not out_dir.is_dir():
        raise DatasetError(f"{out_dir} is not a directory; give an output directory")
    wanted = [k.lower() for k in kinds]

    def chosen(reason: str) -> bool:
        if wanted:
            kind = reason_kind(reason).lower()
            return any(w in kind for w in wanted)
        return everything or after_attempts(reason)

    logs = log_files(out_dir, QUARANTINE)
    by_kind: Counter[str] = Counter()
    kept = 0
    with contextlib.ExitStack() as locks:
        locks.enter_context(directory_lock(out_dir))
        for path in logs:
            locks.enter_context(shard_lock(out_dir, shard_index_of(path)))
        for path in logs:
            back, stay = _split(path, chosen)
            kept += len(stay)
            if back:
                _put_back(out_dir, path, back, stay)
                by_kind.update(reason_kind(str(rec.get("reason", ""))) for rec in back)
    return Retried(sum(by_kind.values()), kept, dict(by_kind.most_common()))


def _split(path: Path, chosen: Callable[[str], bool]) -> tuple[list[Any], list[Any]]:
    back: list[Any] = []
    stay: list[Any] = []
    for _, rec in read_log(path)[0]:
        reason = rec.get("reason") if isinstance(rec, dict) else None
        (back if isinstance(reason, str) and chosen(reason) else stay).append(rec)
    return back, stay


def _put_back(out_dir: Path, path: Path, back: list[Any], stay: list[Any]) -> None:
    history = out_dir / log_name(RETRIED, shard_index_of(path), shard_count_of(path))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log = AppendLog(history)
    try:
        log.append([orjson.dumps({**rec, "retried": when}) + b"\n" for rec in back])
    finally:
        log.close()
    write_atomic(path, b"".join(orjson.dumps(rec) + b"\n" for rec in stay))


# -- CLI -----------------------------------------------------------------------------------


def quarantine_command(args: argparse.Namespace) -> int:
    # inspection (hsx status) imports this module for its counts: its rule, imported here.
    from hsx_async.dataset.inspection import require_dataset  # noqa: PLC0415 - see above

    out = Path(args.out)
    require_dataset(out)
    if args.retry or args.kind or args.all:
        done = retry(out, kinds=args.kind or (), everything=args.all)
        for kind, count in done.by_kind.items():
            print(f"put back: {count:,}  {kind}")
        print(
            f"{done.lines:,} lines put back (history: {RETRIED}*.jsonl), {done.kept:,} still "
            "quarantined" + ("; run `hsx run` again to extract them" if done.lines else "")
        )
        return 0
    found = kinds(out)
    for k in found:
        print(f"{k.count:>8,}  {'retriable' if k.retriable else 'input    '}  {k.kind}")
    total, retriable = sum(k.count for k in found), sum(k.count for k in found if k.retriable)
    hint = (
        f"`hsx quarantine {out} --retry` puts those back (--kind TEXT: by kind, --all: every line)"
        if retriable
        else "nothing for --retry to put back (the input's own faults would be quarantined "
        "again; --all puts them back anyway)"
        if total
        else "nothing to put back"
    )
    print(
        f"{total:,} quarantined, {retriable:,} after failed attempts; {hint}; "
        f"{retried_before(out):,} put back before"
    )
    return 0
