"""The durable consumer state (PROTOCOL §6, version 6): leases that follow their owner's
life, fenced acknowledgements, the versioned registry and the spool's retirement, without
a run (samples written as the pipeline writes them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.inspection import dataset_status
from hsx_async.dataset.live.ledger import (
    LOST,
    NOT_LEASED,
    UNKNOWN,
    ConsumerLog,
    ConsumerState,
    OwnerVoid,
)
from hsx_async.dataset.live.owners import OwnerHold, alive
from hsx_async.dataset.live.registry import (
    ACKED,
    KEEP,
    Registry,
    dataset_identity,
    read_registry,
    record_registry,
)
from hsx_async.dataset.live.retire import Retirer, finish_retirement, read_retired
from hsx_async.dataset.live.view import spool_lines
from hsx_async.dataset.manifest import RETIRED, load_done, read_manifest
from hsx_async.errors import DatasetError
from hsx_async.units import human_bytes
from tests.dataset_factory import write_dataset

OWNER_A, OWNER_B, OWNER_A2 = "a" * 16, "b" * 16, "c" * 16
ORDER = [f"s{i:04d}" for i in range(6)]
PRESENT = frozenset(ORDER)


class Owners:
    """Owners kept alive by this test (as their processes would), killed at will."""

    def __init__(self, root: Path, consumer: str = "train") -> None:
        self.dir = root / "consumers" / consumer
        self.holds: dict[str, OwnerHold] = {}

    def start(self, *owners: str) -> None:
        for owner in owners:
            self.holds[owner] = OwnerHold(self.dir, owner)

    def kill(self, owner: str) -> None:
        self.holds.pop(owner).close()

    def close(self) -> None:
        for hold in self.holds.values():
            hold.close()


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[Owners]:
    found = Owners(tmp_path)
    found.start(OWNER_A, OWNER_B, OWNER_A2)
    yield found
    found.close()


def _lease(
    log: ConsumerLog, owner: str, rank: int, count: int, *, call: str | None = None
) -> list[str]:
    return log.lease(owner=owner, rank=rank, epoch=0, order=ORDER, present=PRESENT, count=count,
                     call=call)  # fmt: skip


def _take(root: Path, consumer: str, owner: str, ids: list[str]) -> None:
    """``owner`` (alive: a hold of this test) leases ``ids`` (the whole order) and acks them."""
    hold = OwnerHold(root / "consumers" / consumer, owner)
    log = ConsumerLog(root, consumer)
    log.lease(owner=owner, rank=0, epoch=0, order=ids, present=set(ids), count=len(ids))
    log.ack(owner=owner, epoch=0, ids=ids)
    hold.close()


def test_two_ranks_never_lease_one_sample(tmp_path: Path, owners: Owners) -> None:
    a, b = ConsumerLog(tmp_path, "train"), ConsumerLog(tmp_path, "train")
    first = _lease(a, OWNER_A, 0, 4)
    second = _lease(b, OWNER_B, 1, 4)
    assert first == ORDER[:4] and second == ORDER[4:]
    assert _lease(a, OWNER_A, 0, 4) == []  # everything is leased


def test_an_acknowledged_sample_never_comes_back(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 3)
    log.ack(owner=OWNER_A, epoch=0, ids=got[:2])
    owners.kill(OWNER_A)  # its process dies: only the unacknowledged one returns, to anyone
    again = _lease(ConsumerLog(tmp_path, "train"), OWNER_B, 1, 10)
    assert got[2] in again and not set(got[:2]) & set(again)
    assert sorted(again) == sorted(set(ORDER) - set(got[:2]))


def test_a_lease_lasts_while_its_owner_lives_whatever_the_clocks(
    tmp_path: Path, owners: Owners
) -> None:
    """Issue 37 (4): leases lived on wall-clock time — a reader 700 s ahead took every live
    lease of another rank, a rank paused past lease_timeout lost its samples. Now no clock
    decides: a live owner keeps its samples for as long as it lives, and a dead one's come
    back at once."""
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2)
    other = ConsumerLog(tmp_path, "train")
    assert not set(got) & set(_lease(other, OWNER_B, 1, 10))  # however long A pauses
    owners.kill(OWNER_A)
    owners.kill(OWNER_B)
    owners.start(OWNER_B)  # B's process lives again, A's does not
    assert set(got) <= set(_lease(ConsumerLog(tmp_path, "train"), OWNER_B, 1, 10))
    assert not alive(owners.dir, OWNER_A) and alive(owners.dir, OWNER_B)


def test_a_restarted_rank_gets_its_samples_back_at_once(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 3)
    log.ack(owner=OWNER_A, epoch=0, ids=got[:1])
    restarted = ConsumerLog(tmp_path, "train")
    again = _lease(restarted, OWNER_A2, 0, 2)
    assert again == got[1:]  # lapsed first, in lease order, though A still lives
    # The old incarnation, still running, is told rather than silently sharing the rank.
    with pytest.raises(OwnerVoid, match="replaced by a newer one of its rank"):
        _lease(log, OWNER_A, 0, 1)


def test_a_replaced_owner_s_acks_are_refused(tmp_path: Path, owners: Owners) -> None:
    """Issue 37 (2): the old process's ack of 8 samples got 200 and deleted samples the new
    process never received."""
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 4)
    _lease(ConsumerLog(tmp_path, "train"), OWNER_A2, 0, 4)  # the rank's new process
    with pytest.raises(OwnerVoid):
        log.ack(owner=OWNER_A, epoch=0, ids=got)
    assert not ConsumerLog(tmp_path, "train").refresh().acked


def test_only_the_holder_acknowledges(tmp_path: Path, owners: Owners) -> None:
    """Issue 37 (2): any id could be acknowledged — never leased, another rank's, not yet
    written."""
    log = ConsumerLog(tmp_path, "train")
    mine, theirs = _lease(log, OWNER_A, 0, 2), _lease(log, OWNER_B, 1, 2)
    result = log.ack(owner=OWNER_A, epoch=0, ids=[*mine, theirs[0], ORDER[5], "ghost"],
                     known=PRESENT)  # fmt: skip
    assert result.acked == mine
    assert result.refused == {theirs[0]: NOT_LEASED, ORDER[5]: NOT_LEASED, "ghost": UNKNOWN}
    assert ConsumerLog(tmp_path, "train").refresh().acked == {0: set(mine)}


def test_a_lease_lost_while_away_is_refused_and_goes_to_the_new_holder(
    tmp_path: Path, owners: Owners
) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2)
    owners.kill(OWNER_A)  # not heard from: serve let go of it
    taken = _lease(ConsumerLog(tmp_path, "train"), OWNER_B, 1, 2)
    assert taken == got
    owners.start(OWNER_A)  # back (SIGCONT)
    assert log.ack(owner=OWNER_A, epoch=0, ids=got).refused == dict.fromkeys(got, LOST)
    assert not log.holds(OWNER_A, 0, got[0]) and log.holds(OWNER_B, 0, got[0])


def test_a_checkpoint_s_samples_are_acknowledged_for_the_process_they_went_to(
    tmp_path: Path, owners: Owners
) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 3)
    owners.kill(OWNER_A)
    # The restarted rank acknowledges what A's checkpoint holds, and nothing else.
    result = log.ack(owner=OWNER_A2, epoch=0, ids=[*got[:2], ORDER[4]], adopted_from=OWNER_A)
    assert result.acked == got[:2] and result.refused == {ORDER[4]: NOT_LEASED}


def test_a_repeated_call_gets_its_samples_again_after_a_restart(
    tmp_path: Path, owners: Owners
) -> None:
    """Issue 37 (5): serve killed after it recorded a lease and before the reader got the
    answer: the retried call got other samples and the first stayed leased for ever."""
    call = "c" * 16
    first = _lease(ConsumerLog(tmp_path, "train"), OWNER_A, 0, 2, call=call)
    again = _lease(ConsumerLog(tmp_path, "train"), OWNER_A, 0, 2, call=call)  # a new process
    assert again == first
    assert _lease(ConsumerLog(tmp_path, "train"), OWNER_A, 0, 2, call="d" * 16) == ORDER[2:4]


def test_a_second_ack_is_counted_not_applied(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2)
    assert log.ack(owner=OWNER_A, epoch=0, ids=got).acked == got
    assert log.ack(owner=OWNER_A, epoch=0, ids=got).again == got
    state = ConsumerLog(tmp_path, "train").refresh()
    assert state.acked[0] == set(got) and state.duplicate_acks == 2


def test_a_released_sample_is_available_again(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2)
    log.release(owner=OWNER_A, epoch=0, ids=got[1:])
    assert _lease(ConsumerLog(tmp_path, "train"), OWNER_B, 1, 1) == got[1:]


def test_a_released_sample_comes_back_through_the_same_log(tmp_path: Path, owners: Owners) -> None:
    """One process (hsx serve) leasing for many owners through one log: a sample released
    behind its cursor is offered again (it was lost until serve restarted)."""
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 6)
    log.release(owner=OWNER_A, epoch=0, ids=got[:3])
    assert _lease(log, OWNER_B, 1, 6) == got[:3]
    log.release(owner=OWNER_B, epoch=0, ids=got[:1])
    log.ack(owner=OWNER_A, epoch=0, ids=got[3:])
    assert _lease(log, OWNER_B, 1, 6) == got[:1]


def test_epochs_are_counted_apart(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 6)
    log.ack(owner=OWNER_A, epoch=0, ids=got)
    epoch1 = log.lease(owner=OWNER_A, rank=0, epoch=1, order=ORDER, present=PRESENT, count=6)
    assert epoch1 == ORDER


def test_a_torn_line_is_cut_and_a_corrupt_one_named(tmp_path: Path, owners: Owners) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 1)
    with log.path.open("ab") as fh:
        fh.write(b'{"op": "ack", "owner": "aaaa')  # a crash mid-append: never acknowledged
    assert ConsumerLog(tmp_path, "train").refresh().leases  # the torn tail is not read
    log.ack(owner=OWNER_A, epoch=0, ids=got)  # the next append cuts it first
    assert ConsumerLog(tmp_path, "train").refresh().acked[0] == set(got)
    with log.path.open("ab") as fh:
        fh.write(b"not json\n")
    with pytest.raises(DatasetError, match=r"log\.jsonl:4 is not valid JSON"):
        ConsumerLog(tmp_path, "train").refresh()


def test_state_replays_a_log_exactly() -> None:
    state = ConsumerState()
    lines = [
        {"op": "start", "owner": OWNER_A, "rank": 0},
        {"op": "lease", "owner": OWNER_A, "rank": 0, "epoch": 0, "ids": ["x", "y"], "until": 5.0},
        {"op": "renew", "owner": OWNER_A, "until": 9.0},  # version 5: read, ignored
        {"op": "ack", "owner": OWNER_A, "epoch": 0, "ids": ["x"]},
        {"op": "start", "owner": OWNER_B, "rank": 0},
    ]
    for n, rec in enumerate(lines):
        state.apply(rec, f"line {n}")
    assert state.acked == {0: {"x"}}
    assert state.live_lease(0, "y", lambda _: True) is None  # the rank started again: void
    assert state.lapsed(0, lambda _: True) == ["y"]
    with pytest.raises(DatasetError, match="ack line is missing"):
        state.apply({"op": "ack"}, "line 9")
    with pytest.raises(DatasetError, match="not a consumer-log line"):
        state.apply({"op": "dance"}, "line 10")


def test_bad_consumer_names_are_refused(tmp_path: Path) -> None:
    for name in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(DatasetError, match="must match"):
            ConsumerLog(tmp_path, name)


def test_registry_is_versioned_and_a_late_consumer_is_refused(tmp_path: Path) -> None:
    assert read_registry(tmp_path) is None
    reg = Registry(ACKED, ("a", "b"), 1 << 20)
    assert record_registry(tmp_path, reg, retired=0).version == 1
    assert read_registry(tmp_path) == Registry(ACKED, ("a", "b"), 1 << 20, 1)
    assert record_registry(tmp_path, reg, retired=0).version == 1  # same rules, same version
    grown = record_registry(tmp_path, Registry(ACKED, ("a", "b", "c"), 1 << 20), retired=0)
    assert grown.version == 2
    with pytest.raises(DatasetError, match="adds d, but the spool has already deleted 3"):
        record_registry(tmp_path, Registry(ACKED, ("a", "b", "c", "d"), 1 << 20), retired=3)
    record_registry(tmp_path, Registry(ACKED, ("a",), 1 << 20), retired=3)  # dropping is fine
    (tmp_path / "consumers.json").write_bytes(b"{")
    with pytest.raises(DatasetError, match="not valid JSON"):
        read_registry(tmp_path)


def test_a_version_5_registry_reads_as_its_first_version(tmp_path: Path) -> None:
    raw = {"retention": "acked", "consumers": ["a"], "spool_limit": 0}
    (tmp_path / "consumers.json").write_bytes(orjson.dumps(raw))
    assert read_registry(tmp_path) == Registry(ACKED, ("a",), 0, 1)


def test_the_identity_is_made_once(tmp_path: Path) -> None:
    first = dataset_identity(tmp_path)
    assert len(first) == 32 and dataset_identity(tmp_path) == first
    assert dataset_identity(tmp_path / "other") != first


def test_a_sample_is_retired_once_every_registered_consumer_acked_it(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=4)
    entries = read_manifest(tmp_path)
    record_registry(tmp_path, Registry(ACKED, ("a", "b"), 0), retired=0)
    retirer = Retirer(tmp_path)
    ids = [str(e.id) for e in entries]
    _take(tmp_path, "a", OWNER_A, ids[:3])
    assert retirer.retire(entries) == []  # b has none yet
    _take(tmp_path, "b", OWNER_B, ids[1:])
    retired = retirer.retire(entries)
    assert [str(e.id) for e in retired] == ids[1:3]
    assert not written[1].path.exists() and not written[2].path.exists()
    assert written[0].path.exists() and written[3].path.exists()
    assert [str(e.id) for e in read_manifest(tmp_path)] == [ids[0], ids[3]]
    assert len(read_manifest(tmp_path, retired=True)) == 4
    done = load_done(tmp_path)
    assert set(ids) <= done.ids and {str(e.id) for e in done.manifest} == {ids[0], ids[3]}
    assert set(read_retired(tmp_path)) == {written[1].entry.path, written[2].entry.path}
    assert retirer.retire(entries) == []  # idempotent


def test_retirement_follows_the_registry_in_force_not_the_one_a_reader_loaded(
    tmp_path: Path,
) -> None:
    """Issue 37 (3): drafter's reader, which loaded ["drafter"] once, deleted all 30 after
    the resumed run added "eval"; a switch to keep still deleted."""
    written = write_dataset(tmp_path, num_samples=3)
    entries = read_manifest(tmp_path)
    ids = [str(e.id) for e in entries]
    record_registry(tmp_path, Registry(ACKED, ("drafter",), 0), retired=0)
    retirer = Retirer(tmp_path)  # made under the first list
    record_registry(tmp_path, Registry(ACKED, ("drafter", "eval"), 0), retired=0)
    _take(tmp_path, "drafter", OWNER_A, ids)
    assert retirer.retire(entries) == []  # eval has none yet
    record_registry(tmp_path, Registry(KEEP, ("drafter", "eval"), 0), retired=0)
    _take(tmp_path, "eval", OWNER_B, ids)
    assert retirer.retire(entries) == []  # keep deletes nothing
    record_registry(tmp_path, Registry(ACKED, ("drafter", "eval"), 0), retired=0)
    assert len(retirer.retire(entries)) == 3  # keep → acked frees the spool
    assert not any(w.path.exists() for w in written)


def test_keep_retires_nothing_and_a_crash_mid_retirement_is_finished(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=2)
    entries = read_manifest(tmp_path)
    _take(tmp_path, "a", OWNER_A, [str(e.id) for e in entries])
    record_registry(tmp_path, Registry(KEEP, ("a",), 0), retired=0)
    assert Retirer(tmp_path).retire(entries) == []
    # A retirement whose line is durable but whose unlink never ran (killed in between).
    line = {"id": entries[0].id, "path": entries[0].path, "bytes": entries[0].size}
    (tmp_path / RETIRED).write_bytes(orjson.dumps(line) + b"\n")
    assert written[0].path.exists()
    assert finish_retirement(tmp_path) == 1
    assert not written[0].path.exists() and written[1].path.exists()
    assert finish_retirement(tmp_path) == 0


def test_status_says_the_spool_and_each_consumer_s_lag_and_leases(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=4)
    entries = read_manifest(tmp_path)
    ids = [str(e.id) for e in entries]
    assert spool_lines(tmp_path) == []  # no consumer, no spool: nothing said
    record_registry(tmp_path, Registry(ACKED, ("a", "b"), 1 << 30), retired=0)
    _take(tmp_path, "a", OWNER_A, ids[:2])
    _take(tmp_path, "b", OWNER_B, ids[:1])
    holder = Owners(tmp_path, "b")
    holder.start(OWNER_A2)
    ConsumerLog(tmp_path, "b").lease(
        owner=OWNER_A2, rank=1, epoch=0, order=ids, present=set(ids), count=2
    )
    Retirer(tmp_path).retire(entries)  # ids[0]
    held = sum(e.size for e in entries[1:])
    text = dataset_status(tmp_path).format()
    holder.close()
    assert f"{human_bytes(held)} of 1.0 GiB held, 1 samples deleted" in text
    assert "delete once a, b acknowledged (consumer list version 1)" in text
    assert "consumer:    a: 2 acknowledged, 2 behind, 0 leased now" in text
    assert "consumer:    b: 1 acknowledged, 3 behind, 2 leased now" in text
    assert "done:        4" in text  # a deleted sample is done, not missing
