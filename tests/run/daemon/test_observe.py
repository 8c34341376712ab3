"""The progress loop: in a pipe, one ``progress`` event per interval, the interval asked
for before every line (a reload changes ``daemon.progress_interval``)."""

from __future__ import annotations

import io
import socket
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from hsx_async.errors import ConfigError
from hsx_async.run.daemon.observe import progress_line, progress_loop, serve_http


class _Stop(Exception):
    pass


STATUS: dict[str, Any] = {
    "done": 3, "quarantined": 1, "skipped": 2, "total_samples": 12, "tokens_per_s": 1000.0,
    "bytes_per_s": 2e9, "bytes": 3 << 30, "in_flight": 4, "eta_s": 75.0, "paused": False,
    "servers": [{"url": "http://a:1"}],
}  # fmt: skip


async def test_progress_in_a_pipe_follows_the_live_interval() -> None:
    delays: list[float] = []
    interval = {"s": 30.0}

    async def sleep(delay: float) -> None:
        delays.append(delay)
        if len(delays) == 2:
            interval["s"] = 2.0  # the reload lands during the second wait
        if len(delays) == 4:
            raise _Stop

    structlog.reset_defaults()  # info events on (the autouse fixture restores the quiet ones)
    with capture_logs() as logs, pytest.raises(_Stop):
        await progress_loop(
            lambda: STATUS, lambda: interval["s"], stream=io.StringIO(), sleep=sleep
        )
    assert delays == [30.0, 30.0, 2.0, 2.0]
    events = [e for e in logs if e["event"] == "progress"]
    assert len(events) == 3
    assert events[0]["done"] == 3 and "servers" not in events[0]


def test_progress_line_shows_share_rate_and_eta() -> None:
    line = progress_line(STATUS)
    assert line.startswith("6/12 samples  50.0% | 1,000 tok/s | 1.9 GiB/s")
    assert "q 1 | in flight 4 (0 at servers, 4 writing) | ETA 1m15s" in line


async def test_a_port_taken_after_the_start_up_check_is_a_config_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ConfigError, match=rf"daemon\.metrics_listen {listen} is in use"):
            await serve_http(listen, CollectorRegistry(), dict)
