"""Fixtures of the run's tests that start a server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hsx_async.server.fake.options import FakeOptions
from hsx_async.server.fake.server import running_fake_server
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server


@pytest.fixture
async def reference(shm_root: Path) -> AsyncIterator[tuple[str, int, tuple[int, ...]]]:
    options = ReferenceOptions(dump_root=shm_root, chunk_size=32, max_batch_tokens=96, threads=1)
    async with running_reference_server(options) as srv:
        yield srv.url, srv.hidden_size, tuple(srv.aux_layers)


@pytest.fixture
async def fake(shm_root: Path) -> AsyncIterator[tuple[str, int, tuple[int, ...]]]:
    """The fake server, chunked and batched: its rows are a function of (token, position,
    layer) alone, so any two runs of one input are byte-equal however they were batched."""
    options = FakeOptions(dump_root=shm_root, chunk_size=32, max_batch_tokens=96)
    async with running_fake_server(options) as srv:
        yield srv.url, options.hidden_size, options.aux_layers
