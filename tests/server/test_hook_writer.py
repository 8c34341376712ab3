"""The background writers behind PrefillDumper (issue 16): per-rid order and commit after
the last part under concurrency, the bound on queued bytes, a failed write poisoning only
its rid, shutdown draining or abandoning a full queue, and the copy-free part layouts."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_async.errors import DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    META_NAME,
    check_meta,
    check_part_sizes,
    parse_meta,
    parse_part_name,
)
from hsx_async.server import dumpwrite, hook_writer
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import HookConfig, ReqView
from hsx_async.server.hook_writer import BackgroundWriter, WriterStats
from hsx_async.server.rows import BatchHidden, assemble_rows
from tests.server.fp8 import FP8_AUX, check_fp8_dump, read_bf16_rows
from tests.server.passes import finite_arrays, pass_loader

NS = "w0"
H = 4
LAYERS = (2, 5)
K = len(LAYERS)
ROW_BYTES = (K + 1) * H * 2
WAIT_S = 30.0  # a deadline for events that happen in microseconds: only a hang reaches it


def view(rid: str, rows: int, *, start: int = 0, num_tokens: int | None = None) -> ReqView:
    n = num_tokens if num_tokens is not None else start + rows
    return ReqView(
        rid=rid,
        ns=NS,
        num_tokens=n,
        max_new_tokens=0,
        start=start,
        rows=rows,
        last_chunk=start + rows == n,
    )


def plain(rows: int) -> ReqView:
    return ReqView("user", None, rows, 64, 0, rows)


def make(
    root: Path, *, threads: int = 4, queue_bytes: int = 1 << 30, **kw: Any
) -> tuple[PrefillDumper, BackgroundWriter]:
    writer = BackgroundWriter(root, threads=threads, queue_bytes=queue_bytes, **kw)
    cfg = HookConfig(dump_root=root, aux_layers=LAYERS, model=None, server="test")
    return PrefillDumper(cfg, model="m", sink=writer), writer


@pytest.fixture
def closing() -> Iterator[list[BackgroundWriter]]:
    """Writers a test made; each is shut down (and must stop) whatever the outcome."""
    made: list[BackgroundWriter] = []
    yield made
    for writer in made:
        writer.close(drain_s=WAIT_S)
        assert writer.alive == 0


def rows_of(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 2**16, (n, K * H), dtype=np.uint16),
        rng.integers(0, 2**16, (n, H), dtype=np.uint16),
    )


def loader(aux: np.ndarray, final: np.ndarray) -> Callable[[], BatchHidden]:
    hidden = BatchHidden(aux, final, LAYERS)
    return lambda: hidden


def expected(aux: np.ndarray, final: np.ndarray) -> np.ndarray:
    return assemble_rows(BatchHidden(aux, final, LAYERS), 0, len(aux))


def read_dump(root: Path, rid: str) -> np.ndarray:
    d = root / NS / rid
    meta = parse_meta((d / META_NAME).read_bytes())
    check_meta(meta, rid=rid, num_tokens=meta.num_tokens, hidden_size=H, aux_layers=LAYERS)
    sizes = {
        span: (d / p.name).stat().st_size
        for p in d.iterdir()
        if (span := parse_part_name(p.name)) is not None
    }
    check_part_sizes(meta, sizes, ROW_BYTES)
    parts = [
        np.fromfile(d / f"part-{s:010d}-{e:010d}.bin", dtype="<u2").reshape(e - s, K + 1, H)
        for s, e in meta.parts
    ]
    return np.concatenate(parts)


class Schedule:
    """Prompts fed through passes of at most ``chunk`` rows, several per pass, with an
    ordinary request in front: the pass layout SGLang's chunked prefill produces."""

    def __init__(self, lengths: Sequence[int], chunk: int, seed: int = 0) -> None:
        self.truth = {f"r{i}": rows_of(seed + i, n) for i, n in enumerate(lengths)}
        self.done = dict.fromkeys(self.truth, 0)
        self.chunk = chunk

    def passes(self) -> Iterator[tuple[list[ReqView], Callable[[], BatchHidden]]]:
        while any(self.done[r] < len(a) for r, (a, _) in self.truth.items()):
            reqs, aux, final = (
                [plain(1)],
                [np.zeros((1, K * H), np.uint16)],
                [np.zeros((1, H), np.uint16)],
            )
            budget = self.chunk
            for rid, (a, f) in self.truth.items():
                start, n = self.done[rid], len(a)
                take = min(n - start, budget)
                if take <= 0:
                    continue
                reqs.append(view(rid, take, start=start, num_tokens=n))
                aux.append(a[start : start + take])
                final.append(f[start : start + take])
                self.done[rid] += take
                budget -= take
                if budget == 0:
                    break
            yield reqs, loader(np.concatenate(aux), np.concatenate(final))


# --------------------------------------------------------------------------------------
# Order and commit
# --------------------------------------------------------------------------------------


def test_parts_in_order_and_meta_after_the_last_under_concurrency(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, closing: list[BackgroundWriter]
) -> None:
    """24 prompts chunked over many passes, 4 writer threads: every rid's files are
    written in row order and its meta.json strictly after its last part."""
    events: list[tuple[str, str, int]] = []  # (rid, "part"/"meta", start), in write order
    lock = threading.Lock()
    real_part, real_meta = dumpwrite.write_part_vectored, dumpwrite.write_meta

    def part(dir_fd: int, start: int, end: int, chunks: Iterable[Sequence[memoryview]]) -> None:
        real_part(dir_fd, start, end, chunks)
        with lock:
            events.append((_rid_of(dir_fd), "part", start))

    def meta(dir_fd: int, m: Any) -> None:
        with lock:
            events.append((m.rid, "meta", -1))
        real_meta(dir_fd, m)

    monkeypatch.setattr(dumpwrite, "write_part_vectored", part)
    monkeypatch.setattr(dumpwrite, "write_meta", meta)
    dumper, writer = make(shm_root)
    closing.append(writer)
    schedule = Schedule([int(n) for n in np.random.default_rng(1).integers(1, 60, 24)], chunk=23)
    for reqs, load in schedule.passes():
        report = dumper.dump_batch(reqs, load)
        assert report.rejects == [] and report.committed == []  # commits happen later
    assert writer.flush(WAIT_S)
    for rid, (aux, final) in schedule.truth.items():
        mine = [(kind, start) for r, kind, start in events if r == rid]
        starts = [start for kind, start in mine if kind == "part"]
        assert starts == sorted(starts) and starts[0] == 0
        assert mine[-1] == ("meta", -1) and [k for k, _ in mine].count("meta") == 1
        np.testing.assert_array_equal(read_dump(shm_root, rid), expected(aux, final))
    stats = writer.stats
    assert stats.committed == 24 and stats.failed == stats.skipped == stats.abandoned == 0
    assert stats.queued_bytes == 0 and stats.bytes_written == sum(
        len(a) * ROW_BYTES for a, _ in schedule.truth.values()
    )


def _rid_of(dir_fd: int) -> str:
    return Path(f"/proc/self/fd/{dir_fd}").readlink().name


def test_report_lists_queued_parts_and_load_refusal_stays_synchronous(
    shm_root: Path, closing: list[BackgroundWriter]
) -> None:
    dumper, writer = make(shm_root, threads=2)
    closing.append(writer)
    aux, final = rows_of(0, 3)
    report = dumper.dump_batch([view("a", 3)], lambda: BatchHidden(aux, final, LAYERS))
    assert [w.rid for w in report.queued] == ["a"] and report.parts == []

    def refuse() -> BatchHidden:
        raise DumpError("ran through a CUDA graph")

    refused = dumper.dump_batch([view("b", 2)], refuse)
    assert [r.rid for r in refused.rejects] == ["b"] and refused.queued == []
    assert writer.flush(WAIT_S)
    assert sorted(p.name for p in (shm_root / NS).iterdir()) == ["a"]


# --------------------------------------------------------------------------------------
# Memory bound
# --------------------------------------------------------------------------------------


class Gate:
    """Holds every part write until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        real = dumpwrite.write_part_vectored

        def held(dir_fd: int, start: int, end: int, chunks: Iterable[Sequence[memoryview]]) -> None:
            self.entered.set()
            assert self.opened.wait(WAIT_S)
            real(dir_fd, start, end, chunks)

        monkeypatch.setattr(dumpwrite, "write_part_vectored", held)


def pass_of(rid: str, rows: int, seed: int) -> tuple[list[ReqView], Callable[[], BatchHidden]]:
    aux, final = rows_of(seed, rows)
    return [view(rid, rows)], lambda: BatchHidden(aux, final, LAYERS)


def test_queued_bytes_are_bounded_and_a_full_queue_blocks(
    shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    closing: list[BackgroundWriter],
) -> None:
    rows = 10
    pass_bytes = rows * ROW_BYTES  # aux + final of one pass, all marked
    gate = Gate(monkeypatch)
    dumper, writer = make(shm_root, threads=2, queue_bytes=2 * pass_bytes)
    closing.append(writer)
    dumper.dump_batch(*pass_of("a", rows, 1))
    dumper.dump_batch(*pass_of("b", rows, 2))
    assert writer.stats.queued_bytes == 2 * pass_bytes and writer.stats.stalls == 0
    blocked = threading.Thread(target=dumper.dump_batch, args=pass_of("c", rows, 3))
    with caplog.at_level(logging.WARNING, logger=hook_writer.__name__):
        blocked.start()
        assert writer.wait_for(lambda s: s.stalls == 1, WAIT_S)
        assert blocked.is_alive()  # the scheduler waits instead of growing memory
        assert writer.stats.queued_bytes == writer.stats.peak_queued_bytes == 2 * pass_bytes
        gate.opened.set()
        blocked.join(WAIT_S)
    assert not blocked.is_alive()
    assert "dump write queue full" in caplog.text and "HSX_WRITE_QUEUE_MB" in caplog.text
    assert writer.flush(WAIT_S)
    assert writer.stats.peak_queued_bytes <= 2 * pass_bytes
    assert writer.stats.committed == 3 and writer.stats.stall_s > 0


def test_a_pass_larger_than_the_budget_passes_alone(
    shm_root: Path, closing: list[BackgroundWriter]
) -> None:
    dumper, writer = make(shm_root, threads=1, queue_bytes=ROW_BYTES)
    closing.append(writer)
    dumper.dump_batch(*pass_of("big", 50, 1))
    dumper.dump_batch(*pass_of("big2", 50, 2))  # waits for the first, then goes
    assert writer.flush(WAIT_S)
    assert writer.stats.committed == 2 and writer.stats.peak_queued_bytes == 50 * ROW_BYTES


def buffers_of_passes(
    dumper: PrefillDumper, passes: int, rows: int, *, floats: bool = False
) -> list[weakref.ref[np.ndarray]]:
    """Hand ``passes`` passes, each one marked request, to ``dumper`` and keep only weak
    references to their row buffers (the caller keeps none: like SGLang, which drops a
    pass's result once it is processed)."""
    refs = []
    for p in range(passes):
        aux, final = rows_of(p, rows)
        if floats:  # a float32 model's rows, which the writers round (issue 28)
            aux, final = aux.astype(np.float32), final.astype(np.float32)
        refs += [weakref.ref(aux), weakref.ref(final)]
        hidden = BatchHidden(aux, final, LAYERS)
        dumper.dump_batch([view(f"p{p}", rows)], lambda h=hidden: h)  # type: ignore[misc]
        del aux, final, hidden
    return refs


@pytest.mark.parametrize("floats", [False, True], ids=["bf16", "float32"])
def test_no_writer_thread_holds_a_pass_after_flush(
    shm_root: Path, closing: list[BackgroundWriter], floats: bool
) -> None:
    """Issue 24: HSX_WRITE_QUEUE_MB bounds what the writers hold, not only what the queue
    counts. Each writer thread used to keep the rows of the last pass it wrote alive after
    the queue had counted them free (a local of its loop outlived the job): with the
    defaults, 4 GiB + 4 passes of pinned host memory, held while idle. After flush(),
    every buffer handed over is free (no garbage collection needed: nothing refers to
    them), on every thread, however many passes each one wrote."""
    dumper, writer = make(shm_root, threads=4)
    closing.append(writer)
    refs = buffers_of_passes(dumper, 12, 3, floats=floats)
    assert writer.flush(WAIT_S)
    assert writer.stats.committed == 12 and writer.stats.queued_bytes == 0
    assert len({writer._lane(f"p{p}") for p in range(12)}) > 1  # several threads wrote
    alive = [r for r in refs if r() is not None]
    assert alive == [], f"{len(alive)} of {len(refs)} row buffers still held after flush()"


def test_a_pass_is_held_while_any_of_its_parts_waits(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, closing: list[BackgroundWriter]
) -> None:
    """The other side of the bound: the rows stay alive (and counted) until the last part
    of the pass is written, then go."""
    gate = Gate(monkeypatch)
    dumper, writer = make(shm_root, threads=2)
    closing.append(writer)
    aux, final = rows_of(0, 4)
    refs = [weakref.ref(aux), weakref.ref(final)]
    hidden = BatchHidden(aux, final, LAYERS)
    dumper.dump_batch([view("a", 2), view("b", 2)], lambda h=hidden: h)  # type: ignore[misc]
    del aux, final, hidden
    assert gate.entered.wait(WAIT_S)
    assert all(r() is not None for r in refs) and writer.stats.queued_bytes == 4 * ROW_BYTES
    gate.opened.set()
    assert writer.flush(WAIT_S)
    assert [r() for r in refs] == [None, None] and writer.stats.queued_bytes == 0


def test_held_bytes_count_the_whole_pass(shm_root: Path, closing: list[BackgroundWriter]) -> None:
    """Unmarked rows of a pass stay in memory while its parts wait: they count too."""
    seen: list[int] = []
    dumper, writer = make(shm_root, threads=1)
    closing.append(writer)
    aux, final = rows_of(0, 12)
    dumper.dump_batch([plain(10), view("a", 2)], lambda: BatchHidden(aux, final, LAYERS))
    seen.append(writer.stats.peak_queued_bytes)
    assert writer.flush(WAIT_S)
    assert seen == [12 * ROW_BYTES] and writer.stats.bytes_written == 2 * ROW_BYTES


# --------------------------------------------------------------------------------------
# Failure
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flush_between", [True, False])
def test_a_failed_background_write_poisons_only_its_rid(
    shm_root: Path,
    caplog: pytest.LogCaptureFixture,
    closing: list[BackgroundWriter],
    flush_between: bool,
) -> None:
    """ "bad"'s directory cannot be created (a plain file holds its name): its first part
    fails on a writer thread, its later parts and its commit are skipped, and the next
    pass no longer queues it; "good1" and "good2", chunked alongside, commit intact."""
    (shm_root / NS).mkdir()
    (shm_root / NS / "bad").write_text("in the way")
    rejects: list[Any] = []
    dumper, writer = make(shm_root, threads=3, on_reject=rejects.append)
    closing.append(writer)
    truth = {rid: rows_of(i, 9) for i, rid in enumerate(("good1", "bad", "good2"))}
    queued: list[list[str]] = []
    for start in (0, 3, 6):
        reqs = [view(rid, 3, start=start, num_tokens=9) for rid in truth]
        aux = np.concatenate([a[start : start + 3] for a, _ in truth.values()])
        final = np.concatenate([f[start : start + 3] for _, f in truth.values()])
        report = dumper.dump_batch(reqs, loader(aux, final))
        assert report.rejects == []
        queued.append([w.rid for w in report.queued])
        if flush_between:
            assert writer.flush(WAIT_S)
    assert writer.flush(WAIT_S)
    assert [r.rid for r in rejects] == ["bad"] and "not a plain directory" in rejects[0].reason
    assert (shm_root / NS / "bad").read_text() == "in the way"
    for rid in ("good1", "good2"):
        np.testing.assert_array_equal(read_dump(shm_root, rid), expected(*truth[rid]))
    assert writer.stats.committed == 2 and writer.stats.failed == 1
    if flush_between:  # the scheduler saw the failure before planning the next pass
        assert queued[1:] == [["good1", "good2"]] * 2 and writer.stats.skipped == 0
    else:
        # Each later pass either still queued "bad" (its job is then skipped) or not.
        assert writer.stats.skipped == queued[1].count("bad") + queued[2].count("bad")
    assert "bad" not in dumper.registry


def test_a_retried_rid_is_not_poisoned_by_its_old_failure(
    shm_root: Path, closing: list[BackgroundWriter]
) -> None:
    (shm_root / NS).mkdir()
    blocker = shm_root / NS / "a"
    blocker.write_text("x")
    dumper, writer = make(shm_root, threads=1, on_reject=lambda r: None)
    closing.append(writer)
    dumper.dump_batch([view("a", 2, num_tokens=4)], pass_of("a", 2, 0)[1])
    assert writer.flush(WAIT_S) and writer.stats.failed == 1
    # SGLang retracts the request and computes it again from row 0; the way is clear now.
    dumper.dump_batch(
        [ReqView("a", NS, 4, 0, 2, 2, last_chunk=True, retracted=True)], pass_of("a", 2, 0)[1]
    )
    blocker.unlink()
    aux, final = rows_of(5, 4)
    dumper.dump_batch([view("a", 4)], lambda: BatchHidden(aux, final, LAYERS))
    assert writer.flush(WAIT_S)
    np.testing.assert_array_equal(read_dump(shm_root, "a"), expected(aux, final))


def test_an_unexpected_error_keeps_the_lane_alive(
    shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    closing: list[BackgroundWriter],
) -> None:
    real = dumpwrite.write_job

    def flaky(root: Path, job: Any, hidden: BatchHidden, tamper: Any = None) -> Any:
        if job.write.rid == "boom":
            raise RuntimeError("a bug")
        return real(root, job, hidden, tamper)

    monkeypatch.setattr(hook_writer, "write_job", flaky)
    dumper, writer = make(shm_root, threads=1)
    closing.append(writer)
    with caplog.at_level(logging.ERROR, logger=hook_writer.__name__):
        dumper.dump_batch(*pass_of("boom", 2, 0))
        dumper.dump_batch(*pass_of("fine", 2, 1))
        assert writer.flush(WAIT_S)
    assert "dump writer failed on rid boom" in caplog.text
    assert sorted(p.name for p in (shm_root / NS).iterdir()) == ["fine"]
    assert writer.stats.queued_bytes == 0


# --------------------------------------------------------------------------------------
# Shutdown
# --------------------------------------------------------------------------------------


def visible_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_shutdown_drains_the_queue(shm_root: Path) -> None:
    dumper, writer = make(shm_root, threads=2)
    for i in range(8):
        dumper.dump_batch(*pass_of(f"r{i}", 5, i))
    assert writer.close(drain_s=WAIT_S) == 0
    assert writer.alive == 0 and writer.stats.committed == 8
    assert not [f for f in visible_files(shm_root) if Path(f).name.startswith(".")]
    late = dumper.dump_batch(*pass_of("late", 2, 9))  # after shutdown: refused, not lost
    assert [r.rid for r in late.rejects] == ["late"] and "shut down" in late.rejects[0].reason
    assert not (shm_root / NS / "late").exists()


def test_shutdown_with_a_full_queue_abandons_without_partial_files(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first write is held in progress, the queue is full behind it; close() with no
    drain time abandons the queue: the write in progress completes under its real name,
    nothing else appears, no meta.json for any abandoned rid, no temporary file left."""
    gate = Gate(monkeypatch)
    rows = 4
    budget = 7 * rows * ROW_BYTES
    dumper, writer = make(shm_root, threads=1, queue_bytes=budget)
    first = [view("long", rows, num_tokens=2 * rows)]
    dumper.dump_batch(first, pass_of("long", rows, 0)[1])
    assert gate.entered.wait(WAIT_S)
    for i in range(5):
        dumper.dump_batch(*pass_of(f"r{i}", rows, i))
    last = [view("long", rows, start=rows, num_tokens=2 * rows)]
    dumper.dump_batch(last, pass_of("long", rows, 9)[1])
    assert writer.stats.queued_bytes == budget  # full: the next pass would block
    abandoned: list[int] = []
    closer = threading.Thread(target=lambda: abandoned.append(writer.close(0.0, WAIT_S)))
    with caplog.at_level(logging.WARNING, logger=hook_writer.__name__):
        closer.start()
        assert writer._abandon.wait(WAIT_S)  # the drain time is over: the queue goes
        gate.opened.set()  # the write in progress may finish now
        closer.join(WAIT_S)
    assert not closer.is_alive() and writer.alive == 0
    assert abandoned == [6] and writer.stats.abandoned == 6
    assert "6 dump parts unwritten" in caplog.text
    assert visible_files(shm_root) == [f"{NS}/long/part-0000000000-0000000004.bin"]
    assert writer.stats.queued_bytes == 0


def test_writer_needs_a_thread_and_a_budget(shm_root: Path) -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        BackgroundWriter(shm_root, threads=0, queue_bytes=1)
    assert WriterStats().queued_bytes == 0


@pytest.mark.parametrize("encoded", [False, True], ids=["host", "device"])
def test_fp8_parts_in_the_background(
    shm_root: Path, closing: list[BackgroundWriter], encoded: bool
) -> None:
    """FP8 requests through the writer threads: the same bytes as written synchronously,
    the budget counts the host bytes the pass holds, and bytes_written the part sizes."""
    dumper, writer = make(shm_root, threads=2)
    closing.append(writer)
    (aux1, final1), (aux2, final2) = finite_arrays(1 + 5, seed=3), finite_arrays(3, seed=4)
    for rid, fp8 in (("bf", False), ("q", True)):
        storage = FP8_AUX if fp8 else BF16_STORAGE
        first = dataclasses.replace(view(rid, 5, num_tokens=8), storage=storage)
        second = dataclasses.replace(view(rid, 3, start=5), storage=storage)
        for req, aux, final in ((first, aux1, final1), (second, aux2, final2)):
            load = pass_loader(aux, final, FP8_AUX if fp8 and encoded else None)
            reqs = [plain(1), req] if req.start == 0 else [req]
            queued = dumper.dump_batch(reqs, load).queued
            assert [(w.rid, w.storage) for w in queued] == [(rid, req.storage)]
    assert writer.flush(WAIT_S)
    check_fp8_dump(shm_root / NS / "q", read_bf16_rows(shm_root / NS / "bf"), FP8_AUX,
                   aux_layers=LAYERS)  # fmt: skip
    fp8_row = FP8_AUX.row_bytes(K + 1, H)
    assert writer.stats.bytes_written == 8 * ROW_BYTES + 8 * fp8_row
    assert writer.stats.queued_bytes == 0 and writer.stats.committed == 2
