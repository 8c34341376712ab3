"""The export's format registry: a format is one module and one registry line, and nothing
else needs to know it — the driver takes paths, final-state kind, dtype and aux-count
rules, writer, finish step, extra draft-config keys and hint from its descriptor; ``hsx
export``'s choices and help and the live dataset's views take its name from the registry
(issue 38 item 4: a stand-in format, :mod:`tests.dataset.standin_format`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import orjson
import pytest
import torch

from hsx_async.cli import build_parser, main
from hsx_async.cli.handlers.export import _print_result
from hsx_async.dataset.export import (
    DRAFT_CONFIG,
    EXPORT_INFO,
    FORMAT_MODULES,
    export_dataset,
    export_format,
    format_names,
    read_export_log,
)
from hsx_async.dataset.export.plan import DatasetFacts
from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset, views
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, POST_NORM
from tests.dataset import standin_format
from tests.dataset.live.test_dataset import mark_input
from tests.dataset_factory import write_dataset


def test_a_new_format_is_one_descriptor_in_the_registry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with standin_format.registered():
        _export_toy(tmp_path, capsys)


def _export_toy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finished, aux_counts = standin_format.FINISHED, standin_format.AUX_COUNTS
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

    toy = dataclasses.replace(standin_format.FORMAT, check_aux=refuse)
    monkeypatch.setattr(standin_format, "FORMAT", toy)
    src = tmp_path / "out"
    write_dataset(src, num_samples=2, hidden_size=8)
    with standin_format.registered(), pytest.raises(DatasetError, match="toy takes no aux"):
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
    with standin_format.registered():
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
    assert standin_format.FINISHED == [3]
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
    monkeypatch.setitem(FORMAT_MODULES, "other", standin_format.__name__)  # FORMAT is "toy"
    with pytest.raises(DatasetError, match="defines no export format 'other'"):
        export_format("other")
    monkeypatch.setitem(FORMAT_MODULES, "gone", "tests.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        export_format("gone")
