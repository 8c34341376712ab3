"""Following a dataset while ``hsx run`` writes it (PROTOCOL §6): which samples are
committed, in commit order, which the spool retired, and whether extraction is complete.

Pure reading of append-only logs (every one through a :class:`LogTail`), so a follower
costs one ``read`` of what is new per look. Extraction is complete when every shard of the
directory has recorded its input line count (the ``input`` event) and that many lines are
in its manifest and quarantine: every input line ends in exactly one of them (PROTOCOL §4),
and a retired sample's line stays in the manifest. Blocking: call from a thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hsx_async.dataset.events import event_files
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    RETIRED,
    LogTail,
    ManifestEntry,
    log_files,
    manifest_entry,
    shard_count_of,
    shard_index_of,
)


@dataclass
class Followed:
    """What the logs said so far."""

    order: list[str] = field(default_factory=list)  # committed ids, commit order
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    by_path: dict[str, str] = field(default_factory=dict)  # file → its id in entries
    retired: dict[str, int] = field(default_factory=dict)  # path → bytes
    settled: dict[int, int] = field(default_factory=dict)  # shard → manifest + quarantine lines
    input_lines: dict[str, int] = field(default_factory=dict)  # "index/count" → lines
    shard_count: int | None = None

    @property
    def present(self) -> set[str]:
        """Committed ids whose files the dataset still holds."""
        if not self.retired:
            return set(self.entries)
        return {i for i, e in self.entries.items() if e.path not in self.retired}

    @property
    def complete(self) -> bool:
        """Every input line of every shard is in a manifest or a quarantine."""
        count = self.shard_count
        if count is None:
            return False
        for index in range(count):
            lines = self.input_lines.get(f"{index}/{count}")
            if lines is None or self.settled.get(index, 0) < lines:
                return False
        return True

    def held_bytes(self) -> int:
        """Bytes of the committed sample files not retired."""
        return sum(e.size for e in self.entries.values() if e.path not in self.retired)


class DatasetFollower:
    """Follows every manifest, quarantine and events log of ``out_dir`` and its retired
    log. :meth:`refresh` returns the same :class:`Followed`, grown."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.state = Followed()
        self._tails: dict[Path, LogTail] = {}

    def _tail(self, path: Path) -> LogTail:
        tail = self._tails.get(path)
        if tail is None:
            tail = self._tails[path] = LogTail(path)
        return tail

    def refresh(self) -> Followed:
        if not self.out_dir.is_dir():
            return self.state
        restarted = False
        for kind in (MANIFEST, QUARANTINE):
            for path in log_files(self.out_dir, kind):
                restarted |= self._read_log(kind, path)
        if restarted:  # a log was rewritten (verify --repair): start over, once
            self.state, self._tails = Followed(), {}
            return self.refresh()
        for path in event_files(self.out_dir):
            for _, rec in self._tail(path).read():
                if isinstance(rec, dict) and rec.get("event") == "input":
                    lines = rec.get("lines")
                    if isinstance(lines, int):
                        self.state.input_lines[str(rec.get("shard", "0/1"))] = lines
                        self._count_from(str(rec.get("shard", "0/1")))
        for _, rec in self._tail(self.out_dir / RETIRED).read():
            if isinstance(rec, dict) and isinstance(rec.get("path"), str):
                self.state.retired[rec["path"]] = int(rec.get("bytes", 0))
        return self.state

    def _count_from(self, shard: str) -> None:
        if self.state.shard_count is None:
            _, _, count = shard.partition("/")
            if count.isdigit():
                self.state.shard_count = int(count)

    def _read_log(self, kind: str, path: Path) -> bool:
        tail = self._tail(path)
        records = tail.read()
        if tail.restarted:
            return True
        state = self.state
        shard = shard_index_of(path)
        if state.shard_count is None:
            state.shard_count = shard_count_of(path)
        state.settled[shard] = state.settled.get(shard, 0) + len(records)
        if kind == MANIFEST:
            for number, rec in records:
                entry = manifest_entry(rec, f"{path}:{number}")
                key = canonical_id(entry.id)
                if key not in state.entries:
                    state.order.append(key)
                state.entries[key] = entry
                state.by_path[entry.path] = key
        return False
