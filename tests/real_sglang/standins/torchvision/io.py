"""``torchvision.io`` stand-in: the names transformers' image utilities import."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from . import missing


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(__name__, name)
