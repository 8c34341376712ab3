"""``hsx samples``: synthetic input of a given size, the same bytes for the same arguments."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx_async.cli import main
from hsx_async.run.source import BadLine, SampleReader


def test_samples_are_valid_sized_and_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "sub" / "b.jsonl"
    for path in (a, b):
        assert main(["samples", "--count", "50", "--max-len", "40", "--out", str(path)]) == 0
    assert a.read_bytes() == b.read_bytes()
    items = list(SampleReader(a, 40).iter_sync())
    assert len(items) == 50 and not any(isinstance(i, BadLine) for i in items)
    lengths = [len(orjson.loads(x)["input_ids"]) for x in a.read_bytes().splitlines()]
    assert min(lengths) >= 16 and max(lengths) <= 40
    assert all(
        3 <= t < 1024 for x in a.read_bytes().splitlines() for t in orjson.loads(x)["input_ids"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "sub"]  # no temp left


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "0"], "--count must be at least 1"),
        (["--count", "3", "--max-len", "4", "--min-len", "9"], "--min-len (9) ≤ --max-len (4)"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "s.jsonl"
    assert main(["samples", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_out_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["samples", "--count", "1", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
