"""``hsx serve`` on 127.0.0.1, for real: remote readers get every sample exactly once and
byte for byte, through a server restart, a consumer that vanishes and a transfer cut
short; every endpoint refuses what breaks its bounds (PROTOCOL §6.4).

The server and the consumers are child processes; samples are written as the pipeline
writes them (tests/dataset_factory.py). A run and the spool together: tests/run/test_online.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import torch

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.registry import ACKED, Registry, record_registry
from hsx_async.dataset.live.remote import CACHE_PREFIX, RemoteSource
from hsx_async.dataset.manifest import read_manifest
from hsx_async.errors import DatasetError, LiveError
from tests.conftest import SHM
from tests.dataset.live.procs import Child, server_faults, start_consumer, start_server
from tests.dataset.live.test_dataset import mark_input
from tests.dataset_factory import write_dataset
from tests.e2e import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Path, str, Child]]:
    out = tmp_path / "out"
    write_dataset(out, num_samples=10, hidden_size=32)
    mark_input(out, 10)
    server, url = await start_server(out, free_port())
    try:
        yield out, url, server
    finally:
        await server.kill()
    assert await server_faults(server) == []  # no request failed inside the server


def _ids(out: Path) -> list[str]:
    return sorted(str(e.id) for e in read_manifest(out, retired=True))


async def test_remote_samples_equal_local_ones_and_ranks_split_them(
    served: tuple[Path, str, Child],
) -> None:
    out, url, _ = served
    local = {s[HSX_ID]: s for s in LiveDataset(out, consumer="check")}
    remote = await asyncio.to_thread(
        lambda: {s[HSX_ID]: s for s in LiveDataset(url, consumer="check2")}
    )
    assert sorted(remote) == sorted(local) == _ids(out)
    for key, sample in remote.items():
        for name, tensor in local[key].items():
            if name != HSX_ID:
                assert torch.equal(sample[name], tensor), (key, name)
    ranks = [await start_consumer(url, "--rank", str(r), "--world", "3") for r in range(3)]
    assert [await c.finish() for c in ranks] == [0, 0, 0]
    got = [i for c in ranks for i in c.got()]
    assert sorted(got) == _ids(out) and len(set(got)) == len(got)  # each to exactly one rank
    assert sorted(i for c in ranks for i in c.acked()) == _ids(out)


async def test_a_server_killed_and_started_again_loses_nothing(
    served: tuple[Path, str, Child],
) -> None:
    out, url, server = served
    port = int(url.rsplit(":", 1)[1])
    live = LiveDataset(url, consumer="train", prefetch=2, lease_timeout=600)
    it = iter(live)
    first = [await asyncio.to_thread(next, it) for _ in range(3)]
    live.done(first)
    await asyncio.to_thread(live.ack)
    await server.kill()
    # The reader retries through the gap: its next lease waits for the new server.
    rest_task = asyncio.create_task(asyncio.to_thread(lambda: [s[HSX_ID] for s in it]))
    again, _ = await start_server(out, port)
    try:
        rest = await asyncio.wait_for(rest_task, 60)
        live.done(rest)
        await asyncio.to_thread(live.ack)
    finally:
        await again.kill()
    assert await server_faults(again) == []
    ids = [s[HSX_ID] for s in first] + rest
    assert sorted(ids) == _ids(out) and len(set(ids)) == len(ids)
    state = ConsumerLog(out, "train").refresh()
    assert state.acked[0] == set(ids) and state.duplicate_acks == 0


async def test_a_vanished_consumer_s_samples_go_to_another_after_the_timeout(
    served: tuple[Path, str, Child],
) -> None:
    out, url, _ = served
    gone = await start_consumer(url, "--rank", "0", "--world", "2", "--prefetch", "4",
                                "--hold-after", "2", "--lease-timeout", "1.5")  # fmt: skip
    await gone.until("holding")
    await gone.kill()  # two acknowledged, two more leased and never used
    # A rank whose epoch ends while a peer's leases are live does not wait for them (the
    # peers would wait for each other's last acks): start the other once they lapsed.
    log = ConsumerLog(out, "train")
    for _ in range(200):
        if not log.refresh().held(0, log.alive.fresh()):
            break
        await asyncio.sleep(0.05)  # a poll of the log's lease times, bounded
    else:
        raise AssertionError("the killed consumer's leases never lapsed")
    other = await start_consumer(url, "--rank", "1", "--world", "2", "--lease-timeout", "1.5")
    assert await other.finish() == 0
    assert not set(gone.acked()) & set(other.got())  # nothing acknowledged comes back
    assert sorted(gone.acked() + other.got()) == _ids(out)
    # The killed reader's cache went with the next reader's; that one's with its exit.
    assert not list(SHM.glob(f"{CACHE_PREFIX}{gone.proc.pid}-*"))
    assert not list(SHM.glob(f"{CACHE_PREFIX}{other.proc.pid}-*"))


async def test_a_reader_s_cache_goes_with_close_and_a_dead_reader_s_with_the_next(
    served: tuple[Path, str, Child], tmp_path: Path
) -> None:
    _, url, _ = served
    dead = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    assert await asyncio.wait_for(dead.wait(), 60) == 0  # its pid is no one's now
    left = tmp_path / f"{CACHE_PREFIX}{dead.pid}-abc"
    left.mkdir()
    (left / ".x.safetensors").write_bytes(b"half a file")
    alive = tmp_path / f"{CACHE_PREFIX}{os.getppid()}-abc"  # a live process's: kept
    alive.mkdir()
    source = RemoteSource(url, "train", cache_dir=tmp_path)
    owner = "ab" * 8
    [entry] = (await asyncio.to_thread(source.lease, owner, 0, 0, 1)).entries
    path, temporary = await asyncio.to_thread(source.fetch, owner, 0, entry)
    assert temporary and path.stat().st_size == entry.size
    assert path.parent.name.startswith(f"{CACHE_PREFIX}{os.getpid()}-")
    assert not left.exists() and alive.is_dir()
    source.close()
    assert not path.parent.exists()


class _CuttingProxy:
    """A TCP proxy to ``port`` that cuts the first ``cuts`` file transfers short: once a
    ``GET /v1/file`` passes, the answer is cut after a few KB and the connection closed."""

    def __init__(self, port: int, cuts: int) -> None:
        self.target, self.cuts, self.cut = port, cuts, 0
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection (``Connection: close`` upstream): the answer is
        forwarded to its end, or cut after 5000 bytes; then the connection closes (the
        reader's next call on it is refused, and retried on a new one)."""
        up_writer: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            body = await reader.readexactly(length)
            cut = head.startswith(b"GET /v1/file") and self.cut < self.cuts
            self.cut += int(cut)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            up_writer.write(head[:-2] + b"Connection: close\r\n\r\n" + body)
            sent = 0
            while chunk := await up_reader.read(1 << 16):
                if cut and sent + len(chunk) > 5000:
                    writer.write(chunk[: 5000 - sent])
                    break
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the reader went away: its retry comes on a new connection
        finally:
            for stream in (writer, up_writer):
                if stream is not None:
                    stream.close()
                    with contextlib.suppress(OSError):
                        await stream.wait_closed()

    def __enter__(self) -> _CuttingProxy:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self.loop
        ).result(10)
        self._server = server
        return self

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()  # connections the reader kept open for its next call
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def test_a_transfer_cut_short_is_fetched_again_and_checked(
    served: tuple[Path, str, Child],
) -> None:
    out, url, _ = served
    with _CuttingProxy(int(url.rsplit(":", 1)[1]), cuts=3) as proxy:
        ids = await asyncio.to_thread(
            lambda: [s[HSX_ID] for s in LiveDataset(f"http://127.0.0.1:{proxy.port}", consumer="t")]
        )
        assert proxy.cut == 3
    assert sorted(ids) == _ids(out)


def _post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST" if body else "GET", path, body=body or None)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _body(**fields: object) -> bytes:
    base = {"consumer": "train", "owner": "ab" * 8, "call": "cd" * 8}
    return orjson.dumps(base | fields)


async def test_bad_requests_are_refused_with_a_reason(served: tuple[Path, str, Child]) -> None:
    out, url, _ = served
    lease = {"rank": 0, "epoch": 0, "timeout": 10, "wait": 0}
    cases: list[tuple[str, bytes, int, str]] = [
        ("/v1/lease", b"{not json", 400, "not JSON"),
        ("/v1/lease", _body(**lease, count=100_000), 400, "'count'"),
        ("/v1/lease", _body(**lease, count=1, consumer="../x"), 400, "must match"),
        ("/v1/lease", _body(**lease, count=1, call="short"), 400, "'call'"),
        ("/v1/ack", _body(epoch=0, ids=["x"] * 5000), 400, "at most 4096"),
        ("/v1/ack", b"x" * (2 << 20), 413, ""),
        ("/v1/file?path=../../etc/passwd", b"", 400, "not of the dataset's form"),
        ("/v1/file?path=data/00/nope.safetensors", b"", 404, "no such sample"),
    ]
    for path, body, status, reason in cases:
        got, text = await asyncio.to_thread(_post, url, path, body)
        assert got == status, (path, got, text[:200])
        assert reason.encode() in text, (path, text[:200])
    record_registry(out, Registry(ACKED, ("a",), 0), retired=0)
    got, text = await asyncio.to_thread(
        _post, url, "/v1/lease", _body(**lease, count=1, consumer="b")
    )
    assert got == 409 and b"'b' is not registered" in text
    with pytest.raises(DatasetError, match="not registered"):
        await asyncio.to_thread(lambda: next(iter(LiveDataset(url, consumer="b"))))


def test_an_unreachable_server_ends_in_a_live_error(tmp_path: Path) -> None:
    source = RemoteSource(f"http://127.0.0.1:{free_port()}", "train", unreachable_timeout=0.5)
    with pytest.raises(LiveError, match="is hsx serve running there"):
        source.lease("ab" * 8, 0, 0, 1)
    with pytest.raises(DatasetError, match="not an http"):
        RemoteSource("ftp://x", "train")


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:99999", "127.0.0.1:"])
def test_a_bad_listen_address_is_one_line_exit_2(tmp_path: Path, listen: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hsx_async", "serve", str(tmp_path), "--listen", listen],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is not HOST:PORT" in proc.stderr and "Traceback" not in proc.stderr
