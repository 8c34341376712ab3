"""Small durable-write helpers: temp file → fsync → rename → fsync of the directory; the
exclusive lock that keeps two writers out of one place."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from hsx_async.errors import DatasetError, DiskFullError, WriteError


@contextlib.contextmanager
def exclusive_lock(path: Path, busy: str, *, wait: float = 0.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block; another
    holder makes it raise :class:`DatasetError` with ``busy`` — at once, or after waiting
    up to ``wait`` seconds for it to let go (short critical sections shared by several
    processes). The kernel drops the lock when the process dies, so a crash never leaves
    a stale one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _flock(fd, busy, wait)
        yield
    finally:
        os.close(fd)


def is_locked(path: Path, *, holders_share: bool = False, remove_if_free: bool = False) -> bool:
    """Whether a live process holds a lock on ``path`` now (creates nothing).

    A holder of :func:`exclusive_lock` is seen by a shared probe; holders that share the lock
    among themselves (``holders_share``: a live dataset's owners) by an exclusive one.
    ``remove_if_free`` unlinks a file nobody holds while the probe still holds it, so no
    holder can take it in between.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if holders_share else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        if remove_if_free:
            with contextlib.suppress(OSError):
                path.unlink()
    finally:
        os.close(fd)  # also drops the lock taken
    return False


def _flock(fd: int, busy: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise DatasetError(busy) from None
        else:
            return
        time.sleep(pause)  # a poll on another process's lock: no event to wait for
        pause = min(pause * 2, 0.05)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make a file's data durable (any descriptor of the inode will do)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(final: Path, write: Callable[[Path], object], *, tmp: Path | None = None) -> None:
    """Make ``final`` appear whole or not at all: ``write(tmp)`` fills a temp file next to
    it, then fsync, rename over ``final``, fsync of the directory. On any failure the
    temp file goes and ``final`` is untouched. ``tmp`` names the temp file for callers
    whose resume recognises their own (by default a unique hidden name)."""
    with _durable_tmp(final, tmp) as path:
        write(path)


@contextlib.contextmanager
def open_atomic(path: Path) -> Iterator[BinaryIO]:
    """A file to write that appears as ``path`` only when the block ends without error
    (as :func:`write_durably`); on an error the temp file goes and ``path`` is untouched."""
    with _durable_tmp(path, None) as tmp, tmp.open("wb") as fh:
        yield fh


@contextlib.contextmanager
def _durable_tmp(final: Path, tmp: Path | None) -> Iterator[Path]:
    tmp = tmp or final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fsync_file(tmp)
        tmp.replace(final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(final.parent)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new file, never a mix."""
    write_durably(path, lambda tmp: tmp.write_bytes(data))


def write_error(exc: OSError, path: Path) -> WriteError:
    """The typed error for a failed write: ENOSPC is :class:`DiskFullError`."""
    if exc.errno == errno.ENOSPC:
        return DiskFullError(f"no space left writing {path}; free space on the output disk")
    return WriteError(f"writing {path} failed: {exc.strerror or exc}")
