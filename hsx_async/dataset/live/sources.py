"""Where a live reader leases, fetches and acknowledges (PROTOCOL §6): the output
directory itself (this node, or a shared file system: :class:`LocalSource`, also what
``hsx serve`` runs for remote readers), or ``hsx serve`` on the node that holds it
(:class:`~hsx_async.dataset.live.remote.RemoteSource`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from hsx_async.dataset.export.plan import DatasetFacts, dataset_facts
from hsx_async.dataset.live.follow import DatasetFollower
from hsx_async.dataset.live.ledger import AckResult, ConsumerLog, LeaseLost, consumer_names
from hsx_async.dataset.live.owners import OwnerHold
from hsx_async.dataset.live.registry import (
    ACKED,
    CONSUMERS_DIR,
    REGISTRY,
    Registry,
    check_name,
    dataset_identity,
    read_registry,
)
from hsx_async.dataset.live.retire import RETIRE_EPOCH, Retirer
from hsx_async.dataset.manifest import MANIFEST, QUARANTINE, ManifestEntry, log_files
from hsx_async.dataset.provenance import PROVENANCE
from hsx_async.errors import DatasetError

log = structlog.get_logger("hsx.live")

MAX_CONSUMERS = 64  # consumers of a dataset whose registry names none


@dataclass(frozen=True, slots=True)
class Leased:
    """One lease call's answer: the samples now this owner's, and whether the epoch holds
    nothing more for it (extraction complete, everything acknowledged or leased)."""

    entries: list[ManifestEntry]
    ended: bool


class Source(Protocol):
    """Where a live reader leases, fetches and acknowledges (local or ``hsx serve``)."""

    def hold(self, owner: str, timeout: float) -> None: ...  # keep ``owner`` alive
    def lease(self, owner: str, rank: int, epoch: int, count: int) -> Leased: ...
    def fetch(self, owner: str, epoch: int, entry: ManifestEntry) -> tuple[Path, bool]: ...
    def ack(
        self, owner: str, epoch: int, ids: Sequence[str], *, adopted_from: str | None = None
    ) -> AckResult: ...
    def release(self, owner: str, epoch: int, ids: Sequence[str]) -> None: ...
    def facts(self, entry: ManifestEntry) -> DatasetFacts: ...  # as the export sees it
    def identity(self) -> str: ...
    def close(self) -> None: ...


def check_live_dir(out_dir: Path) -> None:
    """A live reader (or ``hsx serve``) may start before ``hsx run``: an output directory
    that does not exist yet, or is empty, is waited for (nothing is made in it until it
    holds a dataset's files; a missing one is said in the log). Anything else that is no
    hsx dataset is refused at once (issue 39: a wrong path hung silently)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DatasetError(f"{out_dir} is not a directory; give the [output].dir of a run")
    if (
        log_files(out_dir, MANIFEST)
        or log_files(out_dir, QUARANTINE)
        or (out_dir / PROVENANCE).is_file()
        or (out_dir / REGISTRY).is_file()
        or (out_dir / CONSUMERS_DIR).is_dir()
    ):
        return
    if any(out_dir.iterdir()):
        raise DatasetError(
            f"{out_dir} is not an hsx dataset (no manifest, quarantine, provenance.json or "
            "consumers.json) and not empty; give the [output].dir of hsx run"
        )


class LocalSource:
    """A dataset this process can open (a local disk or a shared file system). The same
    object serves remote readers inside ``hsx serve``. Blocking."""

    def __init__(self, out_dir: Path, consumer: str) -> None:
        check_live_dir(out_dir)
        self.out_dir = out_dir
        self.consumer = check_name(consumer)
        self.follower = DatasetFollower(out_dir)
        self.log = ConsumerLog(out_dir, consumer)
        self.retirer = Retirer(out_dir)
        self._holds: dict[str, OwnerHold] = {}
        self._said_missing = False

    # -- rules read afresh at every call (issue 37: never a stale registry) --------------

    def registry(self) -> Registry | None:
        return read_registry(self.out_dir)

    def check(self, epoch: int) -> None:
        """This consumer may read ``epoch`` under the registry in force now."""
        registry = self.registry()
        if registry is not None and registry.consumers:
            if self.consumer not in registry.consumers:
                raise DatasetError(
                    f"consumer {self.consumer!r} is not registered in {self.out_dir}/"
                    f"{REGISTRY} (consumers: {', '.join(registry.consumers)}): use one of "
                    "those names, or add it to [output].consumers before the run starts"
                )
        else:
            names = consumer_names(self.out_dir)
            if self.consumer not in names and len(names) >= MAX_CONSUMERS:
                raise DatasetError(
                    f"{self.out_dir} has {MAX_CONSUMERS} consumers already; name the ones "
                    "that read it in [output].consumers"
                )
        if registry is not None and registry.retention == ACKED and epoch != RETIRE_EPOCH:
            raise DatasetError(
                f"epoch {epoch}: with retention acked the spool deletes each sample after "
                "epoch 0; train further epochs from a dataset with retention keep"
            )

    # -- the Source protocol ----------------------------------------------------------------

    def hold(self, owner: str, timeout: float = 0.0) -> None:
        """Keep ``owner`` alive while this process lives (``timeout``: remote only); in a
        directory that does not exist yet, from the first lease it answers."""
        if owner not in self._holds and self._exists():
            self.log.ensure_dir()
            self._holds[owner] = OwnerHold(self.log.dir, owner)

    def _exists(self) -> bool:
        """Whether the output directory exists (said once in the log while it does not)."""
        if self.out_dir.is_dir():
            return True
        if not self._said_missing:
            self._said_missing = True
            log.warning(
                "live_waiting_for_dataset", out=str(self.out_dir),
                note="no such directory yet: waiting for hsx run to make it; is the path right?",
            )  # fmt: skip
        return False

    def drop(self, owner: str) -> None:
        hold = self._holds.pop(owner, None)
        if hold is not None:
            hold.close()

    def close(self) -> None:
        for owner in list(self._holds):
            self.drop(owner)

    def lease(
        self,
        owner: str,
        rank: int,
        epoch: int,
        count: int,
        *,
        call: str | None = None,
        via: str | None = None,
        timeout: float | None = None,
    ) -> Leased:
        self.check(epoch)
        if not self._exists():
            return Leased([], ended=False)
        if via is None:
            self.hold(owner)
        followed = self.follower.refresh()
        present = followed.present
        ids = self.log.lease(
            owner=owner, rank=rank, epoch=epoch, order=followed.order, present=present,
            count=count, call=call, via=via, timeout=timeout,
        )  # fmt: skip
        if ids:
            return Leased([followed.entries[i] for i in ids], ended=False)
        return Leased([], ended=followed.complete and self._all_taken(epoch, present))

    def _all_taken(self, epoch: int, present: set[str]) -> bool:
        state, is_alive = self.log.state, self.log.alive.fresh()
        return all(
            state.is_acked(epoch, s) or state.live_lease(epoch, s, is_alive) is not None
            for s in present
        )

    def still_holds(self, owner: str, epoch: int, entry: ManifestEntry) -> bool:
        return self.log.holds(owner, epoch, str(entry.id))

    def fetch(self, owner: str, epoch: int, entry: ManifestEntry) -> tuple[Path, bool]:
        if not self.still_holds(owner, epoch, entry):
            raise LeaseLost(f"sample {entry.id}: not leased to owner {owner} any more")
        return self.out_dir / entry.path, False

    def ack(
        self,
        owner: str,
        epoch: int,
        ids: Sequence[str],
        *,
        adopted_from: str | None = None,
        call: str | None = None,
    ) -> AckResult:
        self.check(epoch)
        followed = self.follower.refresh()
        result = self.log.ack(
            owner=owner, epoch=epoch, ids=ids, known=set(followed.entries),
            adopted_from=adopted_from, call=call,
        )  # fmt: skip
        if epoch == RETIRE_EPOCH and result.acked:
            entries = followed.entries
            self.retirer.retire([entries[i] for i in result.acked if i in entries])
        return result

    def release(self, owner: str, epoch: int, ids: Sequence[str]) -> None:
        self.log.release(owner=owner, epoch=epoch, ids=ids)

    def facts(self, entry: ManifestEntry) -> DatasetFacts:
        return dataset_facts(self.out_dir, [entry])

    def identity(self) -> str:
        return dataset_identity(self.out_dir)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
