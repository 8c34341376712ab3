"""Small durable-write helpers: temp file → fsync → rename → fsync of the directory."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from hsx_async.errors import DiskFullError, WriteError


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new file, never a mix."""
    with open_atomic(path) as fh:
        fh.write(data)


@contextlib.contextmanager
def open_atomic(path: Path) -> Iterator[BinaryIO]:
    """A file to write that appears as ``path`` only when the block ends without error
    (temp name starting with ``.`` → fsync → rename → fsync of the directory); on an
    error the temp file goes and ``path`` is untouched."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_error(exc: OSError, path: Path) -> WriteError:
    """The typed error for a failed write: ENOSPC is :class:`DiskFullError`."""
    if exc.errno == errno.ENOSPC:
        return DiskFullError(f"no space left writing {path}; free space on the output disk")
    return WriteError(f"writing {path} failed: {exc.strerror or exc}")
