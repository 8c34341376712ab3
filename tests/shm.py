"""/dev/shm files that processes killed by a test leave behind, and their removal.

A process killed with its whole group (a server at the end of its tier, a run SIGKILLed by
a crash test) cannot unlink what it created there: multiprocessing's named semaphores
(``sem.mp-*``), its shared-memory blocks (``psm_*``) and the engines' own files. A test
that kills notes what was there before and removes what appeared since, unless a live
process still holds it open or mapped (another test's server may run beside it)."""

from __future__ import annotations

import contextlib
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
    held = _paths_in_use()
    for name in new:
        path = SHM / name
        if str(path) not in held:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _paths_in_use() -> set[str]:
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    held.add(str(fd.readlink()))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line[line.index("/dev/shm/") :].removesuffix(" (deleted)"))
    return held
