"""Run by .venv-sglang's Python (never imported by pytest): calls the installed SGLang's own
``set_eagle3_layers_to_capture`` of each model class on a stand-in object and prints, as
JSON, the ``layers_to_capture`` each call set.

    python sglang_probe.py '{"archs": [...], "inner": {...}, "stacks": [...], "cases": [...]}'

A model class is never built (that needs weights and a distributed runtime): the method
is called unbound on a stand-in that has what these methods read: ``pp_group.is_last_rank``
(or ``get_parallel()``), ``config.num_hidden_layers`` (``config.text_config`` for multimodal
configs), the decoder stack as ``model`` or ``language_model``, with ``layers`` and
``layers_to_capture``. A multimodal class that hands the ids to its text model gets, as
``language_model``, a stand-in of the text class named in ``inner``, so the ids travel
through the real code of both.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

METHOD = "set_eagle3_layers_to_capture"
FLAG = "_is_layer_to_capture"


class Stack:
    """A decoder stack: ``layers`` and ``layers_to_capture``, and the stack-level setter
    some families call with the already mapped list (stored as given, flags set; the
    ``stacks`` check proves SGLang's own stack setters do exactly that)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [SimpleNamespace() for _ in range(num_layers)]
        self.layers_to_capture: list[int] | None = None

    def set_eagle3_layers_to_capture(self, layers: list[int]) -> None:
        self.layers_to_capture = list(layers)
        for k in layers:
            if 0 <= k < len(self.layers):  # gpt-oss may name the boundary after the last
                setattr(self.layers[k], FLAG, True)


class Delegate(Stack):
    """A ``language_model`` that is a full text model of class ``cls``: its method runs
    SGLang's code of that class on a stand-in of its own."""

    def __init__(self, cls: Any, num_layers: int) -> None:
        super().__init__(num_layers)
        self.inner = stand_in(num_layers)
        self.cls = cls

    def set_eagle3_layers_to_capture(self, layers: list[int] | None = None) -> None:
        call(self.cls, self.inner, layers)


def stand_in(num_layers: int, inner: Any = None) -> SimpleNamespace:
    config = SimpleNamespace(
        num_hidden_layers=num_layers, text_config=SimpleNamespace(num_hidden_layers=num_layers)
    )
    language_model = Stack(num_layers) if inner is None else Delegate(inner, num_layers)
    return SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=config,
        model=Stack(num_layers),
        language_model=language_model,
        capture_aux_hidden_states=False,
    )


def call(cls: Any, obj: Any, ids: list[int] | None) -> None:
    fn = cls.__dict__.get(METHOD) or getattr(cls, METHOD)
    # exaone_moe and minimax_m2 read the pipeline rank through the runtime context.
    scope = fn.__globals__
    saved = scope.get("get_parallel")
    if saved is not None:
        scope["get_parallel"] = lambda: SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True))
    try:
        fn(obj, ids)
    finally:
        if saved is not None:
            scope["get_parallel"] = saved


def captured(obj: Any) -> list[int] | None:
    """The list the call set, wherever this family keeps its decoder stack."""
    lm = obj.language_model
    for stack in (lm.inner.model if isinstance(lm, Delegate) else None, lm, obj.model):
        if stack is not None and stack.layers_to_capture is not None:
            return list(stack.layers_to_capture)
    return None


def owner_of(cls: Any) -> str:
    owner = next(k for k in cls.__mro__ if METHOD in k.__dict__)
    return f"{owner.__module__}.{owner.__qualname__}"


def defining_classes(models_dir: Path) -> list[str]:
    """``module.Class`` for every class in sglang/srt/models that defines the method (read
    from the source, so a module that fails to import here is still seen)."""
    found = []
    for path in sorted(models_dir.rglob("*.py")):
        module = ".".join(path.relative_to(models_dir).with_suffix("").parts)
        # utf-8-sig: a model file of 0.5.14 starts with a byte-order mark.
        tree = ast.parse(path.read_text(encoding="utf-8-sig"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(f, ast.FunctionDef) and f.name == METHOD for f in node.body
            ):
                found.append(f"{module}.{node.name}")
    return found


def main(request: dict[str, Any]) -> dict[str, Any]:
    import importlib

    import sglang
    from sglang.srt.models.registry import ModelRegistry

    models = ModelRegistry.models
    out: dict[str, Any] = {
        "version": sglang.__version__,
        "registered": {a: owner_of(c) for a, c in models.items() if hasattr(c, METHOD)},
        "defining": defining_classes(Path(sglang.__file__).parent / "srt" / "models"),
        "results": {},
        "stacks": {},
    }
    for arch in request["archs"]:
        cls = models.get(arch)
        if cls is None or not hasattr(cls, METHOD):
            out["results"][arch] = None
            continue
        inner_name = request["inner"].get(arch)
        inner = models[inner_name] if inner_name else None
        rows = []
        for ids, n in request["cases"]:
            obj = stand_in(n, inner)
            try:
                call(cls, obj, ids)
            except Exception as exc:  # reported, and the test names it
                rows.append([ids, n, f"{type(exc).__name__}: {exc}"])
                continue
            rows.append([ids, n, captured(obj)])
        out["results"][arch] = rows
    for name in request["stacks"]:
        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls_name)
        stack = SimpleNamespace(layers=[SimpleNamespace() for _ in range(8)])
        if METHOD not in cls.__dict__:  # (not a stack-level setter in this release)
            out["stacks"][name] = None
            continue
        cls.__dict__[METHOD](stack, [1, 4, 6])
        flagged = [k for k, layer in enumerate(stack.layers) if getattr(layer, FLAG, False)]
        out["stacks"][name] = [list(stack.layers_to_capture), flagged]
    return out


if __name__ == "__main__":
    print("HSX-PROBE " + json.dumps(main(json.loads(sys.argv[1]))))
