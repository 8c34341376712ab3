"""SIGHUP: every key listed as live takes effect in the running daemon."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import LIVE_KEYS, load_config
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.notify import Notifier
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import check_dataset, config_raw, when_done, write_config, write_samples

H, AUX = 64, (1, 3, 5)

# What the running daemon uses for each live key: read from the object that acts on it,
# never from a copy of the config file.
Probe = Callable[[Daemon], Any]


def _workers(daemon: Daemon) -> Any:
    assert daemon.pipeline is not None
    return daemon.pipeline.workers


def _servers(daemon: Daemon) -> Any:
    assert daemon.servers is not None
    return daemon.servers


def _debug_enabled(_: Daemon) -> bool:
    return bool(structlog.get_logger("hsx.test").is_enabled_for(logging.DEBUG))


PROBES: dict[str, Probe] = {
    "server.urls": lambda d: [s.url for s in _servers(d).servers if not s.retired],
    "server.engines": lambda d: [s.engine_name for s in _servers(d).servers if not s.retired],
    # The worker reads these from its config at every attempt.
    "server.request_timeout": lambda d: _workers(d).config.server.request_timeout,
    "dump.timeout": lambda d: _workers(d).config.dump.timeout,
    "server.health_interval": lambda d: _servers(d).health_interval,
    "server.unreachable_timeout": lambda d: _servers(d).unreachable_timeout,
    "dump.shm_budget": lambda d: (_workers(d).budget.capacity, d.snapshot().shm_budget),
    "workers.concurrency": lambda d: _workers(d).target_workers,
    # The autotune loop reads it at every tick.
    "workers.max_concurrency": lambda d: d.config.workers.max_concurrency,
    "workers.max_attempts": lambda d: _workers(d).retry.max_attempts,
    "workers.backoff_base": lambda d: _workers(d).retry.base,
    "workers.backoff_max": lambda d: _workers(d).retry.cap,
    "daemon.log_level": _debug_enabled,
    # The progress and watchdog loops ask for the interval before every line.
    "daemon.progress_interval": lambda d: d.progress_interval(),
    # The stop path reads it when the signal comes.
    "daemon.drain_timeout": lambda d: d.config.daemon.drain_timeout,
    "output.disk_reserve": lambda d: d.guard.reserve,
}


class _ReloadWatch(Notifier):
    """systemd's view of a reload: RELOADING=1, then READY=1 once it is applied."""

    def __init__(self) -> None:
        super().__init__(None)
        self.reloads: asyncio.Queue[None] = asyncio.Queue()
        self._reloading = False

    def reloading(self) -> None:
        self._reloading = True

    def ready(self) -> None:
        if self._reloading:
            self._reloading = False
            self.reloads.put_nowait(None)


def _changed(raw: dict[str, Any], second_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The raw config with every live key changed, and what each probe should then read."""
    new = {section: dict(keys) for section, keys in raw.items()}
    first_url = raw["server"]["urls"][0]
    new["server"].update(
        urls=[first_url, second_url],
        engines=["sglang", "sglang"],
        request_timeout=11.0,
        health_interval=0.07,
        unreachable_timeout=21.0,
    )
    new["dump"].update(timeout=6.0, shm_budget=32 << 20)
    new["workers"].update(
        concurrency=2, max_concurrency=33, max_attempts=9, backoff_base=0.002, backoff_max=0.02
    )
    new["daemon"].update(log_level="debug", progress_interval=7.0, drain_timeout=12.0)
    new["output"].update(disk_reserve=4096)
    expected = {
        "server.urls": [first_url, second_url],
        "server.engines": ["sglang", "sglang"],
        "server.request_timeout": 11.0,
        "dump.timeout": 6.0,
        "server.health_interval": 0.07,
        "server.unreachable_timeout": 21.0,
        "dump.shm_budget": (32 << 20, 32 << 20),
        "workers.concurrency": 2,
        "workers.max_concurrency": 33,
        "workers.max_attempts": 9,
        "workers.backoff_base": 0.002,
        "workers.backoff_max": 0.02,
        "daemon.log_level": True,
        "daemon.progress_interval": 7.0,
        "daemon.drain_timeout": 12.0,
        "output.disk_reserve": 4096,
    }
    return new, expected


def test_every_live_key_has_a_probe() -> None:
    assert set(PROBES) == set(LIVE_KEYS)


async def test_sighup_applies_every_live_key(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 80, max_len=16)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as one, running_fake_server(options) as two:
        raw = config_raw(
            tmp_path, samples.path, [one.url], shm_root, daemon={"progress_interval": 5.0}
        )
        path = write_config(tmp_path, raw)
        watch = _ReloadWatch()
        daemon = Daemon(load_config(path), notifier=watch)
        some = when_done(daemon, 10)
        run = asyncio.create_task(daemon.run())
        await some.wait()
        before = {key: probe(daemon) for key, probe in PROBES.items()}
        new, expected = _changed(raw, two.url)
        write_config(tmp_path, new)
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(20):
            await watch.reloads.get()
        after = {key: probe(daemon) for key, probe in PROBES.items()}
        summary = await run
    assert after == expected
    assert all(before[key] != expected[key] for key in PROBES), "a probe saw no change"
    assert summary.done == len(samples.good)
    check_dataset(daemon.config.output.dir, samples, hidden_size=H, num_layers=len(AUX) + 1)
