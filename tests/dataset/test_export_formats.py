"""The export's format registry: a format is one module and one registry line, and nothing
else needs to know it — the driver takes paths, final-state kind, dtype and aux-count
rules, writer, finish step, extra draft-config keys and hint from its descriptor; ``hsx
export``'s choices and help and the live dataset's views take its name from the registry
(issue 38 item 4: this module is a stand-in format's, registered by the tests)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from hsx_async.cli import build_parser, main
from hsx_async.cli.handlers.export import _print_result
from hsx_async.dataset import reader
from hsx_async.dataset.export import (
    DRAFT_CONFIG,
    EXPORT_INFO,
    FORMAT_MODULES,
    export_dataset,
    export_format,
    format_names,
    read_export_log,
)
from hsx_async.dataset.export.format import ExportFormat
from hsx_async.dataset.export.plan import DatasetFacts, ExportPlan, FinalConversion
from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset, views
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, POST_NORM
from tests.dataset.live.test_dataset import mark_input
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


# This module is the stand-in format's too: its FORMAT, and the registry line that
# registered() adds for a test (what a new format is: one module and one line).
FINISHED: list[int] = []  # the number of samples at each finish step
AUX_COUNTS: list[int] = []  # the aux-layer count at each check
FORMAT = _toy(FINISHED, AUX_COUNTS)


@contextlib.contextmanager
def registered() -> Iterator[ExportFormat]:
    """The stand-in in the registry for the block, its records emptied."""
    FINISHED.clear()
    AUX_COUNTS.clear()
    FORMAT_MODULES[FORMAT.name] = __name__
    try:
        yield FORMAT
    finally:
        del FORMAT_MODULES[FORMAT.name]


def test_a_new_format_is_one_descriptor_in_the_registry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with registered():
        _export_toy(tmp_path, capsys)


def _export_toy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finished, aux_counts = FINISHED, AUX_COUNTS
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

    toy = dataclasses.replace(FORMAT, check_aux=refuse)
    monkeypatch.setattr(sys.modules[__name__], "FORMAT", toy)
    src = tmp_path / "out"
    write_dataset(src, num_samples=2, hidden_size=8)
    with registered(), pytest.raises(DatasetError, match="toy takes no aux"):
        export_dataset(src, tmp_path / "dest", fmt="toy")
    assert not (tmp_path / "dest").exists()


def test_every_registered_format_is_reachable_by_its_name() -> None:
    assert format_names() == ("specforge", "speculators")
    for name in format_names():
        assert export_format(name).name == name
    with pytest.raises(DatasetError, match="unknown export format 'nope'; choose one of"):
        export_format("nope")


def _export_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["export"]
    return parser


def test_the_cli_and_the_live_views_take_the_registrys_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Registered, the stand-in is a choice of ``hsx export --format`` (and named in its
    help) and a view of the live dataset; ``hsx export --format toy`` writes it."""
    src = tmp_path / "out"
    written = write_dataset(src, num_samples=3, hidden_size=8)
    mark_input(src, 3)
    with registered():
        [choice] = [a for a in _export_parser()._actions if a.dest == "format"]
        assert choice.choices == ("specforge", "speculators", "toy")
        assert "{specforge,speculators,toy}" in _export_parser().format_help()
        assert "(specforge, speculators, toy)" in build_parser().format_help()
        assert views() == ("hsx", "specforge", "speculators", "toy")
        live = {s[HSX_ID]: s["final"] for s in LiveDataset(src, consumer="t", view="toy")}
        code = main(["export", str(src), "--format", "toy", "--to", str(tmp_path / "toy")])
    assert code == 0
    out = capsys.readouterr().out
    assert f"exported 3 samples to {tmp_path / 'toy'} (toy)" in out
    assert f"toy: read {tmp_path / 'toy'} (bfloat16, layers [2, 30, 58])" in out
    assert FINISHED == [3]
    assert sorted(live) == sorted(str(s.id) for s in written)
    for sample in written:
        assert torch.equal(live[str(sample.id)], sample.hidden[:, -1])


def test_an_unregistered_format_is_no_choice_and_no_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path), "--format", "toy", "--to", str(tmp_path / "d")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'toy' (choose from 'specforge', 'speculators')" in err
    with pytest.raises(ValueError, match=r"expected one of hsx, specforge, speculators$"):
        LiveDataset(tmp_path, consumer="t", view="toy")
    assert "toy" not in FORMAT_MODULES


def test_a_registry_line_without_its_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FORMAT_MODULES, "toy", "tests.dataset_factory")
    with pytest.raises(
        DatasetError, match=r"tests\.dataset_factory defines no export format 'toy'"
    ):
        export_format("toy")
    monkeypatch.setitem(FORMAT_MODULES, "other", __name__)  # its FORMAT is "toy"
    with pytest.raises(DatasetError, match="defines no export format 'other'"):
        export_format("other")
    monkeypatch.setitem(FORMAT_MODULES, "gone", "tests.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        export_format("gone")
