"""An export format of the tests' own, the whole of what a new format is: this module
(defining ``FORMAT``) and its line in the registry
(:data:`hsx_async.dataset.export.formats.FORMAT_MODULES`, added by :func:`registered`).

It writes one raw bfloat16 file of the final state per sample; it records each finish step
and each aux-count check in :data:`FINISHED` and :data:`AUX_COUNTS` for the tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hsx_async.dataset import reader
from hsx_async.dataset.export.format import ExportFormat
from hsx_async.dataset.export.formats import FORMAT_MODULES
from hsx_async.dataset.export.plan import DatasetFacts, ExportPlan, FinalConversion
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.protocol import BF16, POST_NORM

NAME = "toy"
FINISHED: list[int] = []  # the number of samples at each finish step
AUX_COUNTS: list[int] = []  # the aux-layer count at each check


def relpath(index: int, group_size: int) -> str:
    return f"toy/{index // group_size}/{index}.bin"


def tensors(source: Path, entry: ManifestEntry, plan: ExportPlan) -> dict[str, Any]:
    header, stored = reader.read_hidden(source, num_tokens=entry.num_tokens)
    final, _aux = reader.split_layers(reader.hidden_bf16(header, stored))
    return {"final": plan.conv.apply(header.metadata, final)}


def write(source: Path, entry: ManifestEntry, plan: ExportPlan, tmp: Path) -> None:
    final = tensors(source, entry, plan)["final"]
    tmp.write_bytes(final.contiguous().view(torch.uint8).numpy().tobytes())


def dtype_rule(asked: str, facts: DatasetFacts, conv: FinalConversion) -> tuple[str, str]:
    return BF16, "toy reads bfloat16"


def check_aux(facts: DatasetFacts) -> None:
    AUX_COUNTS.append(len(facts.aux_layers or ()))


def finish(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: Mapping[str, int]
) -> None:
    FINISHED.append(len(entries))
    (dest / "toy.index").write_text("\n".join(sorted(indices)))


def hint(dest: Path, dtype: str, draft: Mapping[str, Any]) -> str:
    return f"toy: read {dest} ({dtype}, layers {draft['hsx']['toy_layers']})"


FORMAT = ExportFormat(
    name=NAME,
    final_state=POST_NORM,
    relpath=relpath,
    write=write,
    tensors=tensors,
    dtype_rule=dtype_rule,
    hint=hint,
    check_aux=check_aux,
    finish=finish,
    draft_keys=lambda aux: {"toy_layers": list(aux)},
)


@contextmanager
def registered() -> Iterator[ExportFormat]:
    """The stand-in in the registry for the block (the one line a real format adds), with
    its records emptied."""
    FINISHED.clear()
    AUX_COUNTS.clear()
    FORMAT_MODULES[NAME] = __name__
    try:
        yield FORMAT
    finally:
        del FORMAT_MODULES[NAME]
