"""The mount table: points unescaped, the mount holding a path, its options."""

from __future__ import annotations

from pathlib import Path

from hsx_async.run.dumps.mounts import fs_type, huge_always, mount_of, read_mounts

_TABLE = (
    "/dev/vda1 / ext4 rw,relatime 0 0\n"
    "tmpfs /mnt/with\\040space tmpfs rw,size=1g,huge=always 0 0\n"
    "tmpfs /mnt/with\\040space/deeper ramfs rw 0 0\n"
    "tmpfs /mnt/twice tmpfs rw,huge=always 0 0\n"
    "tmpfs /mnt/twice tmpfs rw,huge=within_size 0 0\n"
)


def test_mount_points_are_unescaped(tmp_path: Path) -> None:
    table = tmp_path / "mounts"
    table.write_text(_TABLE)
    mounts = read_mounts(table)
    assert [str(m.point) for m in mounts][:3] == ["/", "/mnt/with space", "/mnt/with space/deeper"]
    assert mounts[1].options == ("rw", "size=1g", "huge=always")
    assert fs_type(Path("/mnt/with space/x"), table) == "tmpfs"
    assert fs_type(Path("/mnt/with space/deeper/y"), table) == "ramfs"
    assert fs_type(Path("/mnt/with/x"), table) == "ext4"
    assert read_mounts(tmp_path / "no-such-table") == []
    assert fs_type(Path("/x"), tmp_path / "no-such-table") == "unknown"


def test_the_mount_holding_a_path_is_the_last_one_mounted_on_the_deepest_point(
    tmp_path: Path,
) -> None:
    table = tmp_path / "mounts"
    table.write_text(_TABLE)
    over = mount_of(Path("/mnt/twice/dumps"), table)
    assert over is not None and over.option("huge") == "within_size"
    assert not huge_always(over)
    under = mount_of(Path("/mnt/with space/dumps"), table)
    assert under is not None and huge_always(under)
    assert under.option("size") == "1g" and under.option("mode") is None
    deeper = mount_of(Path("/mnt/with space/deeper"), table)
    assert deeper is not None and not huge_always(deeper)  # not a tmpfs
    assert mount_of(Path("/x"), tmp_path / "no-such-table") is None


def test_a_mount_reads_as_its_table_line(tmp_path: Path) -> None:
    table = tmp_path / "mounts"
    table.write_text(_TABLE)
    mount = mount_of(Path("/mnt/with space/x"), table)
    assert str(mount) == "tmpfs on /mnt/with space (tmpfs, rw,size=1g,huge=always)"
