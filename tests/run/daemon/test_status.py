"""The run's snapshot and the gauges collected from it: names, labels and /status keys
are an interface (alert rules, the dashboard, scripts), so they are pinned here."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from hsx_async.run.daemon.status import RunStatus, StatusCollector, take_status
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.servers.pool import ServerPool

GAUGES = {
    "hsx_in_flight",
    "hsx_shm_budget_used_bytes",
    "hsx_shm_budget_bytes",
    "hsx_writer_queue_depth",
    "hsx_workers",
    "hsx_server_up",
    "hsx_output_free_bytes",
    "hsx_intake_paused",
    "hsx_samples_remaining",
    "hsx_eta_seconds",
}
STATUS_KEYS = [
    "done", "quarantined", "skipped", "retried", "attempts_failed", "tokens", "bytes",
    "tokens_per_s", "bytes_per_s", "total_samples", "remaining_tokens", "eta_s", "in_flight",
    "workers", "shm_used", "shm_budget", "writer_queue", "paused", "free_disk", "disk_reserve",
    "stopping", "servers", "spool",
]  # fmt: skip


def _status(tmp_path: Path, metrics: Metrics, pool: ServerPool, guard: DiskGuard) -> RunStatus:
    return take_status(
        metrics,
        pending=(10, 1000),
        pipeline=None,
        servers=pool,
        guard=guard,
        stopping=False,
        shm_budget=1 << 20,
    )


async def test_gauges_and_status_read_one_snapshot(tmp_path: Path) -> None:
    metrics = Metrics()
    pool = ServerPool(
        ["http://a:1", "http://user:secret@b:2"], health_interval=1.0, unreachable_timeout=1.0
    )
    await pool.evict(pool.servers[1], "refused")
    guard = DiskGuard(tmp_path, reserve=100, free_fn=lambda _: 50)
    guard.apply(50)  # below the reserve: paused
    metrics.sample_done(tokens=100, nbytes=4096)
    metrics.totals.samples_skipped = 2
    metrics.registry.register(StatusCollector(lambda: _status(tmp_path, metrics, pool, guard)))

    status = _status(tmp_path, metrics, pool, guard)
    as_json = status.as_dict()
    assert list(as_json) == STATUS_KEYS
    assert as_json["servers"] == [
        {"url": "http://a:1", "healthy": True, "in_flight": 0, "requests": 0, "last_error": "",
         "out_of_rotation": "", "model": ""},
        {"url": "http://user:***@b:2", "healthy": False, "in_flight": 0, "requests": 0,
         "last_error": "refused", "out_of_rotation": "unreachable: refused", "model": ""},
    ]  # fmt: skip
    assert (status.total_samples, status.remaining_tokens) == (12, 900)
    assert status.remaining_samples == 12 - 1 - 2

    text = generate_latest(metrics.registry).decode()
    for name in GAUGES:
        assert f"# TYPE {name} gauge" in text, name
    assert "hsx_intake_paused 1.0" in text
    assert "hsx_output_free_bytes 50.0" in text
    assert "hsx_samples_remaining 9.0" in text
    assert "hsx_shm_budget_bytes 1.048576e+06" in text
    assert 'hsx_server_up{server="http://a:1"} 1.0' in text
    assert 'hsx_server_up{server="http://user:***@b:2"} 0.0' in text


async def test_a_retired_server_leaves_the_gauges(tmp_path: Path) -> None:
    metrics = Metrics()
    pool = ServerPool(["http://a:1", "http://b:2"], health_interval=1.0, unreachable_timeout=1.0)
    guard = DiskGuard(tmp_path, reserve=0, free_fn=lambda _: 1)
    metrics.registry.register(StatusCollector(lambda: _status(tmp_path, metrics, pool, guard)))
    await pool.set_urls(["http://a:1"])
    text = generate_latest(metrics.registry).decode()
    assert 'hsx_server_up{server="http://a:1"} 1.0' in text
    assert "http://b:2" not in text
