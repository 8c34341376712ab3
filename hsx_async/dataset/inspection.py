"""``hsx status OUT`` and ``hsx verify OUT``: what a dataset holds, and whether to trust it.

``verify`` re-hashes every file against its manifest line, parses its safetensors header
and checks shapes, dtypes and metadata; ``--deep`` also decodes every tensor
(:mod:`hsx_async.dataset.audit`); ``--repair`` drops the entries that failed (and their files) so
a resumed run extracts them again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import write_atomic
from hsx_async.dataset.events import input_lines
from hsx_async.dataset.layout import (
    DATA_DIR,
    FILE_SUFFIX,
    canonical_id,
    expected_tensors,
    read_header,
)
from hsx_async.dataset.live.view import spool_lines
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    ManifestEntry,
    hash_file,
    log_files,
    read_log,
    read_manifest,
    read_quarantine,
    shard_index_of,
)
from hsx_async.dataset.provenance import PROVENANCE, dataset_storage, read_provenance, shard_lock
from hsx_async.dataset.quarantine import reason_of, retried_before
from hsx_async.dataset.running import Running, running_runs
from hsx_async.errors import DatasetError, DumpError
from hsx_async.protocol import (
    HIDDEN,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    SCALES,
    UNQUANTIZED,
    Storage,
    storage_from_metadata,
)
from hsx_async.units import eta_text, human_bytes

# -- status --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    done: int
    quarantined: int
    tokens: int
    bytes: int
    input_samples: int | None  # from provenance, when a run recorded it (older runs)
    shards: int
    # Input lines per shard ("index/count"), once a run has read its whole shard: every
    # line ends in the manifest or the quarantine, so these give "remaining" exactly.
    input_lines: dict[str, int] = field(default_factory=dict)
    storage: str = "bfloat16"  # provenance.json's dtype and quantized slots, described
    running: tuple[Running, ...] = ()  # the runs going on now, with their /status
    retriable: int = 0  # quarantined after attempts: `hsx quarantine --retry` puts them back
    retried: int = 0  # put back by earlier retries (the history)
    out: str = ""
    spool: tuple[str, ...] = ()  # a bounded spool and its consumers (PROTOCOL §6)

    @property
    def remaining(self) -> int | None:
        if self.input_lines:
            return max(0, sum(self.input_lines.values()) - self.done - self.quarantined)
        if self.input_samples is None:
            return None
        return max(0, self.input_samples - self.done - self.quarantined)

    def _remaining_text(self) -> str:
        rem = self.remaining
        if rem is None:
            return "unknown (no run has read the whole input yet)"
        if not self.input_lines:
            return f"{rem:,} (of {self.input_samples or 0:,} input samples)"
        total = sum(self.input_lines.values())
        counted = sorted(self.input_lines, key=lambda k: [int(x) for x in k.split("/")])
        where = "" if counted == ["0/1"] else f", shards {', '.join(counted)}"
        return f"{rem:,} (of {total:,} input lines{where})"

    def _retry_text(self) -> str:
        before = f"; {self.retried:,} put back before" if self.retried else ""
        if not self.retriable:
            return f" (none could be retried{before})" if self.quarantined else ""
        return (
            f" ({self.retriable:,} after failed attempts could be retried: "
            f"`hsx quarantine {self.out or 'OUT'} --retry` puts them back for the next run"
            f"{before})"
        )

    def format(self) -> str:
        return "\n".join(
            [
                f"done:        {self.done:,} samples, {self.tokens:,} tokens, "
                f"{human_bytes(self.bytes)}",
                f"storage:     {self.storage}",
                f"quarantined: {self.quarantined:,}{self._retry_text()}",
                f"remaining:   {self._remaining_text()}",
                f"manifests:   {self.shards}",
                *self.spool,
                *(_running_line(r) for r in self.running),
            ]
        )


def _running_line(run: Running) -> str:
    """A live run as its progress line says it: rate, in flight, ETA (from /status)."""
    s = run.status
    if s is None:
        return f"running:     shard {run.shard}: {run.error}"
    eta = eta_text(s.get("eta_s")) if isinstance(s.get("eta_s"), int | float) else "?"
    rate = s.get("tokens_per_s")
    rate_text = f"{rate:,.0f} tok/s" if isinstance(rate, int | float) else "? tok/s"
    waiting = (s.get("spool") or {}).get("waiting")
    paused = ", PAUSED (spool full)" if waiting else ", PAUSED (disk)" if s.get("paused") else ""
    return (
        f"running:     shard {run.shard}: {rate_text}, "
        f"{human_bytes(float(s.get('bytes_per_s') or 0))}/s, {s.get('in_flight', '?')} in "
        f"flight, ETA {eta}{paused} ({run.url}/status)"
    )


def _is_dataset(path: Path) -> bool:
    return bool(
        log_files(path, MANIFEST) or log_files(path, QUARANTINE) or (path / PROVENANCE).is_file()
    )


def require_dataset(out_dir: Path) -> None:
    """:class:`DatasetError` (one line, what to give instead) unless ``out_dir`` is an hsx
    output directory: the one rule of status, verify and export."""
    if not out_dir.is_dir():
        raise DatasetError(f"{out_dir} is not a directory; give an output directory ([output].dir)")
    if _is_dataset(out_dir):
        return
    parent = out_dir.resolve().parent
    hint = f"; did you mean {parent}?" if out_dir.name == DATA_DIR and _is_dataset(parent) else ""
    raise DatasetError(
        f"{out_dir} is not an hsx dataset (no manifest.jsonl, quarantine.jsonl or "
        f"provenance.json); give the [output].dir of a run{hint}"
    )


def dataset_status(out_dir: Path) -> Status:
    require_dataset(out_dir)
    manifest = read_manifest(out_dir, retired=True)  # a spool's deleted samples are done
    prov = read_provenance(out_dir) or {}
    counted = prov.get("input_samples")
    quarantine = read_quarantine(out_dir)
    return Status(
        done=len(manifest),
        quarantined=len(quarantine),
        tokens=sum(e.num_tokens for e in manifest),
        bytes=sum(e.size for e in manifest),
        input_samples=counted if isinstance(counted, int) else None,
        shards=len(log_files(out_dir, MANIFEST)),
        input_lines=input_lines(out_dir, prov.get("input_lines")),
        storage=dataset_storage(prov).describe(),
        running=tuple(running_runs(out_dir)),
        retriable=sum(reason_of(q).retriable for q in quarantine),
        retried=retried_before(out_dir),
        out=str(out_dir),
        spool=tuple(spool_lines(out_dir)),
    )


# -- verify --------------------------------------------------------------------------------


def _check_header(header: dict[str, Any], entry: ManifestEntry) -> list[str]:
    t = entry.num_tokens
    problems = []
    meta = header.get("__metadata__", {})
    if meta.get("id") != canonical_id(entry.id):
        problems.append(f"metadata id {meta.get('id')!r} != manifest id {entry.id!r}")
    ids = header.get("input_ids", {})
    if ids.get("dtype") != "I64" or ids.get("shape") != [t]:
        problems.append(f"input_ids is {ids.get('dtype')} {ids.get('shape')}, expected I64 [{t}]")
    mask = header.get("loss_mask")
    if mask is not None and (mask.get("dtype") != "U8" or mask.get("shape") != [t]):
        problems.append(f"loss_mask is {mask.get('dtype')} {mask.get('shape')}, expected U8 [{t}]")
    try:
        storage = storage_from_metadata(meta, "metadata")
    except DumpError as exc:
        return [*problems, str(exc)]
    return problems + (
        _check_fp8_sections(header, storage, t) if storage.is_fp8 else _check_bf16(header, t)
    )


def _check_bf16(header: dict[str, Any], t: int) -> list[str]:
    problems = []
    hs = header.get("hidden_states", {})
    shape = hs.get("shape", [])
    if hs.get("dtype") != "BF16" or len(shape) != 3 or shape[0] != t:
        problems.append(f"hidden_states is {hs.get('dtype')} {shape}, expected BF16 [{t}, L, H]")
    aux = header.get("__metadata__", {}).get("aux_layers", "")
    if len(shape) == 3 and aux and shape[1] != len(aux.split(",")) + 1:
        problems.append(f"hidden_states has {shape[1]} layers but aux_layers is {aux!r}")
    problems.extend(
        f"{name} is in a file whose metadata names no FP8 storage"
        for name in (SCALES, OUTLIER_INDEX, OUTLIER_VALUES, UNQUANTIZED)
        if name in header
    )
    return problems


def _check_fp8_sections(header: dict[str, Any], storage: Storage, t: int) -> list[str]:
    """Each FP8 section as the file's metadata says (PROTOCOL §4)."""
    meta = header.get("__metadata__", {})
    aux = meta.get("aux_layers", "")
    layers = len(aux.split(",")) + 1 if aux else 1
    if storage.quantized[-1] >= layers:
        return [f"quantized slot {storage.quantized[-1]} is past the {layers} layer slots"]
    shape = header.get(HIDDEN, {}).get("shape") or [t, 0, 0]
    want = expected_tensors(storage, t, layers, shape[-1])
    problems = []
    for name in (HIDDEN, SCALES, OUTLIER_INDEX, OUTLIER_VALUES, UNQUANTIZED):
        got, need = header.get(name), want.get(name)
        if got is None and need is not None:
            problems.append(f"{name} is missing; {storage.describe()} stores it")
        elif got is not None and need is None:
            what = "keeps no slot" if name == UNQUANTIZED else "has no outliers"
            problems.append(f"{name} is present, but {storage.describe()} {what}")
        elif got is not None and need is not None and (got.get("dtype"), got.get("shape")) != need:
            problems.append(
                f"{name} is {got.get('dtype')} {got.get('shape')}, expected {need[0]} "
                f"{need[1]} ({storage.describe()}, aux_layers {aux!r})"
            )
    return problems


def verify_entry(out_dir: Path, entry: ManifestEntry) -> list[str]:
    """Problems with one manifest entry (empty: the file is exactly what was recorded)."""
    path = out_dir / entry.path
    where = entry.path
    try:
        if path.is_symlink() or not path.is_file():
            return [f"{where}: missing or not a regular file"]
        size, digest = hash_file(path)
        if size != entry.size:
            return [f"{where}: {size} bytes, manifest says {entry.size}"]
        if digest != entry.xxh3_64:
            return [f"{where}: xxh3 {digest}, manifest says {entry.xxh3_64}"]
        return [f"{where}: {p}" for p in _check_header(read_header(path)[0], entry)]
    except (OSError, ValueError) as exc:
        return [f"{where}: unreadable ({exc})"]


@dataclass
class VerifyReport:
    checked: int = 0
    bytes: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)  # manifest path -> problems
    duplicates: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.problems or self.duplicates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "bytes": self.bytes,
            "problems": [p for plist in self.problems.values() for p in plist],
            "duplicates": self.duplicates,
            "strays": self.strays,
        }

    def format(self) -> str:
        lines = [f"checked {self.checked} files, {human_bytes(self.bytes)}"]
        for plist in self.problems.values():
            lines.extend(f"BAD  {p}" for p in plist)
        lines.extend(f"DUP  {d}" for d in self.duplicates)
        lines.extend(f"STRAY {s} (no manifest line; a resumed run deletes it)" for s in self.strays)
        lines.append(
            "OK" if self.ok else f"FAILED: {len(self.problems) + len(self.duplicates)} problems"
        )
        return "\n".join(lines)


def _strays(out_dir: Path, named: set[str]) -> list[str]:
    data = out_dir / DATA_DIR
    if not data.is_dir():
        return []
    found = []
    for path in sorted(data.rglob("*")):
        rel = str(path.relative_to(out_dir))
        if path.is_file() and rel not in named and path.name.endswith(FILE_SUFFIX):
            found.append(rel)
    return found


def verify_dataset(out_dir: Path, *, threads: int = 2) -> VerifyReport:
    require_dataset(out_dir)
    entries = read_manifest(out_dir)
    report = VerifyReport()
    seen: dict[str, str] = {}
    for e in entries:
        key = canonical_id(e.id)
        if key in seen:
            report.duplicates.append(f"id {key!r} appears twice ({seen[key]}, {e.path})")
        seen[key] = e.path
    quarantined = {canonical_id(q.own_id) for q in read_quarantine(out_dir) if q.own_id is not None}
    report.duplicates.extend(
        f"id {k!r} is both written and quarantined" for k in sorted(quarantined & set(seen))
    )
    with ThreadPoolExecutor(threads) as pool:  # xxhash releases the GIL
        for entry, problems in zip(
            entries, pool.map(lambda e: verify_entry(out_dir, e), entries), strict=True
        ):
            report.checked += 1
            report.bytes += entry.size
            if problems:
                report.problems[entry.path] = problems
    report.strays = _strays(out_dir, {e.path for e in entries})
    return report


def repair(out_dir: Path, bad_paths: Iterable[str]) -> int:
    """Drop manifest lines naming ``bad_paths`` and delete those files. Takes every shard's
    lock, so it refuses to run beside a live ``hsx run``."""
    bad = set(bad_paths)
    files = log_files(out_dir, MANIFEST)
    dropped = 0
    with contextlib.ExitStack() as locks:
        for index in sorted({shard_index_of(f) for f in files}):
            locks.enter_context(shard_lock(out_dir, index))
        for log_path in files:
            dropped += _rewrite_without(log_path, bad)
    left = [rel for rel in sorted(bad) if not _delete_sample_file(out_dir / rel)]
    if left:
        raise DatasetError(
            f"dropped {dropped} manifest entries, but {left[0]}"
            + (f" and {len(left) - 1} more" if len(left) > 1 else "")
            + f" in {out_dir} is a directory, not a sample file: hsx deletes only files; "
            "remove it by hand, then run again"
        )
    return dropped


def _delete_sample_file(path: Path) -> bool:
    """Unlink a sample file (or a link or other non-directory in its place); False when a
    directory stands there (never deleted: hsx did not make it)."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        return False
    except PermissionError:
        # Linux answers unlink(2) of a directory with EISDIR, some systems with EPERM.
        if path.is_dir() and not path.is_symlink():
            return False
        raise
    return True


def _rewrite_without(log_path: Path, bad: set[str]) -> int:
    """Atomically rewrite one manifest without the lines naming ``bad``; lines dropped."""
    records, _ = read_log(log_path)
    keep = [orjson.dumps(rec) + b"\n" for _, rec in records if rec.get("path") not in bad]
    write_atomic(log_path, b"".join(keep))
    return len(records) - len(keep)
