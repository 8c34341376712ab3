"""Test-only stand-in for two CPU-only gaps of SGLang 0.5.23 that its DeepSeek-V3 path (Kimi-
K2.5's architecture) meets on a CPU without AMX. Loaded only where the real-SGLang tier puts
this directory on ``PYTHONPATH`` (the tiny DeepSeek-V3 servers of
``tests/real_sglang/test_real_deepseek.py``): Python imports ``sitecustomize`` at start-up,
in the launcher and in every scheduler process SGLang spawns. Nothing here is part of hsx
or of a deployment; on a GPU neither gap exists (see ../README.md).

Each patch is applied right after SGLang's own module is imported (a post-import hook),
changes one thing, and refuses to run if SGLang already has what it adds:

1. DeepSeek's attention dispatcher (``AttentionBackendRegistry`` in
   ``models/deepseek_common/attention_backend_handler.py``) has no handler for the
   ``torch_native`` backend, the one SGLang picks on a CPU without AMX, and falls back to
   the Triton handler. That sends a prefill without a cached prefix down the MHA path,
   which writes full keys and values into the MLA latent cache and fails ("Expected size
   ... [2, 64] but got: [2, 96]"). Registered here: ``torch_native`` → SGLang's own
   ``_dispatch_mla_subtype``, the absorbed MLA path (the same attention, computed through
   the latent cache) that the same dispatcher already uses for decode and for later chunks.
2. Under DP attention SGLang pads each DP rank's batch (an idle rank runs a padded batch)
   and asks the backend for the seq-len fill value of the padding rows; on the CPU that is
   ``get_cpu_graph_seq_len_fill_value``, which ``TorchNativeAttnBackend`` lacks (only the
   AMX backend has it). Added here: it returns 1, as the AMX backend's does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

BACKEND = "torch_native"
FILL_VALUE = "get_cpu_graph_seq_len_fill_value"


class StandInStale(RuntimeError):
    """SGLang now has what a stand-in adds: the stand-in must go."""


def route_torch_native_to_mla(module: ModuleType) -> None:
    registry = module.AttentionBackendRegistry
    if BACKEND in registry._handlers:
        raise StandInStale(f"SGLang registers {BACKEND!r} itself now: remove this stand-in")
    registry.register(BACKEND, module._dispatch_mla_subtype)


def add_cpu_graph_fill_value(module: ModuleType) -> None:
    backend = module.TorchNativeAttnBackend
    if FILL_VALUE in vars(backend):
        raise StandInStale(f"TorchNativeAttnBackend has {FILL_VALUE} now: remove this stand-in")

    def get_cpu_graph_seq_len_fill_value(self: Any) -> int:
        return 1

    setattr(backend, FILL_VALUE, get_cpu_graph_seq_len_fill_value)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.models.deepseek_common.attention_backend_handler": route_torch_native_to_mla,
    "sglang.srt.layers.attention.torch_native_backend": add_cpu_graph_fill_value,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the original
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as the normal path finder does, and patches each once it
    has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _AfterImport())
