"""Test-only stand-in for torchvision (see ../README.md): the registry's build needs CUDA,
and SGLang's configs import ``torchvision.transforms`` at module level, which makes
transformers import its torchvision-backed image utilities too. No image model runs in the
real-SGLang tier: the names exist, and every function raises when called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__version__ = "0.28.0"


def missing(module: str, name: str) -> Callable[..., Any]:
    """A function that raises: what every stand-in function is."""

    def function(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{module}.{name}: the hsx test stand-in of torchvision")

    function.__name__ = name
    return function
