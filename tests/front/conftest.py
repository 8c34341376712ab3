"""Real Mooncake for the front's tests (marker ``mooncake``): .venv-mooncake (bash
.ci/mooncake-env) holds mooncake-transfer-engine-non-cuda and sees speculators 0.9.0 and
hs-connectors 0.9.0; without it the tests skip, and fail under CI."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hsx_async.server.fake.options import FakeOptions
from hsx_async.server.fake.server import running_fake_server
from tests.e2e import free_port

REPO = Path(__file__).resolve().parents[2]
MOONCAKE_VENV = Path(os.environ.get("HSX_MOONCAKE_VENV", REPO / ".venv-mooncake"))
START_TIMEOUT = 30.0
VOCAB = 50_000  # the fake server refuses an id at or past it (a 400: the sample's fault)


def mooncake_python() -> Path:
    python = MOONCAKE_VENV / "bin" / "python"
    if python.is_file() and (MOONCAKE_VENV / ".hsx-mooncake-ok").is_file():
        return python
    message = f"{MOONCAKE_VENV} is missing: run `bash .ci/mooncake-env` to build it"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


async def wait_listening(port: int, proc: asyncio.subprocess.Process, what: str) -> None:
    """Until 127.0.0.1:``port`` accepts a connection (bounded; fails if ``proc`` exits)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if proc.returncode is not None or loop.time() > deadline:
                pytest.fail(f"{what} did not listen on {port} (exit {proc.returncode})")
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def running_master(tmp: Path) -> AsyncIterator[str]:
    """A real mooncake_master on 127.0.0.1 (its log in ``tmp``); its HOST:PORT."""
    python = mooncake_python()
    port = free_port()
    log = (tmp / "mooncake_master.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        python.parent / "mooncake_master",
        f"-rpc_port={port}",
        "-rpc_address=127.0.0.1",
        f"-metrics_port={free_port()}",
        stdout=log,
        stderr=log,
    )
    try:
        await wait_listening(port, proc, "mooncake_master")
        yield f"127.0.0.1:{port}"
    finally:
        await stop(proc)
        log.close()


@pytest.fixture
async def mooncake_master(tmp_path: Path) -> AsyncIterator[str]:
    """A real mooncake_master on 127.0.0.1; its HOST:PORT."""
    async with running_master(tmp_path) as master:
        yield master


@pytest.fixture
async def fake(shm_root: Path) -> AsyncIterator[str]:
    """The fake server, chunked prefill of 32 rows, refusing ids from :data:`VOCAB` on."""
    options = FakeOptions(dump_root=shm_root, chunk_size=32, max_batch_tokens=96, vocab_size=VOCAB)
    async with running_fake_server(options) as srv:
        yield srv.url
