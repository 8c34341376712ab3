"""Only the CLI parses options and prints (STYLE 4b, issue 38 item 4): each command's
handler lives in :mod:`hsx_async.cli.handlers`; a domain module neither imports argparse
nor calls ``print``/``sys.stdout.write``. The server side prints in its own processes and
stands apart; ``_NOT_YET`` lists the handlers still to move (shrink it as they move)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from hsx_async.cli import build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "hsx_async"
HANDLERS = "hsx_async.cli.handlers."
# command → its domain module, which still holds its handler.
_NOT_YET: dict[str, str] = {}


def _handlers() -> dict[str, str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: str(p.get_default("handler")) for name, p in sub.choices.items()}


def test_every_handler_is_in_the_cli_but_those_not_moved_yet() -> None:
    handlers = _handlers()
    moved = {name for name, spec in handlers.items() if spec.startswith(HANDLERS)}
    server = {name for name, spec in handlers.items() if spec.startswith("hsx_async.server.")}
    assert server == {"fake-server", "reference-server"}
    assert set(handlers) - moved - server == set(_NOT_YET)
    for name in moved:
        module, _, function = handlers[name].removeprefix(HANDLERS).partition(":")
        assert (module, function) == (name.replace("-", "_"), f"{module}_command"), name


def _cli_calls(path: Path) -> list[str]:
    """argparse imports, print() and sys.stdout/stderr.write calls in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"import argparse (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"from argparse (line {node.lineno})")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                found.append(f"print (line {node.lineno})")
            elif (
                isinstance(func, ast.Attribute)
                and func.attr == "write"
                and isinstance(func.value, ast.Attribute)
                and func.value.attr in ("stdout", "stderr")
            ):
                found.append(f"sys.{func.value.attr}.write (line {node.lineno})")
    return found


def test_no_domain_module_parses_options_or_prints() -> None:
    offenders = {
        rel: calls
        for path in sorted(PACKAGE.rglob("*.py"))
        if (rel := path.relative_to(PACKAGE).as_posix()).split("/")[0] not in ("cli", "server")
        and (calls := _cli_calls(path))
    }
    assert set(offenders) <= set(_NOT_YET.values()), {
        rel: calls for rel, calls in offenders.items() if rel not in _NOT_YET.values()
    }
    assert _cli_calls(PACKAGE / "cli" / "handlers" / "samples.py") != []  # the scan sees
