"""FileWriter: a dump in /dev/shm becomes one durable safetensors file, or nothing at all."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import xxhash
from safetensors import safe_open

from hsx_async.dataset.durable import fsync_dir
from hsx_async.dataset.layout import build_layout, data_relpath, sample_key
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DiskFullError, DumpError, WriteError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    META_NAME,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
    DumpMeta,
    Storage,
    part_name,
    row_bytes,
)
from hsx_async.quantize import encode_rows
from hsx_async.run.dumps import writer as writer_module
from hsx_async.run.dumps.dump import Dump
from hsx_async.run.dumps.writer import FileWriter, WriteJob
from hsx_async.run.source import Sample
from tests.dataset.test_layout import load_sample, sample_bytes


@dataclass(frozen=True)
class Shape:
    hidden: int
    aux: tuple[int, ...]

    @property
    def row(self) -> int:
        return row_bytes(self.hidden, self.aux)


ALIGNED = Shape(512, (1, 2, 3))  # 4 layers × 512 × 2 bytes = 4096: O_DIRECT can copy it
UNALIGNED = Shape(24, (1, 2))  # 144 bytes a row: only sendfile can
PARTS = ((0, 16), (16, 30), (30, 37))


@dataclass(frozen=True)
class Case:
    job: WriteJob
    ids: npt.NDArray[np.int64]
    hidden: npt.NDArray[np.uint16]
    mask: npt.NDArray[np.uint8] | None


def make_case(
    shm_root: Path,
    shape: Shape,
    *,
    parts: tuple[tuple[int, int], ...] = PARTS,
    with_mask: bool = True,
    sid: str | int = "s-1",
) -> Case:
    """A committed dump in ``shm_root`` and the job that copies it."""
    t = parts[-1][1]
    layers = len(shape.aux) + 1
    rng = np.random.default_rng(t * 7919 + shape.hidden)
    hidden = rng.integers(0, 2**16, size=(t, layers, shape.hidden), dtype=np.uint16)
    rid = f"rid-{sample_key(sid)[:40]}"
    rid_dir = shm_root / "ns" / rid
    rid_dir.mkdir(parents=True)
    for start, end in parts:
        (rid_dir / part_name(start, end)).write_bytes(hidden[start:end].astype("<u2").tobytes())
    meta = DumpMeta(rid, t, shape.hidden, shape.aux, parts, "m", "test")
    (rid_dir / META_NAME).write_bytes(meta.to_json())
    ids = rng.integers(0, 150_000, size=t, dtype=np.int64)
    mask = rng.integers(0, 2, size=t, dtype=np.uint8) if with_mask else None
    layout = build_layout(
        sample_id=sid,
        num_tokens=t,
        hidden_size=shape.hidden,
        aux_layers=shape.aux,
        has_loss_mask=with_mask,
    )
    job = WriteJob(
        Sample(sid, 3, ids, mask),
        Dump(rid_dir, meta),
        layout,
        data_relpath(sample_key(sid)),
        "s0-t",
    )
    return Case(job, ids, hidden, mask)


def write_one(fw: FileWriter, job: WriteJob) -> ManifestEntry:
    """Stage and publish one sample, as the writer and the committer do for a batch."""
    staged = fw.stage(job)
    fw.publish([staged])
    return staged.entry


def check_written(out: Path, case: Case, entry: Any) -> None:
    """The file is complete, loads with safetensors and matches its manifest entry."""
    path = out / case.job.relpath
    data = path.read_bytes()
    assert data == sample_bytes(case.job.layout, case.ids, case.hidden, case.mask)
    assert entry.id == case.job.sample.id
    assert entry.path == case.job.relpath
    assert entry.num_tokens == case.ids.shape[0]
    assert entry.size == len(data) == case.job.layout.total_bytes
    assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
    tensors, meta = load_sample(path)
    np.testing.assert_array_equal(tensors["hidden_states"], case.hidden)
    np.testing.assert_array_equal(tensors["input_ids"], case.ids)
    if case.mask is not None:
        np.testing.assert_array_equal(tensors["loss_mask"], case.mask)
    assert meta["id"] == str(case.job.sample.id)
    assert_no_temp(out)


def assert_no_temp(out: Path) -> None:
    assert [p.name for p in out.rglob("*.tmp")] == []


def assert_nothing_written(out: Path) -> None:
    assert [p for p in out.rglob("*") if p.is_file()] == []


def o_direct_supported(directory: Path) -> bool:
    probe = directory / ".o-direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return True


class _OsProxy(types.SimpleNamespace):
    """``os`` with some functions replaced; every other name is the real module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def patch_os(monkeypatch: pytest.MonkeyPatch, **overrides: Callable[..., Any]) -> None:
    """Replace functions of ``os`` as the writer sees them, and nowhere else (pytest's own
    output and pathlib keep the real ones)."""
    monkeypatch.setattr(writer_module, "os", _OsProxy(**overrides))


def fail_on_call(number: int, real: Callable[..., Any], err: int) -> Callable[..., Any]:
    calls = 0

    def fake(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == number:
            raise OSError(err, os.strerror(err))
        return real(*args)

    return fake


@pytest.fixture
def out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


# --- both methods, aligned and not ------------------------------------------------------


@pytest.mark.parametrize("method", ["sendfile", "auto"])
@pytest.mark.parametrize("shape", [ALIGNED, UNALIGNED], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("with_mask", [True, False])
def test_write_produces_the_file_and_its_entry(
    shm_root: Path, out: Path, method: str, shape: Shape, with_mask: bool
) -> None:
    case = make_case(shm_root, shape, with_mask=with_mask)
    fw = FileWriter(out, method=method, fsync=True, row_bytes=shape.row)
    entry = write_one(fw, case.job)
    check_written(out, case, entry)
    if method == "auto":  # direct only where the shape allows and the disk accepts it
        expected = shape is ALIGNED and o_direct_supported(out)
        assert fw.direct is expected
    else:
        assert fw.direct is False


def test_direct_method(shm_root: Path, out: Path) -> None:
    if not o_direct_supported(out):
        pytest.skip("the temp file system refuses O_DIRECT")
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method="direct", fsync=True, row_bytes=ALIGNED.row)
    check_written(out, case, write_one(fw, case.job))
    assert fw.direct


def test_direct_part_larger_than_one_copy_chunk(shm_root: Path, out: Path) -> None:
    rows = writer_module.CHUNK // ALIGNED.row + 10  # the first part takes two chunks
    case = make_case(shm_root, ALIGNED, parts=((0, rows), (rows, rows + 3)))
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row)
    check_written(out, case, write_one(fw, case.job))


def test_direct_writes_whole_chunks_at_chunk_boundaries(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header and ids do not shift the bulk: every O_DIRECT write but the last is one
    whole chunk at a chunk-aligned file offset, and the file and its hash are those of
    the bytes in order."""
    _direct_or_skip("auto", out)
    case = make_case(shm_root, ALIGNED, parts=BIG_PARTS)
    writes: list[tuple[int, int]] = []

    def write(fd: int, data: Any) -> int:
        writes.append((os.lseek(fd, 0, os.SEEK_CUR), memoryview(data).nbytes))
        return os.write(fd, data)

    patch_os(monkeypatch, write=write)
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row)
    check_written(out, case, write_one(fw, case.job))
    chunk = writer_module.CHUNK
    *whole, (last_at, last_size) = writes
    assert len(whole) == 2
    assert all(at % chunk == 0 and size == chunk for at, size in whole), writes
    assert last_at == 2 * chunk and last_size % 4096 == 0


def test_direct_reads_the_next_chunk_while_the_last_one_is_written(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stream keeps the device busy: the O_DIRECT write of a chunk runs in a flusher
    thread while the copy thread reads and hashes the next one (here the first write
    waits until a read of the next chunk happened; a write in the copy thread would wait
    for ever). Writes stay in order, and the file and its hash are the plain copy's."""
    _direct_or_skip("auto", out)
    case = make_case(shm_root, ALIGNED, parts=BIG_PARTS)
    chunk = writer_module.CHUNK
    next_chunk_read = threading.Event()
    overlapped: list[bool] = []

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if offset >= chunk:  # the part's bytes past the file's first chunk
            next_chunk_read.set()
        return os.preadv(fd, buffers, offset)

    def write(fd: int, data: Any) -> int:
        if not overlapped:
            overlapped.append(next_chunk_read.wait(10))
        return os.write(fd, data)

    patch_os(monkeypatch, write=write, preadv=preadv)
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row)
    check_written(out, case, write_one(fw, case.job))
    fw.close()
    assert overlapped == [True]


def test_the_copies_buffers_are_made_once_when_the_writer_starts(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh memory's first touch is slow on a VM (PERF-NOTES): one buffer per planned copy
    is made (and touched) by the constructor, before the run, and every copy reuses one."""
    made: list[writer_module.HugePageBuffer] = []
    real = writer_module.HugePageBuffer

    def counted(size: int) -> Any:
        made.append(real(size))
        return made[-1]

    monkeypatch.setattr(writer_module, "HugePageBuffer", counted)
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row, copies=2)
    assert len(made) == 2
    for i in range(3):
        case = make_case(shm_root / str(i), ALIGNED, sid=f"s{i}")
        check_written(out, case, write_one(fw, case.job))
    assert len(made) == 2
    fw.close()


def test_each_copy_buffer_starts_on_a_huge_page_boundary() -> None:
    """THP backs only whole 2 MiB pages of a mapping: a buffer where the kernel put it had
    its CHUNKs straddle huge pages (bench/buffer_placement.py measures the cost)."""
    size = 2 * writer_module.CHUNK + writer_module.SUB
    buffers = [writer_module.HugePageBuffer(size) for _ in range(3)]  # back to back
    for buf in buffers:
        assert writer_module.address(buf.view) % writer_module.HUGE_PAGE == 0
        assert buf.view.nbytes == size and not buf.view.readonly


def test_direct_needs_an_aligned_row(out: Path) -> None:
    with pytest.raises(WriteError, match="multiple of 4096; use 'auto' or 'sendfile'"):
        FileWriter(out, method="direct", fsync=True, row_bytes=UNALIGNED.row)


def test_several_samples_share_a_bucket_and_ids_of_any_kind(shm_root: Path, out: Path) -> None:
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row)
    for sid in ("a", 7, "../../etc/passwd"):
        case = make_case(shm_root / str(abs(hash(sid))), ALIGNED, parts=((0, 5),), sid=sid)
        entry = write_one(fw, case.job)
        check_written(out, case, entry)
        assert (out / entry.path).resolve().is_relative_to(out.resolve())


# --- O_DIRECT refused -------------------------------------------------------------------


def _uses_direct(fw: FileWriter) -> bool:
    """Read the flag afresh (a plain attribute read would stay narrowed for mypy)."""
    return fw.direct


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    refused: list[int] = []

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            refused.append(flags)
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.open(path, flags, *args, **kwargs)

    patch_os(monkeypatch, open=fake_open)
    return refused


def test_auto_falls_back_for_good_when_o_direct_is_refused(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = _refuse_o_direct(monkeypatch)
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    assert fw.direct
    first = make_case(shm_root / "a", ALIGNED)
    check_written(out, first, write_one(fw, first.job))
    assert _uses_direct(fw) is False
    second = make_case(shm_root / "b", ALIGNED, sid="s-2")
    check_written(out, second, write_one(fw, second.job))
    assert len(refused) == 1  # the fallback is remembered, not retried per file


def test_forced_direct_refused_is_a_write_error(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_o_direct(monkeypatch)
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method="direct", fsync=True, row_bytes=ALIGNED.row)
    with pytest.raises(WriteError, match="Invalid argument") as info:
        write_one(fw, case.job)
    assert not isinstance(info.value, DiskFullError)
    assert_nothing_written(out)


# --- a full disk ------------------------------------------------------------------------


def _direct_or_skip(method: str, out: Path) -> None:
    if method == "auto" and not o_direct_supported(out):
        pytest.skip("the temp file system refuses O_DIRECT")


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("sendfile", 1),  # header + input_ids
        ("sendfile", 2),  # loss_mask
        ("auto", 1),  # direct: the only block of a small sample
    ],
)
def test_enospc_on_write_leaves_nothing(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, method: str, call: int
) -> None:
    _direct_or_skip(method, out)
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method=method, fsync=True, row_bytes=ALIGNED.row)
    patch_os(monkeypatch, write=fail_on_call(call, os.write, errno.ENOSPC))
    with pytest.raises(DiskFullError, match=r"no space left writing .*free space"):
        write_one(fw, case.job)
    assert_nothing_written(out)
    assert not (out / case.job.relpath).exists()


# A sample of two parts, the first spanning more than two chunks. Read into the buffer,
# O_DIRECT writes 1: the header, ids and the start of the part; 2: a whole chunk; 3: the
# rest, the second part and the loss mask, zero-padded.
BIG_ROWS = 2 * writer_module.CHUNK // ALIGNED.row + 10
BIG_PARTS = ((0, BIG_ROWS), (BIG_ROWS, BIG_ROWS + 3))


@pytest.mark.parametrize("call", [1, 2, 3], ids=["first-block", "middle", "padded-last"])
def test_enospc_on_a_direct_write_leaves_nothing(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, call: int
) -> None:
    """Failing inside a part's copy too: a view left alive would turn ENOSPC into
    BufferError when the buffer is resized or closed."""
    _direct_or_skip("auto", out)
    case = make_case(shm_root, ALIGNED, parts=BIG_PARTS)
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    patch_os(monkeypatch, write=fail_on_call(call, os.write, errno.ENOSPC))
    with pytest.raises(DiskFullError, match=r"no space left writing .*free space"):
        write_one(fw, case.job)
    assert_nothing_written(out)
    assert not (out / case.job.relpath).exists()


def fail_fsync(monkeypatch: pytest.MonkeyPatch, *, directory: bool, number: int) -> None:
    """ENOSPC from the ``number``-th fsync of a directory (or of a file), wherever the
    writer's helpers live: the fd's type says which kind of fsync it is."""
    real = os.fsync
    calls = 0

    def fake(fd: int) -> None:
        nonlocal calls
        if stat.S_ISDIR(os.fstat(fd).st_mode) == directory:
            calls += 1
            if calls == number:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fake)


@pytest.mark.parametrize("what", ["sendfile", "ftruncate"])
def test_enospc_elsewhere_leaves_nothing(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    method = "sendfile" if what == "sendfile" else "auto"
    _direct_or_skip(method, out)
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method=method, fsync=True, row_bytes=ALIGNED.row)
    patch_os(monkeypatch, **{what: fail_on_call(1, getattr(os, what), errno.ENOSPC)})
    with pytest.raises(DiskFullError):
        write_one(fw, case.job)
    assert_nothing_written(out)


@pytest.mark.parametrize("method", ["sendfile", "auto"])
def test_enospc_syncing_the_file_leaves_nothing(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method=method, fsync=True, row_bytes=ALIGNED.row)
    fail_fsync(monkeypatch, directory=False, number=1)
    with pytest.raises(DiskFullError):
        write_one(fw, case.job)
    assert_nothing_written(out)


# Directory fsyncs of a first publish, all after the rename: 1–2 the names of data/ (in the
# output directory) and of the new bucket (in data/), 3 the bucket's entries.
@pytest.mark.parametrize("number", [1, 2, 3], ids=["data", "new-bucket", "after-rename"])
def test_enospc_syncing_a_directory_is_a_disk_full_error(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, number: int
) -> None:
    case = make_case(shm_root, UNALIGNED)
    fw = FileWriter(out, method="sendfile", fsync=True, row_bytes=UNALIGNED.row)
    fail_fsync(monkeypatch, directory=True, number=number)
    with pytest.raises(DiskFullError):
        write_one(fw, case.job)
    assert_no_temp(out)
    # The file stays under its name: it has no manifest line, so a resume deletes it.
    assert (out / case.job.relpath).exists()


def _record_dir_syncs(monkeypatch: pytest.MonkeyPatch, out: Path) -> list[str]:
    synced: list[str] = []

    def record(path: Path) -> None:
        synced.append(str(path.relative_to(out)))
        fsync_dir(path)

    monkeypatch.setattr(writer_module, "fsync_dir", record)
    return synced


def test_stage_leaves_only_a_synced_temp_file_and_publish_names_it(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = make_case(shm_root, ALIGNED)
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    synced = _record_dir_syncs(monkeypatch, out)
    staged = fw.stage(case.job)
    assert not (out / case.job.relpath).exists()
    assert [p.name for p in out.rglob("*.tmp")] == [staged.tmp.name]
    assert synced == [], "no name is synced before the publish"
    fw.publish([staged])
    check_written(out, case, staged.entry)
    bucket = str(Path(case.job.relpath).parent)
    assert synced == [".", "data", bucket]


def test_one_publish_syncs_each_directory_once_for_a_batch(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five samples, two buckets (three in one): 2 + 2 directory syncs, not 5 × 3."""
    cases = [make_case(shm_root, ALIGNED, sid=f"s-{i}") for i in range(5)]
    buckets = ["data/aa", "data/aa", "data/aa", "data/bb", "data/bb"]
    jobs = [
        dataclasses.replace(c.job, relpath=f"{b}/{sample_key(c.job.sample.id)}.safetensors")
        for c, b in zip(cases, buckets, strict=True)
    ]
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    synced = _record_dir_syncs(monkeypatch, out)
    staged = [fw.stage(job) for job in jobs]
    fw.publish(staged)
    # The names of new directories first, in order; then the buckets, side by side.
    assert synced[:2] == [".", "data"]
    assert sorted(synced[2:]) == ["data/aa", "data/bb"]
    for case, job, s in zip(cases, jobs, staged, strict=True):
        check_written(out, dataclasses.replace(case, job=job), s.entry)


def test_a_failed_bucket_sync_fails_the_publish_after_every_other_sync_ran(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight buckets synced side by side, one fails: the publish raises DiskFullError, and
    only once no sync is still running behind it."""
    cases = [make_case(shm_root, ALIGNED, sid=f"s-{i}") for i in range(8)]
    jobs = [
        dataclasses.replace(c.job, relpath=f"data/b{i}/{sample_key(c.job.sample.id)}.st")
        for i, c in enumerate(cases)
    ]
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    staged = [fw.stage(job) for job in jobs]
    finished: list[str] = []
    lock = threading.Lock()

    def sync(path: Path) -> None:
        if path.name == "b3":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync_dir(path)
        with lock:
            finished.append(path.name)

    monkeypatch.setattr(writer_module, "fsync_dir", sync)
    with pytest.raises(DiskFullError, match="b3"):
        fw.publish(staged)
    buckets = {f"b{i}" for i in range(8)} - {"b3"}
    assert buckets <= set(finished), "every other sync ran to its end"
    for s in staged:  # renamed, not listed: a resume deletes them
        assert s.final.exists()


def test_a_bucket_name_is_synced_until_a_publish_succeeded(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two samples staged into a new bucket, published in separate batches, second first:
    that batch must sync the bucket's name too (the other one has not yet). And after a
    failed sync the next publish syncs it again."""
    a, b, c = (make_case(shm_root, ALIGNED, sid=f"s-{i}") for i in range(3))
    jobs = [
        dataclasses.replace(x.job, relpath=f"data/cc/{sample_key(x.job.sample.id)}.safetensors")
        for x in (a, b, c)
    ]
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    synced = _record_dir_syncs(monkeypatch, out)
    first, second = fw.stage(jobs[0]), fw.stage(jobs[1])
    fail_fsync(monkeypatch, directory=True, number=1)
    with pytest.raises(DiskFullError):
        fw.publish([second])
    synced.clear()
    fw.publish([first])
    assert synced == [".", "data", "data/cc"], "the failed sync is redone"
    synced.clear()
    fw.publish([fw.stage(jobs[2])])
    assert synced == ["data/cc"], "once durable, only the bucket's entries"


def test_each_name_above_a_bucket_is_synced_once_a_run(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second new bucket needs only its own name synced (in data/): the name of data/
    in the output directory is already durable."""
    a, b = (make_case(shm_root, ALIGNED, sid=f"s-{i}") for i in range(2))
    jobs = [
        dataclasses.replace(x.job, relpath=f"data/{bucket}/{sample_key(x.job.sample.id)}.st")
        for x, bucket in ((a, "aa"), (b, "bb"))
    ]
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=ALIGNED.row)
    synced = _record_dir_syncs(monkeypatch, out)
    fw.publish([fw.stage(jobs[0])])
    assert synced == [".", "data", "data/aa"]
    synced.clear()
    fw.publish([fw.stage(jobs[1])])
    assert synced == ["data", "data/bb"]


def test_discard_temps_removes_what_was_staged_and_never_published(
    shm_root: Path, out: Path
) -> None:
    a, b = (make_case(shm_root, ALIGNED, sid=f"s-{i}") for i in range(2))
    fw = FileWriter(out, method="auto", fsync=False, row_bytes=ALIGNED.row)
    published, abandoned = fw.stage(a.job), fw.stage(b.job)
    fw.publish([published])
    fw.discard_temps()
    assert_no_temp(out)
    check_written(out, a, published.entry)
    assert not (out / b.job.relpath).exists()
    assert not abandoned.tmp.exists()


def test_other_os_errors_are_write_errors(
    shm_root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = make_case(shm_root, UNALIGNED)
    fw = FileWriter(out, method="sendfile", fsync=False, row_bytes=UNALIGNED.row)
    patch_os(monkeypatch, write=fail_on_call(1, os.write, errno.EIO))
    with pytest.raises(WriteError, match="Input/output error") as info:
        write_one(fw, case.job)
    assert not isinstance(info.value, DiskFullError)
    assert_nothing_written(out)


# --- the dump changed after validation --------------------------------------------------


@pytest.mark.parametrize("method", ["sendfile", "auto"])
def test_part_resized_after_validation_is_a_dump_error(
    shm_root: Path, out: Path, method: str
) -> None:
    case = make_case(shm_root, ALIGNED)
    path = case.job.dump.part_paths()[1]
    os.truncate(path, path.stat().st_size - 4096)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    with pytest.raises(DumpError, match="changed after validation"):
        write_one(fw, case.job)
    assert_nothing_written(out)


def test_part_removed_after_validation_is_a_dump_error(shm_root: Path, out: Path) -> None:
    case = make_case(shm_root, UNALIGNED)
    case.job.dump.part_paths()[2].unlink()
    fw = FileWriter(out, method="sendfile", fsync=False, row_bytes=UNALIGNED.row)
    with pytest.raises(DumpError, match="vanished before it was copied"):
        write_one(fw, case.job)
    assert_nothing_written(out)


def test_part_swapped_for_a_link_after_validation_is_a_dump_error(
    shm_root: Path, out: Path
) -> None:
    case = make_case(shm_root, UNALIGNED)
    part = case.job.dump.part_paths()[0]
    real = shm_root / "elsewhere.bin"
    part.rename(real)
    part.symlink_to(real)
    fw = FileWriter(out, method="sendfile", fsync=False, row_bytes=UNALIGNED.row)
    with pytest.raises(DumpError, match="became a link after validation"):
        write_one(fw, case.job)
    assert_nothing_written(out)


# --- FP8 storage (PROTOCOL §3, §4, version 3) --------------------------------------------


def _fp8_case(
    shm_root: Path,
    storage: Storage,
    *,
    dump_fp8: bool,
    rid: str,
    edit: Callable[[torch.Tensor], None] | None = None,
) -> WriteJob:
    """Realistic rows (per-slot magnitudes differing by orders, one outlier token), dumped
    as the hook would store them (``dump_fp8``) or as bfloat16 for the writer to quantize;
    ``edit`` changes the rows ``[T, L, H]`` first."""
    shape, t = Shape(64, (1, 2, 3)), PARTS[-1][1]
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn((t, 4, shape.hidden), generator=gen)
    rows *= torch.tensor([0.05, 1.0, 30.0, 2.0]).view(1, 4, 1)
    rows[0] *= 100.0
    if edit is not None:
        edit(rows)
    rows = rows.to(torch.bfloat16)
    rid_dir = shm_root / "ns" / rid
    rid_dir.mkdir(parents=True)
    dumped = storage if dump_fp8 else BF16_STORAGE
    for start, end in PARTS:
        blob = b"".join(
            bytes(t_.contiguous().view(torch.uint8).numpy())
            for t_ in encode_rows(rows[start:end], dumped)
        )
        (rid_dir / part_name(start, end)).write_bytes(blob)
    meta = DumpMeta(rid, t, shape.hidden, shape.aux, PARTS, "m", "test", storage=dumped)
    (rid_dir / META_NAME).write_bytes(meta.to_json())
    ids = np.arange(t, dtype=np.int64)
    layout = build_layout(sample_id="q", num_tokens=t, hidden_size=shape.hidden,
                          aux_layers=shape.aux, has_loss_mask=True, storage=storage)  # fmt: skip
    sample = Sample("q", 0, ids, np.ones(t, dtype=np.uint8))
    return WriteJob(sample, Dump(rid_dir, meta), layout, data_relpath("q"), f"s0-{rid}")


@pytest.mark.parametrize("layout", [PER_TOKEN_SLOT, PER_TOKEN_SLOT_OUTLIERS16])
@pytest.mark.parametrize("method", ["direct", "sendfile"])
@pytest.mark.parametrize("slots", [(0, 1, 2, 3), (0, 1, 2)])
def test_fp8_dump_is_copied_unchanged_and_a_bf16_dump_quantized_to_the_same_bytes(
    shm_root: Path, tmp_path: Path, method: str, slots: tuple[int, ...], layout: str
) -> None:
    """The hook's FP8 sections are copied byte for byte; a server that dumped bfloat16
    gets the same file from the writer's fallback quantizer (same bytes, same hash), and
    the file loads with safetensors as e4m3fn + float32 scales (+ the outliers, + the bf16
    slots)."""
    storage = Storage(FP8, slots, layout)
    files = []
    for dump_fp8 in (True, False):
        out = tmp_path / f"out-{dump_fp8}"
        out.mkdir()
        job = _fp8_case(shm_root, storage, dump_fp8=dump_fp8, rid=f"r-{dump_fp8}")
        fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
        entry = write_one(fw, job)
        fw.close()
        data = (out / job.relpath).read_bytes()
        assert entry.size == len(data) == job.layout.total_bytes
        assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
        files.append(out / job.relpath)
    assert files[0].read_bytes() == files[1].read_bytes()
    with safe_open(str(files[0]), "pt") as fh:
        assert fh.metadata()["dtype"] == FP8
        assert fh.metadata()["quantized"] == ",".join(map(str, slots))
        q = fh.get_tensor("hidden_states")
        scales = fh.get_tensor("hidden_states_scales")
        assert q.dtype == torch.float8_e4m3fn and q.shape == (37, len(slots), 64)
        assert scales.dtype == torch.float32 and scales.shape == (37, len(slots), 1)
        names = set(fh.keys())
        assert ("hidden_states_unquantized" in names) == (len(slots) < 4)
        assert ("hidden_states_outlier_index" in names) == (layout == PER_TOKEN_SLOT_OUTLIERS16)
        assert bool((q.float().abs().amax(-1) == 448.0).all())  # each vector's amax


def test_fp8_fallback_memory_is_one_block_whatever_the_sample(
    shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback quantizes a bounded block of rows at a time: with blocks of 3 rows the
    parts (16, 14, 7 rows) are read in pieces, and the file is still the hook's (the
    outliers layout: its per-vector sections gathered over the blocks)."""
    storage = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT_OUTLIERS16)
    ref = _fp8_case(shm_root, storage, dump_fp8=True, rid="r-ref")
    job = _fp8_case(shm_root, storage, dump_fp8=False, rid="r-blocks")
    monkeypatch.setattr(writer_module, "_ENCODE_BYTES", 3 * job.dump.meta.row_bytes)
    outs = []
    for j, name in ((ref, "a"), (job, "b")):
        out = tmp_path / name
        out.mkdir()
        fw = FileWriter(out, method="sendfile", fsync=False, row_bytes=ALIGNED.row)
        write_one(fw, j)
        fw.close()
        outs.append((out / j.relpath).read_bytes())
    assert outs[0] == outs[1]


def test_the_client_imports_torch_only_to_quantize() -> None:
    """A bf16 run (and an FP8 one whose hook quantizes) copies bytes: importing torch
    would cost each client ~1.4 CPU-s and 200 MB (bench/README.md, FP8)."""
    code = "import sys, hsx_async.cli, hsx_async.run.daemon.daemon; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _corrupt_scale(job: WriteJob, value: float, *, part: int = 1, row: int = 3) -> None:
    """Overwrite one float32 scale of a hook-written FP8 dump (its scale section follows
    the e4m3fn one in each part), as a broken or hostile hook could leave it."""
    meta = job.dump.meta
    start, end = meta.parts[part]
    n, lq, hidden = end - start, len(job.layout.storage.quantized), meta.hidden_size
    offset = n * lq * hidden + (row * lq + lq - 1) * 4  # the last quantized slot of the row
    path = job.dump.part_paths()[part]
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(np.array([value], dtype="<f4").tobytes())


BAD_SCALES = {
    "negative": -0.5,
    "zero": 0.0,
    "negative zero": -0.0,
    "subnormal": 2.0**-127,
    "smallest subnormal": 2.0**-149,
    "NaN": float("nan"),
    "Inf": float("inf"),
    "-Inf": float("-inf"),
}


@pytest.mark.parametrize("method", ["direct", "sendfile"])
@pytest.mark.parametrize("value", list(BAD_SCALES.values()), ids=list(BAD_SCALES))
def test_fp8_scales_no_quantizer_makes_fail_the_copy(
    shm_root: Path, tmp_path: Path, method: str, value: float
) -> None:
    """PROTOCOL §3 makes every scale max(amax / 448, 2^-126): a hook-written scale that is
    negative (it flips the sign of its vector), zero, subnormal or not finite is an invalid
    dump, refused while its bytes are copied; nothing is written."""
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, Storage(FP8, (0, 1, 2)), dump_fp8=True, rid="r-bad")
    _corrupt_scale(job, value)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    with pytest.raises(DumpError, match=r"part-0000000016-0000000030\.bin: 1 FP8 scales are "):
        fw.stage(job)
    fw.close()
    assert_nothing_written(out)


@pytest.mark.parametrize("method", ["direct", "sendfile"])
def test_fp8_scales_at_the_rules_bounds_are_copied(
    shm_root: Path, tmp_path: Path, method: str
) -> None:
    """The smallest scale the rule makes (2^-126: an all-zero vector) and float32's largest
    pass; the file holds them as dumped."""
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, Storage(FP8, (0, 1, 2)), dump_fp8=True, rid="r-edge")
    _corrupt_scale(job, 2.0**-126, row=0)
    _corrupt_scale(job, float(np.finfo(np.float32).max), row=1)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    write_one(fw, job)
    fw.close()
    with safe_open(str(out / job.relpath), "pt") as fh:
        scales = fh.get_tensor("hidden_states_scales")
    assert scales[16, 2, 0].item() == 2.0**-126
    assert scales[17, 2, 0].item() == float(np.finfo(np.float32).max)


def test_a_checked_section_is_read_in_blocks_and_still_hashed_in_order(
    shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scales are read and checked before the copy, whatever SUB (here 8 bytes); a bad one
    in a later row is found, and a good dump's file and hash are the plain copy's."""
    monkeypatch.setattr(writer_module, "SUB", 8)
    storage = Storage(FP8, (0, 1, 2))
    for name, value in (("good", None), ("bad", -1.0)):
        out = tmp_path / name
        out.mkdir()
        job = _fp8_case(shm_root, storage, dump_fp8=True, rid=f"r-{name}")
        fw = FileWriter(out, method="direct", fsync=False, row_bytes=ALIGNED.row)
        if value is None:
            entry = write_one(fw, job)
            data = (out / job.relpath).read_bytes()
            assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
        else:
            _corrupt_scale(job, value, row=12)
            with pytest.raises(DumpError, match="1 FP8 scales are negative"):
                fw.stage(job)
        fw.close()


def _corrupt_outliers(job: WriteJob, *, index: int | None = None, value: float | None = None,
                      part: int = 1, row: int = 3) -> None:  # fmt: skip
    """Overwrite the first outlier entry (its channel, or its value) of one vector of a
    hook-written dump of the outliers layout, as a broken or hostile hook could leave it."""
    meta = job.dump.meta
    start, end = meta.parts[part]
    n, lq, hidden = end - start, len(job.layout.storage.quantized), meta.hidden_size
    sections = n * lq * (hidden + 4)  # the e4m3fn values, then the scales
    if index is not None:
        at, data = sections + row * lq * 32, np.array([index], dtype="<u2").tobytes()
    else:
        at = sections + n * lq * 32 + row * lq * 32
        data = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with job.dump.part_paths()[part].open("r+b") as fh:
        fh.seek(at)
        fh.write(data)


OUTLIERS16 = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT_OUTLIERS16)


@pytest.mark.parametrize("method", ["direct", "sendfile"])
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"index": 64}, "1 FP8 vectors' outlier channels are past the hidden size 64"),
        ({"index": 0xFFFF}, "1 FP8 vectors' outlier channels are past the hidden size 64"),
        ({"value": float("nan")}, "1 FP8 outlier values are not finite"),
        ({"value": float("-inf")}, "1 FP8 outlier values are not finite"),
    ],
    ids=["past H", "unused first", "NaN", "-Inf"],
)
def test_fp8_outliers_no_quantizer_makes_fail_the_copy(
    shm_root: Path, tmp_path: Path, method: str, change: dict[str, float], match: str
) -> None:
    """The outliers layout's channels (ascending, below H, the unused last) and values
    (finite, as the scales are) are checked while they are copied; nothing is written."""
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, OUTLIERS16, dump_fp8=True, rid="r-bad")
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    _corrupt_outliers(job, **change)  # type: ignore[arg-type]
    with pytest.raises(DumpError, match=rf"part-0000000016-0000000030\.bin: {match}"):
        fw.stage(job)
    fw.close()
    assert_nothing_written(out)


def test_outlier_channels_are_checked_in_whole_vectors_whatever_the_block(
    shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SUB at 40 bytes (the FP8 values, 64 bytes a vector, then watched in windows
    that split vectors) the outliers' checks still pass a good dump; the file and hash are
    the plain copy's."""
    monkeypatch.setattr(writer_module, "SUB", 40)
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, OUTLIERS16, dump_fp8=True, rid="r-blocks")
    fw = FileWriter(out, method="direct", fsync=False, row_bytes=ALIGNED.row)
    entry = write_one(fw, job)
    fw.close()
    data = (out / job.relpath).read_bytes()
    assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(data)


def _outlier_sections(job: WriteJob, part: int) -> tuple[Path, int, int]:
    """A hook-written outliers dump's part: its path, where its outlier values start, and
    its vectors (rows × quantized slots)."""
    meta = job.dump.meta
    start, end = meta.parts[part]
    vectors = (end - start) * len(job.layout.storage.quantized)
    values_at = vectors * (meta.hidden_size + 4 + 32)  # e4m3fn values, scales, channels
    return job.dump.part_paths()[part], values_at, vectors


def _values_by_magnitude(job: WriteJob) -> None:
    """Each vector's outlier values listed largest |value| first instead of in their
    channels' (ascending) order, the channels left ascending: every per-section rule holds."""
    for part in range(len(job.dump.meta.parts)):
        path, at, vectors = _outlier_sections(job, part)
        data = bytearray(path.read_bytes())
        bits = np.frombuffer(data, "<u2", vectors * 16, at).reshape(vectors, 16).copy()
        magnitude = (bits & 0x7FFF).astype(np.int64)  # bfloat16 bits order as |value| does
        order = np.argsort(-magnitude, axis=1, kind="stable")
        data[at : at + bits.nbytes] = np.take_along_axis(bits, order, axis=1).tobytes()
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("method", ["direct", "sendfile"])
def test_outlier_values_out_of_their_channels_order_fail_the_copy(
    shm_root: Path, tmp_path: Path, method: str
) -> None:
    """Issue 38: outlier values stored by magnitude, their channels ascending, passed every
    check of the copy (only ``verify --deep`` saw them); each outlier's own FP8 value must
    be ±448 with its value's sign, and the copy now checks that as it copies."""
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, OUTLIERS16, dump_fp8=True, rid="r-order")
    _values_by_magnitude(job)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    match = r"0000-0000000016\.bin: FP8 outliers' own values are not ±448 with their sign "
    with pytest.raises(DumpError, match=match + r"\(\d+ in a stretch; first: vector 0, "):
        fw.stage(job)
    fw.close()
    assert_nothing_written(out)


@pytest.mark.parametrize(("method", "sub"), [("direct", None), ("sendfile", 40), ("sendfile", 1)])
def test_one_outliers_fp8_value_of_the_wrong_sign_fails_the_copy_wherever_it_lies(
    shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
    sub: int | None,
) -> None:  # fmt: skip
    """One flipped code at an outlier's channel, in the last vector of a part, is found
    whether the copy sees the values whole (direct) or in windows splitting vectors."""
    if sub is not None:
        monkeypatch.setattr(writer_module, "SUB", sub)
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, OUTLIERS16, dump_fp8=True, rid="r-sign")
    path, at, vectors = _outlier_sections(job, 1)
    data = bytearray(path.read_bytes())
    last = vectors - 1
    channel = int(np.frombuffer(data, "<u2", 1, at - vectors * 32 + last * 32)[0])
    data[last * 64 + channel] ^= 0x80  # e4m3fn's sign bit
    path.write_bytes(bytes(data))
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    match = rf"0030\.bin: FP8 .* \(1 in a stretch; first: vector {last}, channel {channel},"
    with pytest.raises(DumpError, match=match):
        fw.stage(job)
    fw.close()
    assert_nothing_written(out)


def _infinities(rows: torch.Tensor) -> None:
    rows[5, 1, :20] = float("inf")  # more infinite values than the 16 outliers


@pytest.mark.parametrize("dump_fp8", [True, False], ids=["hook", "client"])
def test_more_infinities_than_outliers_are_refused_whoever_quantizes(
    shm_root: Path, tmp_path: Path, dump_fp8: bool
) -> None:
    """Issue 38: a vector with more than 16 infinite values was stored as finite
    ±3.39e38 with a finite scale; the rule gives it an infinite scale, which the copy
    refuses, from the hook's dump and from the client's own quantizer alike."""
    out = tmp_path / "out"
    out.mkdir()
    job = _fp8_case(shm_root, OUTLIERS16, dump_fp8=dump_fp8, rid="r-inf", edit=_infinities)
    fw = FileWriter(out, method="sendfile", fsync=False, row_bytes=ALIGNED.row)
    with pytest.raises(DumpError, match=r"1 FP8 scales are negative, zero, subnormal or not "
                       r"finite \(first: inf\)"):  # fmt: skip
        fw.stage(job)
    fw.close()
    assert_nothing_written(out)
