"""The export's format registry: a format is one descriptor, and the driver needs nothing
else — paths, final-state kind, dtype and aux-count rules, writer, finish step, extra
draft-config keys and hint all come from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from hsx_async.dataset import reader
from hsx_async.dataset.export import (
    DRAFT_CONFIG,
    EXPORT_INFO,
    FORMATS,
    ExportFormat,
    export_dataset,
    export_format,
    read_export_log,
)
from hsx_async.dataset.export.command import _print_result
from hsx_async.dataset.export.plan import DatasetFacts, ExportPlan, FinalConversion
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, POST_NORM
from tests.dataset_factory import write_dataset


def _toy(finished: list[int], aux_counts: list[int]) -> ExportFormat:
    """A format of the test's own: one raw bf16 file of the final state per sample."""

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
        aux_counts.append(len(facts.aux_layers or ()))

    def finish(
        out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: Mapping[str, int]
    ) -> None:
        finished.append(len(entries))
        (dest / "toy.index").write_text("\n".join(sorted(indices)))

    def hint(dest: Path, dtype: str, draft: Mapping[str, Any]) -> str:
        return f"toy: read {dest} ({dtype}, layers {draft['hsx']['toy_layers']})"

    return ExportFormat(
        name="toy",
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


def test_a_new_format_is_one_descriptor_in_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    finished: list[int] = []
    aux_counts: list[int] = []
    monkeypatch.setitem(FORMATS, "toy", _toy(finished, aux_counts))
    src, dest = tmp_path / "out", tmp_path / "toy-out"
    written = write_dataset(src, num_samples=5, hidden_size=8)
    result = export_dataset(src, dest, fmt="toy", file_group_size=2)
    assert (result.written, result.dtype, result.dtype_why) == (5, BF16, "toy reads bfloat16")
    assert (finished, aux_counts) == ([5], [3])
    by_id = {str(s.id): s for s in written}
    for record in read_export_log(dest).values():
        assert record.path == f"toy/{record.index // 2}/{record.index}.bin"
        final = by_id[record.id].hidden[:, -1].contiguous()
        assert (dest / record.path).read_bytes() == final.view(torch.uint8).numpy().tobytes()
    info = orjson.loads((dest / EXPORT_INFO).read_bytes())
    assert (info["format"], info["final_state"]) == ("toy", POST_NORM)
    draft = orjson.loads((dest / DRAFT_CONFIG).read_bytes())
    assert draft["hsx"]["toy_layers"] == [2, 30, 58]
    assert draft["hsx"]["final_state"] == POST_NORM
    _print_result(result)
    assert f"toy: read {dest} (bfloat16, layers [2, 30, 58])" in capsys.readouterr().out
    again = export_dataset(src, dest, fmt="toy", file_group_size=2)  # resumes as any format
    assert (again.written, again.skipped, finished) == (0, 5, [5, 5])


def test_a_formats_own_refusal_comes_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(facts: DatasetFacts) -> None:
        raise DatasetError("toy takes no aux layers")

    toy = dataclasses.replace(_toy([], []), check_aux=refuse)
    monkeypatch.setitem(FORMATS, "toy", toy)
    src = tmp_path / "out"
    write_dataset(src, num_samples=2, hidden_size=8)
    with pytest.raises(DatasetError, match="toy takes no aux layers"):
        export_dataset(src, tmp_path / "dest", fmt="toy")
    assert not (tmp_path / "dest").exists()


def test_every_registered_format_is_reachable_by_its_name() -> None:
    assert set(FORMATS) == {"specforge", "speculators"}
    for name, fmt in FORMATS.items():
        assert export_format(name) is fmt and fmt.name == name
    with pytest.raises(DatasetError, match="unknown export format 'nope'; choose one of"):
        export_format("nope")
