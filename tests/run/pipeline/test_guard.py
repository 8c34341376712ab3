"""The disk guard's words (issue 39, 2.1): a full spool is an online job's intended state,
so its pauses are said once a run, not four times a second; a full disk is still an error."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.source import Sample


class _Spool:
    def __init__(self) -> None:
        self.full = False

    def admit(self, sample: Sample) -> bool:
        return not self.full

    def holds(self) -> str:
        return "spool full" if self.full else ""

    def fix(self) -> str:
        return "raise output.spool_limit"


def _loud(logs: list[MutableMapping[str, Any]]) -> list[object]:
    return [e["event"] for e in logs if e["log_level"] in ("info", "warning", "error")]


@pytest.mark.usefixtures("fresh_structlog")
def test_a_full_spool_is_said_once_a_run(tmp_path: Path) -> None:
    guard, spool = DiskGuard(tmp_path, 0), _Spool()
    guard.limits.append(spool)
    with capture_logs() as logs:
        for _ in range(40):  # the README's online example: ~4 pauses a second
            spool.full = True
            guard.apply(1 << 40)
            spool.full = False
            guard.apply(1 << 40)
    assert _loud(logs) == ["intake_paused_limit"]
    assert sum(e["event"] == "intake_resumed" for e in logs) == 40  # still there, at debug


@pytest.mark.usefixtures("fresh_structlog")
def test_a_full_disk_is_an_error_and_its_end_a_warning(tmp_path: Path) -> None:
    guard = DiskGuard(tmp_path, 100)
    with capture_logs() as logs:
        for _ in range(2):
            guard.apply(10)
            guard.apply(1000)
    assert _loud(logs) == ["intake_paused_disk_low", "intake_resumed"] * 2
