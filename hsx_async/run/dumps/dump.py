"""Reading a request's dump from shared memory (PROTOCOL §3), and keeping namespaces clean.

A worker owns ``<root>/<ns>/``: it clears it at start, reads only ``<ns>/<rid>/`` for its
own rids, deletes each dump once the writer has it on disk, and removes anything else it
finds there as debris (late writes of abandoned attempts, stray files). Nothing in a dump
is trusted: links are never followed, sizes are checked against ``meta.json``, and the
writer re-checks each part's size on the descriptor it copies from.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hsx_async.errors import ConfigError, DumpError, DumpMissingError, IdentityError
from hsx_async.protocol import (
    BF16_STORAGE,
    META_NAME,
    DumpMeta,
    Storage,
    check_meta,
    check_part_sizes,
    check_storage,
    parse_meta,
    parse_part_name,
    part_name,
)
from hsx_async.run.dumps.mounts import tmpfs_mounts

_META_MAX = 1 << 20
_POLL_FIRST = 0.001
_POLL_MAX = 0.05


class DumpLinkError(DumpError):
    """A name in a dump is a symbolic link (never followed)."""


@dataclass(frozen=True, slots=True)
class Dump:
    """A complete, validated dump: its directory and its parts in row order."""

    path: Path
    meta: DumpMeta

    def part_paths(self) -> list[Path]:
        return [self.path / part_name(s, e) for s, e in self.meta.parts]


def _remove_at(dir_fd: int, name: str) -> None:
    """Delete ``name`` in an open directory: a file, a link (not its target) or a tree."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        # rmtree with dir_fd works on fds and never follows a link (safe against races).
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def _open_dir(path: Path) -> int | None:
    """An O_NOFOLLOW descriptor of a directory; None if it is gone or is not one."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return None
        raise


def remove_tree(path: Path) -> None:
    """Delete a file, link or directory tree; nothing below ``path.parent`` is followed."""
    parent = _open_dir(path.parent)
    if parent is None:
        return  # gone, or the parent was swapped for a link: never delete through it
    try:
        _remove_at(parent, path.name)
    finally:
        os.close(parent)


def remove_stray_dump(their_root: object, root: Path, ns: str, rid: str) -> None:
    """A probe's dump that a server wrote under its own dump root when ``dump.root`` names
    another directory (``their_root``: where its info endpoint says it dumps): removed, and
    the namespace directory it made there if nothing else is in it, so a refused run leaves
    nothing in the server's real root. Only this run's own ``<ns>/<rid>`` is touched, never
    through a link; a root the server does not name, or names as ours, is left alone."""
    if not isinstance(their_root, str) or not their_root.startswith("/"):
        return
    theirs = Path(their_root)
    if theirs == root:
        return
    with contextlib.suppress(OSError):  # another user's files, or gone: nothing to undo
        remove_tree(theirs / ns / rid)
        root_fd = _open_dir(theirs)
        if root_fd is not None:
            try:
                os.rmdir(ns, dir_fd=root_fd)  # only when empty (ENOTEMPTY otherwise)
            finally:
                os.close(root_fd)


def prepare_namespace(root: Path, ns: str) -> Path:
    """Create ``<root>/<ns>/`` empty. A link planted there is removed, never followed."""
    root.mkdir(parents=True, exist_ok=True)
    ns_dir = root / ns
    remove_tree(ns_dir)
    ns_dir.mkdir(mode=0o777)
    # Servers may run as another user sharing the tmpfs; the mode above is cut by umask.
    with contextlib.suppress(PermissionError):
        ns_dir.chmod(0o777)
    return ns_dir


@contextlib.contextmanager
def namespace_lock(root: Path, base: str) -> Iterator[None]:
    """Hold the namespaces ``<base><n>`` of ``root`` for one run: two runs on one machine
    with the same dump root and prefix would clear and sweep each other's dumps. The lock
    is ``<root>/.hsx-ns-<base>.lock`` (a leading ``.``: never a namespace), flocked, and
    removed at the end by its holder; a holder checks it locked the file still at that
    name, so a removal racing a new run's open never leaves two holders.
    :class:`ConfigError` (``dump.namespace_prefix``) when another run holds it."""
    path = root / f".hsx-ns-{base}.lock"
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                "dump.namespace_prefix",
                f"another hsx run on this machine uses the dump namespaces {base}* in {root} "
                f"(it holds {path.name}); give each run its own dump.namespace_prefix",
            ) from None
        if _same_file(path, fd):
            break
        os.close(fd)  # removed by its last holder between our open and our lock: again
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _same_file(path, fd):
                path.unlink()
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _open_lock(path: Path) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT, 0o644)
        except PermissionError:  # another user's file in a sticky root (protected_regular)
            fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(
            "dump.root", f"cannot open the lock {path}: {exc.strerror}; remove it or fix dump.root"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError("dump.root", f"{path} is not a regular file; remove it")
    return fd


def sweep_namespace(ns_dir: Path, keep: Iterable[str]) -> int:
    """Remove everything in the namespace but the ``keep`` rids; returns entries removed.

    Works on a descriptor of the namespace, so a namespace swapped for a link is never
    swept through: the link itself is replaced by a fresh directory instead."""
    keep = set(keep)
    fd = _open_dir(ns_dir)
    if fd is None:
        if ns_dir.is_symlink() or ns_dir.exists():
            prepare_namespace(ns_dir.parent, ns_dir.name)
            return 1
        return 0
    try:
        with os.scandir(fd) as entries:
            names = [e.name for e in entries if e.name not in keep]
        for name in names:
            _remove_at(fd, name)
    finally:
        os.close(fd)
    return len(names)


def has_debris(ns_dir: Path, keep: Iterable[str]) -> bool:
    """Whether the namespace holds anything but the ``keep`` rids, or is not a plain
    directory: a look that removes nothing (:func:`sweep_namespace` does that)."""
    keep = set(keep)
    fd = _open_dir(ns_dir)
    if fd is None:
        return True
    try:
        with os.scandir(fd) as entries:
            return any(e.name not in keep for e in entries)
    finally:
        os.close(fd)


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs: its metadata calls never wait for a device."""
    try:
        dev = path.stat().st_dev
    except OSError:
        return False
    for mount, _ in tmpfs_mounts():
        with contextlib.suppress(OSError):
            if mount.stat().st_dev == dev:
                return True
    return False


def _open_nofollow(path: Path | str, flags: int, dir_fd: int | None = None) -> int:
    """Open without following a link; a link or non-directory becomes a DumpError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise DumpError(f"{path} is a link or not a directory; refusing it") from None
        raise


def open_dump_file(dir_fd: int, name: str) -> int:
    """A read descriptor of a file in a dump, opened so that nothing can block or be
    followed: ``O_NONBLOCK`` (opening a FIFO for reading would otherwise wait, forever,
    for a writer, on whatever thread called it — the event loop for tmpfs dumps) and
    ``O_NOFOLLOW``. Anything but a regular file is a :class:`DumpError`; FileNotFoundError
    passes through. O_NONBLOCK changes nothing for a regular file's reads."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DumpLinkError(f"{name} is a link; refusing it") from None
        if exc.errno in (errno.ENOTDIR, errno.ENXIO, errno.EISDIR):
            raise DumpError(f"{name} is not a regular file; refusing it") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DumpError(f"{name} is not a regular file; refusing it")
    return fd


def open_dump_dir(rid_dir: Path) -> int:
    """A descriptor of ``<root>/<ns>/<rid>`` opened one component at a time with
    O_NOFOLLOW below the (operator-owned) root, so neither a namespace nor a request
    directory swapped for a link is ever followed. FileNotFoundError if it is gone."""
    ns_path, rid = os.path.split(os.fspath(rid_dir))  # str: no Path objects per request
    root, ns = os.path.split(ns_path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in (ns, rid):
            next_fd = _open_nofollow(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_meta(rid_dir: Path) -> bytes | None:
    """``meta.json`` bytes once visible; None before. Links and non-files are refused."""
    found = _look(rid_dir, sizes=False)
    return None if found is None else found[0]


def read_dump(rid_dir: Path) -> tuple[bytes, dict[tuple[int, int], int]] | None:
    """``meta.json`` and the sizes of the visible parts, through one descriptor of the
    dump's directory; None before the commit. (meta.json is renamed last: once it is
    visible, so is every part.)"""
    return _look(rid_dir, sizes=True)


def _look(rid_dir: Path, *, sizes: bool) -> tuple[bytes, dict[tuple[int, int], int]] | None:
    try:
        dir_fd = open_dump_dir(rid_dir)
    except FileNotFoundError:
        return None
    except DumpError:
        raise DumpError(f"{rid_dir.name}: meta.json or its directory is a link") from None
    try:
        try:
            fd = open_dump_file(dir_fd, META_NAME)
        except FileNotFoundError:
            return None
        except DumpLinkError:
            raise DumpError(f"{rid_dir.name}: meta.json or its directory is a link") from None
        except DumpError:
            raise DumpError(f"{rid_dir.name}: meta.json is not a regular file") from None
        try:
            data = os.read(fd, _META_MAX + 1)
        finally:
            os.close(fd)
        if len(data) > _META_MAX:
            raise DumpError(f"{rid_dir.name}: meta.json is over {_META_MAX} bytes")
        return data, (_part_sizes_at(dir_fd) if sizes else {})
    finally:
        os.close(dir_fd)


async def wait_for_meta(rid_dir: Path, timeout: float) -> bytes:
    """Poll for the commit. The hook writes it as the response leaves, so the first or
    second look usually finds it; the poll backs off so a late commit costs no CPU."""
    delay = _POLL_FIRST
    try:
        async with asyncio.timeout(timeout):
            while (data := read_meta(rid_dir)) is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX)
    except TimeoutError:
        raise DumpMissingError(
            f"no meta.json in {rid_dir} {timeout:g} s after the response (dump.timeout); "
            "is the hsx hook loaded and HSX_DUMP_ROOT the same as dump.root?"
        ) from None
    return data


def _part_sizes(rid_dir: Path) -> dict[tuple[int, int], int]:
    """Sizes of the visible part files; temp files (leading '.') are ignored."""
    try:
        dir_fd = open_dump_dir(rid_dir)
    except FileNotFoundError:
        raise DumpError(f"{rid_dir.name} vanished before it was validated") from None
    try:
        return _part_sizes_at(dir_fd)
    finally:
        os.close(dir_fd)


def _part_sizes_at(dir_fd: int) -> dict[tuple[int, int], int]:
    sizes: dict[tuple[int, int], int] = {}
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            span = parse_part_name(entry.name)
            if span is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                raise DumpError(f"{entry.name} vanished during validation") from None
            if not stat.S_ISREG(st.st_mode):
                raise DumpError(f"{entry.name} is not a regular file")
            sizes[span] = st.st_size
    return sizes


def validate_dump(
    rid_dir: Path,
    meta_bytes: bytes,
    *,
    rid: str,
    num_tokens: int,
    hidden_size: int,
    aux_layers: tuple[int, ...],
    storage: Storage = BF16_STORAGE,
    sizes: dict[tuple[int, int], int] | None = None,
) -> Dump:
    """Every check of PROTOCOL §3; any failure raises :class:`DumpError`. ``storage``: the
    dataset's (the dump holds it, or bfloat16). ``sizes``: the part sizes
    :func:`read_dump` saw with ``meta_bytes`` (else the directory is listed)."""
    meta = parse_meta(meta_bytes)
    try:
        check_meta(
            meta, rid=rid, num_tokens=num_tokens, hidden_size=hidden_size, aux_layers=aux_layers
        )
    except DumpError as exc:
        # A dump of another shape than the config's: the server's identity, not the
        # sample (hsx_async.run.servers.faults); the message stays the protocol's.
        if meta.hidden_size != hidden_size:
            raise IdentityError(str(exc), key="model.hidden_size", field="hidden_size") from None
        if list(meta.aux_layers) != list(aux_layers):
            raise IdentityError(str(exc), key="model.aux_layers", field="aux_layers") from None
        raise
    check_storage(meta, storage)
    check_part_sizes(meta, _part_sizes(rid_dir) if sizes is None else sizes, meta.row_bytes)
    return Dump(rid_dir, meta)
