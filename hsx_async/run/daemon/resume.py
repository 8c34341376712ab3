"""Resuming: make the output directory agree with its manifests before new work starts.

A crash can leave temp files (``.<name>.<tag>.tmp``) and data files renamed into place
whose manifest line never became durable. Neither is trusted: both are deleted, and their
samples are extracted again. In a directory shared by shards, a process only deletes
files of its own shard, so it never races another shard's rename-then-append.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsx_async.config import ShardConfig
from hsx_async.dataset.layout import DATA_DIR, FILE_SUFFIX, read_header, shard_of_id
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError

log = structlog.get_logger("hsx.resume")


@dataclass(frozen=True, slots=True)
class Cleanup:
    temp_files: int
    orphans: int
    foreign: int  # orphans of another shard, left alone


def _file_id(path: Path) -> str | None:
    """The ``id`` in a safetensors file's metadata, or None when unreadable."""
    try:
        header, _ = read_header(path)
        return str(header["__metadata__"]["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _owned(path: Path, shard: ShardConfig) -> bool:
    if shard.count == 1:
        return True
    if path.name.startswith("."):  # temp: .<name>.s<index>-<nonce>.tmp
        parts = path.name.rsplit(".", 2)
        return len(parts) == 3 and parts[1].startswith(f"s{shard.index}-")
    sample_id = _file_id(path)
    if sample_id is None:
        return False
    return shard_of_id(sample_id, shard.count) == shard.index


def clean_orphans(out_dir: Path, entries: Iterable[ManifestEntry], shard: ShardConfig) -> Cleanup:
    """Delete temp files and unnamed data files of this shard under ``out_dir/data``."""
    named = {e.path for e in entries}
    counts = {"temp": 0, "orphan": 0, "foreign": 0}
    data = out_dir / DATA_DIR
    if not data.is_dir():
        return Cleanup(0, 0, 0)
    with os.scandir(data) as buckets:
        for bucket in buckets:
            if bucket.is_dir(follow_symlinks=False):
                with os.scandir(bucket.path) as names:
                    for entry in names:
                        kind = _clean_entry(entry, f"{DATA_DIR}/{bucket.name}", named, shard)
                        if kind:
                            counts[kind] += 1
    temp, orphans, foreign = counts["temp"], counts["orphan"], counts["foreign"]
    if temp or orphans:
        log.info("resume_cleanup", temp_files=temp, orphans=orphans, foreign=foreign)
    return Cleanup(temp, orphans, foreign)


def _clean_entry(entry: os.DirEntry[str], bucket: str, named: set[str], shard: ShardConfig) -> str:
    """Delete one bucket entry if it is this shard's temp file or orphan; what it was
    ('temp', 'orphan', 'foreign': another shard's, left alone) or '' (kept)."""
    is_temp = entry.name.startswith(".") and entry.name.endswith(".tmp")
    if not is_temp and (f"{bucket}/{entry.name}" in named or not entry.name.endswith(FILE_SUFFIX)):
        return ""
    path = Path(entry.path)
    if entry.is_dir(follow_symlinks=False):
        raise DatasetError(
            f"{path} is a directory where a sample file belongs; hsx deletes only files: "
            "remove it by hand, then run again"
        )
    # A link or FIFO in a file's place is never opened (a FIFO would block): only an
    # unsharded run, which owns every name, removes it.
    regular = entry.is_file(follow_symlinks=False)
    if not (_owned(path, shard) if regular else shard.count == 1):
        return "foreign"
    path.unlink(missing_ok=True)
    return "temp" if is_temp else "orphan"


def check_entries(out_dir: Path, entries: Iterable[ManifestEntry]) -> None:
    """Every manifest line names a regular file of the recorded size (cheap: one stat each).

    A full re-hash is ``hsx verify``; this catches a deleted or truncated file before a
    resumed run reports the dataset complete.
    """
    bad = []
    for e in entries:
        try:
            st = (out_dir / e.path).lstat()
            ok = stat.S_ISREG(st.st_mode) and st.st_size == e.size
        except FileNotFoundError:
            ok = False
        if not ok:
            bad.append(e.path)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DatasetError(
            f"{len(bad)} manifest entries name a missing or resized file ({shown}); run "
            f"`hsx verify {out_dir} --repair` to drop them so they are extracted again"
        )
