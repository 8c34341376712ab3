"""A server that is not up yet when ``hsx run`` starts (a model still loading, a Slurm
task's own server starting beside hsx) is waited for, probed, and used once it answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.servers.client import EngineClient
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import check_dataset, free_port, make_config, shm_leftovers, write_samples


async def test_run_waits_for_a_server_that_starts_late(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=16)
    port = free_port()
    config = make_config(tmp_path, samples.path, [f"http://127.0.0.1:{port}"], shm_root)
    refused = asyncio.Event()
    probes_failed = 0
    health = EngineClient.health

    async def counting_health(self: EngineClient, url: str, timeout: float = 5.0) -> str:
        nonlocal probes_failed
        error = await health(self, url, timeout)
        if error:
            probes_failed += 1
            if probes_failed >= 3:  # the start-up probe and two while waiting
                refused.set()
        return error

    monkeypatch.setattr(EngineClient, "health", counting_health)
    run = asyncio.create_task(Daemon(config).run())
    await asyncio.wait_for(refused.wait(), 15)
    assert not run.done()
    options = FakeOptions(hidden_size=64, aux_layers=(1, 3, 5), dump_root=shm_root)
    async with running_fake_server(options, port=port):
        summary = await asyncio.wait_for(run, 60)
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=64, num_layers=4)
    assert shm_leftovers(shm_root) == []
