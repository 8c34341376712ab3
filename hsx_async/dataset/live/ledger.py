"""The consumers of a live dataset (PROTOCOL §6): who must have a sample before a bounded
spool may delete it, and each consumer's durable leases and acknowledgements.

Files, in the output directory:

- ``consumers.json`` — the registry: the retention (``keep``, or ``acked``: a sample is
  deleted once every registered consumer acknowledged it), the registered consumer names
  and the spool limit. ``hsx run`` writes it (temp → fsync → rename) before its first
  sample, from ``[output]``.
- ``consumers/<name>/log.jsonl`` — one consumer's append-only log. Every line is appended
  under ``consumers/<name>/.lock`` (``flock``) after reading the whole log, and fsynced
  before the call that wrote it returns; so the data-parallel ranks of one consumer (local
  processes, or a server leasing on behalf of remote ones) never lease a sample twice, and
  what a call reported done survives any crash. Lines (``op``):

  - ``start`` ``{owner, rank}``: a process (an *owner*: one incarnation of one rank) begins.
    The leases of every earlier owner of the same rank are void from here: that process is
    gone (it was restarted), so its samples come back at once, not after a timeout.
  - ``lease`` ``{owner, rank, epoch, ids, until}``: the samples are this owner's until the
    wall-clock time ``until``; it also renews the owner's other leases to ``until``.
  - ``renew`` ``{owner, until}``: the owner is alive; its leases last until ``until``.
  - ``ack`` ``{owner, epoch, ids}``: the trainer's step that used these samples is done
    (durable: its optimizer step or checkpoint). An acknowledged sample is never delivered
    again in that epoch, to any rank; a second ack of it is counted, never applied twice.
  - ``release`` ``{owner, epoch, ids}``: the owner gives leased samples back unused.

  A complete line that does not parse is corruption (the error names file and line); a
  torn last line (a crash mid-append, never acknowledged) is cut before the next append.

A sample is *available* to a consumer in an epoch when it is in the dataset, not
acknowledged in that epoch, and not under a live lease: leased by an owner that is not
void, whose lease (or latest renewal) runs until a time still ahead.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import orjson

from hsx_async.dataset.durable import exclusive_lock, fsync_dir, write_atomic
from hsx_async.dataset.manifest import AppendLog, LogTail
from hsx_async.errors import DatasetError
from hsx_async.protocol import NS_PATTERN, valid_ns

REGISTRY = "consumers.json"
CONSUMERS_DIR = "consumers"
LOG_NAME = "log.jsonl"
LOCK_NAME = ".lock"
KEEP: Final = "keep"
ACKED: Final = "acked"
Retention = Literal["keep", "acked"]
RETENTIONS: tuple[str, ...] = (KEEP, ACKED)
_OWNER = re.compile(r"[0-9a-f]{8,64}")
LOCK_WAIT_S = 30.0  # a lease or ack holds the lock for one read and one fsynced append
MAX_IDS_PER_LINE = 4096
Ids = set[str] | frozenset[str]


def check_name(name: object) -> str:
    """A consumer name becomes a directory name: the rule of a dump namespace (PROTOCOL §2:
    letters, digits and ``._-``, 1–64 characters), the same function."""
    if not valid_ns(name):
        raise DatasetError(
            f"consumer name {name!r} must match {NS_PATTERN} (letters, digits, '._-', ≤ 64)"
        )
    assert isinstance(name, str)
    return name


# -- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Registry:
    retention: Retention
    consumers: tuple[str, ...]
    spool_limit: int  # bytes of sample files a run may hold at once; 0: no limit

    def to_json(self) -> bytes:
        record = {
            "retention": self.retention,
            "consumers": list(self.consumers),
            "spool_limit": self.spool_limit,
        }
        return orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n"

    def must_ack(self, name: str) -> bool:
        """Whether ``name``'s acknowledgements decide when a sample is deleted."""
        return self.retention == ACKED and name in self.consumers


def read_registry(out_dir: Path) -> Registry | None:
    path = out_dir / REGISTRY
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError:
        raise DatasetError(f"{path} is not valid JSON; hsx did not write it") from None
    try:
        retention = raw["retention"]
        names = tuple(check_name(n) for n in raw["consumers"])
        limit = raw["spool_limit"]
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: missing or mistyped {exc}; hsx did not write it") from None
    if retention not in RETENTIONS or type(limit) is not int or limit < 0:
        raise DatasetError(f"{path}: retention {retention!r} / spool_limit {limit!r} invalid")
    return Registry(retention, names, limit)


def record_registry(out_dir: Path, registry: Registry, *, retired: int) -> None:
    """Write the registry for a run (blocking; under the directory lock). A consumer added
    after samples were deleted could never receive those: refused."""
    old = read_registry(out_dir)
    if old == registry:
        return
    if old is not None and retired and registry.retention == ACKED:
        added = sorted(set(registry.consumers) - set(old.consumers))
        if added:
            raise DatasetError(
                f"[output].consumers adds {', '.join(added)}, but the spool has already "
                f"deleted {retired:,} samples the registered consumers "
                f"({', '.join(old.consumers) or 'none'}) acknowledged: the new ones could "
                "never receive them. Remove them from [output].consumers, or extract into a "
                "new [output].dir"
            )
    write_atomic(out_dir / REGISTRY, registry.to_json())


# -- one consumer's state -------------------------------------------------------------------


@dataclass(slots=True)
class Lease:
    owner: str
    rank: int
    until: float


@dataclass
class ConsumerState:
    """What a consumer's log says, line by line (pure: no I/O)."""

    acked: dict[int, set[str]] = field(default_factory=dict)  # epoch → ids
    leases: dict[tuple[int, str], Lease] = field(default_factory=dict)  # (epoch, id)
    ranks: dict[str, int] = field(default_factory=dict)  # owner → rank
    renewed: dict[str, float] = field(default_factory=dict)  # owner → until
    void: set[str] = field(default_factory=set)  # owners whose rank started again
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

    def _lease(self, rec: Any) -> None:
        owner, rank, epoch = str(rec["owner"]), int(rec["rank"]), int(rec["epoch"])
        until = float(rec["until"])
        self.ranks.setdefault(owner, rank)
        for sample in rec["ids"]:
            self.leases[(epoch, str(sample))] = Lease(owner, rank, until)
        self.renewed[owner] = max(self.renewed.get(owner, 0.0), until)

    def _renew(self, rec: Any) -> None:
        owner = str(rec["owner"])
        self.renewed[owner] = max(self.renewed.get(owner, 0.0), float(rec["until"]))

    def _ack(self, rec: Any) -> None:
        epoch = int(rec["epoch"])
        done = self.acked.setdefault(epoch, set())
        for sample in map(str, rec["ids"]):
            if sample in done:
                self.duplicate_acks += 1
            else:
                done.add(sample)
            self.leases.pop((epoch, sample), None)

    def _release(self, rec: Any) -> None:
        owner, epoch = str(rec["owner"]), int(rec["epoch"])
        for sample in map(str, rec["ids"]):
            lease = self.leases.get((epoch, sample))
            if lease is not None and lease.owner == owner:
                del self.leases[(epoch, sample)]

    # -- questions ------------------------------------------------------------------------

    def is_acked(self, epoch: int, sample: str) -> bool:
        return sample in self.acked.get(epoch, ())

    def live_lease(self, epoch: int, sample: str, now: float) -> Lease | None:
        lease = self.leases.get((epoch, sample))
        if lease is None or lease.owner in self.void:
            return None
        until = max(lease.until, self.renewed.get(lease.owner, 0.0))
        return lease if until > now else None

    def held(self, epoch: int, now: float) -> dict[str, int]:
        """Live leases of ``epoch`` per rank."""
        counts: dict[str, int] = {}
        for (e, sample), lease in self.leases.items():
            if e == epoch and self.live_lease(e, sample, now) is not None:
                counts[str(lease.rank)] = counts.get(str(lease.rank), 0) + 1
        return counts

    def lapsed(self, epoch: int, now: float) -> list[str]:
        """Leased samples of ``epoch`` that are available again (void or expired)."""
        return [s for (e, s) in self.leases if e == epoch and self.live_lease(e, s, now) is None]


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
        self._tail = LogTail(self.path)
        self._cursor: dict[int, int] = {}  # epoch → index into `order`

    def _ensure_dir(self) -> None:
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
        self._ensure_dir()
        return exclusive_lock(
            self.dir / LOCK_NAME,
            f"{self.dir / LOCK_NAME}: another process held the consumer lock for "
            f"{self.lock_wait:.0f} s; is one stuck?",
            wait=self.lock_wait,
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
        timeout: float,
        now: float | None = None,
    ) -> list[str]:
        """Lease up to ``count`` available samples of ``epoch`` to ``owner`` (rank
        ``rank``) for ``timeout`` seconds; ``present``: ids the dataset still holds."""
        with self._locked():
            self.refresh()
            now = time.time() if now is None else now
            records: list[dict[str, Any]] = []
            if owner in self.state.void:
                raise DatasetError(
                    f"consumer {self.name!r} rank {rank}: another process started as this "
                    "rank after this one (its leases are void): run one process per rank"
                )
            if owner not in self.state.ranks:
                records.append({"op": "start", "owner": owner, "rank": rank, "time": now})
                self.state.apply(records[-1], str(self.path))  # voids before picking
            picked = self._pick(epoch, order, present, count, now)
            until = now + timeout
            if picked:
                lease = {"op": "lease", "owner": owner, "rank": rank, "epoch": epoch}
                records.append(lease | {"ids": picked, "until": until})
            elif records:
                records.append({"op": "renew", "owner": owner, "until": until})
            if records:
                self._append(records)
        return picked

    def _pick(
        self, epoch: int, order: Sequence[str], present: Ids, count: int, now: float
    ) -> list[str]:
        state = self.state
        picked = [s for s in state.lapsed(epoch, now) if s in present][:count]
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

    def ack(self, *, owner: str, epoch: int, ids: Iterable[str]) -> list[str]:
        """Record the acknowledgement of ``ids`` durably; the ids newly acknowledged."""
        wanted = list(dict.fromkeys(map(str, ids)))
        with self._locked():
            self.refresh()
            fresh = [s for s in wanted if not self.state.is_acked(epoch, s)]
            records = [
                {"op": "ack", "owner": owner, "epoch": epoch, "ids": chunk}
                for chunk in _chunks(wanted)
            ]
            if records:
                self._append(records)
        return fresh

    def release(self, *, owner: str, epoch: int, ids: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(map(str, ids)))
        if not wanted:
            return
        with self._locked():
            self.refresh()
            line = {"op": "release", "owner": owner, "epoch": epoch}
            self._append([line | {"ids": chunk} for chunk in _chunks(wanted)])

    def renew(self, *, owner: str, until: float) -> None:
        with self._locked():
            self.refresh()
            self._append([{"op": "renew", "owner": owner, "until": until}])


def _chunks(ids: list[str]) -> list[list[str]]:
    return [ids[i : i + MAX_IDS_PER_LINE] for i in range(0, len(ids), MAX_IDS_PER_LINE)]


def consumer_names(out_dir: Path) -> list[str]:
    """Every consumer that has a log in ``out_dir`` (registered or not)."""
    base = out_dir / CONSUMERS_DIR
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if valid_ns(p.name) and (p / LOG_NAME).is_file())
