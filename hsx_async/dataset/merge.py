"""``hsx merge SRC... --to DEST``: combine shard outputs into one unsharded dataset.

Each source is an output directory (one shard's, or a shared one with several shard
manifests). Every file is re-hashed against its manifest line on the way (a bad copy is
refused, not merged), linked when source and destination share a file system and copied
with fsync otherwise, and only then gets its line in ``DEST/manifest.jsonl``. Merging is
resumable: ids already in the destination are skipped; the same id with another hash in
two sources is an error. Sources must come from the same input and model shape.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import write_durably
from hsx_async.dataset.events import input_lines
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    AppendLog,
    ManifestEntry,
    hash_file,
    log_name,
    read_manifest,
    read_quarantine,
)
from hsx_async.dataset.provenance import (
    PROVENANCE,
    check_shard_layout,
    dataset_storage,
    directory_lock,
    read_provenance,
    shard_lock,
    write_provenance,
)
from hsx_async.errors import DatasetError


@dataclass
class MergeResult:
    copied: int = 0
    skipped: int = 0
    quarantined: int = 0
    bytes: int = 0


def _check_provenance(sources: list[Path], dest: Path) -> dict[str, Any] | None:
    records = [(src, read_provenance(src)) for src in sources]
    known = [(src, r) for src, r in records if r is not None]
    if not known:
        return None
    first_src, first = known[0]
    _check_storage(known, dest)
    for src, rec in known[1:]:
        for key in ("input", "hidden_size", "aux_layers"):
            a, b = first.get(key), rec.get(key)
            if key == "input" and isinstance(a, dict) and isinstance(b, dict):
                a, b = a.get("xxh3_64"), b.get("xxh3_64")
            if a != b:
                raise DatasetError(
                    f"{src} and {first_src} differ in {key}: they are not shards of one job"
                )
    return first


def _check_storage(known: list[tuple[Path, dict[str, Any]]], dest: Path) -> None:
    """One storage per dataset (PROTOCOL §4): shards stored otherwise cannot be merged,
    nor merged into a destination that already holds another."""
    first_src, first = known[0]
    want = dataset_storage(first)
    theirs = list(known[1:])
    if (dest / PROVENANCE).exists():
        theirs.append((dest, read_provenance(dest) or {}))
    for src, rec in theirs:
        have = dataset_storage(rec)
        if have != want:
            raise DatasetError(
                f"{src} stores hidden states as {have.describe()} but {first_src} as "
                f"{want.describe()}: one dataset holds one storage; merge them apart"
            )


def _place(src: Path, dest: Path) -> None:
    """Link or copy ``src`` to ``dest`` durably; ``dest`` appears only when complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)  # left by an interrupted merge
        try:
            os.link(src, tmp)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            with src.open("rb") as fin, tmp.open("wb") as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)

    write_durably(dest, fill, tmp=dest.with_name(f".{dest.name}.merge.tmp"))


def merge(sources: list[Path], dest: Path) -> MergeResult:
    prov = _check_provenance(sources, dest)
    dest.mkdir(parents=True, exist_ok=True)
    result = MergeResult()
    with directory_lock(dest), shard_lock(dest, 0):
        check_shard_layout(dest, 1)  # merge writes the unsharded logs
        have = {canonical_id(e.id): e for e in read_manifest(dest)}
        have_q = {(q.id, q.line) for q in read_quarantine(dest)}
        manifest = AppendLog(dest / log_name(MANIFEST))
        quarantine = AppendLog(dest / log_name(QUARANTINE))
        try:
            for src in sources:
                for entry in read_manifest(src):
                    _merge_entry(
                        src, dest, entry=entry, have=have, manifest=manifest, result=result
                    )
                lines = [q for q in read_quarantine(src) if (q.id, q.line) not in have_q]
                quarantine.append(q.to_line() for q in lines)
                have_q.update((q.id, q.line) for q in lines)
                result.quarantined += len(lines)
        finally:
            manifest.close()
            quarantine.close()
        _record_provenance(dest, prov, sources)
    return result


def _record_provenance(dest: Path, prov: dict[str, Any] | None, sources: list[Path]) -> None:
    """The sources' provenance, with their input line counts per shard (``hsx status``
    needs them for "remaining": the events logs they come from stay in the sources)."""
    counts: dict[str, int] = {}
    for src in sources:
        counts.update(input_lines(src, (read_provenance(src) or {}).get("input_lines")))
    old = read_provenance(dest) if (dest / PROVENANCE).exists() else None
    if old is None:
        if prov is None:
            return
        old = {**prov, "merged_from": [str(s) for s in sources]}
    merged = {**old.get("input_lines", {}), **counts}
    if merged:
        old["input_lines"] = merged
    write_provenance(dest, orjson.dumps(old, option=orjson.OPT_INDENT_2))


def _merge_entry(
    src: Path,
    dest: Path,
    *,
    entry: ManifestEntry,
    have: dict[str, ManifestEntry],
    manifest: AppendLog,
    result: MergeResult,
) -> None:
    key = canonical_id(entry.id)
    if key in have:
        if have[key].xxh3_64 != entry.xxh3_64:
            raise DatasetError(
                f"id {key!r} is in two sources with different content "
                f"({have[key].xxh3_64} vs {entry.xxh3_64} in {src})"
            )
        result.skipped += 1
        return
    size, digest = hash_file(src / entry.path)
    if (size, digest) != (entry.size, entry.xxh3_64):
        raise DatasetError(
            f"{src / entry.path} does not match its manifest line; run "
            f"`hsx verify {src} --repair` and extract again before merging"
        )
    if (src / entry.path).resolve() != (dest / entry.path).resolve():
        _place(src / entry.path, dest / entry.path)
    manifest.append([entry.to_line()])
    have[key] = entry
    result.copied += 1
    result.bytes += entry.size
