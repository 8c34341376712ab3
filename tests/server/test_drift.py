"""The drift checker on sources read from a wheel (a zip), and the "calls" kind."""

from __future__ import annotations

import zipfile
from pathlib import Path

from hsx_async.server.drift import Target, check_targets, wheel_root

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
