"""``hsx serve``'s side of the fenced wire (PROTOCOL §6.4, version 6), on the server object
itself (no sockets: the HTTP layer is tests/dataset/live/test_serve.py's): remote owners
kept alive by their heartbeats on serve's monotonic clock, fenced acks and files, answers
that survive a restart, a long poll that holds no lock, and bounds on holders and
consumers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from hsx_async.dataset.live import serve as serve_module
from hsx_async.dataset.live import sources as sources_module
from hsx_async.dataset.live.ledger import LOST, NOT_LEASED, LeaseLost, OwnerVoid
from hsx_async.dataset.live.registry import ACKED, Registry, record_registry
from hsx_async.dataset.live.serve import Busy, LiveServer
from hsx_async.dataset.manifest import read_manifest
from hsx_async.errors import DatasetError
from tests.dataset.live.test_dataset import mark_input
from tests.dataset_factory import write_dataset

pytestmark = pytest.mark.timeout(60)
A, B, A2 = "a" * 16, "b" * 16, "c" * 16


def _call(n: int) -> str:
    return f"{n:016x}"


def _lease(owner: str, call: int, *, rank: int = 0, count: int = 2, wait: float = 0.0,
           timeout: float = 5.0, consumer: str = "train") -> dict[str, Any]:  # fmt: skip
    return {"consumer": consumer, "owner": owner, "call": _call(call), "rank": rank,
            "epoch": 0, "count": count, "timeout": timeout, "wait": wait}  # fmt: skip


def _ack(owner: str, call: int, ids: list[str], **extra: Any) -> dict[str, Any]:
    body = {"consumer": "train", "owner": owner, "call": _call(call), "epoch": 0, "ids": ids}
    return body | extra


def _ids(answer: dict[str, Any]) -> list[str]:
    return [str(e["id"]) for e in answer["entries"]]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    write_dataset(tmp_path, num_samples=6)
    mark_input(tmp_path, 6)
    return tmp_path


async def test_a_silent_owner_s_leases_end_and_a_returning_one_is_refused(out: Path) -> None:
    """Issue 37 (4): a paused rank's samples went to another rank, which acknowledged and
    deleted them; the paused rank then crashed on the missing file. Now: its leases end
    after its timeout on serve's clock, its file request is refused as lost (410, skipped
    by the reader), and so is its ack."""
    server = LiveServer(out)
    mine = _ids(await server.lease(_lease(A, 1, timeout=2.0)))
    assert server.lapse(time.monotonic() + 1.0) == 0  # heard within its timeout: alive
    assert server.lapse(time.monotonic() + 3.0) == 1  # silent for longer: let go
    taken = _ids(await server.lease(_lease(B, 2, rank=1)))
    assert taken == mine
    entry = next(e for e in read_manifest(out) if str(e.id) == mine[0])
    query = {"path": entry.path, "consumer": "train", "owner": A, "epoch": "0"}
    with pytest.raises(LeaseLost):
        await server.sample_file(query)
    assert (await server.sample_file(query | {"owner": B}))[1] == entry
    answer = await server.ack(_ack(A, 3, mine))
    assert answer["acked"] == 0 and answer["refused"] == dict.fromkeys(mine, LOST)
    server.close()


async def test_a_heartbeat_keeps_a_paused_reader_s_samples(out: Path) -> None:
    server = LiveServer(out)
    mine = _ids(await server.lease(_lease(A, 1, timeout=2.0)))
    for n in range(3):  # the reader's thread beats while its training loop is paused
        await server.renew({"consumer": "train", "owner": A, "call": _call(10 + n), "timeout": 2})
        assert server.lapse(time.monotonic() + 1.5) == 0
    assert not set(mine) & set(_ids(await server.lease(_lease(B, 2, rank=1, count=6))))
    server.close()


async def test_a_replaced_owner_is_refused_on_every_call(out: Path) -> None:
    server = LiveServer(out)
    mine = _ids(await server.lease(_lease(A, 1)))
    await server.lease(_lease(A2, 2))  # the rank's next process
    for call in (server.ack(_ack(A, 3, mine)), server.lease(_lease(A, 4))):
        with pytest.raises(OwnerVoid):
            await call
    with pytest.raises(OwnerVoid):
        await server.renew({"consumer": "train", "owner": A, "call": _call(5), "timeout": 5})
    server.close()


async def test_a_peer_can_acknowledge_only_what_it_holds(out: Path) -> None:
    server = LiveServer(out)
    theirs = _ids(await server.lease(_lease(A, 1)))
    answer = await server.ack(_ack(B, 2, theirs))
    assert answer["acked"] == 0 and answer["refused"] == dict.fromkeys(theirs, NOT_LEASED)
    assert (await server.ack(_ack(A, 3, theirs)))["acked"] == 2
    server.close()


async def test_a_restarted_serve_answers_a_repeated_lease_with_its_samples(out: Path) -> None:
    """Issue 37 (5): serve SIGKILLed after it recorded a lease and before the reader got
    the answer; the restarted serve handed the retried call other samples."""
    first = LiveServer(out)
    recorded = _ids(await first.lease(_lease(A, 7)))
    first.close()  # its answer is lost with it
    second = LiveServer(out)
    assert await second.adopt_served_owners() == 1  # A's leases are held for A's timeout
    assert _ids(await second.lease(_lease(A, 7))) == recorded
    assert not set(recorded) & set(_ids(await second.lease(_lease(B, 8, rank=1, count=6))))
    second.close()


async def test_a_waiting_lease_does_not_hold_up_an_ack(out: Path) -> None:
    """Issue 37 (6): each waiting lease held the consumer's lock for its whole poll, so
    rank 0's ack waited 27.4 s behind six long polls."""
    server = LiveServer(out)
    mine = _ids(await server.lease(_lease(A, 1, count=6)))
    waiting = [
        asyncio.create_task(server.lease(_lease(f"{n:x}" * 16, 100 + n, rank=1 + n, wait=8.0)))
        for n in range(1, 7)
    ]
    await asyncio.sleep(0.3)  # let every poll start waiting (not a synchronisation)
    started = time.monotonic()
    assert (await server.ack(_ack(A, 2, mine)))["acked"] == 6
    assert time.monotonic() - started < 2.0  # behind no poll (each waits 8 s)
    answers = await asyncio.gather(*waiting)
    assert all(a["ended"] and not a["entries"] for a in answers)
    server.close()


async def test_holders_and_consumers_are_bounded(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37 (7): 2,000 leases with fresh owner ids grew serve by 195 MiB, never
    forgotten; 300 fresh consumer names made 300 directories."""
    monkeypatch.setattr(serve_module, "MAX_HOLDERS", 3)
    monkeypatch.setattr(sources_module, "MAX_CONSUMERS", 2)
    server = LiveServer(out)
    for n in range(3):
        await server.lease(_lease(f"{n + 1:x}" * 16, n, rank=n, count=1, timeout=1.0))
    with pytest.raises(Busy, match="3 live readers"):
        await server.lease(_lease("e" * 16, 9, rank=5, count=1))
    assert server.lapse(time.monotonic() + 2.0) == 3  # forgotten once silent
    assert not server.consumers["train"].holders
    await server.lease(_lease("e" * 16, 10, rank=5, count=1))  # room again
    await server.lease(_lease(A, 11, consumer="eval", count=1))
    with pytest.raises(DatasetError, match="has 2 consumers already"):
        await server.lease(_lease(A, 12, consumer="third", count=1))
    assert not (out / "consumers" / "third").exists()
    record_registry(out, Registry(ACKED, ("train",), 0), retired=0)
    with pytest.raises(DatasetError, match="'eval' is not registered"):
        await server.lease(_lease(B, 13, consumer="eval", count=1))
    server.close()


def test_serve_refuses_a_directory_that_is_no_dataset(tmp_path: Path) -> None:
    """Issue 39 (2.2): hsx serve on a directory that is no dataset started without a word."""
    (tmp_path / "notes.txt").write_text("not a dataset")
    with pytest.raises(DatasetError, match="is not an hsx dataset"):
        LiveServer(tmp_path)
    (tmp_path / "empty").mkdir()
    LiveServer(tmp_path / "empty").close()  # an empty one is waited for (hsx run not started)


async def test_a_file_deleted_after_its_lease_went_elsewhere_is_lost_not_missing(out: Path) -> None:
    """The soak's find: a reader paused past its timeout asked for a file that the owner
    its lease went to had acknowledged (and the spool deleted): 404 crashed it; 410 makes
    it skip the sample."""
    record_registry(out, Registry(ACKED, ("train",), 0), retired=0)
    server = LiveServer(out)
    mine = _ids(await server.lease(_lease(A, 1, timeout=1.0)))
    assert server.lapse(time.monotonic() + 2.0) == 1
    assert _ids(await server.lease(_lease(B, 2, rank=1))) == mine
    assert (await server.ack(_ack(B, 3, mine)))["acked"] == 2  # retired: deleted
    entry = next(e for e in read_manifest(out, retired=True) if str(e.id) == mine[0])
    assert not (out / entry.path).exists()
    with pytest.raises(LeaseLost, match="deleted"):
        await server.sample_file(
            {"path": entry.path, "consumer": "train", "owner": A, "epoch": "0"}
        )
    server.close()
