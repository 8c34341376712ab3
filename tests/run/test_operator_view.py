"""What an operator sees from ``hsx run`` (issue 17): a server started just after the run,
the stop summary, the progress bar's wording and its last frame, JSON log values."""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import time
from pathlib import Path

import orjson
import pytest

from hsx_async.demo import demo_samples, hsx_invocation, run_demo
from hsx_async.logs import configure_logging
from hsx_async.run.daemon.daemon import Daemon, RunSummary
from hsx_async.run.daemon.observe import progress_line, progress_loop
from hsx_async.run.notify import Notifier
from hsx_async.run.pipeline.metrics import Metrics, Totals
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from hsx_async.units import human_bytes
from tests.e2e import free_port, make_config, write_samples

H, AUX = 64, (1, 3, 5)


class _WaitSeen(Notifier):
    """Sets ``waiting`` when the daemon reports that it waits for a server."""

    def __init__(self) -> None:
        super().__init__(None)
        self.waiting = asyncio.Event()

    def status(self, text: str) -> None:
        if text.startswith("waiting for a server"):
            self.waiting.set()


async def test_a_server_started_after_the_run_is_used_at_once(
    tmp_path: Path, shm_root: Path
) -> None:
    """`hsx fake-server & hsx run`: the first probe is refused; the run must not wait
    for server.unreachable_timeout before it probes again."""
    samples = write_samples(tmp_path / "in.jsonl", 5, max_len=8)
    port = free_port()
    config = make_config(
        tmp_path,
        samples.path,
        [f"http://127.0.0.1:{port}"],
        shm_root,
        server={"health_interval": 0.05, "unreachable_timeout": 60.0},
    )
    notifier = _WaitSeen()
    run = asyncio.create_task(Daemon(config, notifier=notifier).run())
    async with asyncio.timeout(20):
        await notifier.waiting.wait()
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options, port=port):
        async with asyncio.timeout(20):  # far below the 60 s unreachable timeout
            summary = await run
    assert summary.done == len(samples.good)


async def test_stop_summary_says_what_remains_and_how_to_finish(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=8)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root, latency_base_ms=20)
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, workers={"concurrency": 2}
        )
        daemon = Daemon(config)

        def stop_once_counted(totals: Totals) -> None:
            if totals.samples_done >= 3 and daemon.feeder and daemon.feeder.pending is not None:
                daemon.metrics.on_sample_done.clear()
                daemon.request_stop()

        daemon.metrics.on_sample_done.append(stop_once_counted)
        stream = io.StringIO()
        configure_logging("json", "info", stream)
        summary = await daemon.run()
    logs = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert summary.stopped
    left = len(samples.good) - summary.done
    assert left > 0 and summary.remaining == left
    step = summary.next_step(Path("job.toml"))
    assert step == (
        f"{left:,} samples remaining: run `hsx run --config job.toml` again to finish (it resumes)"
    )
    finished = [e for e in logs if e["event"] == "run_finished"]
    # Clocks mean nothing outside the process: neither start mark is logged.
    assert finished and not {"started", "cpu_started"} & set(finished[0])
    assert finished[0]["seconds"] > 0
    # The run's own CPU (every thread, start-up excluded): what bench/throughput.py reads.
    assert 0 < finished[0]["cpu_s"] < time.process_time()


def test_summary_line_formats_counts_and_sizes() -> None:
    summary = RunSummary(
        done=1085, quarantined=2, skipped=0, tokens=1234567, bytes=3 << 20,
        seconds=2.0, stopped=False, unfinished=0,
    )  # fmt: skip
    line = summary.line()
    assert "1,085 samples written" in line and "1,234,567 tokens" in line
    assert "3.0 MiB in 2.0 s" in line and "0.00 GB" not in line
    assert human_bytes(1 << 30) == "1.0 GiB"  # "1GiB" in a config reads back as written


def test_progress_line_explains_in_flight() -> None:
    snap = {
        "done": 5, "quarantined": 0, "skipped": 0, "total_samples": 10, "tokens_per_s": 1.0,
        "bytes_per_s": 2048.0, "bytes": 4096, "in_flight": 20, "eta_s": 3.0,
        "servers": [{"in_flight": 3}, {"in_flight": 1}],
    }  # fmt: skip
    assert "in flight 20 (4 at servers, 16 writing)" in progress_line(snap)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_progress_bar_clears_its_last_frame() -> None:
    stream = _Tty()
    drawn = asyncio.Event()
    snap = {
        "done": 9, "quarantined": 0, "skipped": 0, "total_samples": 10, "tokens_per_s": 1.0,
        "bytes_per_s": 1.0, "bytes": 1, "in_flight": 0, "eta_s": 1.0, "servers": [],
    }  # fmt: skip

    def status() -> dict[str, object]:
        drawn.set()
        return snap

    task = asyncio.create_task(progress_loop(status, 30.0, stream=stream))
    async with asyncio.timeout(10):
        await drawn.wait()
        await asyncio.sleep(0)  # let the frame be written
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    out = stream.getvalue()
    assert "90.0%" in out
    assert out.endswith("\r\x1b[2K"), repr(out[-20:])  # erased, not left above the summary


def test_hints_name_the_hsx_that_works(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    venv_hsx = tmp_path / "venv" / "bin" / "hsx"
    venv_hsx.parent.mkdir(parents=True)
    venv_hsx.write_text("#!/bin/sh\n")
    venv_hsx.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(venv_hsx), "demo"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert hsx_invocation() == str(venv_hsx)  # not activated: the path that works
    monkeypatch.setenv("PATH", str(venv_hsx.parent))
    assert hsx_invocation() == "hsx"


async def test_demo_says_what_it_does_before_the_server_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hsx_async.server.reference.server as reference

    def not_started(*_: object, **__: object) -> None:
        raise RuntimeError("stop here")

    monkeypatch.setattr(reference, "running_reference_server", not_started)
    heard: list[str] = []
    with pytest.raises(RuntimeError, match="stop here"):
        await run_demo(tmp_path / "demo", demo_samples(), say=heard.append)
    assert any("reference model" in h for h in heard)
    assert any("starting the reference server" in h for h in heard)


def test_the_runs_cpu_is_counted_from_its_start_not_from_its_set_up() -> None:
    """``cpu_s`` and ``seconds`` cover the run itself (``run_started`` on): the set-up
    before it (the copies' buffers touched in advance) is not the run's."""
    metrics = Metrics()
    spent = time.process_time() + 0.05
    while time.process_time() < spent:  # set-up that costs CPU
        pass
    assert metrics.cpu() >= 0.05 and metrics.elapsed() >= 0.05
    metrics.run_starts()
    assert 0 <= metrics.cpu() < 0.05 and 0 <= metrics.elapsed() < 0.05
