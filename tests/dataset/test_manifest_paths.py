"""Issue 15, item 6: a manifest line names a file by a path; shard outputs come from other
nodes, so no reader may follow a path that is not of the dataset's own form
(``data/<2 hex>/<key>.safetensors``). Merge used to hard-link a file outside ``--to``;
``verify --repair`` unlinks ``out/<path>``; a NUL byte or a 5,000-character path crashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.dataset.layout import data_relpath, manifest_path_problem, sample_key
from hsx_async.dataset.manifest import hash_file, load_done, read_manifest
from hsx_async.dataset.merge import merge
from hsx_async.errors import DatasetError
from tests.dataset_factory import write_dataset

HOSTILE_PATHS = [
    "../../payload.safetensors",
    "/tmp/payload.safetensors",
    "data/00/../../payload.safetensors",
    "data/00/a\x00b.safetensors",
    "data/" + "a" * 5000 + ".safetensors",
    "data/00/.hidden.safetensors",
    "data/zz/a.safetensors",
    "data/00/a.safetensors/",
    "data//a.safetensors",
    "",
]


@pytest.mark.parametrize("sid", ["a", 7, "../../etc/passwd", "x" * 300, ".", "-rf", "", "é/ü"])
def test_every_path_hsx_writes_is_of_the_form(sid: Any) -> None:
    assert manifest_path_problem(data_relpath(sample_key(sid))) == ""


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_paths_of_another_form_are_refused(path: str) -> None:
    assert "is not of the dataset's form" in manifest_path_problem(path)
    assert len(manifest_path_problem(path)) < 300  # a 5,000-character path is cut


def _plant(out: Path, path: str, payload: Path | None = None) -> None:
    """Append a line naming ``path``, with the hash of ``payload`` when given."""
    size, digest = hash_file(payload) if payload else (1, "0" * 16)
    line = {"id": "evil", "path": path, "num_tokens": 1, "bytes": size, "xxh3_64": digest}
    with (out / "manifest.jsonl").open("ab") as fh:
        fh.write(orjson.dumps(line) + b"\n")


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_merge_never_writes_where_a_source_points(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "node1" / "out"
    write_dataset(src, num_samples=2)
    payload = tmp_path / "node1" / "payload.safetensors"
    payload.write_bytes(b"not a sample")
    to = tmp_path / "merged"
    to.mkdir()
    if kind == "relative":
        # Relative to --to, this leaves it: merged/../../payload... → tmp_path's parent.
        target = "../escape.safetensors"
        (src.parent / "escape.safetensors").write_bytes(payload.read_bytes())
        _plant(src, target, payload)
        outside = to.parent / "escape.safetensors"
    else:
        _plant(src, str(payload), payload)
        outside = payload
    with pytest.raises(DatasetError, match=r"manifest\.jsonl:3: path .* is not of the dataset"):
        merge([src], to)
    assert read_manifest(to) == []
    if kind == "relative":
        assert not outside.exists()
    else:
        assert outside.stat().st_nlink == 1  # never hard-linked


def test_verify_repair_never_unlinks_outside(tmp_path: Path, capsys: Any) -> None:
    from hsx_async.cli import main

    out = tmp_path / "out"
    write_dataset(out, num_samples=2)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    _plant(out, "../victim.safetensors")  # size and hash wrong: verify would flag it
    assert main(["verify", str(out), "--repair"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not of the dataset's form" in err[0], err
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_every_reader_refuses_with_one_line(tmp_path: Path, path: str) -> None:
    out = tmp_path / "out"
    write_dataset(out, num_samples=1)
    _plant(out, path)
    with pytest.raises(DatasetError, match="is not of the dataset's form"):
        load_done(out)  # what resume reads
    from hsx_async.dataset.reader import HiddenStateDataset

    with pytest.raises(DatasetError, match="is not of the dataset's form"):
        HiddenStateDataset(out)


def test_verify_of_a_nul_or_long_path_is_exit_2(tmp_path: Path, capsys: Any) -> None:
    from hsx_async.cli import main

    for i, path in enumerate(["data/00/a\x00.safetensors", "data/" + "b" * 5000]):
        out = tmp_path / f"out{i}"
        write_dataset(out, num_samples=1)
        _plant(out, path)
        assert main(["verify", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hsx: error: "), err
