"""Whether an owner — one incarnation of one rank of a consumer — is alive (PROTOCOL §6.2).

A lease lasts while its owner lives, not until a wall-clock instant: no clock of any node
decides it (issue 37: a reader 700 s ahead took every live lease of another rank; a
trainer paused for a checkpoint lost its samples). An owner is alive while some process
holds a shared ``flock`` on ``consumers/<name>/owners/<owner>.lock``: the reading process
itself (and its DataLoader workers), or ``hsx serve`` on behalf of a remote reader whose
heartbeats keep arriving (measured on serve's monotonic clock). The kernel drops the lock
when the last holder dies, so a SIGKILLed trainer's samples come back at once, and a
stopped (SIGSTOP) or paused one keeps them. Blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from hsx_async.dataset.durable import is_locked

OWNERS_DIR = "owners"


def owner_lock_path(consumer_dir: Path, owner: str) -> Path:
    return consumer_dir / OWNERS_DIR / f"{owner}.lock"


class OwnerHold:
    """This process holds ``owner`` alive (a shared lock, until :meth:`close`)."""

    def __init__(self, consumer_dir: Path, owner: str) -> None:
        path = owner_lock_path(consumer_dir, owner)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = None
        while self.fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while a checker looks (µs)
            if _same_file(fd, path):
                self.fd = fd
            else:  # a checker found it unheld and removed it in between: again
                os.close(fd)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


def alive(consumer_dir: Path, owner: str) -> bool:
    """Whether a process holds ``owner`` now. A dead owner's lock file is removed (its
    owner id never comes back: one incarnation)."""
    path = owner_lock_path(consumer_dir, owner)
    return is_locked(path, holders_share=True, remove_if_free=True)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
