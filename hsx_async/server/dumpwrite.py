"""Server side of PROTOCOL §3: write a request's parts and commit its ``meta.json``.

The one way every hook and server writes a dump: :func:`write_job` writes one planned part
(and, after a request's last part, its ``meta.json``), on the calling thread or on a
:class:`~hsx_async.server.hook_writer.BackgroundWriter` thread. All file access goes through
directory file descriptors opened with ``O_NOFOLLOW``, so neither a crafted ``ns``/``rid``
nor a symlink planted in the dump root can make a server write outside it. Every file is
written under a hidden temporary name and renamed into place. The server never deletes:
the client owns ``<root>/<ns>/``. The fake server's faults are a :class:`Tamper` handed to
:func:`write_job`; hooks pass none.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hsx_async.errors import DumpError
from hsx_async.protocol import META_NAME, DumpMeta, part_name, valid_ns, valid_rid
from hsx_async.server.hook_core import PartWrite, Reject, RequestDump
from hsx_async.server.rows import PassRows, part_bytes

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_subdir(parent_fd: int, name: str, *, create: bool) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o777, dir_fd=parent_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise DumpError(f"{name!r} in the dump root is not a plain directory") from None
        raise


@contextlib.contextmanager
def request_dir_fd(root: Path, ns: str, rid: str) -> Iterator[int]:
    """An fd for ``<root>/<ns>/<rid>``, created if needed; refuses unsafe names and links."""
    if not valid_ns(ns):
        raise DumpError(f"namespace {ns!r} is not a valid hsx_ns")
    if not valid_rid(rid):
        raise DumpError(f"rid {rid!r} is not a valid rid")
    root.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        ns_fd = _open_subdir(root_fd, ns, create=True)
        try:
            rid_fd = _open_subdir(ns_fd, rid, create=True)
        finally:
            os.close(ns_fd)
    finally:
        os.close(root_fd)
    try:
        yield rid_fd
    finally:
        os.close(rid_fd)


def _write_atomic(dir_fd: int, name: str, chunks: Iterable[Sequence[memoryview]]) -> None:
    """Write under ``.name.tmp``, then rename: a visible name is always a complete file.

    ``chunks`` yields lists of byte buffers, each written with one ``writev`` (a list is at
    most :data:`IOV_MAX` buffers); a failed write leaves only the hidden temporary name.
    """
    tmp = f".{name}.tmp"
    fd = os.open(tmp, _NEW_FILE_FLAGS, 0o666, dir_fd=dir_fd)
    try:
        for buffers in chunks:
            _writev_all(fd, buffers)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _writev_all(fd: int, buffers: Sequence[memoryview]) -> None:
    """``writev`` until every byte of ``buffers`` is written (a short write resumes).
    Buffers are counted in bytes whatever their shape (a row block is ``[n, L, H]``)."""
    pending, first = [b if b.ndim == 1 and b.itemsize == 1 else b.cast("B") for b in buffers], 0
    while first < len(pending):
        written = os.writev(fd, pending[first:] if first else pending)
        while first < len(pending) and written >= len(pending[first]):
            written -= len(pending[first])
            first += 1
        if written:
            pending[first] = pending[first][written:]


def byte_view(data: bytes | memoryview) -> memoryview:
    return memoryview(data).cast("B")


def write_part(dir_fd: int, start: int, end: int, data: bytes | memoryview) -> None:
    _write_atomic(dir_fd, part_name(start, end), [[byte_view(data)]])


def write_part_vectored(
    dir_fd: int, start: int, end: int, chunks: Iterable[Sequence[memoryview]]
) -> None:
    """A part written from many buffers (row slices) with ``writev``, assembled nowhere."""
    _write_atomic(dir_fd, part_name(start, end), chunks)


def write_meta(dir_fd: int, meta: DumpMeta) -> None:
    """The commit: ``meta.json`` is renamed into place after every part."""
    _write_atomic(dir_fd, META_NAME, [[byte_view(meta.to_json())]])


def commit_meta(root: Path, ns: str, rid: str, meta: DumpMeta) -> None:
    """A commit made apart from the last part's write (the fake server's late_meta)."""
    with request_dir_fd(root, ns, rid) as dir_fd:
        write_meta(dir_fd, meta)


Chunks = Iterable[Sequence[memoryview]]


@dataclass(frozen=True, slots=True)
class PartJob:
    """One part to write, and, for a request's last part, the ``meta.json`` to commit
    after it. ``dump`` is the request's bookkeeping, shared by all its jobs: a failure
    marks it, and its later jobs then write nothing."""

    write: PartWrite
    dump: RequestDump
    meta: DumpMeta | None


@dataclass(frozen=True, slots=True)
class JobOutcome:
    wrote: bool
    committed: bool
    reject: Reject | None


class Tamper(Protocol):
    """Fault injection, for the fake server only: what is written in place of a part and
    of a commit. Hooks and the reference server pass none."""

    def part(self, write: PartWrite, chunks: Chunks) -> list[tuple[int, int, Chunks]]:
        """The part files ``(start, end, bytes)`` to write for ``write``."""
        ...

    def meta(self, write: PartWrite, meta: DumpMeta) -> DumpMeta | None:
        """The ``meta.json`` to commit after ``write`` (None: no commit now)."""
        ...


def write_job(
    root: Path, job: PartJob, hidden: PassRows, tamper: Tamper | None = None
) -> JobOutcome:
    """Write ``job``'s part (and commit) unless an earlier part of its dump failed."""
    write = job.write
    if job.dump.failed:
        return JobOutcome(wrote=False, committed=False, reject=None)
    meta = job.meta
    try:
        with request_dir_fd(root, write.ns, write.rid) as dir_fd:
            chunks: Chunks = part_bytes(hidden, write)
            files = [(write.start, write.end, chunks)]
            if tamper is not None:
                files = tamper.part(write, chunks)
                meta = None if meta is None else tamper.meta(write, meta)
            for start, end, data in files:
                write_part_vectored(dir_fd, start, end, data)
            if meta is not None:
                write_meta(dir_fd, meta)
    except (DumpError, OSError) as exc:
        job.dump.failed = True
        reason = f"writing {part_name(write.start, write.end)}: {exc}"
        return JobOutcome(wrote=False, committed=False, reject=Reject(write.rid, reason))
    return JobOutcome(wrote=True, committed=meta is not None, reject=None)
