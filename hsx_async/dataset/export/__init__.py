"""``hsx export``: the dataset in the on-disk format of an existing EAGLE-3 trainer.

One module per format — :mod:`.specforge` (SpecForge's offline hidden-states directory),
:mod:`.speculators` (speculators' data directory) — each defining an
:class:`~.format.ExportFormat` (paths, the final-state kind its trainer reads, its dtype
and aux-count rules, its sample writer, finish step and next-step hint), listed in
:mod:`.formats`. Everything else is shared: :mod:`.driver` (streaming, resumable, one
export per destination), :mod:`.log` (``hsx-export.jsonl``), :mod:`.plan` (the dataset's
facts and the final-state conversion), :mod:`.fp8` (FP8 handed on or quantized),
:mod:`.draft` (``draft-config.json``).

The names below are loaded on first use: importing :mod:`.formats` (what ``hsx export
--help`` reads) imports this package, which must then import nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx_async.dataset.export.draft import DRAFT_CONFIG
    from hsx_async.dataset.export.driver import (
        EXPORT_INFO,
        LOCK_NAME,
        ExportResult,
        export_dataset,
    )
    from hsx_async.dataset.export.format import TMP_PREFIX, ExportFormat, export_format
    from hsx_async.dataset.export.formats import FORMAT_MODULES, format_names
    from hsx_async.dataset.export.log import (
        EXPORT_LOG,
        ExportRecord,
        assign_indices,
        read_export_log,
    )
    from hsx_async.dataset.export.plan import AUTO, DTYPE_CHOICES
    from hsx_async.dataset.export.specforge import GROUP_SIZE as SPECFORGE_GROUP_SIZE
    from hsx_async.dataset.export.specforge import specforge_relpath
    from hsx_async.dataset.export.speculators import (
        SPECULATORS_ROWS,
        TOKEN_FREQ,
        speculators_relpath,
    )

# name → (module, its name there)
_HOMES = {
    "AUTO": ("plan", "AUTO"),
    "DRAFT_CONFIG": ("draft", "DRAFT_CONFIG"),
    "DTYPE_CHOICES": ("plan", "DTYPE_CHOICES"),
    "EXPORT_INFO": ("driver", "EXPORT_INFO"),
    "EXPORT_LOG": ("log", "EXPORT_LOG"),
    "FORMAT_MODULES": ("formats", "FORMAT_MODULES"),
    "LOCK_NAME": ("driver", "LOCK_NAME"),
    "SPECFORGE_GROUP_SIZE": ("specforge", "GROUP_SIZE"),
    "SPECULATORS_ROWS": ("speculators", "SPECULATORS_ROWS"),
    "TMP_PREFIX": ("format", "TMP_PREFIX"),
    "TOKEN_FREQ": ("speculators", "TOKEN_FREQ"),
    "ExportFormat": ("format", "ExportFormat"),
    "ExportRecord": ("log", "ExportRecord"),
    "ExportResult": ("driver", "ExportResult"),
    "assign_indices": ("log", "assign_indices"),
    "export_dataset": ("driver", "export_dataset"),
    "export_format": ("format", "export_format"),
    "format_names": ("formats", "format_names"),
    "read_export_log": ("log", "read_export_log"),
    "specforge_relpath": ("specforge", "specforge_relpath"),
    "speculators_relpath": ("speculators", "speculators_relpath"),
}

__all__ = [
    "AUTO",
    "DRAFT_CONFIG",
    "DTYPE_CHOICES",
    "EXPORT_INFO",
    "EXPORT_LOG",
    "FORMAT_MODULES",
    "LOCK_NAME",
    "SPECFORGE_GROUP_SIZE",
    "SPECULATORS_ROWS",
    "TMP_PREFIX",
    "TOKEN_FREQ",
    "ExportFormat",
    "ExportRecord",
    "ExportResult",
    "assign_indices",
    "export_dataset",
    "export_format",
    "format_names",
    "read_export_log",
    "specforge_relpath",
    "speculators_relpath",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _HOMES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
