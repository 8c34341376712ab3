"""``workers.concurrency = "auto"``: the controller against modelled servers (no sockets),
and one real run against the fake server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hsx_async.config import load_config
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.pipeline.autotune import (
    Change,
    ConcurrencyController,
    Reading,
    TuneSettings,
    shm_ceiling,
)
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import (
    after_done,
    check_dataset,
    config_raw,
    shm_leftovers,
    write_config,
    write_samples,
)

MEAN_LEN = 1000  # tokens a sample in the modelled runs


@dataclass
class Modelled:
    """A server whose rate rises linearly with requests in flight up to ``knee``, then
    stays flat (a batch is full): tokens/s = per_request × min(limit, knee)."""

    knee: int
    per_request: float = 1000.0
    now: float = 0.0
    tokens: float = 0.0

    def advance(self, limit: int, dt: float) -> None:
        self.now += dt
        self.tokens += self.per_request * min(limit, self.knee) * dt


def drive(
    ctl: ConcurrencyController, server: Modelled, seconds: float, shm_limit: int = 10**6
) -> list[Change]:
    changes = []
    end = server.now + seconds
    while server.now < end:
        server.advance(ctl.limit, 0.5)
        samples = int(server.tokens // MEAN_LEN)
        change = ctl.observe(Reading(server.now, samples, int(server.tokens), shm_limit))
        if change is not None:
            changes.append(change)
    return changes


def test_reaches_the_knee_and_settles_just_above_it() -> None:
    ctl = ConcurrencyController(TuneSettings(start=2, maximum=64))
    server = Modelled(knee=10)
    changes = drive(ctl, server, 600)
    # Slow start doubles 2 → 4 → 8 → 16 → 32, finds 32 no better and goes back to 16.
    assert [c.new for c in changes[:5]] == [4, 8, 16, 32, 16]
    assert changes[4].reason.startswith("slow start done")
    assert all(c.reason for c in changes)
    # Then probes walk it down to the smallest level that still fills the server.
    assert 10 <= ctl.settled_limit <= 13, changes
    assert ctl.phase == "steady"


def test_follows_the_knee_when_the_workload_moves() -> None:
    ctl = ConcurrencyController(TuneSettings(start=4, maximum=64))
    server = Modelled(knee=6)
    drive(ctl, server, 400)
    assert 6 <= ctl.settled_limit <= 8
    server.knee = 24  # shorter prompts: more of them fit in one pass
    drive(ctl, server, 1500)
    assert 22 <= ctl.settled_limit <= 32, ctl.settled_limit


def test_never_above_max_concurrency() -> None:
    ctl = ConcurrencyController(TuneSettings(start=2, maximum=5))
    changes = drive(ctl, Modelled(knee=40), 600)
    assert max(c.new for c in changes) == 5
    assert ctl.limit == 5


def test_shm_budget_caps_and_lowers_the_limit_at_once() -> None:
    ctl = ConcurrencyController(TuneSettings(start=2, maximum=64))
    server = Modelled(knee=40)
    drive(ctl, server, 200, shm_limit=12)
    assert ctl.limit <= 12
    samples = int(server.tokens // MEAN_LEN)
    change = ctl.observe(Reading(server.now + 0.5, samples, int(server.tokens), 3))
    assert change is not None and change.new == 3
    assert "shm" in change.reason
    later = drive(ctl, server, 200, shm_limit=3)
    assert all(c.new <= 3 for c in later)
    assert ctl.limit <= 3


def test_no_window_is_judged_before_the_last_level_turned_over() -> None:
    ctl = ConcurrencyController(TuneSettings(start=4, maximum=64, window_s=1.0))
    # Time passes but nothing completes: never a decision.
    for i in range(100):
        assert ctl.observe(Reading(float(i), 0, 0, 100)) is None
    assert ctl.limit == 4


def test_shm_ceiling() -> None:
    assert shm_ceiling(1000, 0, 0, row_bytes=10, maximum=64) == 64
    # mean sample: 50 tokens × 10 bytes = 500 → 2 fit in 1000 bytes
    assert shm_ceiling(1000, 500, 10, row_bytes=10, maximum=64) == 2
    assert shm_ceiling(100, 500, 10, row_bytes=10, maximum=64) == 1
    assert shm_ceiling(10**9, 500, 10, row_bytes=10, maximum=64) == 64


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="start <= maximum"):
        TuneSettings(start=9, maximum=8)


async def test_auto_run_raises_concurrency_and_loses_nothing(
    tmp_path: Path, shm_root: Path, fresh_structlog: None
) -> None:
    """Against a batching fake server (50 ms a pass, whatever its rows) a run starts at
    4 workers and slow start raises it, each change logged; the dataset is complete."""
    samples = write_samples(tmp_path / "in.jsonl", 400, max_len=24)
    options = FakeOptions(
        hidden_size=64, aux_layers=(1, 3, 5), dump_root=shm_root, latency_base_ms=50.0
    )
    async with running_fake_server(options) as srv:
        raw = config_raw(
            tmp_path,
            samples.path,
            [srv.url],
            shm_root,
            workers={"concurrency": "auto", "max_concurrency": 8},
        )
        config = load_config(write_config(tmp_path, raw))
        assert config.workers.auto
        tune = TuneSettings(window_s=0.5, min_window_samples=4)
        daemon = Daemon(config, autotune=tune)
        with capture_logs() as logs:
            summary = await asyncio.wait_for(daemon.run(), 120)
    changes = [e for e in logs if e["event"] == "concurrency_changed"]
    assert changes, "no concurrency change logged"
    assert (changes[0]["old"], changes[0]["new"]) == (4, 8)
    assert changes[0]["reason"].startswith("slow start")
    assert max(e["new"] for e in changes) <= 8
    assert all(e["reason"] for e in changes)
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=64, num_layers=4)
    assert shm_leftovers(shm_root) == []


async def test_sighup_switches_a_fixed_run_to_auto(
    tmp_path: Path, shm_root: Path, fresh_structlog: None
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 400, max_len=24)
    options = FakeOptions(
        hidden_size=64, aux_layers=(1, 3, 5), dump_root=shm_root, latency_base_ms=50.0
    )
    async with running_fake_server(options) as srv:
        raw = config_raw(tmp_path, samples.path, [srv.url], shm_root, workers={"concurrency": 2})
        path = write_config(tmp_path, raw)
        daemon = Daemon(load_config(path), autotune=TuneSettings(window_s=0.5))

        def to_auto() -> None:
            raw["workers"] = {"concurrency": "auto", "max_concurrency": 6}
            write_config(tmp_path, raw)
            daemon.request_reload()

        after_done(daemon, 20, to_auto)
        with capture_logs() as logs:
            summary = await asyncio.wait_for(daemon.run(), 120)
    assert [e["event"] for e in logs if e["event"].startswith("config_")] == ["config_reloaded"]
    changes = [e for e in logs if e["event"] == "concurrency_changed"]
    assert changes and changes[0]["old"] == 2, changes
    assert max(e["new"] for e in changes) <= 6
    assert summary.done == len(samples.good)
