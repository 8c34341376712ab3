"""The mount table, as this process sees it (``/proc/self/mounts``), read in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Mount:
    source: str  # the device, or the file system's name for a virtual one ("tmpfs")
    point: Path  # unescaped: a space in the table's \\040 is a space here
    fstype: str
    options: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.source} on {self.point} ({self.fstype}, {','.join(self.options)})"

    def option(self, name: str) -> str | None:
        """The value of ``name=value`` among the options (``None`` when absent)."""
        for opt in self.options:
            key, _, value = opt.partition("=")
            if key == name:
                return value
        return None


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
            point, options = Path(_unescape(fields[1])), tuple(fields[3].split(","))
            found.append(Mount(fields[0], point, fields[2], options))
    return found


def tmpfs_mounts() -> list[tuple[Path, list[str]]]:
    """Mount point and options of every tmpfs this process sees."""
    return [(m.point, list(m.options)) for m in read_mounts() if m.fstype == "tmpfs"]


def mount_of(path: Path, table: Path = Path("/proc/self/mounts")) -> Mount | None:
    """The mount holding ``path``: the deepest point above it, the last one mounted there
    (``None`` when the table cannot be read)."""
    real = str(path.resolve())
    best: Mount | None = None
    for mount in read_mounts(table):
        point = str(mount.point)
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(str(best.point))):
            best = mount
    return best


def fs_type(path: Path, table: Path = Path("/proc/self/mounts")) -> str:
    """The file system type of the mount holding ``path`` ("unknown" when not found)."""
    mount = mount_of(path, table)
    return mount.fstype if mount else "unknown"


def huge_always(mount: Mount) -> bool:
    """A tmpfs mounted ``huge=always``: every file, however small, takes (and zeroes) a
    2 MiB page. For a dump root that is each probe part and each ``meta.json``; measured
    (bench/README.md, issue 27 seventh round) it makes a server's probe 5x slower than
    ``huge=within_size``, which gives huge pages only to files that fill them."""
    return mount.fstype == "tmpfs" and mount.option("huge") == "always"


def _unescape(path: str) -> str:
    """The mount table writes a space as \\040 (and so on, in octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)
