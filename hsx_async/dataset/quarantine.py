"""The quarantine: samples that could not be made, and the kinds of reason why.

``quarantine*.jsonl`` (PROTOCOL §4) holds one line per input line that did not become a
sample, with its reason: the prose for people and, since issue 38, the structured record
programs read (:class:`~hsx_async.dataset.manifest.Reason`: ``cause``, ``kind``,
``retriable``), written by whoever quarantines (the pipeline's
:class:`~hsx_async.run.servers.retry.Attempts` from the fault it charged last, the intake for input
lines: :func:`input_reason`). Every reader — ``hsx quarantine``, its ``--retry``, the job
report, ``hsx status`` — takes a line's reason from :func:`reason_of`, which reads a line
written before the fields from its prose (the prefixes below and :func:`reason_kind`): the
one place the prose is parsed.

A quarantine is not final: once its cause is fixed, :func:`retry` (``hsx quarantine OUT
--retry``) puts lines back — those quarantined after attempts, or by reason kind, or all
— and the next ``hsx run`` extracts them again. The lines put back are kept, with the
time, in ``quarantine-retried*.jsonl``.
"""

from __future__ import annotations

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
    QuarantineEntry,
    Reason,
    log_files,
    log_name,
    quarantine_entry,
    read_log,
    read_quarantine,
    shard_count_of,
    shard_index_of,
)
from hsx_async.dataset.provenance import directory_lock, shard_lock
from hsx_async.errors import DatasetError


def reason_kind(reason: str) -> str:
    """A failure's prose without its particulars (ids, numbers, paths, the server it
    happened on), so the same problem counts once however many samples met it: the kind
    of an old quarantine line (:func:`reason_of`), and the label of failed attempts in
    the job report."""
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


# -- the reasons' prose (run/retry writes it; a reader never parses a new line's prose) -----

_ATTEMPTS = re.compile(r"^\d+ attempts failed; last: ")
_REFUSED = "the server refused the sample itself, not retried: "
RETRIED = "quarantine-retried"  # the history: every line put back, with when

# The kinds of an input line that is not a sample (the fault kinds: run/faults.KINDS).
BAD_INPUT = "bad_input"  # not JSON, no input_ids, mismatched loss_mask, too long, ...
DUPLICATE_ID = "duplicate_id"  # an id an earlier line holds
INPUT_KINDS = (BAD_INPUT, DUPLICATE_ID)


def attempts_reason(count: int, last: str) -> str:
    """The prose of a sample quarantined after ``count`` charged attempts."""
    return f"{count} attempts failed; last: {last}"


def refused_reason(last: str) -> str:
    """The prose of a sample whose content the server refused (a 4xx, not retried)."""
    return f"{_REFUSED}{last}"


def input_reason(text: str, *, duplicate: bool = False) -> Reason:
    """An input line that is not a sample: the input's own fault, which a rerun would
    quarantine again as it is (not retriable)."""
    return Reason(text, "sample", DUPLICATE_ID if duplicate else BAD_INPUT, retriable=False)


def reason_of(entry: QuarantineEntry) -> Reason:
    """A quarantine line's reason: its structured fields; for a line written before them
    (issue 38), what its prose says — retriable when the pipeline wrote it (the sample
    was sent and failed: the prefixes above), its kind the prose without particulars
    (:func:`reason_kind`), its cause not recorded (None)."""
    why = entry.why
    if why is not None:
        return why
    text = entry.reason
    retriable = bool(_ATTEMPTS.match(text)) or text.startswith(_REFUSED)
    return Reason(text, None, reason_kind(text), retriable)


@dataclass(frozen=True)
class Kind:
    cause: str | None
    kind: str
    count: int
    retriable: bool  # quarantined after attempts (a fixed cause may make them pass)
    example: str  # the prose of one of its lines, for people


def kinds(out_dir: Path) -> list[Kind]:
    """The quarantine's lines by (cause, kind, retriable), most first."""
    counts: Counter[tuple[str | None, str, bool]] = Counter()
    examples: dict[tuple[str | None, str, bool], str] = {}
    for entry in read_quarantine(out_dir):
        why = reason_of(entry)
        key = (why.cause, why.kind, why.retriable)
        counts[key] += 1
        examples.setdefault(key, why.text)
    return [Kind(c, k, n, r, examples[c, k, r]) for (c, k, r), n in counts.most_common()]


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

    def chosen(why: Reason) -> bool:
        if wanted:
            return any(w in why.kind.lower() for w in wanted)
        return everything or why.retriable

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
                _put_back(out_dir, path, [rec for rec, _ in back], stay)
                by_kind.update(why.kind for _, why in back)
    return Retried(sum(by_kind.values()), kept, dict(by_kind.most_common()))


def _split(
    path: Path, chosen: Callable[[Reason], bool]
) -> tuple[list[tuple[Any, Reason]], list[Any]]:
    """The log's lines to put back (each with its reason) and those to keep, each line as
    it is (a field hsx does not know survives the rewrite)."""
    back: list[tuple[Any, Reason]] = []
    stay: list[Any] = []
    for number, rec in read_log(path)[0]:
        why = reason_of(quarantine_entry(rec, f"{path}:{number}"))
        if chosen(why):
            back.append((rec, why))
        else:
            stay.append(rec)
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
