"""The package's layering holds: the import-linter contracts in pyproject.toml — the
``layers`` contract over the whole stack (cli → demo | prepare | samples → run → config |
dataset → the core), the server apart — and the ``server`` whitelist (what SGLang and vLLM
load into their own process imports only the protocol and the quantizer)."""

from __future__ import annotations

import contextlib
import io
import pkgutil
import tomllib
from pathlib import Path
from typing import Any

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


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_layers_contract_covers_the_whole_stack() -> None:
    """Every module of the package is in a layer, the server and package data excepted
    (import-linter's ``exhaustive`` checks it too; this says which ones stand apart)."""
    [layers] = [c for c in _contracts() if c.get("containers") == ["hsx_async"]]
    assert layers["containers"] == ["hsx_async"] and layers["exhaustive"] is True
    named = {m.strip() for layer in layers["layers"] for m in layer.split("|")}
    apart = set(layers["exhaustive_ignores"])
    assert apart == {"data", "server"}
    children = {m.name for m in pkgutil.iter_modules([str(ROOT / "hsx_async")])}
    assert children == named | apart, children ^ (named | apart)
    # The server side stands apart: nothing of the client side but the demo imports it.
    [apart_contract] = [c for c in _contracts() if "only the demo" in str(c["name"])]
    sources = {m.removeprefix("hsx_async.") for m in apart_contract["source_modules"]}
    assert sources == named - {"__main__", "cli", "demo"}


def test_the_live_dataset_is_ordered_inside() -> None:
    """Issue 37: the online feature is one package whose modules have an order (the layers
    contract over hsx_async.dataset.live), every one of them in it."""
    [live] = [c for c in _contracts() if c.get("containers") == ["hsx_async.dataset.live"]]
    named = {m.strip() for layer in live["layers"] for m in layer.split("|")}
    children = {m.name for m in pkgutil.iter_modules([str(ROOT / "hsx_async/dataset/live")])}
    assert live["exhaustive"] is True and children == named, children ^ named


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
