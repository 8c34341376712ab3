"""Moving a dump from /dev/shm into a durable dataset file (PROTOCOL §4). Blocking: threads.

Two steps, so that the slow part runs in parallel and the syncs are shared:

- :meth:`FileWriter.stage` (one writer thread per sample): header and ``input_ids`` from
  memory, ``hidden_states`` copied part by part from the tmpfs, ``loss_mask`` last, into a
  temp file; XXH3-64 over the same bytes as they are written (no second pass), fsync.
- :meth:`FileWriter.publish` (the group commit, many samples at once): rename each temp
  file into place, then one fsync per directory touched (a bucket's name in ``data/``,
  the new names in each bucket). Only then does the caller write the manifest lines.

FP8 datasets (PROTOCOL versions 3, 4): a dump the hook stored as FP8 is copied the same way,
section by section (each file tensor is one section of every part, in row order), bytes
unchanged; its per-vector sections (the scales, and the outliers' channels and values:
4 or 68 bytes a vector, ~1 % of the sample) are read first into the copy's own memory,
checked there against the quantization rule (:func:`~hsx_async.protocol.section_check`: a
negative, zero, subnormal or non-finite scale, outlier channels out of order or past H, a
non-finite outlier value are an invalid dump, a failed attempt) and written from there:
what is checked is what is written. The big FP8 values get no extra pass: in the outliers
layout each outlier's own value is checked against its outlier entry as the copy's buffer
holds it (:class:`_OutlierWatch`: ±448 with the value's sign, what ``hsx verify --deep``
checks per vector), 16 bytes a vector. A server that dumped bfloat16 gets its rows
quantized here, by the same quantizer, a bounded block of rows at a time
(:func:`_encoded`), its per-vector sections checked as a hook's: the same file as if the
hook had done it, at the CPU cost bench/README.md ("FP8") measures.

Copy methods:

- ``direct``: the file's bytes — header and ``input_ids``, the parts, ``loss_mask`` — pass
  in order through two page-aligned buffers of ``CHUNK`` bytes, the parts read into one
  (``preadv``) ``SUB`` bytes at a time, each piece hashed while it is still in the CPU
  cache, while the other, full, is written with ``O_DIRECT`` at a ``CHUNK`` boundary of
  the file by a flusher thread: one memory copy, no page-cache pollution, the device sees
  whole aligned writes, and one stream keeps it busy while the next chunk is read.
  Needs every part to start on a 4 KiB boundary in the file, which holds when L × H × 2 is
  a multiple of 4096 (any real model); the layout pads the header so ``hidden_states``
  starts aligned.
- ``sendfile``: kernel copy into the page cache; works everywhere (``copy_file_range`` does
  not work from tmpfs to ext4). The hash reads the tmpfs part through the same buffer.

``auto`` picks ``direct`` when the shape allows and the file system accepts O_DIRECT, and
falls back to ``sendfile`` for good on the first EINVAL.

Why no part is ever mapped: a dump belongs to an untrusted server, and a part truncated
under a mapping makes the next access to it raise SIGBUS, which kills the process (and
Python's ``mmap`` refuses a window past a shrunken end with ``ValueError``). A read
(``preadv``, ``sendfile``) of a shrunken part just comes back short, which fails the
attempt. Mapping was only ever cheaper on a huge-page tmpfs (2 MiB faults); on 4 KiB pages
faulting cost ~0.7 CPU-s/GB against ~0.3 for the read copy (bench/README.md, "Findings").
Nothing is read whole either, so a 32k-token sample adds nothing to the RSS but the buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hsx_async.dataset.durable import fsync_dir, write_error
from hsx_async.dataset.layout import ALIGN, FileLayout
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DumpError, WriteError
from hsx_async.protocol import (
    HIDDEN,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    SCALE_BYTES,
    SCALES,
    Section,
    SectionCheck,
    num_layers,
    saturated_codes,
    section_check,
)
from hsx_async.run.dumps.dump import Dump, DumpLinkError, open_dump_dir, open_dump_file
from hsx_async.run.dumps.failpoints import failpoint
from hsx_async.run.source import Sample

if TYPE_CHECKING:
    import torch

CHUNK = 8 << 20  # bytes per O_DIRECT write: large enough to keep the device streaming
SUB = 256 << 10  # bytes read then hashed at once: still in the L2 cache when hashed
WATCHED = 1 << 20  # bytes a watch sees at once (see _read_hashed)
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
Hasher = xxhash.xxh3_64
Flusher = futures.Executor
Watch = Callable[[memoryview, int], None]  # sees copied bytes and their offset in the range
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass(frozen=True, slots=True)
class WriteJob:
    sample: Sample
    dump: Dump
    layout: FileLayout
    relpath: str  # data/xx/<key>.safetensors
    tmp_tag: str  # unique per run and shard, so shards never touch each other's temp files


@dataclass(frozen=True, slots=True)
class Staged:
    """A sample file written and fsynced under its temp name, waiting for :meth:`publish`."""

    tmp: Path
    final: Path
    entry: ManifestEntry
    new_dirs: tuple[Path, ...]  # directories whose name publish must make durable first


class _BufferPool:
    """The copies' buffers (:class:`HugePageBuffer`, each: two CHUNKs to write from, SUB
    bytes for checked pieces), made and touched when the writer starts, reused by every copy,
    never freed while it runs: allocating large buffers on the hot path stalled the
    process, and the first touch of fresh memory costs ~2.3 CPU-s/GB on this VM
    (PERF-NOTES) — 16 MiB a copy, at the start of every run.

    Private memory backed by transparent huge pages where the kernel allows it (the
    ``madvise`` mode is the common default): an O_DIRECT write from 2 MiB pages pins 4
    pages per CHUNK instead of 2,048 and hands the device a few large segments. Measured
    here: ~25% less CPU per GB and twice the throughput on the virtio disk."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._free = [HugePageBuffer(2 * CHUNK + SUB) for _ in range(count)]

    @contextlib.contextmanager
    def lease(self) -> Iterator[memoryview]:
        """A buffer for one copy (a new one if more copies run than were planned for)."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = HugePageBuffer(2 * CHUNK + SUB)
        try:
            yield buf.view
        finally:
            with self._lock:
                self._free.append(buf)

    def clear(self) -> None:
        """Drop the buffers: their memory goes with the last view of it (not unmapped
        here, under a view a failed copy may still hold)."""
        with self._lock:
            self._free.clear()


class HugePageBuffer:
    """``size`` bytes (rounded up to ALIGN) of private memory, each page touched now,
    ``view`` starting on a huge-page boundary. A mapping is only page-aligned, and THP
    backs only the whole 2 MiB pages inside it: placed where the kernel put it, a
    buffer's CHUNKs straddled huge pages and some of its bytes lay on 4 KiB pages, so an
    O_DIRECT write handed the device more, smaller segments (bench/buffer_placement.py:
    ~1.15× the write rate and half its CPU from a buffer on the boundary)."""

    def __init__(self, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        # One huge page more than needed, to start the view on a boundary within it.
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # THP disabled: small pages work as well
                self._map.madvise(advice)
        with memoryview(self._map) as whole:
            start = -address(whole) % HUGE_PAGE
            self.view = whole[start : start + size]
        for offset in range(0, size, mmap.PAGESIZE):
            self.view[offset] = 0


def address(view: memoryview) -> int:
    """Where a writable ``view``'s bytes start in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class FileWriter:
    """Writes sample files under ``out_dir``; thread-safe, one instance per run."""

    def __init__(
        self, out_dir: Path, *, method: str, fsync: bool, row_bytes: int, copies: int = 1
    ) -> None:
        """``copies``: how many :meth:`stage` calls run at once (the writer threads);
        their buffers are made here, before the run."""
        self.out_dir = out_dir
        self.fsync = fsync
        self.direct = method == "direct" or (method == "auto" and row_bytes % ALIGN == 0)
        if method == "direct" and row_bytes % ALIGN:
            raise WriteError(
                f"writer.method = 'direct' needs L × H × 2 ({row_bytes}) to be a multiple of "
                f"{ALIGN}; use 'auto' or 'sendfile'"
            )
        self._forced = method == "direct"
        self._dirs_ready: set[Path] = set()  # created (or found) and checked for links
        self._names_durable: set[Path] = set()  # ... and their names synced by a publish
        self._temps: set[Path] = set()  # staged, not yet published
        self._lock = threading.Lock()
        # Threads syncing the directories of one publish side by side (started on first use).
        self._dir_sync_pool = futures.ThreadPoolExecutor(16, thread_name_prefix="hsx-dirsync")
        # The O_DIRECT writes of the copies, one in flight per copy at a time (a thread is
        # started per copy running at once, on first use).
        self._flusher = futures.ThreadPoolExecutor(16, thread_name_prefix="hsx-flush")
        self._buffers = _BufferPool(copies)

    def close(self) -> None:
        """Stop the writer's threads and free its buffers (once no stage or publish
        runs)."""
        self._dir_sync_pool.shutdown(wait=True)
        self._flusher.shutdown(wait=True)
        self._buffers.clear()

    def stage(self, job: WriteJob) -> Staged:
        """Copy, hash and fsync the sample into a temp file next to its final name.
        Nothing is named yet: a crash leaves a temp file, which a resume deletes."""
        final = self.out_dir / job.relpath
        try:
            new_dirs = self._ensure_dir(final.parent)
        except OSError as exc:
            raise write_error(exc, final.parent) from exc
        tmp = final.parent / f".{final.name}.{job.tmp_tag}.tmp"
        self._temps.add(tmp)
        try:
            digest, size = self._write_file(tmp, job)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._temps.discard(tmp)
            if isinstance(exc, OSError):
                raise write_error(exc, final) from exc
            raise
        entry = ManifestEntry(job.sample.id, job.relpath, job.sample.num_tokens, size, digest)
        return Staged(tmp, final, entry, new_dirs)

    def publish(self, batch: list[Staged]) -> None:
        """Rename each staged file into place, then sync every directory touched, once:
        when this returns every name is durable, and manifest lines may follow. A failure
        stops here; temp files not yet renamed stay for a resume to delete."""
        parents: dict[Path, None] = {}  # where new directories were named (outermost first)
        for staged in batch:
            parents.update(dict.fromkeys(d.parent for d in staged.new_dirs))
        buckets: dict[Path, None] = {}  # where files were renamed
        for i, staged in enumerate(batch):
            failpoint("writer.after_fsync")
            try:
                staged.tmp.rename(staged.final)
            except OSError as exc:
                for rest in batch[i:]:
                    with contextlib.suppress(OSError):
                        rest.tmp.unlink()
                    self._temps.discard(rest.tmp)
                raise write_error(exc, staged.final) from exc
            self._temps.discard(staged.tmp)
            failpoint("writer.after_rename")
            buckets[staged.final.parent] = None
        if self.fsync:
            # The new directories' names, then every bucket a file was renamed into. Each
            # bucket is a directory of its own (256 of them), so a batch touches many:
            # their fsyncs run side by side and the device sees them queued together.
            for directory in parents:
                _sync_dir(directory)
            _sync_dirs([d for d in buckets if d not in parents], self._dir_sync_pool)
        for staged in batch:
            self._names_durable.update(staged.new_dirs)

    def forget(self, staged: Staged) -> None:
        """Delete a staged file that will not be published (its commit failed)."""
        if staged.tmp in self._temps:
            with contextlib.suppress(OSError):
                staged.tmp.unlink()
            self._temps.discard(staged.tmp)

    def discard_temps(self) -> None:
        """Delete the temp files of samples staged but never published (the run failed
        or was cut short before their commit). Call once no stage or publish runs; a
        shielded commit still finishing on the event loop may yet drop one from the set, so
        each is taken out atomically (set.pop) rather than iterated."""
        while self._temps:
            try:
                tmp = self._temps.pop()
            except KeyError:  # emptied by a late publish between the test and the pop
                break
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _ensure_dir(self, directory: Path) -> tuple[Path, ...]:
        """Create the bucket directory if needed. Returns the directories, outermost first,
        whose own name is not yet known durable in their parent this run (whether this run
        created them or a crashed one did): a publish syncs their parents before listing a
        file inside, once per run for each."""
        if directory in self._names_durable:
            return ()  # and so is every name above it
        if directory not in self._dirs_ready:
            with self._lock:
                if directory not in self._dirs_ready:
                    directory.mkdir(parents=True, exist_ok=True)
                    _refuse_links(self.out_dir, directory)
                    self._dirs_ready.add(directory)
        names = []
        current = directory
        while current != self.out_dir and current not in self._names_durable:
            names.append(current)
            current = current.parent
        return tuple(reversed(names))

    def _write_file(self, tmp: Path, job: WriteJob) -> tuple[str, int]:
        hasher = xxhash.xxh3_64()
        if self.direct:
            try:
                fd = os.open(tmp, _NEW_FILE | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._forced:
                    raise
                self.direct = False  # this file system refuses O_DIRECT: fall back for good
        if not self.direct:
            fd = os.open(tmp, _NEW_FILE, 0o644)
        try:
            with self._buffers.lease() as whole:
                if self.direct:
                    _write_direct(fd, job, hasher, self._flusher, whole)
                else:
                    _write_buffered(fd, job, hasher, whole[:SUB])
            size = os.fstat(fd).st_size
            if size != job.layout.total_bytes:
                raise WriteError(f"{tmp}: wrote {size} bytes, expected {job.layout.total_bytes}")
            failpoint("writer.after_temp_write")
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return hasher.hexdigest(), size


def _sync_dir(directory: Path) -> None:
    try:
        fsync_dir(directory)
    except OSError as exc:  # the files are in place but their names not durable
        raise write_error(exc, directory) from exc


def _sync_dirs(directories: list[Path], pool: futures.ThreadPoolExecutor) -> None:
    """fsync every directory, concurrently; returns once all are done, raising the first
    failure (after the others finished: nothing keeps running behind the caller)."""
    if len(directories) <= 1:
        for directory in directories:
            _sync_dir(directory)
        return
    pending = [pool.submit(_sync_dir, d) for d in directories]
    futures.wait(pending)
    for done in pending:
        done.result()


def _refuse_links(base: Path, directory: Path) -> None:
    """Every directory between ``base`` and ``directory`` must be a real one: mkdir with
    exist_ok accepts a planted link, and the sample would be written where it points."""
    current = base
    for name in directory.relative_to(base).parts:
        current = current / name
        if not stat.S_ISDIR(current.lstat().st_mode):
            raise WriteError(
                f"{current} is a link or not a directory; remove it (hsx writes only into "
                "real directories under output.dir)"
            )


def _head(job: WriteJob) -> bytes:
    return job.layout.header + job.sample.input_ids.astype("<i8", copy=False).tobytes()


def _tail(job: WriteJob) -> bytes:
    mask = job.sample.loss_mask
    return b"" if mask is None else np.asarray(mask, dtype=np.uint8).tobytes()


def _open_part(path: Path, expected: int) -> int:
    """Open a part without following links and re-check its size on the descriptor."""
    try:
        # Component by component: a request dir swapped for a link is not followed either.
        dir_fd = open_dump_dir(path.parent)
        try:
            # Non-blocking, no link followed, regular files only: a part swapped for a
            # FIFO or a link after validation fails the attempt (the dump's fault).
            fd = open_dump_file(dir_fd, path.name)
        finally:
            os.close(dir_fd)
    except FileNotFoundError:
        raise DumpError(f"{path.name} vanished before it was copied") from None
    except DumpLinkError:
        raise DumpError(f"{path.name} became a link after validation") from None
    except DumpError as exc:
        raise DumpError(f"{exc} (after validation)") from None
    st = os.fstat(fd)
    if st.st_size != expected:
        os.close(fd)
        raise DumpError(f"{path.name} changed after validation ({st.st_size} bytes)")
    return fd


def _write_all(fd: int, data: memoryview | bytes | mmap.mmap) -> None:
    """Write every byte. Each view taken here is released even when a write fails: a view
    still alive in the traceback would make resizing or closing the buffer it came from
    raise BufferError later, in an unrelated call."""
    with memoryview(data) as view:
        done, total = 0, view.nbytes
        while done < total:
            with view[done:] as rest:
                done += os.write(fd, rest)


def _read_hashed(
    part_fd: int,
    name: str,
    view: memoryview,
    offset: int,
    hasher: Hasher,
    *,
    watch: tuple[Watch, int] | None = None,
) -> None:
    """Fill ``view`` from the part at ``offset``, hashing each piece right after reading it
    and, with ``watch`` (the check, and the offset of ``view`` in its range), showing it
    what was read, ``WATCHED`` bytes at a time (a call costs a few µs of numpy whatever its
    size; bench/fp8_copy_check.py measured 256 KiB, 1 MiB and 8 MiB alike)."""
    done, total, seen = 0, view.nbytes, 0
    while done < total:
        with view[done : done + SUB] as piece:
            got = os.preadv(part_fd, [piece], offset + done)
            if got == 0:
                raise DumpError(f"{name} shrank while it was copied")
            with piece[:got] as filled:
                hasher.update(filled)
        done += got
        if watch is not None and (done - seen >= WATCHED or done == total):
            with view[seen:done] as stretch:
                watch[0](stretch, watch[1] + seen)
            seen = done


class _AlignedFile:
    """The bytes of one file, in order, written with O_DIRECT at CHUNK-aligned offsets of
    the file: every write but the last is a whole CHUNK, starting on a CHUNK boundary, as
    in a plain copy of the parts. (Written after the header and ``input_ids``, the hidden
    states were shifted off those boundaries; on the virtio disk here that cost 5–7% of a
    raw copy's rate: bench/README.md.) XXH3 runs over the same bytes, in the same order,
    from the buffer: what is hashed is what is written, even if the part changes.

    Two buffers: a full one goes to the flusher thread to be written while the other is
    filled, so reading and hashing a chunk overlaps the device's write of the one before
    (a lone stream — one large sample, the end of a run — was idle ~30% of its time).
    Writes stay in file order, one in flight at a time; a buffer is reused only once its
    write returned. Call :meth:`finish` to complete the file, :meth:`settle` always."""

    def __init__(
        self, fd: int, buffers: tuple[memoryview, memoryview], hasher: Hasher, flusher: Flusher
    ) -> None:
        self.fd, self.buffers, self.hasher, self.flusher = fd, buffers, hasher, flusher
        self.current = 0
        self.whole = buffers[0]
        self.fill = 0  # bytes in the buffer, not yet written
        self.pending: futures.Future[None] | None = None  # the other buffer's write

    def put(self, data: bytes | memoryview) -> None:
        """Small pieces (the header and ids, the loss mask) go through the buffer."""
        self.hasher.update(data)
        with memoryview(data) as view:
            done = 0
            while done < len(view):
                n = min(len(view) - done, CHUNK - self.fill)
                self.whole[self.fill : self.fill + n] = view[done : done + n]
                self.fill, done = self.fill + n, done + n
                if self.fill == CHUNK:
                    self._write_buffer()

    def copy_part(
        self, part_fd: int, name: str, start: int, length: int, watch: Watch | None = None
    ) -> None:
        """A range of a dump part, read into the buffer in pieces, each hashed (and shown
        to ``watch``) while in the cache, before it is written."""
        pos, end = start, start + length
        while pos < end:
            n = min(end - pos, CHUNK - self.fill)
            seen = None if watch is None else (watch, pos - start)
            with self.whole[self.fill : self.fill + n] as view:
                _read_hashed(part_fd, name, view, pos, self.hasher, watch=seen)
            self.fill, pos = self.fill + n, pos + n
            if self.fill == CHUNK:
                self._write_buffer()

    def finish(self, total: int) -> None:
        """The last, partial block: O_DIRECT writes whole blocks, so it is written
        zero-padded and the file cut back to ``total``; returns once every write did."""
        filled = self.fill
        padded = -(-filled // ALIGN) * ALIGN
        if filled:
            self.whole[filled:padded] = bytes(padded - filled)
            self.fill = padded
            self._write_buffer()
        self._wait()
        if padded != filled:
            os.ftruncate(self.fd, total)

    def settle(self) -> None:
        """Wait for a write still in flight (its error dropped: called when another one
        is on its way up), so that neither the file nor the buffer goes while it runs."""
        pending, self.pending = self.pending, None
        if pending is not None:
            futures.wait([pending])

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()  # the write's own error (ENOSPC, EIO) surfaces here

    def _write_buffer(self) -> None:
        """Hand the full buffer to the flusher, and go on in the other one once the write
        before (which used it) returned."""
        if self.fill:
            block = self.whole[: self.fill]
            try:
                self._wait()
                self.pending = self.flusher.submit(_write_block, self.fd, block)
            except BaseException:
                block.release()
                raise
            self.current ^= 1
            self.whole = self.buffers[self.current]
        self.fill = 0


def _write_block(fd: int, block: memoryview) -> None:
    """A flusher's job: one buffer's bytes, then its view released (see _write_all)."""
    try:
        _write_all(fd, block)
    finally:
        block.release()


@dataclass(frozen=True, slots=True)
class _Piece:
    """A byte range of one dump part, copied unchanged into the file. ``data``: its bytes,
    read and checked before the copy (the per-vector sections, :func:`_read_checked`), and
    written from there; ``watch``: a check of the bytes as they are copied
    (:class:`_OutlierWatch`, on the FP8 values of the outliers layout)."""

    path: Path
    part_bytes: int  # the whole part's size, re-checked on the descriptor
    offset: int
    length: int
    data: bytes | None = None
    watch: _OutlierWatch | None = None


def _pieces(job: WriteJob) -> list[_Piece]:
    """What the file's hidden sections are made of when the dump holds the dataset's own
    storage: each section in turn, each part's range of it in row order (a part holds its
    rows' sections back to back, the file each section over all rows). The per-vector
    sections (the FP8 scales and outliers, ~1% of the bytes) are read and checked first,
    so that the outliers layout's values can be checked against them as they are copied."""
    return _checked_pieces(job.dump)


def _checked_pieces(dump: Dump) -> list[_Piece]:
    meta = dump.meta
    grid: dict[str, list[_Piece]] = {}
    for section, piece in _sections(dump):
        check = section_check(section, meta.hidden_size)
        checked = piece if check is None else _read_checked(piece, check)
        grid.setdefault(section.name, []).append(checked)
    if meta.storage.outliers:
        vectors = zip(grid[OUTLIER_INDEX], grid[OUTLIER_VALUES], grid[SCALES], strict=True)
        grid[HIDDEN] = [
            dataclasses.replace(q, watch=_OutlierWatch(q.path.name, meta.hidden_size, *parts))
            for q, parts in zip(grid[HIDDEN], vectors, strict=True)
        ]
    return [piece for pieces in grid.values() for piece in pieces]


def _sections(dump: Dump) -> list[tuple[Section, _Piece]]:
    """Each section of ``dump`` (in its own storage), each part's range of it in row order."""
    meta = dump.meta
    rows = [e - s for s, e in meta.parts]
    sections = meta.storage.sections(num_layers(meta.aux_layers), meta.hidden_size)
    per_row = sum(section.row_bytes for section in sections)
    pieces: list[tuple[Section, _Piece]] = []
    before = 0  # bytes per row of the sections before this one
    for section in sections:
        for path, n in zip(dump.part_paths(), rows, strict=True):
            pieces.append((section, _Piece(path, n * per_row, n * before, n * section.row_bytes)))
        before += section.row_bytes
    return pieces


def check_sections(dump: Dump) -> None:
    """The checks the copy runs on a dump's bytes (the FP8 scales and outliers, read and
    checked before the copy, and each outlier's own value as the copy sees it), run on
    ``dump`` without copying it: what an admission's probe runs on its own dump, so that a
    server whose every dump the copy refuses is not admitted (issue 38). :class:`DumpError`
    with the copy's words."""
    for piece in _checked_pieces(dump):
        if piece.watch is None:
            continue
        block = bytearray(min(piece.length, WATCHED))
        part_fd = _open_part(piece.path, piece.part_bytes)
        try:
            for at in range(0, piece.length, WATCHED):
                with memoryview(block)[: min(WATCHED, piece.length - at)] as view:
                    _read_exact(part_fd, piece.path.name, view, piece.offset + at)
                    piece.watch(view, at)
        finally:
            os.close(part_fd)


def read_sections(dump: Dump, names: Collection[str]) -> dict[str, tuple[Section, bytes]]:
    """The bytes of the sections of ``dump`` named in ``names``, each over all its rows
    (for a small dump: a probe's)."""
    found: dict[str, tuple[Section, bytearray]] = {}
    for section, piece in _sections(dump):
        if section.name not in names:
            continue
        _, held = found.setdefault(section.name, (section, bytearray()))
        held += _read_piece(piece)
    return {name: (section, bytes(data)) for name, (section, data) in found.items()}


def _read_piece(piece: _Piece) -> bytearray:
    """A piece's bytes, read whole into this process's memory."""
    data = bytearray(piece.length)
    part_fd = _open_part(piece.path, piece.part_bytes)
    try:
        with memoryview(data) as view:
            _read_exact(part_fd, piece.path.name, view, piece.offset)
    finally:
        os.close(part_fd)
    return data


def _read_checked(piece: _Piece, check: SectionCheck) -> _Piece:
    """A piece whose bytes must pass a check (:func:`~hsx_async.protocol.section_check`:
    the FP8 scales and outliers, a few bytes a vector), read into the copy's own memory and
    checked there; the file gets those bytes (``data``): what is checked is what is written,
    whatever the server does to the part meanwhile."""
    data = _read_piece(piece)
    problem = check(data)
    if problem is not None:
        raise DumpError(f"{piece.path.name}: {problem}")
    return dataclasses.replace(piece, data=bytes(data))


class _OutlierWatch:
    """The outliers layout's FP8 values of one part, checked as they are copied against
    the part's outliers (read and checked before): each outlier's own e4m3fn value must be
    ±448 with its value's sign (:func:`~hsx_async.protocol.saturated_codes`), as ``hsx
    verify --deep`` requires. A dump whose outlier values are not listed in their channels'
    order (say, by magnitude) passes every per-section check and fails this one. Costs a
    gather of 16 bytes a vector from the copy's buffer (bench/fp8_copy_check.py); the
    entries' offsets (8 bytes each) are made at the part's first bytes, dropped after its
    last."""

    def __init__(
        self, name: str, hidden: int, index: _Piece, values: _Piece, scales: _Piece
    ) -> None:
        """The part's outlier sections and scales, each read and checked before."""
        assert index.data is not None and values.data is not None and scales.data is not None
        vectors = scales.length // SCALE_BYTES
        self.name, self.hidden, self.length = name, hidden, vectors * hidden
        self.index = np.frombuffer(index.data, dtype="<u2").reshape(vectors, -1)
        self.values = np.frombuffer(values.data, dtype="<u2").reshape(vectors, -1)
        self.scales = np.frombuffer(scales.data, dtype="<u4")
        self._entries: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, view: memoryview, at: int) -> None:
        """``view``: the bytes ``at …`` of the part's FP8 values (vectors of H bytes), in
        order over the part."""
        if self._entries is None:
            self._entries = self._checked()
        offsets, codes = self._entries
        # scalar searches, take and a bytes compare: a few µs a call (numpy's general
        # forms cost 5x as much, more than the gather itself)
        lo, hi = int(offsets.searchsorted(at)), int(offsets.searchsorted(at + view.nbytes))
        got = np.frombuffer(view, dtype=np.uint8).take(offsets[lo:hi] - at)
        if got.tobytes() != codes[lo:hi].tobytes():
            self._refuse(offsets[lo:hi][got != codes[lo:hi]])
        if at + view.nbytes >= self.length:
            self._entries = None

    def _checked(self) -> tuple[np.ndarray, np.ndarray]:
        """The offsets in the part's FP8 values of the outlier entries the rule fixes,
        ascending (vectors in order, each one's channels ascending), and their codes."""
        checked, codes = saturated_codes(self.index, self.values, self.scales, self.hidden)
        rows = np.arange(len(self.index), dtype=np.int64)[:, None] * self.hidden
        return (rows + self.index)[checked], codes[checked]

    def _refuse(self, wrong: np.ndarray) -> None:
        vector, channel = divmod(int(wrong[0]), self.hidden)
        entry = int(np.argmax(self.index[vector] == channel))
        bits = np.array([self.values[vector, entry]], dtype="<u4") << 16
        value = float(bits.view("<f4")[0])  # bfloat16: float32's upper half
        raise DumpError(
            f"{self.name}: FP8 outliers' own values are not ±448 with their sign ({len(wrong)} "
            f"in a stretch; first: vector {vector}, channel {channel}, beside the value "
            f"{value:g}); the quantization rule saturates each outlier there, so these values "
            "are not their channels' (listed in another order?)"
        )


def _transcoded(job: WriteJob) -> bool:
    """The server dumped bfloat16 for an FP8 dataset: the writer quantizes (PROTOCOL §3)."""
    return job.dump.meta.storage != job.layout.storage


# Rows quantized at once by the writer's fallback: bounded memory, whatever the sample.
_ENCODE_BYTES = 4 << 20
# torch's threads for the fallback: the writer's threads are the parallelism (one sample
# each), and torch's own pool on top of them cost 1.3-4x the CPU per GB on a busy machine
# (bench/README.md, FP8); the client uses torch for nothing else. 0: torch's default.
FALLBACK_TORCH_THREADS = 1


def _encoded(job: WriteJob) -> Iterator[memoryview]:
    """The hidden sections of an FP8 file from a bfloat16 dump, in file order, a block of
    rows at a time (the same quantizer as the hook, so the same bytes): pass 1 writes the
    quantized slots and keeps their per-vector sections (scales, and the outliers of that
    layout: T × Lq × 4 bytes, × 17 with outliers), then those (checked as a hook's are:
    the same rows are refused whoever quantized them), then pass 2 the slots kept in
    bfloat16. Memory: one block and the per-vector sections, whatever T."""
    # torch only here: a bf16 run (and an FP8 one whose hook quantizes) never imports it.
    import torch  # noqa: PLC0415 - ~1.4 CPU-s and 200 MB that a copy does not need

    from hsx_async.quantize import quantized_sections  # noqa: PLC0415 - imports torch

    if FALLBACK_TORCH_THREADS and torch.get_num_threads() != FALLBACK_TORCH_THREADS:
        torch.set_num_threads(FALLBACK_TORCH_THREADS)
    meta, storage = job.dump.meta, job.layout.storage
    layers, hidden = len(meta.aux_layers) + 1, meta.hidden_size
    in_row = meta.row_bytes
    block_rows = max(1, _ENCODE_BYTES // in_row)
    block = bytearray(block_rows * in_row)
    per_vector: list[torch.Tensor] = []  # [T, Lq, ...] each, filled block by block
    kept = storage.kept(layers)

    def blocks() -> Iterator[tuple[int, torch.Tensor]]:
        for path, (start, end) in zip(job.dump.part_paths(), meta.parts, strict=True):
            size = (end - start) * in_row
            part_fd = _open_part(path, size)
            try:
                for row in range(start, end, block_rows):
                    n = min(block_rows, end - row)
                    with memoryview(block)[: n * in_row] as view:
                        _read_exact(part_fd, path.name, view, (row - start) * in_row)
                    raw = torch.frombuffer(block, dtype=torch.bfloat16, count=n * layers * hidden)
                    yield row, raw.view(n, layers, hidden)
            finally:
                os.close(part_fd)

    every = len(storage.quantized) == layers
    for row, rows in blocks():
        q, *rest = quantized_sections(
            rows if every else rows[:, list(storage.quantized), :], storage
        )
        if not per_vector:
            per_vector = [t.new_empty((meta.num_tokens, *t.shape[1:])) for t in rest]
        for whole, part in zip(per_vector, rest, strict=True):
            whole[row : row + rows.shape[0]] = part
        yield _bytes_of(q.contiguous())
    # a non-finite row gives a non-finite scale or outlier value: refused here as well
    for section, whole in zip(storage.sections(layers, hidden)[1:], per_vector, strict=False):
        data = _bytes_of(whole)
        check = section_check(section, hidden)
        problem = None if check is None else check(data)
        if problem is not None:
            raise DumpError(f"{job.dump.path.name} (quantized by the client): {problem}")
        yield data
    if kept:
        for _, rows in blocks():
            yield _bytes_of(rows[:, list(kept), :].contiguous())


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy (numpy has no bf16 or fp8)."""
    import torch  # noqa: PLC0415 - loaded by then (see _encoded)

    return tensor.view(torch.uint8).numpy().data.cast("B")


def _read_exact(part_fd: int, name: str, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        with view[done:] as rest:
            got = os.preadv(part_fd, [rest], offset + done)
        if got == 0:
            raise DumpError(f"{name} shrank while it was copied")
        done += got


def _write_direct(
    fd: int, job: WriteJob, hasher: Hasher, flusher: Flusher, whole: memoryview
) -> None:
    # The copy's buffer: two CHUNKs to write from (the SUB bytes after them: sendfile's).
    with whole[:CHUNK] as first, whole[CHUNK : 2 * CHUNK] as second:
        out = _AlignedFile(fd, (first, second), hasher, flusher)
        try:
            out.put(_head(job))  # a multiple of ALIGN long, by construction of the layout
            if _transcoded(job):
                for data in _encoded(job):
                    out.put(data)
            else:
                for piece in _pieces(job):
                    _copy_direct(out, piece)
            out.put(_tail(job))
            out.finish(job.layout.total_bytes)
        finally:
            out.settle()


def _copy_direct(out: _AlignedFile, piece: _Piece) -> None:
    if piece.data is not None:  # read and checked before
        out.put(piece.data)
        return
    part_fd = _open_part(piece.path, piece.part_bytes)
    try:
        out.copy_part(part_fd, piece.path.name, piece.offset, piece.length, piece.watch)
    finally:
        os.close(part_fd)


def _hash_piece(part_fd: int, piece: _Piece, hasher: Hasher, scratch: memoryview) -> None:
    end = piece.offset + piece.length
    for offset in range(piece.offset, end, SUB):
        seen = None if piece.watch is None else (piece.watch, offset - piece.offset)
        with scratch[: min(SUB, end - offset)] as view:
            _read_hashed(part_fd, piece.path.name, view, offset, hasher, watch=seen)


def _send_piece(fd: int, piece: _Piece, hasher: Hasher, scratch: memoryview) -> None:
    """A piece of a part through the kernel (``sendfile``), then hashed (and watched) from
    the tmpfs through ``scratch``; a piece read and checked before is written from there."""
    if piece.data is not None:
        _write_all(fd, piece.data)
        hasher.update(piece.data)
        return
    part_fd = _open_part(piece.path, piece.part_bytes)
    try:
        offset, end = piece.offset, piece.offset + piece.length
        while offset < end:
            sent = os.sendfile(fd, part_fd, offset, min(end - offset, 1 << 30))
            if sent == 0:
                raise DumpError(f"{piece.path.name} shrank while it was copied")
            offset += sent
        # Hash from the tmpfs copy: RAM-speed, and no read back from the disk.
        _hash_piece(part_fd, piece, hasher, scratch)
    finally:
        os.close(part_fd)


def _write_buffered(fd: int, job: WriteJob, hasher: Hasher, scratch: memoryview) -> None:
    head = _head(job)
    _write_all(fd, head)
    hasher.update(head)
    if _transcoded(job):
        for data in _encoded(job):
            _write_all(fd, data)
            hasher.update(data)
    else:
        for piece in _pieces(job):
            _send_piece(fd, piece, hasher, scratch)
    tail = _tail(job)
    _write_all(fd, tail)
    hasher.update(tail)
