"""Training while ``hsx run`` extracts: a ``torch`` ``IterableDataset`` that follows the
dataset as samples commit (PROTOCOL §6).

Each sample goes to exactly one data-parallel rank: a rank *leases* a few samples at a time
(:class:`~hsx_async.dataset.live.ledger.ConsumerLog`, under the consumer's lock, fsynced),
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

- A trainer killed at any instant: what it had not acknowledged comes back at once (the
  lease follows the process: it ends when the process dies; a rank's next process voids
  the old one's leases as it starts). A checkpoint holds the samples done since the last
  ack (``state_dict``, with the dataset's identity and this process's owner id), and
  ``load_state_dict`` acknowledges them on behalf of the process they were delivered to:
  a kill between the checkpoint and the ack trains nothing twice. Another dataset's
  checkpoint is refused.
- A trainer paused (a checkpoint, an eval, even SIGSTOP) keeps its samples: the lease
  lives while the process does, whatever its training loop does. Through ``hsx serve`` a
  thread of the reading process sends a heartbeat every ``lease_timeout / 4``; serve ends
  the leases of an owner it has not heard from for ``lease_timeout`` on its own monotonic
  clock. A sample whose lease ended and went to another rank is skipped when its turn
  comes, and its acknowledgement is refused (counted in :attr:`LiveDataset.refused`).
- Only the holder of a sample's lease can acknowledge it; a process replaced by a newer
  one of its rank gets :class:`~hsx_async.errors.LiveError` on its next call.
- ``hsx run`` killed: the reader waits; a resumed run adds the samples it had not written.
- The trainer may start before, during or after extraction; an epoch ends once extraction
  is complete and every sample is acknowledged or held by a live lease (the rank's own
  included: the last batches are acknowledged after the loop).
- ``rank`` and ``world_size`` name the data-parallel rank (``torch.distributed``'s
  ``get_rank()`` and ``get_world_size()``); ranks of one consumer never get one sample
  twice. ``secret_file`` and ``ca_file`` (default: ``HSX_SERVE_SECRET_FILE``,
  ``HSX_SERVE_CA_FILE``) are ``hsx serve``'s shared secret and the CA of its certificate.

``source`` is an output directory (this node, or a shared file system) or the URL of
``hsx serve`` on the node that holds it (:mod:`hsx_async.dataset.live.remote`): the same
leases and acks, made by the server in the same logs; files travel over HTTP and are
checked against their manifest hash before they are read.

``view`` is the layout of each sample: ``"hsx"`` (what :class:`HiddenStateDataset` yields)
or the name of an export format (:mod:`hsx_async.dataset.export.formats`: :func:`views`),
in the format's own in-memory layout — ``"specforge"`` (what SpecForge 0.2.0's offline
loader reads: ``input_ids``, ``loss_mask`` int64, ``aux_hidden_state`` [1, T, 3H],
``hidden_state`` [1, T, H] post-norm) or
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
from typing import Any

import structlog
from torch.utils.data import IterableDataset

from hsx_async.dataset import reader
from hsx_async.dataset.export.format import export_format
from hsx_async.dataset.export.formats import format_names
from hsx_async.dataset.export.plan import DatasetFacts, ExportPlan, find_target, plan_conversion
from hsx_async.dataset.live.ledger import LeaseLost, OwnerVoid
from hsx_async.dataset.live.registry import check_name
from hsx_async.dataset.live.remote import RemoteSource
from hsx_async.dataset.live.sources import LocalSource, Source
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError, LiveError
from hsx_async.protocol import BF16

log = structlog.get_logger("hsx.live")

HSX_ID = "hsx_id"
HSX_IDS = "hsx_ids"
HSX_VIEW = "hsx"  # the dataset's own layout; every other view is an export format's
DEFAULT_LEASE_S = 600.0


def views() -> tuple[str, ...]:
    """The layouts a :class:`LiveDataset` yields: the dataset's own and each registered
    export format's."""
    return (HSX_VIEW, *format_names())


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
        view: str = HSX_VIEW,
        model: str | Path | None = None,
        lease_timeout: float = DEFAULT_LEASE_S,
        prefetch: int = 4,
        wait_timeout: float | None = None,
        poll_interval: float = 1.0,
        cache_dir: str | Path | None = None,
        secret_file: str | Path | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        check_name(consumer)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if view not in views():
            raise ValueError(f"view is {view!r}, expected one of {', '.join(views())}")
        if lease_timeout <= 0 or prefetch < 1 or poll_interval <= 0 or epoch < 0:
            raise ValueError("lease_timeout and poll_interval > 0, prefetch ≥ 1, epoch ≥ 0")
        self.source_spec = str(source)
        self.consumer = consumer
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.view, self.model = view, None if model is None else Path(model)
        self.lease_timeout, self.prefetch = lease_timeout, prefetch
        self.wait_timeout, self.poll_interval = wait_timeout, poll_interval
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        # hsx serve's secret and CA (default: HSX_SERVE_SECRET_FILE / HSX_SERVE_CA_FILE)
        self.remote_options = {"secret_file": secret_file, "ca_file": ca_file}
        self.owner = secrets.token_hex(8)  # this incarnation of the rank
        self._pending: list[str] = []  # done, not yet acknowledged (this process)
        self.lost = 0  # leased samples skipped: their lease went to another rank
        self.refused = 0  # acknowledgements refused (see ack)
        self._source: Source | None = None
        self._reader: Callable[[Path, ManifestEntry], dict[str, Any]] | None = None
        _ = self.source  # a wrong path fails here; this process keeps the owner alive

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_source"] = state["_reader"] = None  # each process opens its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def source(self) -> Source:
        if self._source is None:
            source = open_source(
                self.source_spec, self.consumer, cache_dir=self.cache_dir, **self.remote_options
            )
            source.hold(self.owner, self.lease_timeout)  # alive while this process is
            self._source = source
        return self._source

    # -- the iteration (in the process that iterates: main, or a DataLoader worker) -------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        source = self.source
        pause, idle_since = 0.01, time.monotonic()
        while True:
            leased = source.lease(self.owner, self.rank, self.epoch, self.prefetch)
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
        """Yield each leased sample still this owner's; those not yielded (the consumer
        stopped) go back."""
        left = [_key(e) for e in entries]
        try:
            for entry in entries:
                sample = self._read(source, entry)
                left.pop(0)
                if sample is not None:
                    yield sample
        finally:
            if left:
                with contextlib.suppress(DatasetError, OSError):
                    source.release(self.owner, self.epoch, left)

    def _read(self, source: Source, entry: ManifestEntry) -> dict[str, Any] | None:
        """The sample, or None when it is no longer this owner's (its lease ended while
        this process was not heard from, and another rank has it: skipped, not lost)."""
        try:
            path, temporary = source.fetch(self.owner, self.epoch, entry)
        except LeaseLost as exc:
            self.lost += 1
            log.warning("live_sample_lost", id=_key(entry), reason=str(exc))
            return None
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
        a sample, samples or ids): they await :meth:`ack`."""
        _ = self.source  # this process keeps the owner alive from here on
        self._pending.extend(sample_ids(batch_or_ids))

    def ack(self) -> int:
        """Durably acknowledge every sample :meth:`done` since the last ack (call right
        after a checkpoint or optimizer step is durable); the number acknowledged. Those
        whose lease went to another rank meanwhile are refused (counted in
        :attr:`refused`, logged): that rank trains them."""
        return self._ack(self._pending, None)

    def _ack(self, ids: list[str], adopted_from: str | None) -> int:
        pending, self._pending = ids, []
        if not pending:
            return 0
        try:
            result = self.source.ack(self.owner, self.epoch, pending, adopted_from=adopted_from)
        except OwnerVoid:
            raise  # replaced: what it did is the newer process's to redo
        except BaseException:
            self._pending = pending + self._pending
            raise
        if result.refused:
            self.refused += len(result.refused)
            reasons = sorted(set(result.refused.values()))
            log.warning("live_ack_refused", samples=len(result.refused), reasons=reasons)
        return len(result.acked) + len(result.again)

    def state_dict(self) -> dict[str, Any]:
        """Save with the checkpoint: the samples done since the last ack, the dataset's
        identity and this process's owner id (they were delivered to it)."""
        return {
            "dataset": self.source.identity(),
            "consumer": self.consumer,
            "epoch": self.epoch,
            "owner": self.owner,
            "done": list(self._pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After restoring a checkpoint: acknowledge what it holds, on behalf of the
        process it came from (a sample delivered to it; a second ack of a sample
        acknowledged already is counted, never applied twice). Call before iterating.
        A checkpoint of another dataset, consumer or epoch is refused."""
        ours = {"dataset": self.source.identity(), "consumer": self.consumer, "epoch": self.epoch}
        theirs = {key: state.get(key) for key in ours}
        if theirs != ours or not isinstance(state.get("owner"), str):
            raise DatasetError(
                f"the checkpoint's live state is {theirs} (owner {state.get('owner')!r}), "
                f"this reader {ours}: a checkpoint of another dataset, consumer or epoch "
                "(or of an hsx older than protocol 6) cannot say what this one trained"
            )
        self._ack([str(i) for i in state.get("done", [])], str(state["owner"]))


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
    return [str(i[HSX_ID]) if isinstance(i, dict) else str(i) for i in batch_or_ids]


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
    if view == HSX_VIEW:
        expect = None if facts.provenance is None else facts.storage

        def read_hsx(path: Path, entry: ManifestEntry) -> dict[str, Any]:
            return dict(reader.read_sample(path, num_tokens=entry.num_tokens, expect=expect))

        return read_hsx
    fmt = export_format(view)
    fmt.check_aux(facts)
    target = find_target(model, facts)
    conv = plan_conversion(fmt.name, fmt.final_state, facts, target, model is not None)
    plan = ExportPlan(conv, BF16, 0)
    return lambda path, entry: dict(fmt.tensors(path, entry, plan))


def open_source(
    source: str | Path,
    consumer: str,
    *,
    cache_dir: Path | None,
    secret_file: str | Path | None = None,
    ca_file: str | Path | None = None,
) -> Source:
    """A local (or shared-file-system) output directory, or ``http(s)://`` ``hsx serve``
    (with its secret and CA)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        return RemoteSource(
            text, consumer, cache_dir=cache_dir, secret_file=secret_file, ca_file=ca_file
        )
    return LocalSource(Path(source), consumer)


__all__ = ["HSX_ID", "HSX_IDS", "LiveCollator", "LiveDataset", "make_reader", "sample_ids"]
