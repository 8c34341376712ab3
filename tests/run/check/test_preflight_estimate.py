"""``hsx check``'s job estimate (issue 17, stumble 7): measured from the servers' prefill
rate (real requests), the disk and the client, each stated, bound by the slowest."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from hsx_async.run.check.preflight import estimate, run_checks
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import make_config, write_samples

H, AUX = 64, (1, 3, 5)
US_PER_TOKEN = 500.0  # the modelled server: 2,000 tokens/s however the batch is cut


def test_estimate_takes_the_slowest_part() -> None:
    assert estimate(1000, {"servers": 10.0, "disk": 100.0, "client": 0.0}) == (100.0, "servers")
    assert estimate(1000, {"servers": 0.0, "disk": 50.0, "client": 100.0}) == (20.0, "disk")
    assert estimate(1000, {"servers": 0.0, "disk": 0.0, "client": 0.0}) is None


async def test_check_estimates_from_the_servers_prefill_rate(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=200, seed=4, bad_every=11)
    tokens = sum(len(s["input_ids"]) for s in samples.good.values())
    options = FakeOptions(
        hidden_size=H, aux_layers=AUX, dump_root=shm_root, latency_per_token_us=US_PER_TOKEN
    )
    async with running_fake_server(options) as srv:
        config = make_config(
            tmp_path, samples.path, [srv.url], shm_root, workers={"concurrency": 4}
        )
        report = await asyncio.to_thread(run_checks, config)
        summary = await Daemon(config).run()
    text = report.format()
    assert not report.failed, text
    assert re.search(r"prefill ~[\d,]+ tokens/s \(4 input samples", text), text
    assert "line 11: " in text  # the first bad line, numbered as editors number it
    estimate_line = next(line for line in text.splitlines() if "for the job" in line)
    assert "bound by the servers" in estimate_line, text
    for part in ("servers ~", "disk ~", "client ~"):
        assert part in text, text
    m = re.search(r"~(?:(\d+)h)?(\d+)m(\d+)?s?", estimate_line.split("estimate", 1)[1])
    assert m, estimate_line
    seconds = int(m[1] or 0) * 3600 + int(m[2]) * 60 + int(m[3] or 0)
    modelled = tokens * US_PER_TOKEN / 1e6
    assert 0.5 * modelled <= seconds + 1 <= 2 * modelled + 1, (seconds, modelled, text)
    assert seconds + 1 >= summary.seconds / 3, (seconds, summary.seconds)
