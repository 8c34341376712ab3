"""A bounded spool (PROTOCOL §6): samples deleted once every registered consumer has them.

With ``[output].retention = "acked"`` a sample file is deleted as soon as every consumer in
the registry (``consumers.json``) acknowledged it in epoch 0. Deleting is *retiring*:

1. under ``consumers/.retire.lock``, the sample's line is appended to ``retired.jsonl``
   (``{"id", "path", "bytes"}``) and fsynced;
2. then its file is unlinked (and the bucket directories fsynced).

So a manifest line whose file is gone is always explained by ``retired.jsonl``; a crash
between 1 and 2 leaves a retired file behind, which the next retirement, a resumed run or
:func:`finish_retirement` deletes. Readers of the dataset skip retired samples
(:func:`~hsx_async.dataset.manifest.read_manifest`); a resumed run counts them done.
Every acknowledgement (local or through ``hsx serve``) retires what it completes: one rule,
:class:`Retirer`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import orjson

from hsx_async.dataset.durable import exclusive_lock, fsync_dir
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import (
    ACKED,
    CONSUMERS_DIR,
    KEEP,
    ConsumerLog,
    Registry,
    consumer_names,
    read_registry,
)
from hsx_async.dataset.manifest import (
    RETIRED,
    AppendLog,
    LogTail,
    ManifestEntry,
    read_log,
    read_manifest,
)
from hsx_async.units import human_bytes

RETIRE_LOCK = ".retire.lock"
RETIRE_EPOCH = 0  # a spool deletes after the first epoch: later ones need retention "keep"


def read_retired(out_dir: Path) -> dict[str, int]:
    """Path → bytes of every retired sample."""
    records, _ = read_log(out_dir / RETIRED)
    return {
        rec["path"]: int(rec.get("bytes", 0))
        for _, rec in records
        if isinstance(rec, dict) and isinstance(rec.get("path"), str)
    }


def delete_retired(out_dir: Path, paths: Iterable[str]) -> int:
    """Delete retired files still present; fsync their buckets. The count deleted."""
    removed, buckets = 0, set()
    for rel in paths:
        path = out_dir / rel
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            continue  # never ours: hsx deletes only files (verify names it)
        removed += 1
        buckets.add(path.parent)
    for bucket in buckets:
        with contextlib.suppress(OSError):
            fsync_dir(bucket)
    return removed


def finish_retirement(out_dir: Path) -> int:
    """Delete the files of retired samples a crash left (blocking): the count deleted."""
    retired = read_retired(out_dir)
    return delete_retired(out_dir, retired) if retired else 0


class Retirer:
    """Deletes the samples every registered consumer acknowledged (retention ``acked``).

    Keeps one :class:`ConsumerLog` per registered consumer, followed incrementally, and the
    retired set, followed through ``retired.jsonl``. Blocking: call from a thread."""

    def __init__(self, out_dir: Path, registry: Registry) -> None:
        self.out_dir = out_dir
        self.registry = registry
        self.logs = {name: ConsumerLog(out_dir, name) for name in registry.consumers}
        self.retired: dict[str, int] = {}
        self._tail = LogTail(out_dir / RETIRED)

    @property
    def active(self) -> bool:
        return self.registry.retention == ACKED and bool(self.registry.consumers)

    def refresh_retired(self) -> dict[str, int]:
        records = self._tail.read()
        if self._tail.restarted:
            self.retired = {}
        for _, rec in records:
            if isinstance(rec, dict) and isinstance(rec.get("path"), str):
                self.retired[rec["path"]] = int(rec.get("bytes", 0))
        return self.retired

    def retire(self, candidates: Sequence[ManifestEntry]) -> list[ManifestEntry]:
        """Retire those of ``candidates`` every registered consumer acknowledged; returns
        them. Each consumer's acks are durable before they are looked at here."""
        if not self.active or not candidates:
            return []
        lock = self.out_dir / CONSUMERS_DIR / RETIRE_LOCK
        lock.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(lock, f"{lock}: held for too long", wait=60.0):
            self.refresh_retired()
            states = [log.refresh() for log in self.logs.values()]
            done = [
                e
                for e in candidates
                if e.path not in self.retired
                and all(s.is_acked(RETIRE_EPOCH, canonical_id(e.id)) for s in states)
            ]
            if done:
                log = AppendLog(self.out_dir / RETIRED)
                try:
                    log.append(
                        orjson.dumps({"id": e.id, "path": e.path, "bytes": e.size}) + b"\n"
                        for e in done
                    )
                finally:
                    log.close()
                self.refresh_retired()
        delete_retired(self.out_dir, [e.path for e in done])
        return done


def spool_lines(out_dir: Path) -> list[str]:
    """What ``hsx status`` says of the spool and its consumers ([] when none): the
    retention, the bytes the sample files hold now against the limit, the samples
    deleted, and each consumer's acknowledged, lagging and leased samples (blocking)."""
    registry = read_registry(out_dir)
    names = sorted(set(registry.consumers if registry else ()) | set(consumer_names(out_dir)))
    if registry is None and not names:
        return []
    entries = read_manifest(out_dir, retired=True)
    retired = read_retired(out_dir)
    held = sum(e.size for e in entries if e.path not in retired)
    committed = {canonical_id(e.id) for e in entries}
    if registry is None or registry.retention == KEEP:
        head = f"spool:       keep every sample; {human_bytes(held)} on disk"
    else:
        limit = f" of {human_bytes(registry.spool_limit)}" if registry.spool_limit else ""
        head = (
            f"spool:       delete once {', '.join(registry.consumers)} acknowledged; "
            f"{human_bytes(held)}{limit} held, {len(retired):,} samples deleted"
        )
    lines, now = [head], time.time()
    for name in names:
        state = ConsumerLog(out_dir, name).refresh()
        acked = len(state.acked.get(RETIRE_EPOCH, set()) & committed)
        leased = sum(state.held(RETIRE_EPOCH, now).values())
        extra = f", {state.duplicate_acks:,} acknowledged twice" if state.duplicate_acks else ""
        lines.append(
            f"consumer:    {name}: {acked:,} acknowledged, {len(committed) - acked:,} behind, "
            f"{leased:,} leased now{extra}"
        )
    return lines
