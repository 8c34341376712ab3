"""What an export format is: the descriptor each format module fills in, and the one way a
format writes a file into the destination.

A format says where sample ``i`` goes, which final-state kind its trainer reads, which
hidden-state dtypes and aux-layer counts it takes, how it writes one sample, what it writes
once every sample is there, and what the operator does next. Everything else — the export
log, indices, resume, locking, the final-state conversion, ``draft-config.json`` — is the
driver's (:mod:`.driver`) and the same for every format. A new format is one module that
defines ``FORMAT`` and one line in :mod:`.formats`; :func:`export_format` loads it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_async.dataset.durable import write_durably
from hsx_async.dataset.export.formats import FORMAT_MODULES
from hsx_async.dataset.export.plan import DatasetFacts, ExportPlan, FinalConversion
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError

TMP_PREFIX = ".hsx-tmp-"  # a file under this name is never a complete output

# (index, file group size) → the sample's path in the destination.
RelPath = Callable[[int, int], str]
# (the sample file in the dataset, its manifest entry, the plan, the temp file to fill).
WriteSample = Callable[[Path, ManifestEntry, ExportPlan, Path], None]
# (the sample file, its manifest entry, the plan) → the sample in the trainer's layout in
# memory, bfloat16: what the format's writer saves, and what the live reader hands a
# trainer (:mod:`hsx_async.dataset.live.dataset`, ``view=<format>``).
SampleTensors = Callable[[Path, ManifestEntry, ExportPlan], dict[str, Any]]
# (asked dtype, dataset facts, conversion) → (dtype written, why auto chose bfloat16).
DtypeRule = Callable[[str, DatasetFacts, FinalConversion], tuple[str, str]]
# (dataset dir, destination, manifest entries, sample id → index), once all are written.
Finish = Callable[[Path, Path, Sequence[ManifestEntry], Mapping[str, int]], None]
# (destination, dtype written, draft-config.json as written) → the next step, for the CLI.
Hint = Callable[[Path, str, Mapping[str, Any]], str]


def any_aux_count(facts: DatasetFacts) -> None:
    """The aux-count rule of a trainer that takes any number of aux layers."""


def no_extra_keys(aux_layers: Sequence[int]) -> dict[str, Any]:
    return {}


def no_finish(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: Mapping[str, int]
) -> None:
    """The finish step of a format whose sample files are all there is."""


def nothing_to_install() -> None:
    """The readiness check of a format that needs nothing beyond hsx's own dependencies."""


@dataclass(frozen=True)
class ExportFormat:
    name: str  # --format
    final_state: str  # the kind the trainer reads from the last layer slot
    relpath: RelPath
    write: WriteSample
    tensors: SampleTensors
    dtype_rule: DtypeRule
    hint: Hint
    check_aux: Callable[[DatasetFacts], None] = any_aux_count  # refuses before writing
    # Refuses before anything is read or written when a package the format needs (an
    # optional extra) is missing: an export of a multi-TB job must not fail at its end.
    check_ready: Callable[[], None] = nothing_to_install
    finish: Finish = no_finish
    # Keys of draft-config.json's "hsx" block only this trainer needs (aux layers → keys).
    draft_keys: Callable[[Sequence[int]], dict[str, Any]] = no_extra_keys


def write_output(final: Path, write: Callable[[Path], object]) -> int:
    """``write(tmp)`` made durable under ``final`` (:func:`write_durably`); the size."""
    final.parent.mkdir(parents=True, exist_ok=True)
    write_durably(final, write, tmp=final.with_name(TMP_PREFIX + final.name))
    return final.stat().st_size


def export_format(name: str) -> ExportFormat:
    """The format registered as ``name`` (its module imported now), or
    :class:`DatasetError` naming the registered ones."""
    try:
        module = FORMAT_MODULES[name]
    except KeyError:
        raise DatasetError(
            f"unknown export format {name!r}; choose one of {', '.join(FORMAT_MODULES)}"
        ) from None
    found = getattr(importlib.import_module(module), "FORMAT", None)
    if not isinstance(found, ExportFormat) or found.name != name:
        raise DatasetError(f"{module} defines no export format {name!r} (FORMAT)")
    return found
