"""Disk faults (issue 7): ENOSPC and EIO on the output disk, injected into the writer's
system calls and on a real, small tmpfs. The run pauses (ENOSPC: the disk guard) or fails
with a typed error (EIO); nothing partial is ever visible under a final name or in the
manifest; a resume completes a consistent dataset.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash

from hsx_async.config import Config
from hsx_async.dataset.manifest import read_manifest
from hsx_async.errors import HsxError, WriteError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import running_fake_server
from tests.crash_driver import L, fake_options
from tests.e2e import SampleSet, check_dataset, make_config, shm_leftovers, write_samples

DATA_TEMP = re.compile(r"/data/[0-9a-f]{2}/\.[^/]+\.tmp$")
DATA_DIR = re.compile(r"/data/[0-9a-f]{2}$")
MANIFEST = re.compile(r"/manifest\.jsonl$")
BIG = 1 << 40


@dataclass
class DiskFault:
    """Make one system call fail with ``err`` on paths matching ``path``: after ``skip``
    matching calls succeeded, ``times`` times (None: until :attr:`healed`). A failing
    ``write`` first writes half its data, like a disk that fills up mid-write."""

    call: str  # write | sendfile | fsync | mkdir
    err: int
    path: re.Pattern[str]
    skip: int = 0
    times: int | None = None
    healed: bool = False
    on_fail: Callable[[], None] | None = None
    seen: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def should_fail(self, call: str, path: str) -> bool:
        if call != self.call or not self.path.search(path):
            return False
        with self._lock:
            self.seen += 1
            if self.healed or self.seen <= self.skip:
                return False
            if self.times is not None and self.failed >= self.times:
                return False
            self.failed += 1
        if self.on_fail is not None:
            self.on_fail()
        return True

    def error(self, path: str) -> OSError:
        return OSError(self.err, os.strerror(self.err), path)


def _torn_cut(view: memoryview) -> int:
    """About half the data, never ending right after a newline: a batch of two lines of
    one length would otherwise be cut between them, whole."""
    n = len(view) // 2
    while n > 1 and view[n - 1] == ord("\n"):
        n -= 1
    return n


def _fd_path(fd: int) -> str:
    try:
        return str(Path(f"/proc/self/fd/{fd}").readlink())
    except OSError:
        return ""


def install(monkeypatch: pytest.MonkeyPatch, fault: DiskFault) -> None:
    """Route os.write/sendfile/fsync/mkdir through ``fault`` (the writer, the manifest and
    pathlib all call them through the ``os`` module)."""
    real_write, real_sendfile = os.write, os.sendfile
    real_fsync, real_mkdir = os.fsync, os.mkdir

    def write(fd: int, data: Any) -> int:
        path = _fd_path(fd)
        if fault.should_fail("write", path):
            with memoryview(data) as view, view[: _torn_cut(view)] as half:
                real_write(fd, half)
            raise fault.error(path)
        return real_write(fd, data)

    def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        path = _fd_path(out_fd)
        if fault.should_fail("sendfile", path):
            real_sendfile(out_fd, in_fd, offset, count // 2)
            raise fault.error(path)
        return real_sendfile(out_fd, in_fd, offset, count)

    def fsync(fd: Any) -> None:
        path = _fd_path(fd if isinstance(fd, int) else fd.fileno())
        if fault.should_fail("fsync", path):
            raise fault.error(path)
        real_fsync(fd)

    def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if fault.should_fail("mkdir", os.fspath(path)):
            raise fault.error(os.fspath(path))
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "mkdir", mkdir)


@dataclass
class FakeDisk:
    """Free space as the disk guard sees it."""

    free: int = BIG

    def __call__(self, _: Path) -> int:
        return self.free


def _config(tmp: Path, samples: SampleSet, url: str, root: Path, h: int, **kw: Any) -> Config:
    base: Any = {"output": {"disk_reserve": 1 << 20}, "dump": {"timeout": 2.0}}
    for section, keys in kw.items():
        base.setdefault(section, {}).update(keys)
    return make_config(tmp, samples.path, [url], root, hidden_size=h, **base)


def _guard_events(daemon: Daemon) -> tuple[asyncio.Event, asyncio.Event]:
    paused, resumed = asyncio.Event(), asyncio.Event()
    daemon.guard.interval = 0.02  # seconds between free-space polls (default 5)
    daemon.guard.on_change.append(lambda open_: (resumed if open_ else paused).set())
    return paused, resumed


def assert_manifest_files_intact(out: Path) -> None:
    """The invariant at any instant: each manifest line names a complete file with its
    recorded size and hash, and no data file is visible under a name the manifest lacks
    except while a writer is between its rename and its manifest line."""
    for entry in read_manifest(out):
        data = (out / entry.path).read_bytes()
        assert len(data) == entry.size and xxhash.xxh3_64_hexdigest(data) == entry.xxh3_64


# --- ENOSPC: the disk guard pauses intake ---------------------------------------------------


# O_DIRECT needs L × H × 2 to be a multiple of 4096: H = 512 with 4 layers.
@pytest.mark.parametrize("shape", [("sendfile", 64), ("direct", 512)], ids=["sendfile", "direct"])
@pytest.mark.parametrize("call", ["write", "fsync"])
async def test_enospc_while_writing_pauses_until_space_returns(
    shape: tuple[str, int], call: str, tmp_path: Path, shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    method, h = shape
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=32, seed=1)
    disk = FakeDisk()
    # "write" covers the header and, with O_DIRECT, the hidden states; sendfile is next.
    fault = DiskFault(
        call, errno.ENOSPC, DATA_TEMP, skip=6, on_fail=lambda: setattr(disk, "free", 0)
    )
    install(monkeypatch, fault)
    async with running_fake_server(fake_options(shm_root, hidden_size=h)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, h, writer={"method": method})
        daemon = Daemon(config, free_fn=disk)
        paused, resumed = _guard_events(daemon)
        run = asyncio.create_task(daemon.run())
        await paused.wait()
        assert daemon.guard.paused
        await asyncio.to_thread(assert_manifest_files_intact, config.output.dir)
        fault.healed, disk.free = True, BIG
        summary = await run
    assert fault.failed >= 1 and resumed.is_set()
    assert summary.done == len(samples.good) and summary.unfinished == 0
    check_dataset(config.output.dir, samples, hidden_size=h, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def test_enospc_creating_a_data_directory_pauses_too(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=16, seed=2)
    disk = FakeDisk()
    fault = DiskFault(
        "mkdir", errno.ENOSPC, DATA_DIR, skip=3, on_fail=lambda: setattr(disk, "free", 0)
    )
    install(monkeypatch, fault)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, 64)
        daemon = Daemon(config, free_fn=disk)
        paused, _ = _guard_events(daemon)
        run = asyncio.create_task(daemon.run())
        await paused.wait()
        fault.healed, disk.free = True, BIG
        summary = await run
    assert fault.failed >= 1
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=64, num_layers=L)


async def test_enospc_on_the_last_sample_is_retried_in_the_same_run(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 1, max_len=16, seed=3)
    fault = DiskFault("write", errno.ENOSPC, DATA_TEMP, times=1)
    install(monkeypatch, fault)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, 64,
                         output={"disk_reserve": 0}, workers={"concurrency": 1})  # fmt: skip
        daemon = Daemon(config)
        daemon.guard.interval = 0.02
        summary = await daemon.run()
    assert fault.failed == 1
    assert (summary.done, summary.unfinished) == (1, 0)


# --- EIO: the run fails with a typed error, a resume completes ----------------------------


async def _fail_then_resume(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch, fault: DiskFault, *,
    expected: type[HsxError], message: str,
) -> None:  # fmt: skip
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=24, seed=4)
    install(monkeypatch, fault)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, 64)
        daemon = Daemon(config)
        with pytest.raises(expected, match=message):
            await daemon.run()
        assert daemon.pipeline is not None
        # Writes the failed run left in flight end before anyone looks at the directory.
        await asyncio.to_thread(daemon.pipeline.executor.shutdown, wait=True)
        out = config.output.dir
        assert_manifest_files_intact(out)
        assert not list(out.rglob("*.tmp")), "a temp file outlived the failed write"
        # Requests the failed run left in the server may still land in /dev/shm: the
        # restart drops them, and the resume clears what came before.
        await fake.restart()
        fault.healed = True
        summary = await Daemon(config).run()
    assert fault.failed >= 1
    assert summary.done + summary.skipped == len(samples.good)
    check_dataset(out, samples, hidden_size=64, num_layers=L)
    assert shm_leftovers(shm_root) == []


@pytest.mark.parametrize("call", ["write", "sendfile", "fsync"])
async def test_eio_writing_a_sample_fails_the_run_then_resume_completes(
    call: str, tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = DiskFault(call, errno.EIO, DATA_TEMP, skip=5)
    await _fail_then_resume(tmp_path, shm_root, monkeypatch, fault, expected=WriteError,
                            message=r"writing .*/data/.* failed: Input/output error")  # fmt: skip


async def test_eio_syncing_the_data_directory_fails_the_run_then_resume_completes(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fsync of the directory after the rename fails: the file is in place but the
    run stops before its manifest line; the resume treats it as an orphan and redoes it."""
    fault = DiskFault("fsync", errno.EIO, DATA_DIR, skip=5)
    await _fail_then_resume(tmp_path, shm_root, monkeypatch, fault, expected=WriteError,
                            message="Input/output error")  # fmt: skip


@pytest.mark.parametrize(
    ("call", "err"), [("fsync", errno.EIO), ("write", errno.ENOSPC)], ids=["eio", "enospc"]
)
async def test_manifest_append_failure_fails_the_run_cleanly_then_resume_completes(
    call: str, err: int, tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = DiskFault(call, err, MANIFEST, skip=3)
    await _fail_then_resume(
        tmp_path, shm_root, monkeypatch, fault, expected=WriteError, message="manifest"
    )


async def test_a_torn_manifest_line_from_a_full_disk_is_repaired_by_the_resume(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the run reports, half a manifest line on disk costs nothing: the resume
    cuts it, redoes its sample, and the dataset is complete and exact."""
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=24, seed=6)
    fault = DiskFault("write", errno.ENOSPC, MANIFEST, skip=3)
    install(monkeypatch, fault)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, 64)
        daemon = Daemon(config)
        with pytest.raises(WriteError, match=r"manifest\.jsonl"):
            await daemon.run()
        assert daemon.pipeline is not None
        await asyncio.to_thread(daemon.pipeline.executor.shutdown, wait=True)
        out = config.output.dir
        assert not (out / "manifest.jsonl").read_bytes().endswith(b"\n"), "no torn line"
        await fake.restart()
        fault.healed = True
        summary = await Daemon(config).run()
    assert summary.done + summary.skipped == len(samples.good)
    check_dataset(out, samples, hidden_size=64, num_layers=L)
    assert shm_leftovers(shm_root) == []


# --- a real, small file system --------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the test (root only); skipped where mounting is refused."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


async def test_a_really_full_disk_pauses_and_a_bigger_one_finishes(
    tmp_path: Path, shm_root: Path, small_tmpfs: Path
) -> None:
    """Output on a 2 MiB tmpfs, ~3.5 MiB of samples: the disk fills, the guard pauses
    intake with every manifest line intact; remounting with room lets the run finish."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=200, seed=5)
    out = small_tmpfs / "out"
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root, 64,
                         output={"dir": str(out), "disk_reserve": 256 << 10})  # fmt: skip
        daemon = Daemon(config)
        paused, resumed = _guard_events(daemon)
        run = asyncio.create_task(daemon.run())
        await paused.wait()
        await asyncio.to_thread(assert_manifest_files_intact, out)
        written = len(read_manifest(out))
        assert 0 < written < len(samples.good)
        remount = ["mount", "-o", "remount,size=64m", str(small_tmpfs)]
        await asyncio.to_thread(subprocess.run, remount, check=True)
        summary = await run
    assert resumed.is_set()
    assert summary.done == len(samples.good)
    check_dataset(out, samples, hidden_size=64, num_layers=L)
    assert shm_leftovers(shm_root) == []
