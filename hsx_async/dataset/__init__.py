"""The dataset on disk (PROTOCOL §4) and the offline tools over it: the file layout and
manifest, durable writes, provenance, the training-side reader, verify/audit, export and
merge. Nothing here imports :mod:`hsx_async.run`.

``from hsx_async.dataset import HiddenStateDataset`` keeps working: the reader's names are
loaded on first use, so ``hsx --help`` (which imports the dataset commands) never imports
torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_READER_NAMES = frozenset(
    {
        "AUX_HIDDEN_STATES",
        "FIELDS",
        "HIDDEN_MODES",
        "HIDDEN_STATES",
        "HIDDEN_STATES_SCALES",
        "HIDDEN_STATES_UNQUANTIZED",
        "INPUT_IDS",
        "LOSS_MASK",
        "SECTIONS",
        "STORED",
        "HiddenMode",
        "HiddenStateDataset",
        "LengthGroupedBatchSampler",
        "PadCollator",
        "Sample",
        "SampleHeader",
        "expected_tensors",
        "file_storage",
        "hidden_bf16",
        "padded_fraction",
        "read_header",
        "read_hidden",
        "read_sample",
        "read_tensors",
        "select_entries",
        "split_layers",
        "split_of",
    }
)


def __getattr__(name: str) -> Any:
    if name in _READER_NAMES:
        return getattr(importlib.import_module("hsx_async.dataset.reader"), name)
    raise AttributeError(f"module 'hsx_async.dataset' has no attribute {name!r}")
