"""The one SGLang-like scheduler of the built-in servers: FCFS passes under a budget,
chunked continuations, cut points, modelled GPU time with overlapped writes, requests that
go away, shutdown; and how its passes are described to the dumper."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import HookConfig
from hsx_async.server.sched import (
    Completion,
    DuplicateRid,
    Job,
    PassDumper,
    PassFailed,
    Scheduler,
    ServerClosing,
    Slice,
    SliceResult,
    pass_delay_s,
    plan_pass,
)

WAIT_S = 20.0  # bound on awaiting the scheduler; never reached when things work


def test_plan_pass() -> None:
    assert plan_pass([40, 150, 100, 20], 64, 128) == [(0, 40), (1, 64), (2, 24)]
    assert plan_pass([500], 64, 256) == [(0, 64)]
    assert plan_pass([10, 10], 64, 15) == [(0, 10), (1, 5)]
    assert plan_pass([1, 1, 1], 64, 2) == [(0, 1), (1, 1)]
    assert plan_pass([], 64, 256) == []
    assert plan_pass([10, 30, 5], 0, 32) == [(0, 10), (1, 22)]  # chunk 0: no cap
    assert plan_pass([0, 4], 0, 32) == [(1, 4)]  # nothing pending: not in the pass


async def test_pending_rows_stop_at_the_next_cut() -> None:
    job = Job("r", list(range(10)), 0, "w0", cuts=(3, 7))
    assert job.pending_rows == 3
    job.scheduled = 3
    assert job.pending_rows == 4
    job.scheduled = 7
    assert job.pending_rows == 3


def test_pass_delay_is_base_plus_per_token() -> None:
    assert pass_delay_s(0.0, 0.0, 1000) == 0.0
    assert pass_delay_s(2.0, 10.0, 100) == pytest.approx(0.003)


class Recorder:
    """A step that records each pass's slices (in a worker thread, like a real step)."""

    def __init__(self, *, fail_on: str | None = None, error_for: str | None = None) -> None:
        self.passes: list[list[tuple[str, int, int]]] = []
        self.fail_on, self.error_for = fail_on, error_for
        self.threads: set[str] = set()

    def __call__(self, slices: Sequence[Slice]) -> list[SliceResult]:
        self.threads.add(threading.current_thread().name)
        self.passes.append([(s.job.rid, s.start, s.end) for s in slices])
        if any(s.job.rid == self.fail_on for s in slices):
            raise RuntimeError("the forward broke")
        return [
            SliceResult(error="no room" if s.job.rid == self.error_for else None) for s in slices
        ]


async def serve(step: Recorder, jobs: list[Job], **kw: int) -> list[Completion | BaseException]:
    """Queue ``jobs`` with passes paused (so they batch), run them, close the scheduler."""
    scheduler = Scheduler(step, chunk_size=kw.get("chunk", 4), max_batch_tokens=kw.get("budget", 8))
    runner = asyncio.create_task(scheduler.run())
    scheduler.pause()
    tasks = [asyncio.create_task(scheduler.submit(job)) for job in jobs]
    async with asyncio.timeout(WAIT_S):
        await scheduler.wait_queued(len(jobs))
        scheduler.resume()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    scheduler.close()
    await runner
    return results


async def test_passes_are_fcfs_batches_with_chunked_continuations() -> None:
    step = Recorder()
    jobs = [Job("a", [1] * 6, 0, "w0"), Job("b", [1] * 3, 0, "w0"), Job("c", [1] * 2, 0, None)]
    results = await serve(step, jobs)
    assert results == [Completion(6, []), Completion(3, []), Completion(2, [])]
    assert step.passes == [
        [("a", 0, 4), ("b", 0, 3), ("c", 0, 1)],
        [("a", 4, 6), ("c", 1, 2)],
    ]
    assert all(name.startswith(("asyncio", "ThreadPool")) for name in step.threads)


async def test_cut_points_split_a_prompt_into_passes() -> None:
    step = Recorder()
    await serve(step, [Job("a", [1] * 10, 0, "w0", cuts=(2, 9))], chunk=0, budget=100)
    assert step.passes == [[("a", 0, 2)], [("a", 2, 9)], [("a", 9, 10)]]


async def test_a_failed_pass_fails_its_requests_and_an_error_only_its_own() -> None:
    step = Recorder(fail_on="bad", error_for="full")
    jobs = [Job("bad", [1], 0, "w0"), Job("ok", [1], 0, "w0")]
    failed, also = await serve(step, jobs)
    assert isinstance(failed, PassFailed) and isinstance(also, PassFailed)
    assert "forward pass failed" in str(failed)
    full, fine = await serve(
        Recorder(error_for="full"), [Job("full", [1], 0, "w0"), Job("fine", [1], 0, None)]
    )
    assert isinstance(full, PassFailed) and str(full) == "no room"
    assert fine == Completion(1, [])


async def test_cancelled_request_is_dropped_before_its_pass() -> None:
    step = Recorder()
    dropped: list[str] = []
    scheduler = Scheduler(
        step, chunk_size=4, max_batch_tokens=8, on_drop=lambda j: dropped.append(j.rid)
    )
    runner = asyncio.create_task(scheduler.run())
    scheduler.pause()
    gone = asyncio.create_task(scheduler.submit(Job("gone", [1, 2, 3], 0, None)))
    kept = asyncio.create_task(scheduler.submit(Job("kept", [1, 2, 3, 4, 5], 0, None)))
    await scheduler.wait_queued(2)
    gone.cancel()
    scheduler.resume()
    async with asyncio.timeout(WAIT_S):
        done = await kept
    assert done == Completion(prompt_tokens=5, output_ids=[])
    assert step.passes == [[("kept", 0, 4)], [("kept", 4, 5)]]  # "gone" never
    assert dropped == ["gone", "kept"] and scheduler.queued == 0
    scheduler.close()
    await runner
    with pytest.raises(ServerClosing):
        await scheduler.submit(Job("late", [1], 0, None))


async def test_a_rid_in_flight_is_refused_and_a_paused_server_closes() -> None:
    scheduler = Scheduler(Recorder(), chunk_size=4, max_batch_tokens=8)
    runner = asyncio.create_task(scheduler.run())
    scheduler.pause()
    first = asyncio.create_task(scheduler.submit(Job("r", [1], 0, None)))
    await scheduler.wait_queued(1)
    with pytest.raises(DuplicateRid, match="already in flight"):
        await scheduler.submit(Job("r", [1], 0, None))
    scheduler.close()  # paused: it closes anyway, the gate stays closed
    async with asyncio.timeout(WAIT_S):
        await runner
        with pytest.raises(ServerClosing):
            await first


class Watched(Scheduler):
    """Tells when a pass that continues a request from row 2 on has been planned."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.planned_next = threading.Event()

    def _plan(self) -> list[Slice]:
        slices = super()._plan()
        if any(s.start >= 2 for s in slices):
            self.planned_next.set()
        return slices


async def test_with_modelled_gpu_time_a_pass_is_written_while_the_next_computes() -> None:
    """The step of pass N runs during the modelled time of pass N+1 (overlap): pass 1's
    step is held until the scheduler has planned pass 2, which it can only do while pass
    1 is still being written. One step at a time, in pass order."""
    order: list[tuple[int, int]] = []
    held: list[bool] = []
    scheduler: Watched

    def step(slices: Sequence[Slice]) -> list[SliceResult]:
        order.append((slices[0].start, slices[0].end))
        if len(order) == 1:
            held.append(scheduler.planned_next.wait(WAIT_S))
        return [SliceResult() for _ in slices]

    scheduler = Watched(step, chunk_size=2, max_batch_tokens=2, latency=(1.0, 0.0), overlap=True)
    runner = asyncio.create_task(scheduler.run())
    async with asyncio.timeout(WAIT_S):
        assert await scheduler.submit(Job("a", [1] * 6, 0, "w0")) == Completion(6, [])
    assert held == [True] and order == [(0, 2), (2, 4), (4, 6)]
    scheduler.close()
    await runner


async def test_pass_dumper_reports_dropped_requests_as_aborted_first() -> None:
    config = HookConfig(dump_root=Path("/nonexistent"), aux_layers=(1,), model="m", server="s")
    passes = PassDumper(PrefillDumper(config), layers=2)
    gone, kept, plain = (
        Job("gone", [1] * 4, 0, "w0"),
        Job("kept", [1] * 4, 0, "w0"),
        Job("p", [1], 5, None),
    )
    passes.drop(gone)
    passes.drop(plain)  # ordinary traffic: nothing to abort
    views = passes.views([Slice(kept, 0, 2), Slice(plain, 0, 1)])
    assert [(v.rid, v.aborted, v.rows) for v in views] == [
        ("gone", True, 0), ("kept", False, 2), ("p", False, 1)
    ]  # fmt: skip
    assert not views[1].last_chunk and views[2].ns is None
    assert passes.views([]) == []  # told once
