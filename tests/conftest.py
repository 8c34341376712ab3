"""Shared fixtures. Everything a test creates in /dev/shm lives under one unique directory
that the fixture removes, whatever the test's outcome."""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh dump root in /dev/shm (tmpfs, like production), removed after the test."""
    base = SHM if SHM.is_dir() else Path("/tmp")
    root = base / f"hsx-test-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _no_shm_left_by_kills() -> Iterator[None]:
    """What processes killed during the session (crash tests, stopped servers) could not
    unlink in /dev/shm is removed at its end (a killed live reader's cache too)."""
    from tests.shm import LEAKED_BY_KILLS, remove_left_shm, shm_names

    before = shm_names()
    yield
    remove_left_shm(before, LEAKED_BY_KILLS)
    if "hsx_async.dataset.live.remote" in sys.modules:  # live readers killed by a test
        sys.modules["hsx_async.dataset.live.remote"].sweep_caches(SHM)


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """Each test starts with warning-level JSON logs; a test that reconfigures logging
    (a reload, a CLI run) does not leak its level into the next one."""
    import structlog

    from hsx_async.logs import configure_logging

    configure_logging("json", "warning")
    yield
    structlog.reset_defaults()


@pytest.fixture
def fresh_structlog() -> Iterator[None]:
    """structlog defaults for the test (info events reach ``capture_logs``), whatever
    another test configured; restored after."""
    import structlog

    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        yield
    finally:
        structlog.configure(**saved)


@pytest.fixture(scope="session")
def engine_datasets() -> dict[str, tuple[Path, dict[str, list[int]]]]:
    """Datasets the real-engine tiers wrote in this session, by engine: (output directory,
    the samples by id), so a later tier can run the same samples and compare engines."""
    return {}
