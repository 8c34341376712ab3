"""The package's layering holds: the import-linter contracts in pyproject.toml, and the
``server`` whitelist (what SGLang loads into its own process imports only the protocol and
the quantizer)."""

from __future__ import annotations

import contextlib
import io
import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
# The root package holds only __version__; importing any submodule imports it anyway. The
# quantizer (torch only) is the hooks' too: they quantize where the rows are produced.
SERVER_MAY_IMPORT = (
    "hsx_async",
    "hsx_async.errors",
    "hsx_async.protocol",
    "hsx_async.quantize",
    "hsx_async.server",
)


def test_import_linter_contracts_are_kept() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    report = out.getvalue()
    assert code == 0, report
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert "0 broken" in report and f"{len(contracts['contracts'])} kept" in report, report


def _allowed(imported: str) -> bool:
    return imported == "hsx_async" or any(
        imported == m or imported.startswith(m + ".") for m in SERVER_MAY_IMPORT[1:]
    )


def test_server_imports_nothing_but_protocol_and_errors() -> None:
    graph = grimp.build_graph("hsx_async")
    server = {m for m in graph.modules if m.startswith("hsx_async.server")}
    assert "hsx_async.server.sglang.hook" in server
    wrong = sorted(
        (module, imported)
        for module in server
        for imported in graph.find_modules_directly_imported_by(module)
        if imported.startswith("hsx_async") and not _allowed(imported)
    )
    assert wrong == [], f"server modules importing outside the protocol: {wrong}"
