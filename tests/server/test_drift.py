"""The drift checker on sources read from a wheel (a zip), and the "calls" kind."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hsx_async.server.drift import Target, check_targets, wheel_root
from hsx_async.server.engine_versions import ENGINE_RANGES
from hsx_async.server.sglang import drift as sglang_drift
from tests.server.sglang.test_sglang_drift import ROOT as SGLANG_SOURCE

SOURCE = """
class Connector:
    def __init__(self, config, role):
        self._pending = {}

    def get_finished(self, done):
        for p in self._pending:
            self._submit(p)
        return event.query()
"""


def wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "engine-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(f"engine/{name}", text)
        z.writestr("engine-1.0.dist-info/METADATA", "Name: engine\n")
    return path


TARGETS = (
    Target("a/conn.py", "Connector", "__init__", "method", "subclasses it", ("self", "config")),
    Target("a/conn.py", "Connector", "_pending", "attr", "shares it"),
    Target("a/conn.py", "Connector", "get_finished", "calls", "relies on it", ("_submit", "query")),
)


def test_a_wheel_is_read_without_unpacking(tmp_path: Path) -> None:
    root = wheel_root(wheel(tmp_path, {"a/conn.py": SOURCE}), "engine")
    assert check_targets(root, TARGETS) == []
    assert not (tmp_path / "engine").exists()


def test_a_file_missing_from_a_wheel_is_named(tmp_path: Path) -> None:
    root = wheel_root(wheel(tmp_path, {"b.py": "x = 1\n"}), "engine")
    problems = check_targets(root, TARGETS)
    assert len(problems) == 3 and all("(a/conn.py): the file is gone" in p for p in problems)


def test_a_call_the_glue_relies_on_is_named_when_gone(tmp_path: Path) -> None:
    edited = SOURCE.replace("self._submit(p)", "pass").replace("event.query()", "None")
    root = wheel_root(wheel(tmp_path, {"a/conn.py": edited}), "engine")
    [problem] = check_targets(root, TARGETS)
    assert problem == (
        "Connector.get_finished (a/conn.py): it no longer calls _submit, query; "
        "the hsx hook relies on it"
    )


def test_a_changed_constructor_is_named(tmp_path: Path) -> None:
    edited = SOURCE.replace("(self, config, role)", "(self, cfg, role)")
    root = wheel_root(wheel(tmp_path, {"a/conn.py": edited}), "engine")
    [problem] = check_targets(root, TARGETS)
    assert "its parameters are now (self, cfg, role)" in problem


# -- .ci/engine-drift, offline (--wheels): its verdicts on wheels made from the tier's source

ENGINE_DRIFT = Path(__file__).resolve().parents[2] / ".ci" / "engine-drift"


# Every file a release's targets (either capture path) and the hook loader's call are in.
_ALL_TARGETS = (
    sglang_drift.COMMON_TARGETS + sglang_drift.SERVER_CAPTURE_TARGETS
    + sglang_drift.HOOK_CAPTURE_TARGETS + sglang_drift.GROUPED_SETTINGS_TARGETS
    + sglang_drift.GROUPED_SPEC_TARGETS
)  # fmt: skip
_LOADER = "srt/model_executor/model_runner_components/cuda_graph_setup.py"


def sglang_wheel(dest: Path, version: str, root: Path, broken: bool) -> None:
    """A wheel labelled ``version`` (its ``_version.py``) holding the tier's files that the
    SGLang targets and launch flags are read from; ``broken``: without
    ``srt/runtime_context.py`` (as 0.5.13.post1)."""
    fields = sorted((root / "srt" / "arg_groups" / "fields").glob("*.py"))
    names = {t.path for t in _ALL_TARGETS} | {str(p.relative_to(root)) for p in fields}
    names.add(_LOADER)
    if broken:
        names.discard("srt/runtime_context.py")
    with zipfile.ZipFile(dest / f"sglang-{version}-py3-none-any.whl", "w") as z:
        for name in sorted(names):
            z.writestr(f"sglang/{name}", (root / name).read_text(encoding="utf-8"))
        z.writestr("sglang/_version.py", f"__version__ = version = '{version}'\n")


def run_engine_drift(wheels: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ENGINE_DRIFT), "--engine", "sglang", "--wheels", str(wheels)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(SGLANG_SOURCE is None, reason="no sglang source (bash .ci/sglang-env)")
def test_engine_drift_passes_the_range_and_fails_a_passing_release_below(tmp_path: Path) -> None:
    assert SGLANG_SOURCE is not None
    supported = ENGINE_RANGES["sglang"]
    versions = supported.releases["sglang"]
    for version in versions:
        sglang_wheel(tmp_path, version, SGLANG_SOURCE, broken=False)
    below = supported.below["sglang"]
    for version in below:
        sglang_wheel(tmp_path, version, SGLANG_SOURCE, broken=True)
    done = run_engine_drift(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:-1] == [
        f"engine-drift: {supported.describe()}: {len(versions) + len(below)} releases checked",
        *(f"  sglang {v}: passes" for v in versions),
    ]
    # Labelled 0.5.13.post1 (the hook's path), without srt/runtime_context.py.
    assert lines[-1] == "  sglang 0.5.13.post1 (below the range): fails (8 problems)"
    # A release below the range that passes: the table is too narrow.
    (tmp_path / f"sglang-{below[-1]}-py3-none-any.whl").unlink()
    sglang_wheel(tmp_path, below[-1], SGLANG_SOURCE, broken=False)
    done = run_engine_drift(tmp_path)
    assert done.returncode == 1
    assert f"sglang {below[-1]} (below the range) passes: widen the range to it" in done.stdout
