"""``hsx_async.cli.main``: what every command gets before its handler runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_PROBE = """
import contextlib, io, os, sys
from hsx_async.cli import main
with contextlib.redirect_stderr(io.StringIO()):
    code = main(["status", sys.argv[1]])
import numpy  # after main, as a handler imports it
print(code, os.environ["OPENBLAS_NUM_THREADS"], len(os.listdir("/proc/self/task")))
"""


def _probe(tmp_path: Path, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "not-a-dataset")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=base | env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_numpy_starts_no_blas_threads_under_a_command(tmp_path: Path) -> None:
    """hsx makes no BLAS call: OpenBLAS's thread per core, which spins at import, is
    never started (the process has its main thread only)."""
    code, setting, threads = _probe(tmp_path)
    assert code == "2"  # the command ran (and refused the path)
    assert (setting, threads) == ("1", "1")


def test_an_explicit_blas_setting_is_kept(tmp_path: Path) -> None:
    _, setting, _ = _probe(tmp_path, OPENBLAS_NUM_THREADS="2")
    assert setting == "2"
