"""``manifest.jsonl`` and ``quarantine.jsonl``: the durable record of what is done (PROTOCOL §4).

A line is appended only after its data file is fsynced and renamed into place, and the log
is fsynced before anyone relies on the line. A crash can leave at most a torn last line
(no newline); it is tolerated on read and cut off before the next append. A complete line
that does not parse is corruption, and is reported with its file and line number.

A sharded run (``[shard].count > 1``) writes ``manifest.shard-IIIII-of-NNNNN.jsonl`` (and
the same for quarantine); readers take the union of every manifest file in the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson
import xxhash

from hsx_async.dataset.layout import SampleId, canonical_id, manifest_path_problem
from hsx_async.errors import DatasetError

MANIFEST = "manifest"
QUARANTINE = "quarantine"
_SHARD_FILE = re.compile(r"(manifest|quarantine)(?:\.shard-([0-9]{5})-of-([0-9]{5}))?\.jsonl")
_XXH = re.compile(r"[0-9a-f]{16}")

# Whose fault a failure is (:mod:`hsx_async.run.servers.faults`), as a quarantine line records it.
Cause = Literal["sample", "server", "job"]
CAUSES: tuple[Cause, ...] = ("sample", "server", "job")


def log_name(kind: str, shard_index: int = 0, shard_count: int = 1) -> str:
    if shard_count == 1:
        return f"{kind}.jsonl"
    return f"{kind}.shard-{shard_index:05d}-of-{shard_count:05d}.jsonl"


def log_files(out_dir: Path, kind: str) -> list[Path]:
    """Every ``kind`` log in ``out_dir``, sharded or not, in name order."""
    if not out_dir.is_dir():
        return []
    found = []
    for entry in os.scandir(out_dir):
        m = _SHARD_FILE.fullmatch(entry.name)
        if m and m.group(1) == kind and entry.is_file(follow_symlinks=False):
            found.append(Path(entry.path))
    return sorted(found)


def shard_index_of(path: Path) -> int:
    """The shard a log file belongs to (0 for an unsharded ``manifest.jsonl``)."""
    m = _SHARD_FILE.fullmatch(path.name)
    return int(m.group(2)) if m and m.group(2) else 0


def shard_count_of(path: Path) -> int:
    """The shard count a log file was written with (1 for an unsharded log)."""
    m = _SHARD_FILE.fullmatch(path.name)
    return int(m.group(3)) if m and m.group(3) else 1


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    id: SampleId
    path: str
    num_tokens: int
    size: int  # "bytes" in the JSON line
    xxh3_64: str

    def to_line(self) -> bytes:
        return (
            orjson.dumps(
                {
                    "id": self.id,
                    "path": self.path,
                    "num_tokens": self.num_tokens,
                    "bytes": self.size,
                    "xxh3_64": self.xxh3_64,
                }
            )
            + b"\n"
        )


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a line is quarantined (PROTOCOL §4): ``text``, the prose for people, and for
    programs ``cause`` (whose fault the failure was: the sample's, a server's, the job's;
    None on a line written before the field, issue 38), ``kind`` (a word of a fixed
    vocabulary: a fault kind, :data:`hsx_async.run.servers.faults.KINDS`, or an input kind,
    :data:`hsx_async.dataset.quarantine.INPUT_KINDS`) and ``retriable`` (the sample was
    sent and failed, so a rerun may pass once the cause is fixed; not an input line's own
    fault, which a rerun quarantines again)."""

    text: str
    cause: Cause | None
    kind: str
    retriable: bool


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    """``id`` is None when the line has no usable id (bad JSON). A repeated id keeps its
    id and names the line holding it first in ``duplicate_of``: that line, not this one,
    owns the id. ``line`` is 0-based (PROTOCOL §4); messages say ``line + 1``. ``cause``,
    ``kind`` and ``retriable`` (:class:`Reason`) are None on a line written before them:
    :func:`hsx_async.dataset.quarantine.reason_of` reads those from the prose."""

    id: SampleId | None
    line: int
    reason: str
    duplicate_of: int | None = None
    cause: Cause | None = None
    kind: str | None = None
    retriable: bool | None = None

    @classmethod
    def of(
        cls, sample_id: SampleId | None, line: int, why: Reason, duplicate_of: int | None = None
    ) -> QuarantineEntry:
        return cls(sample_id, line, why.text, duplicate_of, why.cause, why.kind, why.retriable)

    @property
    def own_id(self) -> SampleId | None:
        return None if self.duplicate_of is not None else self.id

    @property
    def why(self) -> Reason | None:
        """The line's structured reason; None on a line written before it."""
        if self.kind is None or self.retriable is None:
            return None
        return Reason(self.reason, self.cause, self.kind, self.retriable)

    def to_line(self) -> bytes:
        record: dict[str, Any] = {"id": self.id, "line": self.line, "reason": self.reason}
        if self.duplicate_of is not None:
            record["duplicate_of"] = self.duplicate_of
        if self.kind is not None and self.retriable is not None:
            record.update(cause=self.cause, kind=self.kind, retriable=self.retriable)
        return orjson.dumps(record) + b"\n"


def _parse_line(raw: bytes, path: Path, number: int) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise DatasetError(
            f"{path}:{number} is not valid JSON; the log is corrupt. Move the line "
            "aside (its sample will be redone) and run again"
        ) from None


def _split_lines(data: bytes, path: Path) -> tuple[list[tuple[int, Any]], int]:
    """Parsed complete lines (with 1-based numbers) and the length of the complete prefix."""
    complete = data.rfind(b"\n") + 1
    records = []
    for number, raw in enumerate(data[:complete].splitlines(), start=1):
        if raw.strip():
            records.append((number, _parse_line(raw, path, number)))
    return records, complete


def iter_log(path: Path) -> Iterator[tuple[int, Any]]:
    """The records of one log's complete lines, as :func:`read_log` reads them (1-based
    numbers; a torn last line left out; a line that is not JSON is the same
    :class:`DatasetError`), one line at a time: for a log whose lines are large (a
    regenerated conversation each), where the whole file is not to be held."""
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return
    with fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                return  # torn: AppendLog cuts it when the log is opened to append
            if raw.strip():
                yield number, _parse_line(raw, path, number)


def quarantine_entries(path: Path) -> Iterator[QuarantineEntry]:
    """The entries of one quarantine log (any name: ``hsx regenerate``'s too), streamed."""
    for n, rec in iter_log(path):
        yield quarantine_entry(rec, f"{path}:{n}")


def _id_of(value: object, where: str) -> SampleId:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise DatasetError(f"{where}: id {value!r} is not a string or integer")
    return value


def _manifest_entry(rec: Any, where: str) -> ManifestEntry:
    try:
        entry = ManifestEntry(
            id=_id_of(rec["id"], where),
            path=rec["path"],
            num_tokens=int(rec["num_tokens"]),
            size=int(rec["bytes"]),
            xxh3_64=str(rec["xxh3_64"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: manifest line is missing or mistypes {exc}") from None
    if not _XXH.fullmatch(entry.xxh3_64):
        raise DatasetError(f"{where}: xxh3_64 {entry.xxh3_64!r} is not 16 hex digits")
    problem = manifest_path_problem(entry.path)
    if problem:
        raise DatasetError(
            f"{where}: {problem}; hsx did not write this line: move it aside (its sample is "
            "extracted again)"
        )
    return entry


def quarantine_entry(rec: Any, where: str) -> QuarantineEntry:
    """One quarantine line's record (``where``: its file and line, for the error)."""
    try:
        raw_id = rec["id"]
        dup = rec.get("duplicate_of")
        entry = QuarantineEntry(
            id=None if raw_id is None else _id_of(raw_id, where),
            line=int(rec["line"]),
            reason=str(rec["reason"]),
            duplicate_of=None if dup is None else int(dup),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: quarantine line is missing or mistypes {exc}") from None
    if "kind" not in rec and "retriable" not in rec and "cause" not in rec:
        return entry  # a line written before the fields (issue 38): its prose says it
    cause, kind, retriable = rec.get("cause"), rec.get("kind"), rec.get("retriable")
    if (
        (cause is not None and cause not in CAUSES)
        or not isinstance(kind, str)
        or not kind
        or not isinstance(retriable, bool)
    ):
        raise DatasetError(
            f"{where}: quarantine line has cause {cause!r}, kind {kind!r}, retriable "
            f"{retriable!r}; expected one of {', '.join(CAUSES)} (or null), a word and "
            "true/false: hsx did not write this line"
        )
    return dataclasses.replace(entry, cause=cause, kind=kind, retriable=retriable)


def read_log(path: Path) -> tuple[list[tuple[int, Any]], bool]:
    """The records of one log and whether its last line is torn (no newline)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    records, complete = _split_lines(data, path)
    return records, complete < len(data)


def read_manifest(out_dir: Path, *, retired: bool = False) -> list[ManifestEntry]:
    """Every manifest entry of the directory (all shards) whose file the dataset still
    holds; ``retired=True`` adds the samples a bounded spool deleted once every consumer
    had them (``retired.jsonl``, PROTOCOL §6): they are done, but their files are gone."""
    entries = [
        _manifest_entry(rec, f"{path}:{n}")
        for path in log_files(out_dir, MANIFEST)
        for n, rec in read_log(path)[0]
    ]
    if retired:
        return entries
    gone = retired_paths(out_dir)
    return [e for e in entries if e.path not in gone] if gone else entries


RETIRED = "retired.jsonl"


def retired_record(rec: Any) -> tuple[str, int] | None:
    """(path, bytes) of one ``retired.jsonl`` line (PROTOCOL §6.1); None for a line that is
    none: the one parser of that log."""
    if isinstance(rec, dict) and isinstance(rec.get("path"), str):
        size = rec.get("bytes", 0)
        return rec["path"], size if type(size) is int else 0
    return None


def retired_paths(out_dir: Path) -> set[str]:
    """Paths of the samples ``retired.jsonl`` records as deleted from the spool."""
    records, _ = read_log(out_dir / RETIRED)
    return {r[0] for r in (retired_record(rec) for _, rec in records) if r is not None}


def read_quarantine(out_dir: Path) -> list[QuarantineEntry]:
    return [
        quarantine_entry(rec, f"{path}:{n}")
        for path in log_files(out_dir, QUARANTINE)
        for n, rec in read_log(path)[0]
    ]


@dataclass(frozen=True, slots=True)
class DoneSet:
    """What a resumed run skips: ids in any manifest or quarantine, and quarantined lines."""

    ids: frozenset[str]
    lines: frozenset[int]
    manifest: tuple[ManifestEntry, ...]
    # What the directory holds (every shard): samples, tokens, bytes (retired ones too)
    # and quarantined lines; a run's start line records it (the job report's per-run
    # counts of a killed run come from it).
    counts: Mapping[str, int] = field(default_factory=dict)

    def is_done(self, sample_id: SampleId, line: int) -> bool:
        return canonical_id(sample_id) in self.ids or line in self.lines


def load_done(out_dir: Path) -> DoneSet:
    """Done: every id in a manifest (retired ones too: a spool deleted their files once
    consumed) or owned by a quarantine line. ``manifest``: the entries whose files the
    dataset holds."""
    manifest = read_manifest(out_dir, retired=True)
    quarantine = read_quarantine(out_dir)
    ids = {canonical_id(e.id) for e in manifest}
    ids.update(canonical_id(q.own_id) for q in quarantine if q.own_id is not None)
    gone = retired_paths(out_dir)
    held = tuple(e for e in manifest if e.path not in gone)
    counts = {
        "samples": len(manifest),
        "tokens": sum(e.num_tokens for e in manifest),
        "bytes": sum(e.size for e in manifest),
        "quarantined": len(quarantine),
    }
    return DoneSet(frozenset(ids), frozenset(q.line for q in quarantine), held, counts)


class LogTail:
    """The complete lines appended to one log since the last :meth:`read`, for a reader
    that follows a log another process writes (a live dataset, the spool). Blocking.

    A torn last line is left for the next read. A log replaced or cut short (``hsx verify
    --repair`` rewrites a manifest atomically) is read again from its start, and
    :attr:`restarted` says so: the caller then forgets what it had from this log.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._inode: tuple[int, int] | None = None
        self._line = 0
        self.restarted = False

    def read(self) -> list[tuple[int, Any]]:
        """New complete records, with their 1-based line numbers."""
        self.restarted = False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        try:
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            if self._inode is not None and (inode != self._inode or st.st_size < self._offset):
                self._offset, self._line, self.restarted = 0, 0, True
            self._inode = inode
            data = _read_from(fd, self._offset, st.st_size)
        finally:
            os.close(fd)
        records, complete = _split_lines(data, self.path)
        self._offset += complete
        base, self._line = self._line, self._line + data[:complete].count(b"\n")
        return [(base + n, rec) for n, rec in records]


def _read_from(fd: int, offset: int, size: int) -> bytes:
    chunks = []
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 8 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def manifest_entry(rec: Any, where: str) -> ManifestEntry:
    """One manifest record checked as :func:`read_manifest` checks each line."""
    return _manifest_entry(rec, where)


class AppendLog:
    """An append-only JSONL log with durable appends. Blocking: call from a thread.

    Opening cuts a torn last line (left by a crash mid-append) so the next line starts
    clean; the cut bytes were never acknowledged, so nothing durable is lost.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            self._repair()
        except BaseException:
            os.close(self._fd)
            raise

    def _repair(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        tail = os.pread(self._fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        if cut < 0 and size > len(tail):
            raise DatasetError(f"{self.path}: last line is over 1 MiB and torn; repair by hand")
        keep = size - len(tail) + cut + 1
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)

    def append(self, lines: Iterable[bytes], *, sync: bool = True) -> None:
        """Write the lines in one ``write`` (O_APPEND keeps them whole) and fsync."""
        data = b"".join(lines)
        if not data:
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


_HASH_CHUNK = 8 << 20


class Readable(Protocol):
    """A binary file read into a buffer (a raw or buffered file object)."""

    def readinto(self, buffer: bytearray, /) -> int | None: ...


def hash_file(path: Path, *, follow_symlinks: bool = False) -> tuple[int, str]:
    """Size and XXH3-64 (hex) of a whole file, as a manifest line records them; read in
    chunks, so memory stays flat whatever the size. Links are refused unless asked for."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    with os.fdopen(os.open(path, flags), "rb", buffering=0) as fh:
        size, digest, _ = hash_stream(fh)
    return size, digest


def hash_stream(fh: Readable, *, prefix: int | None = None) -> tuple[int, str, str | None]:
    """Size and XXH3-64 (hex) of everything ``fh`` reads, in chunks; with ``prefix``, also
    the XXH3-64 of its first ``prefix`` bytes (None when the stream is shorter)."""
    hasher = xxhash.xxh3_64()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    size, head = 0, None
    while n := fh.readinto(buf):
        if prefix is not None and size <= prefix < size + n:
            hasher.update(view[: prefix - size])
            head = hasher.hexdigest()
            hasher.update(view[prefix - size : n])
        else:
            hasher.update(view[:n])
        size += n
    if prefix is not None and prefix == size:
        head = hasher.hexdigest()
    return size, hasher.hexdigest(), head
