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
from collections.abc import Iterable, Sequence
from pathlib import Path

import orjson

from hsx_async.dataset.durable import fsync_dir
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.registry import read_registry, retirement_lock
from hsx_async.dataset.manifest import (
    RETIRED,
    AppendLog,
    LogTail,
    ManifestEntry,
    read_log,
    retired_record,
)

RETIRE_EPOCH = 0  # a spool deletes after the first epoch: later ones need retention "keep"


def read_retired(out_dir: Path) -> dict[str, int]:
    """Path → bytes of every retired sample."""
    records, _ = read_log(out_dir / RETIRED)
    return dict(r for r in (retired_record(rec) for _, rec in records) if r is not None)


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

    The registry is read afresh under the retirement lock at every decision (the lock
    ``hsx run`` writes it under): a sample is deleted only under the list in force then.
    Keeps one :class:`ConsumerLog` per consumer it met, followed incrementally, and the
    retired set, followed through ``retired.jsonl``. Blocking: call from a thread."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.logs: dict[str, ConsumerLog] = {}
        self.retired: dict[str, int] = {}
        self._tail = LogTail(out_dir / RETIRED)

    def _log(self, name: str) -> ConsumerLog:
        found = self.logs.get(name)
        if found is None:
            found = self.logs[name] = ConsumerLog(self.out_dir, name)
        return found

    def refresh_retired(self) -> dict[str, int]:
        records = self._tail.read()
        if self._tail.restarted:
            self.retired = {}
        for _, rec in records:
            found = retired_record(rec)
            if found is not None:
                self.retired[found[0]] = found[1]
        return self.retired

    def retire(self, candidates: Sequence[ManifestEntry]) -> list[ManifestEntry]:
        """Retire those of ``candidates`` every consumer registered *now* acknowledged in
        epoch 0; returns them. Each consumer's acks are durable before they are looked at."""
        if not candidates:
            return []
        with retirement_lock(self.out_dir):
            registry = read_registry(self.out_dir)
            if registry is None or not registry.deletes:
                return []
            self.refresh_retired()
            states = [self._log(name).refresh() for name in registry.consumers]
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
