"""A torchvision functional-transforms stand-in: every function raises when called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import missing


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(__name__, name)
