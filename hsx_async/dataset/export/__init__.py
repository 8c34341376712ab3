"""``hsx export``: the dataset in the on-disk format of an existing EAGLE-3 trainer.

One module per format — :mod:`.specforge` (SpecForge's offline hidden-states directory),
:mod:`.speculators` (speculators' data directory) — each defining an
:class:`~.format.ExportFormat` (paths, the final-state kind its trainer reads, its dtype
and aux-count rules, its sample writer, finish step and next-step hint), listed in
:mod:`.formats`. Everything else is shared: :mod:`.driver` (streaming, resumable, one
export per destination), :mod:`.log` (``hsx-export.jsonl``), :mod:`.plan` (the dataset's
facts and the final-state conversion), :mod:`.fp8` (FP8 handed on or quantized),
:mod:`.draft` (``draft-config.json``), :mod:`.command` (the CLI).
"""

from __future__ import annotations

from hsx_async.dataset.export.command import export_command
from hsx_async.dataset.export.draft import DRAFT_CONFIG
from hsx_async.dataset.export.driver import EXPORT_INFO, LOCK_NAME, ExportResult, export_dataset
from hsx_async.dataset.export.format import TMP_PREFIX, ExportFormat
from hsx_async.dataset.export.formats import FORMAT_NAMES, FORMATS, export_format
from hsx_async.dataset.export.log import EXPORT_LOG, ExportRecord, assign_indices, read_export_log
from hsx_async.dataset.export.plan import AUTO, DTYPE_CHOICES
from hsx_async.dataset.export.specforge import GROUP_SIZE as SPECFORGE_GROUP_SIZE
from hsx_async.dataset.export.specforge import specforge_relpath
from hsx_async.dataset.export.speculators import (
    SPECULATORS_ROWS,
    TOKEN_FREQ,
    speculators_relpath,
)

__all__ = [
    "AUTO",
    "DRAFT_CONFIG",
    "DTYPE_CHOICES",
    "EXPORT_INFO",
    "EXPORT_LOG",
    "FORMATS",
    "FORMAT_NAMES",
    "LOCK_NAME",
    "SPECFORGE_GROUP_SIZE",
    "SPECULATORS_ROWS",
    "TMP_PREFIX",
    "TOKEN_FREQ",
    "ExportFormat",
    "ExportRecord",
    "ExportResult",
    "assign_indices",
    "export_command",
    "export_dataset",
    "export_format",
    "read_export_log",
    "specforge_relpath",
    "speculators_relpath",
]
