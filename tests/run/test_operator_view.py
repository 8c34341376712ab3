"""What an operator sees from ``hsx run`` (issue 17): a server started just after the run,
the stop summary, the progress bar's wording and its last frame, JSON log values."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from hsx_async.run.daemon import Daemon
from hsx_async.run.notify import Notifier
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import make_config, write_samples

H, AUX = 64, (1, 3, 5)


class _WaitSeen(Notifier):
    """Sets ``waiting`` when the daemon reports that it waits for a server."""

    def __init__(self) -> None:
        super().__init__(None)
        self.waiting = asyncio.Event()

    def status(self, text: str) -> None:
        if text.startswith("waiting for a server"):
            self.waiting.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_server_started_after_the_run_is_used_at_once(
    tmp_path: Path, shm_root: Path
) -> None:
    """`hsx fake-server & hsx run`: the first probe is refused; the run must not wait
    for server.unreachable_timeout before it probes again."""
    samples = write_samples(tmp_path / "in.jsonl", 5, max_len=8)
    port = _free_port()
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
