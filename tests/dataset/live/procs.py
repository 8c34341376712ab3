"""Processes for the online tests: ``hsx serve`` and consumer drivers, each a real child
process on 127.0.0.1, read through their JSON-line stdout with bounded waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("consumer_driver.py")
WAIT_S = 60.0


class Child:
    """A child process whose stdout lines are read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []

    @classmethod
    async def start(
        cls,
        name: str,
        *argv: str,
        logs: bool = False,
        env: dict[str, str] | None = None,
        nofile: tuple[int, int] | None = None,
    ) -> Child:
        """``logs``: its stderr (an hsx command's JSON log lines) is read with stdout;
        ``env``: added to this process's; ``nofile``: its descriptor limits (soft, hard)."""
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
        stderr = asyncio.subprocess.STDOUT if logs else asyncio.subprocess.DEVNULL
        limit = (
            None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=REPO,
            env=env, limit=1 << 20, preexec_fn=limit,
        )  # fmt: skip
        return cls(proc, name)

    async def line(self, timeout: float = WAIT_S) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise EOFError(f"{self.name} ended (exit {await self.proc.wait()})")
        text = raw.decode().rstrip("\n")
        self.lines.append(text)
        return text

    async def until(self, key: str, timeout: float = WAIT_S, value: Any = None) -> dict[str, Any]:
        """The next JSON event with ``key`` (set to ``value``, when given); the lines
        before it are kept (``events``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            line = await self.line(max(0.1, deadline - loop.time()))
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if key in event and (value is None or event[key] == value):
                return dict(event)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    def count(self, key: str, value: Any) -> int:
        return sum(1 for e in self.events if e.get(key) == value)

    def got(self) -> list[str]:
        return [e["got"] for e in self.events if "got" in e]

    def acked(self) -> list[str]:
        return [i for e in self.events if "acked" in e for i in e["acked"]]

    async def finish(self, timeout: float = WAIT_S) -> int:
        """Read to the end; the exit code."""
        with contextlib.suppress(EOFError):
            while True:
                await self.line(timeout)
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), WAIT_S)


async def start_server(
    out: Path,
    port: int,
    *args: str,
    env: dict[str, str] | None = None,
    nofile: tuple[int, int] | None = None,
) -> tuple[Child, str]:
    """``hsx serve`` (``args``: more of its flags) with its log lines read too
    (:func:`server_faults` says what went wrong)."""
    child = await Child.start("hsx serve", "-m", "hsx_async", "serve", str(out),
                              "--listen", f"127.0.0.1:{port}", *args, logs=True, env=env,
                              nofile=nofile)  # fmt: skip
    while not (line := await child.line()).startswith("hsx serve:"):
        assert line.startswith("{"), line
    return child, line.rsplit(" on ", 1)[1]


async def server_faults(child: Child) -> list[str]:
    """Once the server is stopped: the lines of its output that are not its own JSON
    log events or its start line (a traceback, aiohttp's "Unhandled exception")."""
    await child.finish()
    return [ln for ln in child.lines if ln and not ln.startswith(("{", "hsx serve:"))]


async def start_consumer(
    source: str, *args: str, env: dict[str, str] | None = None, logs: bool = False
) -> Child:
    """A consumer driver; ``logs``: its stderr (warnings, a traceback) read with stdout."""
    child = await Child.start("consumer", str(DRIVER), source, *args, env=env, logs=logs)
    await child.until("owner")
    return child
