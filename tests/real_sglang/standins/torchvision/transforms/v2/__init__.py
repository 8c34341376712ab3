"""``torchvision.transforms.v2`` stand-in (transformers imports its ``functional``)."""

from __future__ import annotations

from . import functional

__all__ = ["functional"]
