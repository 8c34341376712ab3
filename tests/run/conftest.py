"""Fixtures of the run's tests that start a server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hsx_async.server.reference.server import ReferenceOptions, running_reference_server


@pytest.fixture
async def reference(shm_root: Path) -> AsyncIterator[tuple[str, int, tuple[int, ...]]]:
    options = ReferenceOptions(dump_root=shm_root, chunk_size=32, max_batch_tokens=96, threads=1)
    async with running_reference_server(options) as srv:
        yield srv.url, srv.hidden_size, tuple(srv.aux_layers)
