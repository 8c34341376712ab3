"""The durable consumer state (PROTOCOL §6): leases, acknowledgements, the registry and
the spool's retirement, without a run (samples written as the pipeline writes them)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.inspection import dataset_status
from hsx_async.dataset.live.ledger import (
    ACKED,
    KEEP,
    ConsumerLog,
    ConsumerState,
    Registry,
    read_registry,
    record_registry,
)
from hsx_async.dataset.live.retire import Retirer, finish_retirement, read_retired, spool_lines
from hsx_async.dataset.manifest import RETIRED, load_done, read_manifest
from hsx_async.errors import DatasetError
from hsx_async.units import human_bytes
from tests.dataset_factory import write_dataset

OWNER_A, OWNER_B, OWNER_A2 = "a" * 16, "b" * 16, "c" * 16
ORDER = [f"s{i:04d}" for i in range(6)]
PRESENT = frozenset(ORDER)


def _lease(
    log: ConsumerLog, owner: str, rank: int, count: int, *, now: float, timeout: float = 10.0
) -> list[str]:
    return log.lease(owner=owner, rank=rank, epoch=0, order=ORDER, present=PRESENT, count=count,
                     timeout=timeout, now=now)  # fmt: skip


def test_two_ranks_never_lease_one_sample(tmp_path: Path) -> None:
    a, b = ConsumerLog(tmp_path, "train"), ConsumerLog(tmp_path, "train")
    first = _lease(a, OWNER_A, 0, 4, now=100.0)
    second = _lease(b, OWNER_B, 1, 4, now=100.0)
    assert first == ORDER[:4] and second == ORDER[4:]
    assert _lease(a, OWNER_A, 0, 4, now=100.0) == []  # everything is leased


def test_an_acknowledged_sample_never_comes_back(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 3, now=100.0, timeout=1.0)
    log.ack(owner=OWNER_A, epoch=0, ids=got[:2])
    # Far past every lease: only the unacknowledged one returns, to anyone.
    other = ConsumerLog(tmp_path, "train")
    again = _lease(other, OWNER_B, 1, 10, now=1e6)
    assert got[2] in again and not set(got[:2]) & set(again)
    assert sorted(again) == sorted(set(ORDER) - set(got[:2]))


def test_a_lease_lapses_after_its_timeout_and_a_renewal_extends_it(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2, now=100.0, timeout=5.0)
    other = ConsumerLog(tmp_path, "train")
    assert not set(got) & set(_lease(other, OWNER_B, 1, 10, now=104.0))
    log.renew(owner=OWNER_A, until=200.0)
    assert not set(got) & set(_lease(other, OWNER_B, 1, 10, now=150.0))  # B's own lapsed
    assert set(got) <= set(_lease(other, OWNER_B, 1, 10, now=201.0))


def test_a_restarted_rank_gets_its_samples_back_at_once(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 3, now=100.0, timeout=1e6)
    log.ack(owner=OWNER_A, epoch=0, ids=got[:1])
    restarted = ConsumerLog(tmp_path, "train")
    again = _lease(restarted, OWNER_A2, 0, 2, now=101.0, timeout=1e6)
    assert again == got[1:]  # lapsed first, in lease order, long before the timeout
    # The old incarnation, still running, is told rather than silently sharing the rank.
    with pytest.raises(DatasetError, match="another process started as this rank"):
        _lease(log, OWNER_A, 0, 1, now=102.0)


def test_a_second_ack_is_counted_not_applied(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2, now=100.0)
    assert log.ack(owner=OWNER_A, epoch=0, ids=got) == got
    assert log.ack(owner=OWNER_A, epoch=0, ids=got) == []
    state = ConsumerLog(tmp_path, "train").refresh()
    assert state.acked[0] == set(got) and state.duplicate_acks == 2


def test_a_released_sample_is_available_again(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 2, now=100.0)
    log.release(owner=OWNER_A, epoch=0, ids=got[1:])
    assert _lease(ConsumerLog(tmp_path, "train"), OWNER_B, 1, 1, now=100.0) == got[1:]


def test_epochs_are_counted_apart(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 6, now=100.0)
    log.ack(owner=OWNER_A, epoch=0, ids=got)
    epoch1 = log.lease(owner=OWNER_A, rank=0, epoch=1, order=ORDER, present=PRESENT, count=6,
                       timeout=10.0, now=100.0)  # fmt: skip
    assert epoch1 == ORDER


def test_a_torn_line_is_cut_and_a_corrupt_one_named(tmp_path: Path) -> None:
    log = ConsumerLog(tmp_path, "train")
    got = _lease(log, OWNER_A, 0, 1, now=100.0)
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
        {"op": "ack", "owner": OWNER_A, "epoch": 0, "ids": ["x"]},
        {"op": "start", "owner": OWNER_B, "rank": 0},
    ]
    for n, rec in enumerate(lines):
        state.apply(rec, f"line {n}")
    assert state.acked == {0: {"x"}}
    assert state.live_lease(0, "y", now=1.0) is None  # the rank started again: void
    assert state.lapsed(0, now=1.0) == ["y"]
    with pytest.raises(DatasetError, match="ack line is missing"):
        state.apply({"op": "ack"}, "line 9")
    with pytest.raises(DatasetError, match="not a consumer-log line"):
        state.apply({"op": "dance"}, "line 10")


def test_bad_consumer_names_are_refused(tmp_path: Path) -> None:
    for name in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(DatasetError, match="must match"):
            ConsumerLog(tmp_path, name)


def test_registry_round_trip_and_a_late_consumer_is_refused(tmp_path: Path) -> None:
    assert read_registry(tmp_path) is None
    reg = Registry(ACKED, ("a", "b"), 1 << 20)
    record_registry(tmp_path, reg, retired=0)
    assert read_registry(tmp_path) == reg
    record_registry(tmp_path, Registry(ACKED, ("a", "b", "c"), 1 << 20), retired=0)
    with pytest.raises(DatasetError, match="adds d, but the spool has already deleted 3"):
        record_registry(tmp_path, Registry(ACKED, ("a", "b", "c", "d"), 1 << 20), retired=3)
    record_registry(tmp_path, Registry(ACKED, ("a",), 1 << 20), retired=3)  # dropping is fine
    (tmp_path / "consumers.json").write_bytes(b"{")
    with pytest.raises(DatasetError, match="not valid JSON"):
        read_registry(tmp_path)


def test_a_sample_is_retired_once_every_registered_consumer_acked_it(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=4)
    entries = read_manifest(tmp_path)
    reg = Registry(ACKED, ("a", "b"), 0)
    retirer = Retirer(tmp_path, reg)
    ids = [str(e.id) for e in entries]
    ConsumerLog(tmp_path, "a").ack(owner=OWNER_A, epoch=0, ids=ids[:3])
    assert retirer.retire(entries) == []  # b has none yet
    ConsumerLog(tmp_path, "b").ack(owner=OWNER_B, epoch=0, ids=ids[1:])
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


def test_keep_retires_nothing_and_a_crash_mid_retirement_is_finished(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=2)
    entries = read_manifest(tmp_path)
    ConsumerLog(tmp_path, "a").ack(owner=OWNER_A, epoch=0, ids=[str(e.id) for e in entries])
    assert Retirer(tmp_path, Registry(KEEP, ("a",), 0)).retire(entries) == []
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
    ConsumerLog(tmp_path, "a").ack(owner=OWNER_A, epoch=0, ids=ids[:2])
    ConsumerLog(tmp_path, "b").ack(owner=OWNER_B, epoch=0, ids=ids[:1])
    ConsumerLog(tmp_path, "b").lease(
        owner=OWNER_B, rank=0, epoch=0, order=ids, present=set(ids), count=2, timeout=600
    )
    Retirer(tmp_path, Registry(ACKED, ("a", "b"), 1 << 30)).retire(entries)  # ids[0]
    held = sum(e.size for e in entries[1:])
    text = dataset_status(tmp_path).format()
    assert f"{human_bytes(held)} of 1.0 GiB held, 1 samples deleted" in text
    assert "delete once a, b acknowledged" in text
    assert "consumer:    a: 2 acknowledged, 2 behind, 0 leased now" in text
    assert "consumer:    b: 1 acknowledged, 3 behind, 2 leased now" in text
    assert "done:        4" in text  # a deleted sample is done, not missing
