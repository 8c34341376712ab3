"""Finding the real operator tools (Prometheus, Slurm) the deploy tests run against.

They come from Debian packages that ``bash .ci/ops-env`` installs. When one is missing a
test skips with that instruction, except under CI (``CI`` set), where it fails: CI must
never pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

HOW = "install with `bash .ci/ops-env` (root, apt-get)"
T = TypeVar("T")


def require_tools(*names: str) -> dict[str, str]:
    """Each tool's path; skip (fail under CI) naming those missing and how to get them."""
    found = {name: shutil.which(name) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        message = f"{', '.join(missing)} not found: {HOW}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: not skipping)")
        pytest.skip(message)
    return {name: path for name, path in found.items() if path is not None}


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.2) -> T:
    """Poll ``check`` (an external process's state) until it returns a value; fail after
    ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except (OSError, ValueError) as exc:  # not up yet
            last, value = exc, None
        if value is not None:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last})")


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read(1 << 24)
        return body


@contextlib.contextmanager
def process(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own session, output to ``log_path``; TERM, then KILL, on exit."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(grace)
