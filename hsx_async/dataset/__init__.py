"""The dataset on disk (PROTOCOL §4) and the offline tools over it: the file layout and
manifest, durable writes, provenance, the training-side reader, verify/audit, export and
merge. Nothing here imports :mod:`hsx_async.run`.

``from hsx_async.dataset import HiddenStateDataset`` works for every name of
:mod:`hsx_async.dataset.reader`'s ``__all__`` (and ``LiveDataset`` for those of
:mod:`hsx_async.dataset.live.dataset`'s), loaded on first use: ``hsx run`` imports
this package's file modules (``manifest``, ``durable``, ``provenance``), and a bf16 run
never imports torch, which the reader needs (``tests/run/dumps/test_writer.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_LAZY = ("hsx_async.dataset.reader", "hsx_async.dataset.live.dataset")


def __getattr__(name: str) -> Any:
    # A submodule (``from hsx_async.dataset import manifest``) is never looked up in the reader.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is None:
        for home in _LAZY:
            module = importlib.import_module(home)
            if name in module.__all__:
                return getattr(module, name)
    raise AttributeError(f"module 'hsx_async.dataset' has no attribute {name!r}")
