"""The drift checker: does an engine release's source still have every class, method,
attribute and string an hsx glue relies on? Read as text (an installed package directory, or
straight from a downloaded wheel, which is a zip file), never imported. Each engine lists its
targets next to its glue (:mod:`hsx_async.server.sglang.drift`,
:mod:`hsx_async.server.vllm.drift`); ``.ci/engine-drift`` runs the check on every release of
the range :mod:`hsx_async.server.engine_versions` states.

Dev-only: no hook an engine loads imports this module.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

# "calls": the method ``name`` still calls each of ``params`` (``x.<param>(...)`` or
# ``<param>(...)``), where the glue relies on what the engine's method does, not only on its name.
TargetKind = Literal["method", "attr", "function", "literal", "calls"]
_Def = TypeVar("_Def", ast.ClassDef, ast.FunctionDef)


@dataclass(frozen=True, slots=True)
class Target:
    """A name in an engine's source the glue relies on; ``path`` is relative to the
    package directory (``sglang/``, ``vllm/``)."""

    path: str
    owner: str | None
    name: str
    kind: TargetKind
    why: str
    params: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "literal":
            return f"the string {self.name!r}"
        return f"{self.owner}.{self.name}" if self.owner else self.name


# A package directory on disk, or one inside a wheel (``zipfile.Path(wheel, "sglang/")``).
SourceRoot = Path | zipfile.Path


def wheel_root(wheel: Path, package: str) -> zipfile.Path:
    """``package``'s directory inside a downloaded wheel, read without unpacking it."""
    return zipfile.Path(zipfile.ZipFile(wheel), f"{package}/")


def check_targets(root: SourceRoot, targets: Sequence[Target]) -> list[str]:
    """One line per target missing from the source under ``root``, naming it."""
    trees: dict[str, ast.Module | str] = {}
    problems = []
    for target in targets:
        if target.path not in trees:
            trees[target.path] = _parse(root / target.path)
        tree = trees[target.path]
        problem = tree if isinstance(tree, str) else _check_target(tree, target)
        if problem is not None:
            problems.append(f"{target.label} ({target.path}): {problem}; the hsx hook {target.why}")
    return problems


def _parse(path: SourceRoot) -> ast.Module | str:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (FileNotFoundError, KeyError):  # (KeyError: a member missing from a wheel)
        return "the file is gone"
    except SyntaxError as exc:
        return f"the file does not parse ({exc})"


def _check_target(tree: ast.Module, target: Target) -> str | None:
    if target.kind == "literal":
        found = any(
            isinstance(node, ast.Constant) and node.value == target.name for node in ast.walk(tree)
        )
        return None if found else "the string is gone"
    scope: list[ast.stmt] = tree.body
    if target.owner is not None:
        cls = _find_def(tree.body, target.owner, ast.ClassDef)
        if cls is None:
            return f"class {target.owner} is gone or renamed"
        scope = cls.body
        if target.kind == "attr":
            return None if _class_has_attr(cls, target.name) else "gone or renamed"
    fn = _find_def(scope, target.name, ast.FunctionDef)
    if fn is None:
        return "gone or renamed"
    if target.kind == "calls":
        gone = [name for name in target.params if name not in _called_names(fn)]
        return f"it no longer calls {', '.join(gone)}" if gone else None
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if tuple(names[: len(target.params)]) != target.params:
        return f"its parameters are now ({', '.join(names)}), expected {target.params}"
    return None


def _called_names(fn: ast.FunctionDef) -> set[str]:
    calls = (node.func for node in ast.walk(fn) if isinstance(node, ast.Call))
    return {
        f.attr if isinstance(f, ast.Attribute) else f.id
        for f in calls
        if isinstance(f, ast.Attribute | ast.Name)
    }


def _find_def(body: list[ast.stmt], name: str, kind: type[_Def]) -> _Def | None:
    for node in body:
        if isinstance(node, kind) and getattr(node, "name", None) == name:
            return node
    return None


def _class_has_attr(cls: ast.ClassDef, name: str) -> bool:
    """Declared in the class body (field, constant, method, property) or set as
    ``self.<name>`` in one of its methods."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.AnnAssign | ast.Assign) and name in _assigned_names(node):
            return True
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(cls)
    )


def _assigned_names(node: ast.AnnAssign | ast.Assign) -> set[str]:
    targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
