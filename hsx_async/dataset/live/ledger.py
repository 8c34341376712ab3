"""One consumer's ledger (PROTOCOL §6.1, version 6): its durable leases and
acknowledgements, fenced by owner.

``consumers/<name>/log.jsonl`` is append-only. Every line is appended under
``consumers/<name>/.lock`` (``flock``) after reading what others appended, and fsynced
before the call that wrote it returns; so the data-parallel ranks of one consumer (local
processes, or ``hsx serve`` leasing on behalf of remote ones) never lease a sample twice,
and what a call reported done survives any crash. Lines (``op``):

- ``start`` ``{owner, rank}``: a process (an *owner*: one incarnation of one rank) begins.
  Every earlier owner of the same rank is *void* from here: that process was replaced, its
  leases come back at once and nothing it sends is applied any more.
- ``lease`` ``{owner, rank, epoch, ids, call?, via?, timeout?}``: the samples are this
  owner's while it lives (:mod:`~hsx_async.dataset.live.owners`) and is not void. ``call``
  is the request's id: a repeated call (its answer was lost) gets the same samples, even
  from a restarted ``hsx serve``. ``via: "serve"`` and ``timeout`` (seconds without a
  heartbeat) say that serve keeps the owner alive.
- ``ack`` ``{owner, epoch, ids, call?, from?}``: the trainer's step that used these
  samples is durable. Only the holder of a sample's lease may acknowledge it, or — ``from``
  an earlier owner, when a trainer restored from a checkpoint acknowledges what that
  checkpoint holds — an owner the sample was once leased to. An acknowledged sample is
  never leased again in that epoch; a second ack of it is counted, never applied twice.
- ``release`` ``{owner, epoch, ids}``: the owner gives leased samples back unused.
- ``renew`` (version 5) is read and ignored: leases follow liveness now.

A complete line that does not parse is corruption (the error names file and line); a torn
last line (a crash mid-append, never acknowledged) is cut before the next append.

A sample is *available* to a consumer in an epoch when it is in the dataset, not
acknowledged in that epoch, and not under a live lease: one whose owner is alive and not
void.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import exclusive_lock, fsync_dir
from hsx_async.dataset.live.owners import alive
from hsx_async.dataset.live.registry import CONSUMERS_DIR, check_name
from hsx_async.dataset.manifest import AppendLog, LogTail
from hsx_async.errors import DatasetError, LiveError
from hsx_async.protocol import valid_ns

LOG_NAME = "log.jsonl"
LOCK_NAME = ".lock"
_OWNER = re.compile(r"[0-9a-f]{8,64}")
LOCK_WAIT_S = 30.0  # a lease or ack holds the lock for one read and one fsynced append
MAX_IDS_PER_LINE = 4096
REPLAY = 64  # calls remembered per owner (a repeated call gets its answer again)
Ids = set[str] | frozenset[str]
Alive = Callable[[str], bool]

# Why an acknowledgement was refused (PROTOCOL §6.2): said to the trainer per sample.
VOID = "this process was replaced by a newer one of its rank (its leases are void)"
NOT_LEASED = "never leased to this owner"
LOST = "its lease ended (the owner was not alive) and it went to another owner"
UNKNOWN = "no committed sample of this dataset has this id"
ACKED_BY_OTHER = "acknowledged already by the owner its lease went to"


class OwnerVoid(LiveError):
    """The owner was replaced by a newer process of its rank: nothing it asks is applied
    (the reader stops: its rank lives on in the newer process)."""


class LeaseLost(DatasetError):
    """The sample is no longer this owner's (its lease ended and went to another owner, or
    the sample was acknowledged and deleted): the reader skips it, nothing is lost."""


@dataclass(slots=True)
class Lease:
    owner: str
    rank: int


@dataclass(frozen=True, slots=True)
class AckResult:
    """What an acknowledgement did: the ids newly acknowledged, those acknowledged before
    (counted), and those refused with the reason (nothing of theirs was recorded)."""

    acked: list[str] = field(default_factory=list)
    again: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"acked": len(self.acked), "again": len(self.again), "refused": self.refused}


@dataclass
class ConsumerState:
    """What a consumer's log says, line by line (pure: no I/O)."""

    acked: dict[int, set[str]] = field(default_factory=dict)  # epoch → ids
    acked_by: dict[tuple[int, str], str] = field(default_factory=dict)  # → first owner
    leases: dict[tuple[int, str], Lease] = field(default_factory=dict)  # (epoch, id)
    delivered: dict[tuple[int, str], set[str]] = field(default_factory=dict)  # → owners
    ranks: dict[str, int] = field(default_factory=dict)  # owner → rank
    void: set[str] = field(default_factory=set)  # owners whose rank started again
    served: dict[str, float] = field(default_factory=dict)  # owner → heartbeat timeout
    returned: dict[int, dict[str, None]] = field(default_factory=dict)  # epoch → released
    calls: dict[str, collections.OrderedDict[str, list[str]]] = field(default_factory=dict)
    duplicate_acks: int = 0

    def apply(self, rec: Any, where: str) -> None:
        try:
            op = rec["op"]
            handler = _OPS[op]
        except (KeyError, TypeError):
            raise DatasetError(f"{where}: not a consumer-log line; hsx did not write it") from None
        try:
            handler(self, rec)
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{where}: {op} line is missing or mistypes {exc}") from None

    def _start(self, rec: Any) -> None:
        owner, rank = str(rec["owner"]), int(rec["rank"])
        for other, other_rank in self.ranks.items():
            if other_rank == rank and other != owner:
                self.void.add(other)
        self.ranks[owner] = rank

    def _remember(self, owner: str, call: Any, ids: list[str]) -> None:
        if not isinstance(call, str):
            return
        calls = self.calls.setdefault(owner, collections.OrderedDict())
        calls[call] = ids
        while len(calls) > REPLAY:
            calls.popitem(last=False)

    def _lease(self, rec: Any) -> None:
        owner, rank, epoch = str(rec["owner"]), int(rec["rank"]), int(rec["epoch"])
        self.ranks.setdefault(owner, rank)
        ids = [str(i) for i in rec["ids"]]
        returned = self.returned.get(epoch, {})
        for sample in ids:
            self.leases[(epoch, sample)] = Lease(owner, rank)
            self.delivered.setdefault((epoch, sample), set()).add(owner)
            returned.pop(sample, None)
        if rec.get("via") == "serve":
            self.served[owner] = float(rec.get("timeout", 0.0))
        self._remember(owner, rec.get("call"), ids)

    def _renew(self, rec: Any) -> None:
        str(rec["owner"])  # version 5: leases followed a wall clock; now liveness

    def _ack(self, rec: Any) -> None:
        epoch = int(rec["epoch"])
        done = self.acked.setdefault(epoch, set())
        ids = [str(i) for i in rec["ids"]]
        by = str(rec.get("from", rec["owner"]))  # whose training the ack records
        for sample in ids:
            if sample in done:
                self.duplicate_acks += 1
            else:
                done.add(sample)
                self.acked_by[(epoch, sample)] = by
            self.leases.pop((epoch, sample), None)
            self.returned.get(epoch, {}).pop(sample, None)
        self._remember(str(rec["owner"]), rec.get("call"), ids)

    def _release(self, rec: Any) -> None:
        owner, epoch = str(rec["owner"]), int(rec["epoch"])
        for sample in map(str, rec["ids"]):
            lease = self.leases.get((epoch, sample))
            if lease is not None and lease.owner == owner:
                del self.leases[(epoch, sample)]
                self.returned.setdefault(epoch, {})[sample] = None  # offered again first

    # -- questions ------------------------------------------------------------------------

    def is_acked(self, epoch: int, sample: str) -> bool:
        return sample in self.acked.get(epoch, ())

    def live_lease(self, epoch: int, sample: str, is_alive: Alive) -> Lease | None:
        lease = self.leases.get((epoch, sample))
        if lease is None or lease.owner in self.void or not is_alive(lease.owner):
            return None
        return lease

    def held(self, epoch: int, is_alive: Alive) -> dict[str, int]:
        """Live leases of ``epoch`` per rank."""
        counts: dict[str, int] = {}
        for (e, sample), lease in self.leases.items():
            if e == epoch and self.live_lease(e, sample, is_alive) is not None:
                counts[str(lease.rank)] = counts.get(str(lease.rank), 0) + 1
        return counts

    def lapsed(self, epoch: int, is_alive: Alive) -> list[str]:
        """Samples of ``epoch`` leased once and available again: released, or leased to an
        owner now void or dead (those a cursor passed over)."""
        back = [s for s in self.returned.get(epoch, {}) if not self.is_acked(epoch, s)]
        return back + [
            s for (e, s) in self.leases if e == epoch and self.live_lease(e, s, is_alive) is None
        ]

    def judge_ack(
        self, owner: str, epoch: int, sample: str, known: Ids | None, adopted_from: str | None
    ) -> str:
        """ "" when ``owner`` may acknowledge ``sample``, else the reason it may not."""
        if known is not None and sample not in known:
            return UNKNOWN
        lease = self.leases.get((epoch, sample))
        if lease is not None and lease.owner == owner:
            return ""
        if adopted_from is not None and adopted_from in self.delivered.get((epoch, sample), ()):
            return ""  # delivered to the checkpoint's process: that model trained it
        if owner in self.delivered.get((epoch, sample), ()):
            return LOST
        return NOT_LEASED


_OPS = {
    "start": ConsumerState._start,
    "lease": ConsumerState._lease,
    "renew": ConsumerState._renew,
    "ack": ConsumerState._ack,
    "release": ConsumerState._release,
}


def check_owner(owner: object) -> str:
    if not isinstance(owner, str) or not _OWNER.fullmatch(owner):
        raise DatasetError(f"owner {owner!r} must be 8–64 lowercase hex digits")
    return owner


class Liveness:
    """Whether each owner is alive, asked of its lock at most once per :meth:`fresh` (one
    decision per call: every sample of one owner gets the same answer)."""

    def __init__(self, consumer_dir: Path) -> None:
        self.consumer_dir = consumer_dir
        self._seen: dict[str, bool] = {}

    def fresh(self) -> Liveness:
        self._seen.clear()
        return self

    def __call__(self, owner: str) -> bool:
        found = self._seen.get(owner)
        if found is None:
            found = self._seen[owner] = alive(self.consumer_dir, owner)
        return found


class ConsumerLog:
    """One consumer's log, followed incrementally; every change is made under its lock
    after reading what others appended, and fsynced. Blocking: call from a thread.

    ``lease`` picks from ``order`` (the dataset's sample ids in commit order, a list the
    caller only appends to): first the samples whose lease lapsed, then new ones from a
    cursor that only moves forward (a sample passed over was acknowledged — never offered
    again — or leased, and then it comes back through the lapsed ones)."""

    def __init__(self, out_dir: Path, name: str, *, lock_wait: float = LOCK_WAIT_S) -> None:
        self.name = check_name(name)
        self.dir = out_dir / CONSUMERS_DIR / name
        self.path = self.dir / LOG_NAME
        self.lock_wait = lock_wait
        self.state = ConsumerState()
        self.alive = Liveness(self.dir)
        self._tail = LogTail(self.path)
        self._cursor: dict[int, int] = {}  # epoch → index into `order`

    def ensure_dir(self) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.dir.parent)
            fsync_dir(self.dir.parent.parent)

    def refresh(self) -> ConsumerState:
        """Read what was appended since the last look (no lock: appends are whole lines)."""
        records = self._tail.read()
        if self._tail.restarted:  # replaced under us: rebuild from its start
            self.state, self._cursor = ConsumerState(), {}
        for number, rec in records:
            self.state.apply(rec, f"{self.path}:{number}")
        return self.state

    def _append(self, records: Sequence[dict[str, Any]]) -> None:
        lines = [orjson.dumps(r) + b"\n" for r in records]
        log = AppendLog(self.path)  # opening cuts a torn line a crashed writer left
        try:
            log.append(lines)
        finally:
            log.close()
        for rec in records:
            self.state.apply(rec, str(self.path))
        self._tail.read()  # step over our own lines (already applied)

    def _locked(self) -> Any:
        self.ensure_dir()
        return exclusive_lock(
            self.dir / LOCK_NAME,
            f"{self.dir / LOCK_NAME}: another process held the consumer lock for "
            f"{self.lock_wait:.0f} s; is one stuck?",
            wait=self.lock_wait,
        )

    def _check_live_owner(self, owner: str, rank: int | None) -> None:
        if owner in self.state.void:
            where = "" if rank is None else f" rank {rank}"
            raise OwnerVoid(
                f"consumer {self.name!r}{where} owner {owner}: {VOID}; run one process per rank"
            )

    def lease(
        self,
        *,
        owner: str,
        rank: int,
        epoch: int,
        order: Sequence[str],
        present: Ids,
        count: int,
        call: str | None = None,
        via: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Lease up to ``count`` available samples of ``epoch`` to ``owner`` (rank
        ``rank``); ``present``: ids the dataset still holds. A repeated ``call`` gets
        the samples it leased, those still this owner's."""
        with self._locked():
            self.refresh()
            self._check_live_owner(owner, rank)
            replay = self._replayed(owner, call)
            if replay is not None:
                return [s for s in replay if self._holds(owner, epoch, s)]
            records: list[dict[str, Any]] = []
            if owner not in self.state.ranks:
                records.append({"op": "start", "owner": owner, "rank": rank})
                self.state.apply(records[-1], str(self.path))  # voids before picking
            picked = self._pick(epoch, order, present, count)
            if picked:
                line: dict[str, Any] = {"op": "lease", "owner": owner, "rank": rank}
                line |= {"epoch": epoch, "ids": picked}
                if call is not None:
                    line["call"] = call
                if via is not None:
                    line |= {"via": via, "timeout": timeout}
                records.append(line)
            if records:
                self._append(records)
        return picked

    def _replayed(self, owner: str, call: str | None) -> list[str] | None:
        calls = self.state.calls.get(owner)
        return None if calls is None or call is None else calls.get(call)

    def _holds(self, owner: str, epoch: int, sample: str) -> bool:
        lease = self.state.leases.get((epoch, sample))
        return lease is not None and lease.owner == owner

    def _pick(self, epoch: int, order: Sequence[str], present: Ids, count: int) -> list[str]:
        state, is_alive = self.state, self.alive.fresh()
        picked = [s for s in state.lapsed(epoch, is_alive) if s in present][:count]
        taken = set(picked)
        cursor = self._cursor.get(epoch, 0)
        while len(picked) < count and cursor < len(order):
            sample = order[cursor]
            if sample in taken or sample not in present or state.is_acked(epoch, sample):
                cursor += 1
                continue
            if (epoch, sample) in state.leases:
                cursor += 1  # leased: it comes back through lapsed() if it lapses
                continue
            picked.append(sample)
            taken.add(sample)
            cursor += 1
        self._cursor[epoch] = cursor
        return picked

    def ack(
        self,
        *,
        owner: str,
        epoch: int,
        ids: Iterable[str],
        known: Ids | None = None,
        adopted_from: str | None = None,
        call: str | None = None,
    ) -> AckResult:
        """Record the acknowledgement of those of ``ids`` that ``owner`` holds (or that
        were delivered to ``adopted_from``) durably; ``known``: the dataset's committed
        ids (an id outside them is refused)."""
        wanted = list(dict.fromkeys(map(str, ids)))
        with self._locked():
            self.refresh()
            self._check_live_owner(owner, None)
            replay = self._replayed(owner, call)
            if replay is not None:
                return AckResult(acked=list(replay))
            result = AckResult()
            for sample in wanted:
                if self.state.is_acked(epoch, sample):
                    by = self.state.acked_by.get((epoch, sample))
                    if by in (owner, adopted_from) or by is None:
                        result.again.append(sample)  # its own ack again (a retry): counted
                    else:
                        result.refused[sample] = ACKED_BY_OTHER
                    continue
                reason = self.state.judge_ack(owner, epoch, sample, known, adopted_from)
                if reason:
                    result.refused[sample] = reason
                else:
                    result.acked.append(sample)
            accepted = result.acked + result.again
            records: list[dict[str, Any]] = []
            for chunk in _chunks(accepted):
                line: dict[str, Any] = {"op": "ack", "owner": owner, "epoch": epoch, "ids": chunk}
                if adopted_from is not None:
                    line["from"] = adopted_from
                records.append(line)
            if records and call is not None:
                records[-1]["call"] = call
            if records:
                self._append(records)
        return result

    def release(self, *, owner: str, epoch: int, ids: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(map(str, ids)))
        if not wanted:
            return
        with self._locked():
            self.refresh()
            own = [s for s in wanted if self._holds(owner, epoch, s)]
            line = {"op": "release", "owner": owner, "epoch": epoch}
            if own:
                self._append([line | {"ids": chunk} for chunk in _chunks(own)])

    def holds(self, owner: str, epoch: int, sample: str) -> bool:
        """Whether ``owner`` holds ``sample``'s lease now, as the log says (refreshed)."""
        self.refresh()
        return owner not in self.state.void and self._holds(owner, epoch, sample)


def _chunks(ids: list[str]) -> list[list[str]]:
    return [ids[i : i + MAX_IDS_PER_LINE] for i in range(0, len(ids), MAX_IDS_PER_LINE)]


def consumer_names(out_dir: Path) -> list[str]:
    """Every consumer that has a log in ``out_dir`` (registered or not)."""
    base = out_dir / CONSUMERS_DIR
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if valid_ns(p.name) and (p / LOG_NAME).is_file())
