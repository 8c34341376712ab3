"""/dev/shm files that processes killed by a test leave behind, and their removal.

A process killed with its whole group (a server at the end of its tier, a run SIGKILLed by
a crash test) cannot unlink what it created there: multiprocessing's named semaphores
(``sem.mp-*``), its shared-memory blocks (``psm_*``) and the engines' own files. A test
that kills notes what was there before and removes what appeared since, unless a live
process still holds it open or mapped (another test's server may run beside it).

"Held" is decided by the file (device and inode), not by its name: glibc creates a named
semaphore under a temporary name (``sem.XXXXXX``), maps it, links it as ``sem.mp-*`` and
unlinks the temporary one, so the creator's ``/proc/<pid>/maps`` names
``/dev/shm/sem.XXXXXX (deleted)``. Matching names removed live semaphores of servers
starting beside the sweep (a vLLM worker then failed to open its lock:
``FileNotFoundError`` in ``SemLock._rebuild``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM = Path("/dev/shm")
LEAKED_BY_KILLS = ("sem.mp-", "psm_")


def shm_names() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def remove_left_shm(before: set[str], prefixes: tuple[str, ...]) -> None:
    """Remove the /dev/shm files named with ``prefixes`` that appeared since ``before``
    and that no live process holds open or mapped."""
    new = [name for name in shm_names() - before if name.startswith(prefixes)]
    if not new:
        return
    held = _files_in_use()
    for name in new:
        path = SHM / name
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            if (st.st_dev, st.st_ino) not in held:
                path.unlink()


def _files_in_use() -> set[tuple[int, int]]:
    """(device, inode) of every file under /dev/shm a live process has open or mapped."""
    held: set[tuple[int, int]] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if str(fd.readlink()).startswith("/dev/shm/"):
                        st = fd.stat()
                        held.add((st.st_dev, st.st_ino))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    fields = line.split()
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    held.add((os.makedev(major, minor), int(fields[4])))
    return held
