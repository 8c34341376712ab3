"""Server side of PROTOCOL §3: write a request's parts and commit its ``meta.json``.

Shared by the fake server, the reference server and the SGLang hook. All file access goes
through directory file descriptors opened with ``O_NOFOLLOW``, so neither a crafted
``ns``/``rid`` nor a symlink planted in the dump root can make a server write outside it.
The server never deletes: the client owns ``<root>/<ns>/``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hsx_async.errors import DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    META_NAME,
    DumpMeta,
    Storage,
    part_name,
    valid_ns,
    valid_rid,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
# Buffers one writev takes (Linux UIO_MAXIOV).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


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
    """``writev`` until every byte of ``buffers`` is written (a short write resumes)."""
    pending, first = list(buffers), 0
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


@dataclass(slots=True)
class RequestDump:
    """Rows written so far for one marked request, across chunked-prefill passes.

    Pure bookkeeping: the caller writes the bytes. A retracted request that starts over
    calls :meth:`reset`; parts then get rewritten under the same names.
    """

    rid: str
    ns: str
    num_tokens: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    # Set by a background writer whose write of one of this dump's parts failed: its later
    # parts and its commit are skipped, and the scheduler's next pass poisons the rid. A
    # retried request starts a new RequestDump, so an old failure never leaks into it.
    failed: bool = False
    # How its parts hold the rows (PROTOCOL §3): what the request asked for, or bfloat16.
    storage: Storage = BF16_STORAGE

    @property
    def rows_done(self) -> int:
        return self.parts[-1][1] if self.parts else 0

    def add_part(self, start: int, end: int) -> None:
        if start != self.rows_done or end <= start or end > self.num_tokens:
            raise DumpError(
                f"rid {self.rid}: part [{start}, {end}) does not continue at row "
                f"{self.rows_done} of {self.num_tokens}"
            )
        self.parts.append((start, end))

    @property
    def complete(self) -> bool:
        return self.rows_done == self.num_tokens

    def reset(self) -> None:
        self.parts.clear()

    def meta(self, *, hidden_size: int, aux_layers: list[int], model: str, server: str) -> DumpMeta:
        return DumpMeta(
            rid=self.rid,
            num_tokens=self.num_tokens,
            hidden_size=hidden_size,
            aux_layers=tuple(aux_layers),
            parts=tuple(self.parts),
            model=model,
            server=server,
            storage=self.storage,
        )
