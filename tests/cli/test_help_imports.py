"""``hsx --help`` and every ``hsx <command> --help`` load the standard library and the
parser modules only (STYLE 4b, issue 25 item 3): no torch, no transformers, no third-party
package at all and no domain module. That is what keeps them fast (0.1 s against 5-6 s
when the parsers lived in the domain modules, docs: /work/notes/issue-25-u.md); a handler's
module is imported when its command runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from hsx_async.cli import build_parser

_PROBE = """
import contextlib, io, json, sys
before = set(sys.modules)
from hsx_async.cli import main
loaded = {}
for command in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([*command, "--help"])
    loaded[" ".join(command) or "(none)"] = sorted(set(sys.modules) - before)
print(json.dumps(loaded))
"""

_ALLOWED_HSX = (
    "hsx_async",
    "hsx_async.errors",
    "hsx_async.cli",
    # The export formats' registry (names only) and the packages above it, which import
    # nothing for it: `hsx export --format` takes the registry's names.
    "hsx_async.dataset",
    "hsx_async.dataset.export",
    "hsx_async.dataset.export.formats",
)


def _commands() -> list[list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices is not None
    return [[], *([name] for name in sorted(sub.choices))]


def _foreign(module: str) -> bool:
    top = module.split(".", maxsplit=1)[0]
    if top == "hsx_async":
        return module not in _ALLOWED_HSX and not module.startswith("hsx_async.cli.")
    return top not in sys.stdlib_module_names


def test_help_loads_only_the_standard_library_and_the_parsers() -> None:
    commands = _commands()
    assert len(commands) > 10  # every command, not an empty list
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, orjson.dumps(commands).decode()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded: dict[str, list[str]] = orjson.loads(done.stdout)
    assert set(loaded) == {" ".join(c) or "(none)" for c in commands}
    assert "hsx_async.cli.run" in loaded["(none)"]  # the probe sees what it loads
    for command, modules in loaded.items():
        foreign = [m for m in modules if _foreign(m)]
        assert foreign == [], f"hsx {command} --help loads {foreign}"
        assert "torch" not in modules and "transformers" not in modules


def test_a_command_imports_its_handler_when_it_runs(tmp_path: Path) -> None:
    """The handler is named, not imported, by its parser; ``main`` imports it."""
    code = (
        "import sys\n"
        "from hsx_async.cli import main\n"
        "main(['samples', '--count', '1', '--out', sys.argv[1]])\n"
        "print('hsx_async.samples' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True"
