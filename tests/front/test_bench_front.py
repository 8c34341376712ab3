"""bench/front.py in its smoke size, as tests/test_bench_smoke.py runs the other bench
scripts: it finishes, writes its JSON, table and figure, leaves nothing behind, and both
paths delivered every sample (never how fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.front.conftest import mooncake_python
from tests.test_bench_smoke import positive, run_smoke

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]


def test_front_bench_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("front.py", tmp_path, shm_root, "--mooncake-python", str(mooncake_python()))
    rows = {r["path"]: r for r in data["rows"]}
    assert set(rows) == {"hsx run + hsx serve", "hsx front speculators"}
    samples = data["workload"]["samples"]
    for row in rows.values():
        assert row["samples"] == samples and row["failed"] == 0
        assert positive(row["rate"]) and positive(row["cpu_per_gb"])
    # Both read the same samples in the same layout: the same bytes.
    assert rows["hsx run + hsx serve"]["bytes"] == rows["hsx front speculators"]["bytes"]
    assert rows["hsx run + hsx serve"]["vs_serve"] == 1.0
