"""The hand-off between the pipeline's halves: the writers answer each dump with exactly
one outcome, and decide nothing about the sample (issue 25, item 5)."""

from __future__ import annotations

import ast
import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from hsx_async.dataset.manifest import AppendLog, read_manifest
from hsx_async.errors import DiskFullError, DumpError
from hsx_async.run.dumps.writer import FileWriter, WriteJob
from hsx_async.run.pipeline import writers as commit_module
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.handoff import Committed, Failed, Handoff, Outcome, Requeue
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.pipeline.writers import Writers
from tests.e2e import make_config
from tests.run.dumps.test_writer import ALIGNED, make_case


@asynccontextmanager
async def _writers(tmp_path: Path, shm_root: Path) -> AsyncIterator[Writers]:
    samples = tmp_path / "in.jsonl"
    samples.write_text("")
    config = make_config(
        tmp_path, samples, ["http://127.0.0.1:9"], shm_root,
        hidden_size=ALIGNED.hidden, aux_layers=ALIGNED.aux,
        writer={"threads": 1, "queue_depth": 2},
    )  # fmt: skip
    out = config.output.dir
    out.mkdir()
    executor = ThreadPoolExecutor(2)
    manifest, quarantine = AppendLog(out / "manifest.jsonl"), AppendLog(out / "quarantine.jsonl")
    guard = DiskGuard(out, 0, free_fn=lambda _: 1 << 40)
    writers = Writers(config, metrics=Metrics(), manifest=manifest, quarantine=quarantine,
                      guard=guard, executor=executor)  # fmt: skip
    tasks = [asyncio.create_task(writers.writer()), asyncio.create_task(writers.committer.run())]
    try:
        yield writers
    finally:
        await writers.finish_input()
        await tasks[0]
        writers.committer.close()
        await tasks[1]
        writers.close()
        executor.shutdown(wait=True)
        manifest.close()
        quarantine.close()


def _handoff(job: WriteJob) -> Handoff[WriteJob]:
    loop = asyncio.get_running_loop()
    return Handoff(job, loop.create_future(), loop.create_future())


async def _answer(writers: Writers, job: WriteJob) -> Outcome:
    """The outcome of one hand-off, once the writers also freed what it held."""
    handoff = _handoff(job)
    await writers.submit(handoff)
    async with asyncio.timeout(10):
        outcome = await handoff.outcome
        await handoff.freed
    return outcome


async def test_a_written_dump_is_answered_committed(tmp_path: Path, shm_root: Path) -> None:
    case = make_case(shm_root, ALIGNED)
    async with _writers(tmp_path, shm_root) as writers:
        outcome = await _answer(writers, case.job)
    assert isinstance(outcome, Committed)
    assert [e.id for e in read_manifest(tmp_path / "out")] == [outcome.entry.id]
    assert not case.job.dump.path.exists()  # deleted once committed


@pytest.mark.parametrize(
    ("error", "answer"),
    [(DumpError("part-x shrank"), Failed), (DiskFullError("No space left"), Requeue)],
    ids=["dump-changed", "disk-full"],
)
async def test_a_dump_not_written_is_answered_with_why_and_deleted(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, answer: Any
) -> None:
    def refuse(self: FileWriter, job: WriteJob) -> Any:
        raise error

    monkeypatch.setattr(FileWriter, "stage", refuse)
    case = make_case(shm_root, ALIGNED)
    async with _writers(tmp_path, shm_root) as writers:
        outcome = await _answer(writers, case.job)
        assert writers.guard.paused is (answer is Requeue)  # ENOSPC pauses intake
    assert isinstance(outcome, answer)
    assert read_manifest(tmp_path / "out") == []
    assert not case.job.dump.path.exists()
    if isinstance(outcome, Failed):
        assert outcome.error is error  # the worker half decides what it costs


def test_the_writer_half_imports_nothing_of_the_worker_half() -> None:
    """The halves meet only in run/handoff: commit.py knows no worker, no retry."""
    tree = ast.parse(Path(commit_module.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {
        "hsx_async.run.pipeline.workers",
        "hsx_async.run.servers.retry",
        "hsx_async.run.pipeline.pipeline",
    }


async def test_a_committed_dump_is_answered_at_once_and_freed_once_deleted(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A committed sample is answered as soon as its line is durable; its dump is deleted
    after that, in an I/O thread the writer does not wait for (freeing a large dump's
    pages is slow): the next hand-off and the end of the writers go on meanwhile, and
    ``freed`` (the worker half's cue to release the bytes) comes once the dump is gone."""
    first, second = make_case(shm_root, ALIGNED, sid="a"), make_case(shm_root, ALIGNED, sid="b")
    manifest = tmp_path / "out" / "manifest.jsonl"
    hold = threading.Event()
    listed_at_delete: list[int] = []
    real_delete = commit_module.delete_dump

    def held_delete(path: Path) -> None:
        listed_at_delete.append(len(read_manifest(manifest.parent)))
        if path == first.job.dump.path:
            assert hold.wait(10)
        real_delete(path)

    monkeypatch.setattr(commit_module, "delete_dump", held_delete)
    async with _writers(tmp_path, shm_root) as writers:
        held = _handoff(first.job)
        await writers.submit(held)
        async with asyncio.timeout(10):
            assert isinstance(await held.outcome, Committed)
            assert isinstance(await _answer(writers, second.job), Committed)  # not held up
        assert not held.freed.done() and first.job.dump.path.exists()
        hold.set()
        async with asyncio.timeout(10):
            await held.freed
    assert not first.job.dump.path.exists()
    assert listed_at_delete[0] >= 1  # the line was durable before its dump went
    assert {e.id for e in read_manifest(manifest.parent)} == {"a", "b"}
