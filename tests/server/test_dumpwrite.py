"""The one way a dump is written: atomic, path-safe files, whatever the buffers' shape."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from hsx_async.server import dumpwrite


def test_short_writev_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def stingy(fd: int, buffers: Sequence[memoryview]) -> int:
        first = bytes(buffers[0])
        return real(fd, [first[: max(1, len(first) // 3)]])

    monkeypatch.setattr(os, "writev", stingy)
    data = [memoryview(bytes(range(i, i + 10))) for i in range(0, 50, 10)]
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dumpwrite.write_part_vectored(dir_fd, 0, 1, [data[:2], data[2:]])
    finally:
        os.close(dir_fd)
    assert (tmp_path / "part-0000000000-0000000001.bin").read_bytes() == bytes(range(50))


def test_buffers_of_any_shape_are_written_whole(tmp_path: Path) -> None:
    """A block of rows arrives as a ``[n, L, H]`` byte view: counted in bytes, not rows."""
    block = np.arange(3 * 2 * 4, dtype=np.uint8).reshape(3, 2, 4)
    flat = np.arange(5, dtype=np.uint16)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dumpwrite.write_part_vectored(dir_fd, 0, 3, [[block.data, flat.view(np.uint8).data]])
    finally:
        os.close(dir_fd)
    got = (tmp_path / "part-0000000000-0000000003.bin").read_bytes()
    assert got == block.tobytes() + flat.tobytes()
