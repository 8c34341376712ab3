"""``hsx serve``'s HTTP face on 127.0.0.1, for real (issue 37, items 1 and 7): only a peer
with the shared secret gets anything, on every endpoint; TLS with the reader's CA; a peer
that half-sends requests, or opens more connections than allowed, no longer starves a
trainer; bad flags are one line, exit 2; the descriptor limit is raised at start.

``hsx serve`` runs as a child process (tests/dataset/live/procs.py) where the CLI is what
is tested, in this process (:func:`serve` on port 0) where deadlines are shortened.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import re
import resource
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import torch

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset
from hsx_async.dataset.live.http import Limits, serve
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.remote import RemoteSource
from hsx_async.dataset.manifest import read_manifest
from hsx_async.errors import LiveError
from tests.dataset.live.procs import REPO, server_faults, start_consumer, start_server
from tests.dataset.live.test_dataset import mark_input
from tests.dataset_factory import write_dataset
from tests.e2e import free_port

pytestmark = pytest.mark.timeout(180)

PEERS = 1100  # half-sent requests at once, as in issue 37
SECRET = "4f1c0e9b7d2a6b3e8c5f0a1d9e7b3c2a"
ENDPOINTS = [
    ("GET", "/v1/info", b""),
    ("GET", "/metrics", b""),
    ("GET", "/v1/nothing-here", b""),
    ("POST", "/v1/lease", orjson.dumps({"consumer": "train", "owner": "ab" * 8, "call": "cd" * 8,
                                        "rank": 0, "epoch": 0, "count": 4, "timeout": 60,
                                        "wait": 0})),
    ("POST", "/v1/ack", orjson.dumps({"consumer": "train", "owner": "ab" * 8, "call": "ce" * 8,
                                      "epoch": 0, "ids": ["s0000", "s0001"]})),
    ("POST", "/v1/release", orjson.dumps({"consumer": "train", "owner": "ab" * 8,
                                          "call": "cf" * 8, "epoch": 0, "ids": ["s0000"]})),
    ("POST", "/v1/renew", orjson.dumps({"consumer": "train", "owner": "ab" * 8,
                                        "call": "d0" * 8, "timeout": 60})),
]  # fmt: skip


def secret_file(tmp_path: Path, secret: str = SECRET, mode: int = 0o600) -> Path:
    path = tmp_path / "serve.secret"
    path.write_text(secret + "\n")
    path.chmod(mode)
    return path


def dataset(tmp_path: Path, samples: int = 10, *, complete: bool = True) -> Path:
    """``samples`` written; ``complete``: extraction is over (else a lease long-polls)."""
    out = tmp_path / "out"
    write_dataset(out, num_samples=samples, hidden_size=32)
    if complete:
        mark_input(out, samples)
    return out


def _ids(out: Path) -> list[str]:
    return sorted(str(e.id) for e in read_manifest(out, retired=True))


def request(
    url: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    host, port = url.split("://")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def read_all(url: str, consumer: str = "train") -> dict[str, dict[str, torch.Tensor]]:
    """Every sample through a LiveDataset (its secret and CA from the environment),
    acknowledged as it comes."""
    live = LiveDataset(url, consumer=consumer, prefetch=2, wait_timeout=60)
    got = {}
    for sample in live:
        got[sample[HSX_ID]] = sample
        live.done(sample)
        live.ack()
    return got


# -- the secret ------------------------------------------------------------------------------


async def test_a_peer_without_the_secret_gets_401_everywhere_and_the_trainer_every_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37 item 1: a peer with only the URL could read /v1/info, lease, download and
    acknowledge every sample; the real trainer then got none."""
    out = dataset(tmp_path)
    server, url = await start_server(out, free_port(), "--secret-file", str(secret_file(tmp_path)))
    try:
        file_path = f"/v1/file?path={read_manifest(out)[0].path}"
        wrong = {"Authorization": f"Bearer {SECRET[:-1]}0"}
        for headers in ({}, wrong, {"Authorization": SECRET}, {"Authorization": "Basic eDp5"}):
            for method, path, body in [*ENDPOINTS, ("GET", file_path, b"")]:
                status, text = await asyncio.to_thread(request, url, method, path, body, headers)
                assert status == 401, (headers, path, status, text[:200])
                assert b"train" not in text and b"s0000" not in text and b"hidden" not in text
        # Nothing of it reached the logs: no lease, no ack.
        assert ConsumerLog(out, "train").refresh().acked.get(0, set()) == set()
        assert not (out / "consumers" / "train").exists()
        # A reader with a wrong secret is told at once, not after its unreachable timeout.
        bad = tmp_path / "bad.secret"
        bad.write_text("x" * 32)
        bad.chmod(0o600)
        source = RemoteSource(url, "train", secret_file=bad, unreachable_timeout=600)
        started = time.monotonic()
        with pytest.raises(LiveError, match=r"HTTP 401.*HSX_SERVE_SECRET_FILE"):
            await asyncio.to_thread(source.lease, "ab" * 8, 0, 0, 1)
        assert time.monotonic() - started < 30
        monkeypatch.delenv("HSX_SERVE_SECRET_FILE", raising=False)
        monkeypatch.delenv("HSX_SERVE_SECRET", raising=False)
        source = RemoteSource(url, "train")
        with pytest.raises(LiveError, match="it sent no secret"):
            await asyncio.to_thread(source.lease, "ab" * 8, 0, 0, 1)
        # The trainer, with the secret in its environment, gets every sample.
        monkeypatch.setenv("HSX_SERVE_SECRET_FILE", str(secret_file(tmp_path)))
        got = await asyncio.to_thread(read_all, url)
        assert sorted(got) == _ids(out)
        good = {"Authorization": f"Bearer {SECRET}"}
        status, text = await asyncio.to_thread(request, url, "GET", "/metrics", b"", good)
        assert status == 200
        [refused] = re.findall(rb"^hsx_serve_unauthorized_requests_total (\S+)", text, re.M)
        assert float(refused) >= 4 * (len(ENDPOINTS) + 1)
        assert ConsumerLog(out, "train").refresh().acked[0] == set(_ids(out))
    finally:
        await server.kill()
    assert await server_faults(server) == []
    assert not any(SECRET in line for line in server.lines)  # never logged


@pytest.mark.parametrize(
    ("secret", "mode", "says"),
    [
        (SECRET, 0o640, "chmod 600"),
        (SECRET, 0o604, "chmod 600"),
        ("short", 0o600, "at least"),
    ],
)
def test_a_secret_file_open_to_others_or_too_short_is_refused(
    tmp_path: Path, secret: str, mode: int, says: str
) -> None:
    path = secret_file(tmp_path, secret, mode)
    proc = _hsx_serve(tmp_path, "--secret-file", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and str(path) in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert secret not in proc.stderr or secret == "short"


def test_a_listen_other_nodes_reach_without_a_secret_is_refused(tmp_path: Path) -> None:
    env = {"HSX_SERVE_SECRET_FILE": "", "HSX_SERVE_SECRET": ""}
    proc = _hsx_serve(tmp_path, "--listen", f"0.0.0.0:{free_port()}", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reaches other nodes" in proc.stderr and "--secret-file" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def _hsx_serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hsx_async", "serve", str(tmp_path), *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)},
    )  # fmt: skip


# -- TLS ---------------------------------------------------------------------------------------


def self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA (the openssl CLI), and its key."""
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls_round_trip_and_a_reader_with_another_ca_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = dataset(tmp_path)
    cert, key = self_signed(tmp_path, "serve")
    other, _ = self_signed(tmp_path, "other")
    secret = secret_file(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    server, url = await start_server(out, free_port(), "--secret-file", str(secret), *tls)
    try:
        assert url.startswith("https://127.0.0.1:")
        local = {s[HSX_ID]: s for s in LiveDataset(out, consumer="check")}
        monkeypatch.setenv("HSX_SERVE_SECRET_FILE", str(secret))
        monkeypatch.setenv("HSX_SERVE_CA_FILE", str(cert))
        got = await asyncio.to_thread(read_all, url)
        assert sorted(got) == sorted(local) == _ids(out)
        for key_id, sample in got.items():
            for name, tensor in local[key_id].items():
                if name != HSX_ID:
                    assert torch.equal(sample[name], tensor), (key_id, name)
        # Another CA: refused at once, with what to give.
        source = RemoteSource(url, "train", secret_file=secret, ca_file=other)
        started = time.monotonic()
        with pytest.raises(LiveError, match=r"not trusted.*ca_file"):
            await asyncio.to_thread(source.lease, "ab" * 8, 0, 0, 1)
        assert time.monotonic() - started < 30
        # Plain HTTP to a TLS server is no request at all; https to a plain one is told.
        plain = url.replace("https://", "http://")
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            await asyncio.to_thread(request, plain, "GET", "/v1/info")
    finally:
        await server.kill()
    assert await server_faults(server) == []


# -- connections -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def in_process(out: Path, limits: Limits) -> AsyncIterator[tuple[str, int]]:
    """:func:`serve` in this event loop on a free port: its host and port."""
    stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(out, "127.0.0.1:0", limits=limits, stop=stop, on_bound=bound.set_result)
    )
    url = await asyncio.wait_for(bound, 30)
    try:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One HTTP answer's head, its body read past (bounded)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent until it closed the connection (bounded)."""
    return await asyncio.wait_for(reader.read(), seconds)


async def test_the_header_and_body_deadlines_cut_half_sent_requests_not_idle_readers(
    tmp_path: Path,
) -> None:
    out = dataset(tmp_path, samples=2)
    limits = Limits(header_s=0.5, body_s=0.5)
    async with in_process(out, limits) as (host, port):
        silent = await asyncio.open_connection(host, port)
        half = await asyncio.open_connection(host, port)
        half[1].write(b"POST /v1/lease HTTP/1.1\r\nHost: x\r\nContent-Le")
        short = await asyncio.open_connection(host, port)
        short[1].write(b"POST /v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        idle = await asyncio.open_connection(host, port)
        idle[1].write(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        assert await closed_within(silent[0], 10) == b""
        assert await closed_within(half[0], 10) == b""
        assert (await closed_within(short[0], 10)).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < 5  # the deadlines, not aiohttp's 60 s idle
        # An answered reader waiting for its next call is not cut by the header deadline.
        assert (await answer(idle[0])).startswith(b"HTTP/1.1 200")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(idle[0].read(1), 4 * limits.header_s)
        idle[1].write(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(idle[0].readline(), 10)).startswith(b"HTTP/1.1 200")
        for _, writer in (silent, half, short, idle):
            writer.close()


def _lease(call: str, wait: float) -> bytes:
    body = orjson.dumps({"consumer": "t", "owner": "ab" * 8, "rank": 0, "epoch": 0, "count": 1,
                         "timeout": 60, "wait": wait, "call": call * 8})  # fmt: skip
    head = f"POST /v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def test_connections_beyond_the_limit_evict_the_longest_waiting_or_are_refused(
    tmp_path: Path,
) -> None:
    out = dataset(tmp_path, samples=0, complete=False)  # nothing to lease: a lease long-polls
    async with in_process(out, Limits(max_connections=2, header_s=10.0)) as (host, port):
        opened = time.monotonic()
        old = await asyncio.open_connection(host, port)
        poll = await asyncio.open_connection(host, port)
        # At the limit: no connection has waited 2 s (0.2 × header_s) yet: refused at once.
        young = await asyncio.open_connection(host, port)
        assert await closed_within(young[0], 1) == b""
        # Later, a new one evicts the longest waiting (long before its header deadline).
        for _ in range(100):
            new = await asyncio.open_connection(host, port)
            new[1].write(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
            with contextlib.suppress(asyncio.IncompleteReadError):
                head = await answer(new[0])
                break
            new[1].close()
            await asyncio.sleep(0.05)  # a client's pace between tries, bounded by the loop
        assert head.startswith(b"HTTP/1.1 200")
        assert await closed_within(old[0], 1) == b""
        assert time.monotonic() - opened < 8
        # Every connection in a request (two long polls): one more is refused at once.
        poll[1].write(_lease("e1", 3))
        new[1].write(_lease("e2", 3))
        busy = await asyncio.open_connection(host, port)
        assert await closed_within(busy[0], 2) == b""
        for reader in (poll[0], new[0]):
            line = await asyncio.wait_for(reader.readline(), 10)
            assert line.startswith(b"HTTP/1.1 200"), line
        for _, writer in (old, poll, young, new, busy):
            writer.close()


async def test_half_sent_requests_no_longer_starve_a_trainer(tmp_path: Path) -> None:
    """Issue 37 item 7: 1,100 half-sent requests took all 1,024 descriptors and every
    trainer timed out until the peer left. The same here, each connection opened again
    when the server closes it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < PEERS + 200:
        pytest.skip(f"this process may open {hard} descriptors, the peers need {PEERS + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, PEERS + 200), hard))
    try:
        await _starve(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _starve(tmp_path: Path) -> None:
    out = dataset(tmp_path)
    server, url = await start_server(out, free_port(), "--max-connections", "48",
                                     nofile=(1024, 1024))  # fmt: skip
    output = asyncio.create_task(server.finish(timeout=170))  # its log read as it comes
    port = int(url.rsplit(":", 1)[1])
    stop = asyncio.Event()
    opened = 0

    async def peer() -> None:
        nonlocal opened
        while not stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), 5
                )
            except (OSError, TimeoutError):
                await asyncio.sleep(0.5)  # the peer's pace, not a wait
                continue
            try:
                opened += 1
                writer.write(b"POST /v1/lease HTTP/1.1\r\nHost: x\r\nContent-Len")
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(reader.read(), 150)  # until the server cuts it
            finally:
                writer.close()
            await asyncio.sleep(0.5)  # the peer's pace between connections, not a wait

    peers = [asyncio.create_task(peer()) for _ in range(PEERS)]
    try:
        for _ in range(600):
            if opened >= PEERS:
                break
            await asyncio.sleep(0.05)  # until the peers hold their connections (bounded)
        trainer = await start_consumer(url, "--wait-timeout", "60")  # a process: killable
        try:
            assert await trainer.finish(timeout=60) == 0
        finally:
            await trainer.kill()
        assert sorted(trainer.got()) == sorted(trainer.acked()) == _ids(out)
    finally:
        stop.set()
        await server.kill()  # the peers' connections end with it
        await asyncio.wait_for(asyncio.gather(*peers, output, return_exceptions=True), 30)
    assert await server_faults(server) == []


# -- flags and descriptors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-streams", "-1"], "--max-streams: is -1, expected at least 1"),
        (["--max-streams", "0"], "--max-streams: is 0, expected at least 1"),
        (["--max-connections", "0"], "--max-connections: is 0, expected at least 1"),
        (["--tls-cert", "x.pem"], "give --tls-cert and --tls-key together"),
        (["--tls-cert", "x.pem", "--tls-key", "x.key"], "cannot load x.pem"),
    ],
)
def test_bad_flags_are_one_line_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    proc = _hsx_serve(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


async def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard descriptor limit is {hard}: nothing to raise to")
    server, _ = await start_server(dataset(tmp_path, samples=1), free_port(), nofile=(256, hard))
    try:
        limits = await asyncio.to_thread(Path(f"/proc/{server.proc.pid}/limits").read_text)
        line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
        soft_now = line.split()[3]
        assert soft_now == (str(hard) if hard != resource.RLIM_INFINITY else "unlimited")
        logged = [e for e in server.events if e.get("event") == "serve_descriptors"]
        assert logged and logged[0]["soft_before"] == 256
    finally:
        await server.kill()
    assert await server_faults(server) == []


async def test_a_reader_paused_mid_download_holds_no_stream_past_its_deadline(
    tmp_path: Path,
) -> None:
    """A reader stopped mid-file (a trainer paused for a checkpoint, SIGSTOP) held one of
    the --max-streams send slots for as long as it stayed stopped: with 8 such ranks every
    file waited. Now a send is cut at its deadline and the next file goes out."""
    out = tmp_path / "out"
    write_dataset(out, num_samples=2, hidden_size=4096, lengths=[1024, 1024])
    mark_input(out, 2)
    limits = Limits(max_streams=1, send_grace_s=0.5, send_rate=64 << 20)  # 32 MiB: 1 s
    async with in_process(out, limits) as (host, port):
        paths = []
        for call in ("ab", "cd"):
            conn = await asyncio.open_connection(host, port)
            conn[1].write(_lease(call, 0))
            paths += [e["path"] for e in orjson.loads(await body(conn[0]))["entries"]]
            await _close(conn[1])
        stalled = await _get_file(host, port, paths[0])
        size = _length(await asyncio.wait_for(stalled[0].readuntil(b"\r\n\r\n"), 10))
        started = time.monotonic()
        moving = await _get_file(host, port, paths[1])
        assert len(await asyncio.wait_for(body(moving[0]), 20)) > 0
        assert time.monotonic() - started < 15  # behind the cut, not behind the pause
        got = await asyncio.wait_for(stalled[0].read(), 20)  # cut short, then closed
        assert len(got) < size
        for conn in (stalled, moving):
            await _close(conn[1])


def _length(head: bytes) -> int:
    return int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])


async def body(reader: asyncio.StreamReader) -> bytes:
    """One HTTP answer's body (its head read past), bounded in time."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b" 200 " in head.split(b"\r\n")[0], head
    return await asyncio.wait_for(reader.readexactly(_length(head)), 20)


async def _get_file(
    host: str, port: int, path: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    query = urllib.parse.urlencode({"path": path, "consumer": "t", "owner": "ab" * 8, "epoch": 0})
    conn = await asyncio.open_connection(host, port, limit=1 << 16)
    conn[1].write(f"GET /v1/file?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return conn


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


# -- metrics -----------------------------------------------------------------------------------


def _gauge(text: bytes, name: str, consumer: str) -> float:
    [value] = re.findall(rb'^%s\{consumer="%s"\} (\S+)' % (name.encode(), consumer.encode()),
                         text, re.M)  # fmt: skip
    return float(value)


async def test_metrics_say_each_consumer_s_progress_when_scraped(tmp_path: Path) -> None:
    """serve's ``hsx_consumer_*`` gauges are computed at the scrape (not on every call), from
    the logs read to their ends: a reader's acknowledgements and leases show up at once."""
    out = dataset(tmp_path, samples=6)
    async with in_process(out, Limits()) as (host, port):
        url = f"http://{host}:{port}"
        status, text = await asyncio.to_thread(request, url, "GET", "/metrics")
        assert status == 200 and b"hsx_consumer_lag_samples{" not in text  # no consumer yet
        source = RemoteSource(url, "train")
        leased = await asyncio.to_thread(source.lease, "ab" * 8, 0, 0, 4)
        ids = [str(e.id) for e in leased.entries]
        await asyncio.to_thread(source.ack, "ab" * 8, 0, ids[:3])
        _, text = await asyncio.to_thread(request, url, "GET", "/metrics")
        assert _gauge(text, "hsx_consumer_acked_samples", "train") == 3
        assert _gauge(text, "hsx_consumer_lag_samples", "train") == 3
        assert _gauge(text, "hsx_consumer_leases", "train") == 1
        await asyncio.to_thread(source.close)
