"""Test-only stand-in for ``sgl_kernel.mamba`` (see ../README.md): importable, every kernel
raises when called. The tiny Llama of the real-SGLang tier never reaches a Mamba layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _missing


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"mamba.{name}")
