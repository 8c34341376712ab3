"""Operating the daemon (issue 5): live reload, metrics/status, disk guard, provenance,
notify, shards."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hsx_async.config import load_config
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.errors import DatasetError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.notify import Notifier
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import (
    after_done,
    check_dataset,
    config_raw,
    make_config,
    shm_leftovers,
    when_done,
    write_config,
    write_samples,
)

H, AUX = 64, (1, 3, 5)
L = len(AUX) + 1


def fake(root: Path, **kw: Any) -> FakeOptions:
    return FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=root, **kw)


async def test_sighup_resizes_pool_mid_run_without_loss(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 120, max_len=24)
    async with running_fake_server(fake(shm_root)) as srv:
        raw = config_raw(tmp_path, samples.path, [srv.url], shm_root, workers={"concurrency": 2})
        path = write_config(tmp_path, raw)
        daemon = Daemon(load_config(path))
        seen_workers: list[int] = []
        grown = when_done(daemon, 20)
        run = asyncio.create_task(daemon.run())
        await grown.wait()
        raw["workers"]["concurrency"] = 6
        write_config(tmp_path, raw)
        assert await daemon.reload() == "applied"
        seen_workers.append(daemon.pipeline.workers.workers_running if daemon.pipeline else 0)
        raw["workers"]["concurrency"] = 1
        write_config(tmp_path, raw)
        assert await daemon.reload() == "applied"
        summary = await run
    assert seen_workers == [6]
    assert daemon.config.workers.concurrency == 1
    assert summary.done == len(samples.good)
    check_dataset(daemon.config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def test_reload_refused_and_invalid_keep_old_config(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=16)
    async with running_fake_server(fake(shm_root)) as srv:
        raw = config_raw(tmp_path, samples.path, [srv.url], shm_root)
        path = write_config(tmp_path, raw)
        daemon = Daemon(load_config(path))
        original = daemon.config
        gate = asyncio.Event()
        after_done(daemon, 5, gate.set)
        run = asyncio.create_task(daemon.run())
        await gate.wait()
        # A key that needs a restart: refused, nothing applied (not even live keys).
        raw["model"]["hidden_size"] = 128
        raw["workers"]["concurrency"] = 7
        write_config(tmp_path, raw)
        assert await daemon.reload() == "refused"
        assert daemon.config is original
        # An invalid file: nothing changes.
        path.write_text("[workers]\nconcurency = 3\n")
        assert await daemon.reload() == "invalid"
        assert daemon.config is original
        summary = await run
    assert summary.done == len(samples.good)


async def test_metrics_and_status_endpoints(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=16)
    async with running_fake_server(fake(shm_root)) as srv:
        config = make_config(
            tmp_path, samples.path, [srv.url], shm_root, daemon={"metrics_listen": "127.0.0.1:0"}
        )
        daemon = Daemon(config)
        scraped: dict[str, Any] = {}
        gate = asyncio.Event()
        after_done(daemon, 10, gate.set)
        # Hold the last samples back so the scrape happens mid-run.
        run = asyncio.create_task(daemon.run())
        await gate.wait()
        assert daemon.http_url is not None and daemon.http_url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{daemon.http_url}/metrics") as resp:
                scraped["metrics"] = await resp.text()
            async with session.get(f"{daemon.http_url}/status") as resp:
                scraped["status"] = await resp.json()
        await run
    text = scraped["metrics"]
    for name in (
        "hsx_samples_total",
        "hsx_tokens_total",
        "hsx_bytes_written_total",
        "hsx_in_flight",
        "hsx_shm_budget_used_bytes",
        "hsx_writer_queue_depth",
        "hsx_request_seconds_bucket",
        "hsx_write_seconds_bucket",
        "hsx_output_free_bytes",
        "hsx_eta_seconds",
    ):
        assert name in text, name
    assert 'hsx_samples_total{outcome="done"}' in text
    assert f'hsx_server_up{{server="{srv.url}"}} 1.0' in text
    status = scraped["status"]
    assert status["done"] >= 10
    assert status["servers"][0]["url"] == srv.url and status["servers"][0]["healthy"]
    assert {"tokens_per_s", "bytes_per_s", "eta_s", "in_flight", "shm_used"} <= set(status)


async def test_disk_guard_pauses_and_resumes(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=16)
    free = {"bytes": 10 << 30}
    async with running_fake_server(fake(shm_root)) as srv:
        config = make_config(
            tmp_path, samples.path, [srv.url], shm_root, output={"disk_reserve": "1GiB"}
        )
        daemon = Daemon(config, free_fn=lambda _: free["bytes"])
        daemon.guard.interval = 0.01
        transitions: list[bool] = []
        paused = asyncio.Event()

        def on_change(open_: bool) -> None:
            transitions.append(open_)
            paused.set()

        daemon.guard.on_change.append(on_change)

        def fill_disk() -> None:
            free["bytes"] = 100 << 20

        after_done(daemon, 8, fill_disk)
        run = asyncio.create_task(daemon.run())
        await paused.wait()
        # Paused: in-flight samples finish, nothing new starts.
        done_at_pause = daemon.metrics.totals.samples_done
        assert daemon.status()["paused"]
        free["bytes"] = 10 << 30  # space came back
        summary = await run
    assert transitions == [False, True]
    assert done_at_pause < len(samples.good)
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_enospc_mid_write_leaves_dataset_consistent(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=16)
    real_fsync = os.fsync
    failures = {"left": 3}
    lock = threading.Lock()  # writer threads fsync side by side: count under a lock

    def flaky_fsync(fd: int) -> None:
        with lock:
            fail = failures["left"] > 0 and os.fstat(fd).st_size > 4096
            if fail:
                failures["left"] -= 1
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky_fsync)
    async with running_fake_server(fake(shm_root)) as srv:
        config = make_config(
            tmp_path, samples.path, [srv.url], shm_root, output={"disk_reserve": 0}
        )
        daemon = Daemon(config)
        daemon.guard.interval = 0.01
        summary = await daemon.run()
    assert failures["left"] == 0
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_provenance_mismatch_refused(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 5, max_len=8)
    async with running_fake_server(fake(shm_root)) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        await Daemon(config).run()
        write_samples(samples.path, 6, max_len=8, seed=9)  # the input changed
        with pytest.raises(DatasetError, match="input differs"):
            await Daemon(config).run()
        summary = await Daemon(config, allow_provenance_change=True).run()
    assert summary.skipped == 5


async def test_resume_with_another_storage_is_refused(tmp_path: Path, shm_root: Path) -> None:
    """One dataset holds one storage: a bf16 dataset resumed as FP8 (or the FP8 one with
    other slots) is refused before anything is written, and --allow-provenance-change
    does not lift it (the files would mean two things)."""
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=8)
    async with running_fake_server(fake(shm_root)) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        await Daemon(config).run()
        fp8 = make_config(
            tmp_path, samples.path, [srv.url], shm_root, output={"dtype": "float8_e4m3fn"}
        )
        for allow in (False, True):
            with pytest.raises(DatasetError, match=r"stores hidden states as bfloat16.*\[output\]"):
                await Daemon(fp8, allow_provenance_change=allow).run()
    assert len(read_manifest(config.output.dir)) == 4


async def test_two_shards_equal_one_unsharded_run(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(
        tmp_path / "in.jsonl", 50, max_len=16, bad_every=8, with_duplicates=True
    )
    async with running_fake_server(fake(shm_root)) as srv:
        single = make_config(tmp_path / "one", samples.path, [srv.url], shm_root)
        await Daemon(single).run()
        shards = [
            make_config(
                tmp_path / "two", samples.path, [srv.url], shm_root, shard={"index": i, "count": 2}
            )
            for i in range(2)
        ]
        await asyncio.gather(*(Daemon(c).run() for c in shards))
    one, two = single.output.dir, shards[0].output.dir
    assert {(e.id, e.xxh3_64) for e in read_manifest(one)} == {
        (e.id, e.xxh3_64) for e in read_manifest(two)
    }
    assert {(q.id, q.line) for q in read_quarantine(one)} == {
        (q.id, q.line) for q in read_quarantine(two)
    }
    assert len(list(two.glob("manifest.shard-*-of-00002.jsonl"))) == 2
    check_dataset(two, samples, hidden_size=H, num_layers=L)


async def test_notify_socket_gets_ready_status_stopping(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=16)
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.setblocking(False)
    messages: list[str] = []
    stopping = asyncio.Event()

    async def receive() -> None:
        # Read while the daemon runs: the kernel queue holds only ~10 datagrams, and
        # the notifier rightly drops what does not fit rather than block.
        loop = asyncio.get_running_loop()
        while True:
            messages.append((await loop.sock_recv(sock, 4096)).decode())
            if messages[-1] == "STOPPING=1":
                stopping.set()

    try:
        async with running_fake_server(fake(shm_root)) as srv:
            config = make_config(
                tmp_path, samples.path, [srv.url], shm_root, daemon={"progress_interval": 0.01}
            )
            daemon = Daemon(config, notifier=Notifier.from_env({"NOTIFY_SOCKET": str(sock_path)}))
            after_done(daemon, 5, daemon.request_stop)
            reader = asyncio.create_task(receive())
            await daemon.run()
            async with asyncio.timeout(10):
                await stopping.wait()
            reader.cancel()
    finally:
        sock.close()
    assert messages[0].startswith("STATUS=waiting") or messages[0] == "READY=1"
    assert "READY=1" in messages
    assert any(m.startswith("STATUS=") and "samples" in m for m in messages)
    assert "STOPPING=1" in messages


async def test_shards_on_separate_disks_merge_into_one_dataset(
    tmp_path: Path, shm_root: Path
) -> None:
    from hsx_async.dataset.merge import merge

    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=16, bad_every=7)
    async with running_fake_server(fake(shm_root)) as srv:
        shards = [
            make_config(
                tmp_path / f"node{i}",
                samples.path,
                [srv.url],
                shm_root,
                shard={"index": i, "count": 3},
            )
            for i in range(3)
        ]
        for c in shards:
            await Daemon(c).run()
    dest = tmp_path / "merged"
    result = merge([c.output.dir for c in shards], dest)
    assert result.copied == len(samples.good)
    check_dataset(dest, samples, hidden_size=H, num_layers=L)
    again = merge([c.output.dir for c in shards], dest)  # resumable: nothing twice
    assert again.copied == 0 and again.skipped == len(samples.good)
    check_dataset(dest, samples, hidden_size=H, num_layers=L)
