"""Where a live reader leases, fetches and acknowledges (PROTOCOL §6): the output
directory itself (this node, or a shared file system: :class:`LocalSource`, also what
``hsx serve`` runs for remote readers), or ``hsx serve`` on the node that holds it
(:class:`~hsx_async.dataset.live.remote.RemoteSource`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hsx_async.dataset.export.plan import DatasetFacts, dataset_facts
from hsx_async.dataset.live.follow import DatasetFollower
from hsx_async.dataset.live.ledger import ACKED, ConsumerLog, check_name, read_registry
from hsx_async.dataset.live.retire import RETIRE_EPOCH, Retirer
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError


@dataclass(frozen=True, slots=True)
class Leased:
    """One lease call's answer: the samples now this owner's, and whether the epoch holds
    nothing more for it (extraction complete, everything acknowledged or leased)."""

    entries: list[ManifestEntry]
    ended: bool


class Source(Protocol):
    """Where a live reader leases, fetches and acknowledges (local or ``hsx serve``)."""

    def lease(self, owner: str, rank: int, epoch: int, count: int, timeout: float) -> Leased: ...
    def fetch(self, entry: ManifestEntry) -> tuple[Path, bool]: ...  # (file, a temp copy)
    def ack(self, owner: str, epoch: int, ids: Sequence[str]) -> None: ...
    def release(self, owner: str, epoch: int, ids: Sequence[str]) -> None: ...
    def renew(self, owner: str, until: float) -> None: ...
    def facts(self, entry: ManifestEntry) -> DatasetFacts: ...  # as the export sees it


class LocalSource:
    """A dataset this process can open (a local disk or a shared file system). The same
    object serves remote readers inside ``hsx serve``. Blocking."""

    def __init__(self, out_dir: Path, consumer: str) -> None:
        self.out_dir = out_dir
        self.consumer = check_name(consumer)
        self.follower = DatasetFollower(out_dir)
        self.log = ConsumerLog(out_dir, consumer)
        self._registry_seen = False
        self._retirer: Retirer | None = None

    def _check_registry(self) -> None:
        if self._registry_seen:
            return
        registry = read_registry(self.out_dir)
        if registry is None:
            return  # not written yet (no run started), or a dataset that keeps everything
        if registry.retention != ACKED:
            self._registry_seen = True
            return
        if self.consumer not in registry.consumers:
            raise DatasetError(
                f"consumer {self.consumer!r} is not registered in {self.out_dir}/consumers.json "
                f"(retention acked, consumers: {', '.join(registry.consumers)}): the spool "
                "deletes samples once those have them, so this one would miss samples. Use "
                "one of those names, or add it to [output].consumers before the run starts"
            )
        self._retirer = Retirer(self.out_dir, registry)
        self._registry_seen = True

    def _check_epoch(self, epoch: int) -> None:
        self._check_registry()
        if self._retirer is not None and epoch != RETIRE_EPOCH:
            raise DatasetError(
                f"epoch {epoch}: with retention acked the spool deletes each sample after "
                "epoch 0; train further epochs from a dataset with retention keep"
            )

    def lease(self, owner: str, rank: int, epoch: int, count: int, timeout: float) -> Leased:
        self._check_epoch(epoch)
        followed = self.follower.refresh()
        present = followed.present
        ids = self.log.lease(
            owner=owner, rank=rank, epoch=epoch, order=followed.order, present=present,
            count=count, timeout=timeout,
        )  # fmt: skip
        if ids:
            return Leased([followed.entries[i] for i in ids], ended=False)
        return Leased([], ended=followed.complete and self._all_taken(epoch, present))

    def _all_taken(self, epoch: int, present: set[str]) -> bool:
        state, now = self.log.state, time.time()
        return all(
            state.is_acked(epoch, s) or state.live_lease(epoch, s, now) is not None for s in present
        )

    def fetch(self, entry: ManifestEntry) -> tuple[Path, bool]:
        return self.out_dir / entry.path, False

    def ack(self, owner: str, epoch: int, ids: Sequence[str]) -> None:
        self._check_registry()
        self.log.ack(owner=owner, epoch=epoch, ids=ids)
        if self._retirer is not None and epoch == RETIRE_EPOCH:
            entries = self.follower.refresh().entries
            self._retirer.retire([entries[i] for i in ids if i in entries])

    def release(self, owner: str, epoch: int, ids: Sequence[str]) -> None:
        self.log.release(owner=owner, epoch=epoch, ids=ids)

    def renew(self, owner: str, until: float) -> None:
        self.log.renew(owner=owner, until=until)

    def facts(self, entry: ManifestEntry) -> DatasetFacts:
        return dataset_facts(self.out_dir, [entry])


def open_source(source: str | Path, consumer: str, *, cache_dir: Path | None) -> Source:
    """A local (or shared-file-system) output directory, or ``http(s)://`` ``hsx serve``."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        from hsx_async.dataset.live.remote import RemoteSource  # noqa: PLC0415 - it imports us

        return RemoteSource(text, consumer, cache_dir=cache_dir)
    return LocalSource(Path(source), consumer)
