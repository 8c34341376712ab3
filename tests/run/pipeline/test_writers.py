"""The group commit: files are named before their lines, and nothing after a failure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.manifest import AppendLog, ManifestEntry
from hsx_async.errors import WriteError
from hsx_async.run.dumps.writer import Staged
from hsx_async.run.pipeline.writers import Committer


def _staged(out: Path, name: str) -> Staged:
    final = out / f"{name}.safetensors"
    tmp = out / f".{name}.tmp"
    tmp.write_bytes(name.encode())
    return Staged(tmp, final, ManifestEntry(name, final.name, 1, len(name), "0" * 16), ())


class _Publisher:
    """Renames like FileWriter.publish; can be held inside a batch, or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def __call__(self, batch: list[Staged]) -> None:
        self.batches.append([s.entry.path for s in batch])
        self.entered.set()
        self.release.wait()
        if self.fail:
            raise WriteError("renaming failed")
        for staged in batch:
            staged.tmp.rename(staged.final)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


@asynccontextmanager
async def running(committer: Committer) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(committer.run())
    try:
        yield task
    finally:
        committer.close()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _listed(path: Path) -> list[str]:
    return [orjson.loads(line)["path"] for line in path.read_bytes().splitlines()]


def _committer(
    tmp_path: Path, executor: ThreadPoolExecutor, publish: _Publisher
) -> tuple[Committer, Path]:
    manifest = AppendLog(tmp_path / "manifest.jsonl")
    quarantine = AppendLog(tmp_path / "quarantine.jsonl")
    return Committer(manifest, quarantine, executor, publish), tmp_path / "manifest.jsonl"


async def test_samples_arriving_during_a_flush_are_committed_together_next(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    publish = _Publisher()
    committer, manifest = _committer(tmp_path, executor, publish)
    publish.release.clear()
    async with running(committer):
        first = asyncio.create_task(committer.commit_sample(_staged(tmp_path, "a")))
        await asyncio.to_thread(publish.entered.wait)
        rest = [asyncio.create_task(committer.commit_sample(_staged(tmp_path, n))) for n in "bcd"]
        await asyncio.sleep(0)  # let them queue behind the held flush
        publish.release.set()
        await asyncio.gather(first, *rest)
    assert publish.batches == [
        ["a.safetensors"],
        ["b.safetensors", "c.safetensors", "d.safetensors"],
    ]
    assert _listed(manifest) == [f"{n}.safetensors" for n in "abcd"]
    assert all((tmp_path / f"{n}.safetensors").exists() for n in "abcd")


async def test_a_failed_publish_lists_nothing_and_refuses_later_samples(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    publish = _Publisher()
    publish.fail = True
    committer, manifest = _committer(tmp_path, executor, publish)
    async with running(committer) as task:
        with pytest.raises(WriteError, match="renaming failed"):
            await committer.commit_sample(_staged(tmp_path, "a"))
        with pytest.raises(WriteError, match="an earlier commit failed"):
            await committer.commit_sample(_staged(tmp_path, "b"))
        with pytest.raises(WriteError):
            await task
    assert committer.failed
    assert manifest.read_bytes() == b""


async def test_a_commit_cancelled_mid_flush_never_lists_what_queued_behind_it(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    """The committer's task is cancelled (a drain, another task failing) while its flush
    runs in a thread: the flush completes on its own, and the samples that queued behind
    it fail without a line, whatever the thread does next."""
    publish = _Publisher()
    publish.release.clear()
    committer, manifest = _committer(tmp_path, executor, publish)
    async with running(committer) as task:
        first = asyncio.create_task(committer.commit_sample(_staged(tmp_path, "a")))
        await asyncio.to_thread(publish.entered.wait)
        behind = asyncio.create_task(committer.commit_sample(_staged(tmp_path, "b")))
        await asyncio.sleep(0)
        task.cancel()
        results = await asyncio.gather(first, behind, return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results), results
        publish.release.set()
    executor.shutdown(wait=True)  # the flush of the first batch ends on its own
    assert publish.batches == [["a.safetensors"]]
    assert _listed(manifest) in ([], ["a.safetensors"])
    assert "b.safetensors" not in _listed(manifest)
    assert not (tmp_path / "b.safetensors").exists()


async def test_nothing_is_committed_before_a_held_record_is_durable(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    """An admitted server's provenance record is written while it takes its first
    samples: a sample copied meanwhile waits for it, named and listed only after."""
    publish = _Publisher()
    committer, manifest = _committer(tmp_path, executor, publish)
    record: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    committer.hold(record)
    async with running(committer):
        sample = asyncio.create_task(committer.commit_sample(_staged(tmp_path, "a")))
        for _ in range(20):  # the committer's task has run its turns, and waits
            await asyncio.sleep(0)
        assert not sample.done()
        assert publish.batches == []
        assert manifest.read_bytes() == b""
        record.set_result(None)
        await sample
        await committer.commit_sample(_staged(tmp_path, "b"))  # held no more
    assert publish.batches == [["a.safetensors"], ["b.safetensors"]]
    assert _listed(manifest) == ["a.safetensors", "b.safetensors"]


async def test_a_failed_record_fails_the_commits_waiting_for_it(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    publish = _Publisher()
    committer, manifest = _committer(tmp_path, executor, publish)
    record: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    committer.hold(record)
    async with running(committer) as task:
        sample = asyncio.create_task(committer.commit_sample(_staged(tmp_path, "a")))
        await asyncio.sleep(0)
        record.set_exception(WriteError("provenance.json: No space left on device"))
        with pytest.raises(WriteError, match="No space left"):
            await sample
        with pytest.raises(WriteError, match="No space left"):
            await task
    assert committer.failed
    assert publish.batches == []
    assert manifest.read_bytes() == b""
    assert (tmp_path / ".a.tmp").exists()  # left for a resume to delete, never named
