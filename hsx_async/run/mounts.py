"""The mount table, as this process sees it (``/proc/self/mounts``), read in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Mount:
    point: Path  # unescaped: a space in the table's \\040 is a space here
    fstype: str
    options: tuple[str, ...]


def read_mounts(table: Path = Path("/proc/self/mounts")) -> list[Mount]:
    """Every mount, in the table's order (later lines mount over earlier ones); empty when
    the table cannot be read."""
    try:
        text = table.read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            found.append(Mount(Path(_unescape(fields[1])), fields[2], tuple(fields[3].split(","))))
    return found


def tmpfs_mounts() -> list[tuple[Path, list[str]]]:
    """Mount point and options of every tmpfs this process sees."""
    return [(m.point, list(m.options)) for m in read_mounts() if m.fstype == "tmpfs"]


def fs_type(path: Path, table: Path = Path("/proc/self/mounts")) -> str:
    """The file system type of the mount holding ``path`` ("unknown" when not found)."""
    real = str(path.resolve())
    best, kind = "", "unknown"
    for mount in read_mounts(table):
        point = str(mount.point)
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, mount.fstype
    return kind


def _unescape(path: str) -> str:
    """The mount table writes a space as \\040 (and so on, in octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)
