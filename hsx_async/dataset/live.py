"""Training while ``hsx run`` extracts: a ``torch`` ``IterableDataset`` that follows the
dataset as samples commit (PROTOCOL §6).

Each sample goes to exactly one data-parallel rank: a rank *leases* a few samples at a time
(:class:`~hsx_async.dataset.consumers.ConsumerLog`, under the consumer's lock, fsynced),
yields them, and the trainer *acknowledges* them when the step that used them is durable —
its optimizer step or its checkpoint::

    live = LiveDataset("/nvme/hsx-out", consumer="drafter", rank=rank, world_size=world)
    if resumed:
        live.load_state_dict(checkpoint["live"])   # acks what that checkpoint holds
    loader = DataLoader(live, batch_size=8, collate_fn=LiveCollator(PadCollator()))
    for step, batch in enumerate(loader):
        ...                                        # forward, backward, optimizer step
        live.done(batch)                           # these samples are in the model now
        if step % 100 == 0:
            torch.save({"model": ..., "live": live.state_dict()}, path)
            live.ack()                             # durable: never delivered again

- A trainer killed at any instant: what it had not acknowledged comes back — at once to
  the rank's next process (its ``start`` voids the old leases), else after
  ``lease_timeout`` to any rank. A checkpoint holds the samples done since the last ack
  (``state_dict``), and ``load_state_dict`` acknowledges them: a kill between the
  checkpoint and the ack trains nothing twice.
- ``hsx run`` killed: the reader waits; a resumed run adds the samples it had not written.
- The trainer may start before, during or after extraction; an epoch ends once extraction
  is complete and every sample is acknowledged or held by a live lease (the rank's own
  included: the last batches are acknowledged after the loop).
- Leases last ``lease_timeout`` seconds past the owner's last activity (a lease, a renewal:
  each lease and ``done`` renew them), so a live but slow trainer keeps its samples.

``source`` is an output directory (this node, or a shared file system) or the URL of
``hsx serve`` on the node that holds it (:mod:`hsx_async.dataset.live_remote`): the same
leases and acks, made by the server in the same logs; files travel over HTTP and are
checked against their manifest hash before they are read.

``view`` is the layout of each sample: ``"hsx"`` (what :class:`HiddenStateDataset` yields),
``"specforge"`` (what SpecForge 0.2.0's offline loader reads: ``input_ids``, ``loss_mask``
int64, ``aux_hidden_state`` [1, T, 3H], ``hidden_state`` [1, T, H] post-norm) or
``"speculators"`` (what speculators 0.9.0's transfer hands its dataset: ``hidden_states``
[T, L, H] with the *pre*-norm final state, ``token_ids``, plus ``loss_mask`` int64). The
final state is converted as ``hsx export`` converts it (its own code, with ``model``: the
target's Hugging Face directory, when the dataset holds the other kind). Every sample
carries its id as ``"hsx_id"``; :class:`LiveCollator` moves them into the batch.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from torch.utils.data import IterableDataset

from hsx_async.dataset.consumers import ACKED, ConsumerLog, check_name, read_registry
from hsx_async.dataset.follow import DatasetFollower
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.dataset.spool import RETIRE_EPOCH, Retirer
from hsx_async.errors import DatasetError, LiveError
from hsx_async.protocol import BF16

if TYPE_CHECKING:
    from hsx_async.dataset.export.plan import DatasetFacts

log = structlog.get_logger("hsx.live")

HSX_ID = "hsx_id"
HSX_IDS = "hsx_ids"
VIEWS = ("hsx", "specforge", "speculators")
DEFAULT_LEASE_S = 600.0


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

    def __init__(self, out_dir: Path, consumer: str, *, epoch: int = 0) -> None:
        self.out_dir = out_dir
        self.consumer = check_name(consumer)
        self.follower = DatasetFollower(out_dir)
        self.log = ConsumerLog(out_dir, consumer)
        self._registry_seen = False
        self._retirer: Retirer | None = None
        self._epoch = epoch

    def _check_registry(self) -> None:
        if self._registry_seen:
            return
        registry = read_registry(self.out_dir)
        if registry is None:
            return  # not written yet (no run started), or a dataset that keeps everything
        self._registry_seen = True
        if registry.retention != ACKED:
            return
        if self.consumer not in registry.consumers:
            raise DatasetError(
                f"consumer {self.consumer!r} is not registered in {self.out_dir}/consumers.json "
                f"(retention acked, consumers: {', '.join(registry.consumers)}): the spool "
                "deletes samples once those have them, so this one would miss samples. Use "
                "one of those names, or add it to [output].consumers before the run starts"
            )
        if self._epoch != RETIRE_EPOCH:
            raise DatasetError(
                f"epoch {self._epoch}: with retention acked the spool deletes each sample "
                "after epoch 0; train further epochs from a dataset with retention keep"
            )
        self._retirer = Retirer(self.out_dir, registry)

    def lease(self, owner: str, rank: int, epoch: int, count: int, timeout: float) -> Leased:
        self._check_registry()
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
        from hsx_async.dataset.export.plan import dataset_facts  # noqa: PLC0415 - light, lazy

        return dataset_facts(self.out_dir, [entry])


def open_source(source: str | Path, consumer: str, *, epoch: int, cache_dir: Path | None) -> Source:
    return LocalSource(Path(source), consumer, epoch=epoch)


class LiveDataset(IterableDataset[dict[str, Any]]):
    """See the module docstring. Picklable: DataLoader workers lease as the same owner
    (one incarnation of the rank); acknowledge from the main process."""

    def __init__(
        self,
        source: str | Path,
        *,
        consumer: str,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        view: str = "hsx",
        model: str | Path | None = None,
        lease_timeout: float = DEFAULT_LEASE_S,
        prefetch: int = 4,
        wait_timeout: float | None = None,
        poll_interval: float = 1.0,
        cache_dir: str | Path | None = None,
    ) -> None:
        check_name(consumer)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if view not in VIEWS:
            raise ValueError(f"view is {view!r}, expected one of {', '.join(VIEWS)}")
        if lease_timeout <= 0 or prefetch < 1 or poll_interval <= 0 or epoch < 0:
            raise ValueError("lease_timeout and poll_interval > 0, prefetch ≥ 1, epoch ≥ 0")
        self.source_spec = str(source)
        self.consumer = consumer
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.view, self.model = view, None if model is None else Path(model)
        self.lease_timeout, self.prefetch = lease_timeout, prefetch
        self.wait_timeout, self.poll_interval = wait_timeout, poll_interval
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.owner = secrets.token_hex(8)  # this incarnation of the rank
        self._pending: list[str] = []  # done, not yet acknowledged (this process)
        self._renewed = 0.0
        self._source: Source | None = None
        self._reader: Callable[[Path, ManifestEntry], dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_source"] = state["_reader"] = None  # each process opens its own
        return state

    @property
    def source(self) -> Source:
        if self._source is None:
            self._source = open_source(
                self.source_spec, self.consumer, epoch=self.epoch, cache_dir=self.cache_dir
            )
        return self._source

    # -- the iteration (in the process that iterates: main, or a DataLoader worker) -------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        source = self.source
        pause, idle_since = 0.01, time.monotonic()
        while True:
            leased = source.lease(
                self.owner, self.rank, self.epoch, self.prefetch, self.lease_timeout
            )
            if leased.entries:
                yield from self._deliver(source, leased.entries)
                pause, idle_since = 0.01, time.monotonic()
                continue
            if leased.ended:
                return
            waited = time.monotonic() - idle_since
            if self.wait_timeout is not None and waited > self.wait_timeout:
                raise LiveError(
                    f"{self.source_spec}: no sample for consumer {self.consumer!r} in "
                    f"{waited:.0f} s (wait_timeout): is hsx run going, or paused on a full "
                    "spool that another consumer must drain?"
                )
            time.sleep(pause)  # a poll of logs another process appends to
            pause = min(pause * 2, self.poll_interval)

    def _deliver(self, source: Source, entries: list[ManifestEntry]) -> Iterator[dict[str, Any]]:
        """Yield each leased sample; those not yielded (the consumer stopped) go back."""
        left = [_key(e) for e in entries]
        try:
            for entry in entries:
                sample = self._read(source, entry)
                left.pop(0)
                yield sample
        finally:
            if left:
                with contextlib.suppress(DatasetError, OSError):
                    source.release(self.owner, self.epoch, left)

    def _read(self, source: Source, entry: ManifestEntry) -> dict[str, Any]:
        path, temporary = source.fetch(entry)
        try:
            if self._reader is None:
                self._reader = make_reader(self.view, source.facts(entry), self.model)
            sample = self._reader(path, entry)
        finally:
            if temporary:
                path.unlink(missing_ok=True)  # the mapping outlives the name
        sample[HSX_ID] = _key(entry)
        return sample

    # -- acknowledgement (the trainer's process) ------------------------------------------

    def done(self, batch_or_ids: Any) -> None:
        """The step that used these samples finished (a batch from :class:`LiveCollator`,
        a sample, or ids): they await :meth:`ack`. Renews this owner's leases."""
        self._pending.extend(sample_ids(batch_or_ids))
        now = time.time()
        if now - self._renewed > self.lease_timeout / 4:
            self.source.renew(self.owner, now + self.lease_timeout)
            self._renewed = now

    def ack(self) -> int:
        """Durably acknowledge every sample :meth:`done` since the last ack (call right
        after a checkpoint or optimizer step is durable); the number acknowledged."""
        pending, self._pending = self._pending, []
        if pending:
            try:
                self.source.ack(self.owner, self.epoch, pending)
            except BaseException:
                self._pending = pending + self._pending
                raise
        return len(pending)

    def state_dict(self) -> dict[str, Any]:
        """Save with the checkpoint: the samples done since the last ack."""
        return {"consumer": self.consumer, "epoch": self.epoch, "done": list(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After restoring a checkpoint: acknowledge what it holds (a second ack of a
        sample acknowledged already is counted, never applied twice). Call before
        iterating."""
        if state.get("consumer") != self.consumer or state.get("epoch") != self.epoch:
            raise DatasetError(
                f"checkpoint's live state is consumer {state.get('consumer')!r} epoch "
                f"{state.get('epoch')!r}, this reader {self.consumer!r} epoch {self.epoch}"
            )
        self._pending = [str(i) for i in state.get("done", [])]
        self.ack()


def _key(entry: ManifestEntry) -> str:
    return str(entry.id)


def sample_ids(batch_or_ids: Any) -> list[str]:
    if isinstance(batch_or_ids, dict):
        if HSX_IDS in batch_or_ids:
            return [str(i) for i in batch_or_ids[HSX_IDS]]
        if HSX_ID in batch_or_ids:
            return [str(batch_or_ids[HSX_ID])]
        raise ValueError(f"a batch without {HSX_IDS!r}: collate with LiveCollator")
    if isinstance(batch_or_ids, str):
        return [batch_or_ids]
    return [str(i) for i in batch_or_ids]


@dataclass(frozen=True, slots=True)
class LiveCollator:
    """Wraps a collate function: each sample's ``hsx_id`` goes into the batch's
    ``hsx_ids`` list (what :meth:`LiveDataset.done` takes), the rest to ``inner``."""

    inner: Callable[[list[dict[str, Any]]], Any]

    def __call__(self, batch: Sequence[dict[str, Any]]) -> Any:
        ids = [s[HSX_ID] for s in batch]
        out = self.inner([{k: v for k, v in s.items() if k != HSX_ID} for s in batch])
        if isinstance(out, dict):
            out[HSX_IDS] = ids
            return out
        return {"batch": out, HSX_IDS: ids}


# -- views: the layout each trainer reads --------------------------------------------------


def make_reader(
    view: str, facts: DatasetFacts, model: Path | None
) -> Callable[[Path, ManifestEntry], dict[str, Any]]:
    """The function that reads one sample file in ``view``'s layout: ``"hsx"``, or an
    export format's own in-memory sample (:class:`~.export.format.ExportFormat`
    ``tensors``), planned as ``hsx export --format <view> --dtype bfloat16`` plans it."""
    from hsx_async.dataset import reader  # noqa: PLC0415 - torch once a sample is read

    if view == "hsx":
        expect = None if facts.provenance is None else facts.storage

        def read_hsx(path: Path, entry: ManifestEntry) -> dict[str, Any]:
            return dict(reader.read_sample(path, num_tokens=entry.num_tokens, expect=expect))

        return read_hsx
    from hsx_async.dataset.export import export_format  # noqa: PLC0415 - torch on first use
    from hsx_async.dataset.export.plan import (  # noqa: PLC0415 - torch on first use
        ExportPlan,
        find_target,
        plan_conversion,
    )

    fmt = export_format(view)
    fmt.check_aux(facts)
    target = find_target(model, facts)
    conv = plan_conversion(fmt.name, fmt.final_state, facts, target, model is not None)
    plan = ExportPlan(conv, BF16, 0)
    return lambda path, entry: dict(fmt.tensors(path, entry, plan))
