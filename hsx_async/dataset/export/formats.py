"""The export formats ``hsx export --format`` knows: one module each, one entry here."""

from __future__ import annotations

from collections.abc import Mapping

from hsx_async.dataset.export import specforge, speculators
from hsx_async.dataset.export.format import ExportFormat
from hsx_async.errors import DatasetError

FORMATS: Mapping[str, ExportFormat] = {
    f.name: f
    for f in (
        specforge.FORMAT,
        speculators.FORMAT,
    )
}
FORMAT_NAMES = tuple(FORMATS)


def export_format(name: str) -> ExportFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise DatasetError(
            f"unknown export format {name!r}; choose one of {', '.join(FORMATS)}"
        ) from None
