"""Moving a dump from /dev/shm into a durable dataset file (PROTOCOL §4). Blocking: threads.

One call builds one sample file: header and ``input_ids`` from memory, ``hidden_states``
copied part by part from the tmpfs, ``loss_mask`` last; XXH3-64 is computed over the same
bytes as they are written (no second pass over the disk), then fsync, rename into place,
fsync of the directory. Two copy methods:

- ``direct``: ``O_DIRECT`` writes straight from an mmap of each tmpfs part. Lowest CPU
  (~0.2 s/GB measured) and no page-cache pollution. Needs every part to start on a 4 KiB
  boundary in the file, which holds when L × H × 2 is a multiple of 4096 (any real model);
  the layout pads the header so ``hidden_states`` starts aligned.
- ``sendfile``: kernel copy into the page cache; works everywhere (``copy_file_range`` does
  not work from tmpfs to ext4).

``auto`` picks ``direct`` when the shape allows and the file system accepts O_DIRECT, and
falls back to ``sendfile`` for good on the first EINVAL.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hsx_async.dump import Dump
from hsx_async.durable import fsync_dir
from hsx_async.errors import DiskFullError, DumpError, WriteError
from hsx_async.failpoints import failpoint
from hsx_async.layout import ALIGN, FileLayout
from hsx_async.manifest import ManifestEntry
from hsx_async.source import Sample

CHUNK = 8 << 20  # bytes per write/hash step: large enough to stream, small for the cache
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass(frozen=True, slots=True)
class WriteJob:
    sample: Sample
    dump: Dump
    layout: FileLayout
    relpath: str  # data/xx/<key>.safetensors
    tmp_tag: str  # unique per run and shard, so shards never touch each other's temp files


class _AlignedBuffers(threading.local):
    """One page-aligned scratch buffer per writer thread, grown rarely, never freed:
    allocating large buffers on the hot path stalled the process (PERF-NOTES)."""

    buf: mmap.mmap | None = None

    def get(self, size: int) -> mmap.mmap:
        size = -(-size // ALIGN) * ALIGN
        if self.buf is None or len(self.buf) < size:
            if self.buf is not None:
                self.buf.close()
            self.buf = mmap.mmap(-1, max(size, 1 << 20))
        return self.buf


_buffers = _AlignedBuffers()


class FileWriter:
    """Writes sample files under ``out_dir``; thread-safe, one instance per run."""

    def __init__(self, out_dir: Path, *, method: str, fsync: bool, row_bytes: int) -> None:
        self.out_dir = out_dir
        self.fsync = fsync
        self.direct = method == "direct" or (method == "auto" and row_bytes % ALIGN == 0)
        if method == "direct" and row_bytes % ALIGN:
            raise WriteError(
                f"writer.method = 'direct' needs L × H × 2 ({row_bytes}) to be a multiple of "
                f"{ALIGN}; use 'auto' or 'sendfile'"
            )
        self._forced = method == "direct"
        self._dirs_synced: set[Path] = set()
        self._lock = threading.Lock()

    def write(self, job: WriteJob) -> ManifestEntry:
        final = self.out_dir / job.relpath
        self._ensure_dir(final.parent)
        tmp = final.parent / f".{final.name}.{job.tmp_tag}.tmp"
        try:
            digest, size = self._write_file(tmp, job)
            failpoint("writer.after_fsync")
            tmp.rename(final)
            failpoint("writer.after_rename")
        except BaseException as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(exc, OSError):
                raise _write_error(exc, final) from exc
            raise
        if self.fsync:
            fsync_dir(final.parent)
        return ManifestEntry(job.sample.id, job.relpath, job.sample.num_tokens, size, digest)

    def _ensure_dir(self, directory: Path) -> None:
        if directory in self._dirs_synced:
            return
        with self._lock:
            if directory not in self._dirs_synced:
                directory.mkdir(parents=True, exist_ok=True)
                if self.fsync:  # make the new directory entries themselves durable
                    for d in (directory, directory.parent, directory.parent.parent):
                        fsync_dir(d)
                self._dirs_synced.add(directory)

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
            if self.direct:
                _write_direct(fd, job, hasher)
            else:
                _write_buffered(fd, job, hasher)
            size = os.fstat(fd).st_size
            if size != job.layout.total_bytes:
                raise WriteError(f"{tmp}: wrote {size} bytes, expected {job.layout.total_bytes}")
            failpoint("writer.after_temp_write")
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return hasher.hexdigest(), size


def _head(job: WriteJob) -> bytes:
    return job.layout.header + job.sample.input_ids.astype("<i8", copy=False).tobytes()


def _tail(job: WriteJob) -> bytes:
    mask = job.sample.loss_mask
    return b"" if mask is None else np.asarray(mask, dtype=np.uint8).tobytes()


def _open_part(path: Path, expected: int) -> int:
    """Open a part without following links and re-check its size on the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DumpError(f"{path.name} vanished before it was copied") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
        os.close(fd)
        raise DumpError(f"{path.name} changed after validation ({st.st_size} bytes)")
    return fd


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _parts(job: WriteJob) -> list[tuple[Path, int]]:
    per_row = job.layout.hidden_bytes // job.layout.num_tokens
    return [
        (p, (e - s) * per_row)
        for p, (s, e) in zip(job.dump.part_paths(), job.dump.meta.parts, strict=True)
    ]


def _write_direct(fd: int, job: WriteJob, hasher: xxhash.xxh3_64) -> None:
    head = _head(job)  # its length is a multiple of ALIGN by construction of the layout
    buf = _buffers.get(len(head))
    buf[: len(head)] = head
    _write_all(fd, memoryview(buf)[: len(head)])
    hasher.update(head)
    for path, size in _parts(job):
        part_fd = _open_part(path, size)
        try:
            with mmap.mmap(part_fd, size, prot=mmap.PROT_READ) as mm, memoryview(mm) as view:
                for off in range(0, size, CHUNK):
                    with view[off : off + CHUNK] as chunk:
                        _write_all(fd, chunk)
                        hasher.update(chunk)
        finally:
            os.close(part_fd)
    tail = _tail(job)
    if tail:
        # O_DIRECT writes whole blocks: write the tail zero-padded, then cut to size.
        padded = -(-len(tail) // ALIGN) * ALIGN
        buf[:padded] = tail + bytes(padded - len(tail))
        _write_all(fd, memoryview(buf)[:padded])
        os.ftruncate(fd, job.layout.total_bytes)
        hasher.update(tail)


def _write_buffered(fd: int, job: WriteJob, hasher: xxhash.xxh3_64) -> None:
    head = _head(job)
    _write_all(fd, head)
    hasher.update(head)
    for path, size in _parts(job):
        part_fd = _open_part(path, size)
        try:
            offset = 0
            while offset < size:
                sent = os.sendfile(fd, part_fd, offset, min(size - offset, 1 << 30))
                if sent == 0:
                    raise DumpError(f"{path.name} shrank while it was copied")
                offset += sent
            # Hash from the tmpfs copy: RAM-speed, and no read back from the disk.
            with mmap.mmap(part_fd, size, prot=mmap.PROT_READ) as mm:
                hasher.update(mm)
        finally:
            os.close(part_fd)
    tail = _tail(job)
    _write_all(fd, tail)
    hasher.update(tail)


def _write_error(exc: OSError, path: Path) -> WriteError:
    if exc.errno == errno.ENOSPC:
        return DiskFullError(f"no space left writing {path}; free space on the output disk")
    return WriteError(f"writing {path} failed: {exc.strerror or exc}")
