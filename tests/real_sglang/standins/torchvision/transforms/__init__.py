"""``torchvision.transforms`` stand-in: the names SGLang's configs and transformers import."""

from __future__ import annotations

import enum

from . import functional


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__all__ = ["InterpolationMode", "functional"]
