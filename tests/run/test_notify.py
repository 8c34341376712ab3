"""The systemd notify client against real AF_UNIX datagram sockets."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hsx_async.run.notify import (
    Notifier,
    parse_address,
    parse_watchdog_usec,
    watchdog_loop,
)


def _bind(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    # Datagrams are queued before sendto returns, so a blocking recv never waits long;
    # the timeout only turns a missing message into a failure instead of a hang.
    sock.settimeout(5)
    return sock


def _pending(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued, without waiting for more."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(5)
    return out


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    path = tmp_path / "notify.sock"
    assert len(str(path).encode()) < 108, "tmp_path too long for an AF_UNIX address"
    return path


@pytest.fixture
def receiver(sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """systemd's end: a datagram socket named by NOTIFY_SOCKET."""
    sock = _bind(str(sock_path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (Notifier.ready, b"READY=1"),
        (Notifier.watchdog, b"WATCHDOG=1"),
        (Notifier.stopping, b"STOPPING=1"),
    ],
)
def test_state_messages_are_exact(
    receiver: socket.socket, call: Callable[[Notifier], None], expected: bytes
) -> None:
    notifier = Notifier.from_env()
    assert notifier.enabled
    call(notifier)
    assert _pending(receiver) == [expected]
    notifier.close()


def test_status_is_one_line(receiver: socket.socket) -> None:
    notifier = Notifier.from_env()
    notifier.status("1,200/9,000 samples\n3 quarantined")
    notifier.status("shard 2/8: waiting for server")
    assert _pending(receiver) == [
        b"STATUS=1,200/9,000 samples 3 quarantined",
        b"STATUS=shard 2/8: waiting for server",
    ]
    notifier.close()


def test_reloading_carries_monotonic_time(receiver: socket.socket) -> None:
    notifier = Notifier.from_env()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    [message] = _pending(receiver)
    m = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", message)
    assert m is not None, message
    assert before <= int(m.group(1)) <= after
    notifier.close()


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"hsx-test-{uuid.uuid4().hex}"
    sock = _bind("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = Notifier.from_env()
        notifier.ready()
        assert _pending(sock) == [b"READY=1"]
        notifier.close()
    finally:
        sock.close()


def test_unset_env_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    for call in (notifier.ready, notifier.watchdog, notifier.stopping, notifier.reloading):
        call()
    notifier.status("anything")
    assert notifier.send("READY=1") is False


@pytest.mark.parametrize("value", ["relative/notify.sock", "@", "vsock:2:1234", "/" + "x" * 120])
def test_unusable_address_disables(
    value: str, monkeypatch: pytest.MonkeyPatch, fresh_structlog: None
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    with capture_logs() as logs:
        notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.send("READY=1") is False
    assert [e["event"] for e in logs] == ["notify_socket_unusable"]


def test_parse_address() -> None:
    assert parse_address("/run/systemd/notify") == "/run/systemd/notify"
    assert parse_address("@/org/freedesktop/systemd1/notify/42") == (
        "\0/org/freedesktop/systemd1/notify/42"
    )


def test_missing_socket_file_does_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_structlog: None
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    notifier = Notifier.from_env()
    assert notifier.enabled
    with capture_logs() as logs:
        notifier.ready()
        notifier.status("still running")
        assert notifier.send("WATCHDOG=1") is False
    assert [e["event"] for e in logs] == ["notify_send_failed"] * 3
    assert {e["log_level"] for e in logs} == {"debug"}
    notifier.close()


def test_receiver_gone_then_back(sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ECONNREFUSED while nobody listens; works again once the socket is re-created."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
    sock = _bind(str(sock_path))
    notifier = Notifier.from_env()
    assert notifier.send("READY=1")
    sock.close()  # the file stays, nobody reads it: connection refused
    assert notifier.send("WATCHDOG=1") is False
    sock_path.unlink()
    sock = _bind(str(sock_path))
    try:
        assert notifier.send("WATCHDOG=1")
        assert _pending(sock) == [b"WATCHDOG=1"]
    finally:
        sock.close()
        notifier.close()


def test_full_receiver_never_blocks(receiver: socket.socket) -> None:
    """A receiver that stopped reading: sends fail fast (EAGAIN) instead of blocking."""
    notifier = Notifier.from_env()
    results = [notifier.send(f"STATUS={i}") for i in range(5000)]
    assert results[0] is True
    assert False in results  # the queue filled up; each failed send returned at once
    queued = _pending(receiver)
    assert queued[0] == b"STATUS=0"
    assert len(queued) == results.index(False)
    assert notifier.send("READY=1")  # drained: sending works again
    assert _pending(receiver) == [b"READY=1"]
    notifier.close()


def _fill(notifier: Notifier) -> int:
    """Send STATUS lines until the receiver's queue is full; how many went through."""
    for sent in range(5000):
        if not notifier.send(f"STATUS=filler {sent}"):
            return sent
    pytest.fail("the receiver's queue never filled")


def test_state_change_lost_to_a_full_queue_is_resent(receiver: socket.socket) -> None:
    """A dropped READY=1 would make systemd kill the service at TimeoutStartSec."""
    notifier = Notifier.from_env()
    queued = _fill(notifier)
    notifier.ready()  # EAGAIN: kept
    assert len(_pending(receiver)) == queued
    notifier.watchdog()
    assert _pending(receiver) == [b"READY=1", b"WATCHDOG=1"]
    notifier.watchdog()  # sent once only
    assert _pending(receiver) == [b"WATCHDOG=1"]
    notifier.close()


def test_only_the_latest_state_change_is_resent(receiver: socket.socket) -> None:
    notifier = Notifier.from_env()
    _fill(notifier)
    notifier.ready()
    notifier.stopping()
    _pending(receiver)
    notifier.status("draining")
    assert _pending(receiver) == [b"STOPPING=1", b"STATUS=draining"]
    notifier.close()


def test_close_makes_a_last_try_at_a_pending_state(receiver: socket.socket) -> None:
    notifier = Notifier.from_env()
    _fill(notifier)
    notifier.stopping()
    _pending(receiver)
    notifier.close()
    assert _pending(receiver) == [b"STOPPING=1"]
    notifier.close()  # nothing pending any more
    assert _pending(receiver) == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "120000000"}, 120_000_000),
        ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "{pid}"}, 120_000_000),
        ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_PID": "{pid}"}, None),
        ({}, None),
    ],
)
def test_parse_watchdog_usec(env: dict[str, str], expected: int | None) -> None:
    pid = os.getpid()
    resolved = {k: v.format(pid=pid) for k, v in env.items()}
    assert parse_watchdog_usec(resolved, pid) == expected


def test_watchdog_interval_is_half_of_watchdog_sec(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_env()
    assert notifier.watchdog_interval == 60.0
    assert notifier.ping_interval(30.0) == 30.0
    assert notifier.ping_interval(300.0) == 60.0


def test_watchdog_of_another_process_is_ignored(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    notifier = Notifier.from_env()
    assert notifier.enabled
    assert notifier.watchdog_interval is None
    assert notifier.ping_interval(30.0) == 30.0


# --- watchdog_loop ----------------------------------------------------------------------


class _Stop(Exception):
    """Raised by the fake sleep to end the loop after a set number of rounds."""


class _FakeSleep:
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) == self.rounds:
            raise _Stop


async def test_watchdog_loop_pings_and_reports(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    notifier = Notifier.from_env()
    sleep = _FakeSleep(rounds=3)
    counter = iter(range(1, 100))
    with pytest.raises(_Stop):
        await watchdog_loop(notifier, 10.0, lambda: f"{next(counter)} done", sleep=sleep)
    assert sleep.delays == [10.0, 10.0, 10.0]
    assert _pending(receiver) == [
        b"WATCHDOG=1",
        b"STATUS=1 done",
        b"WATCHDOG=1",
        b"STATUS=2 done",
        b"WATCHDOG=1",
        b"STATUS=3 done",
    ]
    notifier.close()


async def test_watchdog_loop_asks_for_its_interval_every_round(receiver: socket.socket) -> None:
    """A reload changes daemon.progress_interval; the next sleep already uses it."""
    notifier = Notifier.from_env()
    sleep = _FakeSleep(rounds=3)
    interval = {"s": 5.0}

    def status() -> str:
        if len(sleep.delays) == 1:  # the second round: a reload shortened the interval
            interval["s"] = 0.5
        return "x"

    with pytest.raises(_Stop):
        await watchdog_loop(notifier, lambda: interval["s"], status, sleep=sleep)
    assert sleep.delays == [5.0, 0.5, 0.5]
    notifier.close()


async def test_watchdog_loop_without_watchdog_only_reports(receiver: socket.socket) -> None:
    notifier = Notifier.from_env()
    sleep = _FakeSleep(rounds=2)
    with pytest.raises(_Stop):
        await watchdog_loop(notifier, 30.0, lambda: "idle", sleep=sleep)
    assert _pending(receiver) == [b"STATUS=idle", b"STATUS=idle"]
    notifier.close()


async def test_watchdog_loop_survives_a_failing_status(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch, fresh_structlog: None
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    notifier = Notifier.from_env()

    def broken() -> str:
        raise RuntimeError("progress line bug")

    with capture_logs() as logs, pytest.raises(_Stop):
        await watchdog_loop(notifier, 1.0, broken, sleep=_FakeSleep(rounds=2))
    assert _pending(receiver) == [b"WATCHDOG=1", b"WATCHDOG=1"]
    assert [e["event"] for e in logs] == ["notify_status_failed"] * 2
    notifier.close()


async def test_watchdog_loop_returns_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    sleep = _FakeSleep(rounds=1)
    await watchdog_loop(Notifier.from_env(), 5.0, lambda: "x", sleep=sleep)
    assert sleep.delays == []


async def test_watchdog_loop_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        await watchdog_loop(Notifier(None), 0.0, lambda: "x")


async def test_watchdog_loop_in_a_task_group_is_cancellable(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real asyncio.sleep: the first ping arrives, cancelling ends the task."""
    monkeypatch.setenv("WATCHDOG_USEC", "3600000000")
    notifier = Notifier.from_env()
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watchdog_loop(notifier, 3600.0, lambda: "running"))
        assert await loop.sock_recv(receiver, 4096) == b"WATCHDOG=1"
        assert await loop.sock_recv(receiver, 4096) == b"STATUS=running"
        task.cancel()
    assert task.cancelled()
    notifier.close()
