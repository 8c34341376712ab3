"""tests/shm.py removes what killed processes left in /dev/shm, never what a live one holds."""

from __future__ import annotations

import multiprocessing
import os

from tests.shm import LEAKED_BY_KILLS, SHM, remove_left_shm, shm_names


def test_a_live_named_semaphore_stays_and_a_left_one_is_removed() -> None:
    before = shm_names()
    # A live semaphore, as a starting server's: mapped by this process under glibc's
    # temporary name, so only its inode says it is held.
    lock = multiprocessing.get_context("spawn").Lock()
    live = SHM / ("sem." + lock._semlock.name.lstrip("/"))  # type: ignore[attr-defined]
    left = SHM / f"sem.mp-hsx-test-{os.getpid()}"  # what a killed process left: nobody holds it
    left.write_bytes(bytes(32))
    try:
        assert live.exists()
        remove_left_shm(before, LEAKED_BY_KILLS)
        assert live.exists(), "a semaphore a live process maps was removed"
        assert not left.exists()
        with lock:  # still the same semaphore
            pass
    finally:
        left.unlink(missing_ok=True)
        del lock
