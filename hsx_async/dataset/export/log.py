"""``hsx-export.jsonl``, the destination's own manifest: one line per output that is
complete and durable, and the output indices it fixes (assigned once per sample id, in id
order, kept across runs so a resumed or extended export never renumbers a file)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.manifest import read_log
from hsx_async.errors import DatasetError

EXPORT_LOG = "hsx-export.jsonl"


@dataclass(frozen=True, slots=True)
class ExportRecord:
    """One line of ``hsx-export.jsonl``: an output that is complete and durable."""

    index: int
    id: str
    path: str
    size: int
    source_xxh3_64: str

    def to_line(self) -> bytes:
        return (
            orjson.dumps(
                {
                    "index": self.index,
                    "id": self.id,
                    "path": self.path,
                    "bytes": self.size,
                    "source_xxh3_64": self.source_xxh3_64,
                }
            )
            + b"\n"
        )


def _record(raw: Any, where: str) -> ExportRecord:
    try:
        return ExportRecord(
            index=int(raw["index"]),
            id=str(raw["id"]),
            path=str(raw["path"]),
            size=int(raw["bytes"]),
            source_xxh3_64=str(raw["source_xxh3_64"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: export log line is missing or mistypes {exc}") from None


def read_export_log(dest: Path) -> dict[str, ExportRecord]:
    """The latest record per sample id (a redone sample appends a newer line)."""
    path = dest / EXPORT_LOG
    records, _torn = read_log(path)
    return {rec.id: rec for rec in (_record(raw, f"{path}:{n}") for n, raw in records)}


def assign_indices(ids: Sequence[str], done: dict[str, ExportRecord]) -> dict[str, int]:
    """Keep every recorded index; number new ids after the highest one, in the given order."""
    indices = {i: done[i].index for i in ids if i in done}
    following = max((r.index for r in done.values()), default=-1) + 1
    for sample_id in ids:
        if sample_id not in indices:
            indices[sample_id] = following
            following += 1
    return indices
