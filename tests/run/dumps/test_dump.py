"""Reading and validating a dump in /dev/shm (PROTOCOL §3); keeping namespaces clean."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest

from hsx_async.errors import DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    META_NAME,
    PER_TOKEN_SLOT_OUTLIERS16,
    DumpMeta,
    Storage,
    part_name,
    row_bytes,
)
from hsx_async.run.dumps.dump import (
    Dump,
    has_debris,
    on_tmpfs,
    prepare_namespace,
    read_dump,
    remove_stray_dump,
    remove_tree,
    sweep_namespace,
    validate_dump,
    wait_for_meta,
)

HIDDEN, AUX = 8, (1, 2)
ROW = row_bytes(HIDDEN, AUX)  # 3 layers × 8 × 2 = 48 bytes
RID = "nonce-0-1"
PARTS = ((0, 4), (4, 10))


def write_dump(
    rid_dir: Path, *, parts: tuple[tuple[int, int], ...] = PARTS, **meta_changes: Any
) -> bytes:
    """A committed dump: the parts with the right sizes, then meta.json; returns its bytes."""
    rid_dir.mkdir(parents=True, exist_ok=True)
    for start, end in parts:
        (rid_dir / part_name(start, end)).write_bytes(bytes((end - start) * ROW))
    fields: dict[str, Any] = {
        "rid": rid_dir.name,
        "num_tokens": parts[-1][1] if parts else 0,
        "hidden_size": HIDDEN,
        "aux_layers": AUX,
        "parts": parts,
        "model": "m",
        "server": "test",
    }
    fields.update(meta_changes)
    data = DumpMeta(**fields).to_json()
    (rid_dir / META_NAME).write_bytes(data)
    return data


def validate(rid_dir: Path, meta: bytes, **changes: Any) -> Dump:
    expected: dict[str, Any] = {
        "rid": rid_dir.name,
        "num_tokens": 10,
        "hidden_size": HIDDEN,
        "aux_layers": AUX,
    }
    expected.update(changes)
    return validate_dump(rid_dir, meta, **expected)


@pytest.fixture
def rid_dir(shm_root: Path) -> Path:
    return shm_root / "hsx-w0" / RID


@pytest.fixture
def empty_rid_dir(rid_dir: Path) -> Path:
    """The request directory as the hook leaves it before the commit."""
    rid_dir.mkdir(parents=True)
    return rid_dir


def replace_with_link(path: Path, target: Path) -> None:
    """Move ``path`` to ``target`` (maybe on another file system) and leave a symlink to it
    in its place."""
    shutil.move(path, target)
    path.symlink_to(target)


# --- namespaces -------------------------------------------------------------------------


def test_prepare_namespace_creates_an_empty_shared_directory(shm_root: Path) -> None:
    root = shm_root / "root"  # created when missing
    ns_dir = prepare_namespace(root, "hsx-w0")
    assert ns_dir == root / "hsx-w0"
    assert ns_dir.is_dir()
    assert stat.S_IMODE(ns_dir.stat().st_mode) == 0o777  # servers may run as another user
    assert list(ns_dir.iterdir()) == []


def test_prepare_namespace_clears_a_previous_run(shm_root: Path) -> None:
    write_dump(shm_root / "hsx-w0" / "old-rid")
    (shm_root / "hsx-w0" / "stray.bin").write_bytes(b"x")
    ns_dir = prepare_namespace(shm_root, "hsx-w0")
    assert list(ns_dir.iterdir()) == []


@pytest.mark.parametrize("target_kind", ["dir", "file", "dangling"])
def test_prepare_namespace_replaces_a_planted_link_without_following_it(
    shm_root: Path, tmp_path: Path, target_kind: str
) -> None:
    victim = tmp_path / "victim"
    if target_kind == "dir":
        victim.mkdir()
        (victim / "precious").write_bytes(b"keep me")
    elif target_kind == "file":
        victim.write_bytes(b"keep me")
    (shm_root / "hsx-w0").symlink_to(victim)
    ns_dir = prepare_namespace(shm_root, "hsx-w0")
    assert not ns_dir.is_symlink()
    assert ns_dir.is_dir()
    if target_kind == "dir":
        assert (victim / "precious").read_bytes() == b"keep me"
    elif target_kind == "file":
        assert victim.read_bytes() == b"keep me"


def test_remove_tree_removes_anything_without_following_links(
    shm_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"x")
    tree = shm_root / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "link").symlink_to(outside)
    (tree / "file").write_bytes(b"x")
    remove_tree(tree)
    remove_tree(tree)  # already gone: nothing to do
    assert not tree.exists()
    assert (outside / "f").exists()
    link = shm_root / "link"
    link.symlink_to(outside)
    remove_tree(link)
    assert not link.is_symlink()
    assert (outside / "f").exists()
    single = shm_root / "single"
    single.write_bytes(b"x")
    remove_tree(single)
    assert not single.exists()


def test_sweep_namespace_keeps_only_the_keep_set(shm_root: Path, tmp_path: Path) -> None:
    ns_dir = prepare_namespace(shm_root, "hsx-w0")
    for rid in ("live-1", "live-2", "stale-1"):
        write_dump(ns_dir / rid)
    (ns_dir / ".tmp-part").write_bytes(b"x")
    (ns_dir / "stray").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"x")
    (ns_dir / "evil").symlink_to(outside)
    removed = sweep_namespace(ns_dir, iter(["live-1", "live-2", "not-there"]))
    assert removed == 4
    assert sorted(p.name for p in ns_dir.iterdir()) == ["live-1", "live-2"]
    assert (ns_dir / "live-1" / META_NAME).exists()
    assert (outside / "f").exists()
    assert sweep_namespace(ns_dir, {"live-1", "live-2"}) == 0
    assert sweep_namespace(shm_root / "missing", set()) == 0


def test_has_debris_sees_what_a_sweep_would_remove_and_removes_nothing(
    shm_root: Path, tmp_path: Path
) -> None:
    ns_dir = prepare_namespace(shm_root, "hsx-w0")
    assert not has_debris(ns_dir, set())
    write_dump(ns_dir / "live-1")
    assert not has_debris(ns_dir, {"live-1"})
    (ns_dir / ".late-part").write_bytes(b"x")
    assert has_debris(ns_dir, {"live-1"})
    assert (ns_dir / ".late-part").exists()
    sweep_namespace(ns_dir, {"live-1"})
    assert not has_debris(ns_dir, {"live-1"})
    # A namespace swapped for a link, or gone: a sweep must look at it.
    shutil.rmtree(ns_dir)
    assert has_debris(ns_dir, set())
    ns_dir.symlink_to(tmp_path)
    assert has_debris(ns_dir, set())


def test_on_tmpfs_tells_the_dump_root_from_other_file_systems(shm_root: Path) -> None:
    assert on_tmpfs(shm_root)
    assert not on_tmpfs(Path("/proc/self"))
    assert not on_tmpfs(shm_root / "missing")


# --- reading a committed dump ----------------------------------------------------------


def test_read_dump_gives_meta_and_part_sizes_once_committed(rid_dir: Path) -> None:
    assert read_dump(rid_dir) is None  # no directory yet
    rid_dir.mkdir(parents=True)
    (rid_dir / part_name(0, 4)).write_bytes(bytes(4 * ROW))
    assert read_dump(rid_dir) is None  # parts, but no meta.json: not committed
    meta = write_dump(rid_dir)
    found = read_dump(rid_dir)
    assert found is not None
    assert found[0] == meta
    assert found[1] == {(0, 4): 4 * ROW, (4, 10): 6 * ROW}
    assert validate(rid_dir, meta, sizes=found[1]).meta.parts == PARTS


def test_validation_uses_the_sizes_it_is_given(rid_dir: Path) -> None:
    """The sizes read_dump saw with meta.json are the ones checked (one directory look)."""
    meta = write_dump(rid_dir)
    with pytest.raises(DumpError, match=r"has 0 bytes, expected 192"):
        validate(rid_dir, meta, sizes={(0, 4): 0, (4, 10): 6 * ROW})


def test_read_dump_refuses_a_linked_request_dir(rid_dir: Path, tmp_path: Path) -> None:
    write_dump(tmp_path / "elsewhere")
    rid_dir.parent.mkdir(parents=True)
    rid_dir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DumpError, match="is a link"):
        read_dump(rid_dir)


# --- waiting for the commit -------------------------------------------------------------


async def test_wait_for_meta_returns_a_committed_meta_at_once(rid_dir: Path) -> None:
    data = write_dump(rid_dir)
    assert await wait_for_meta(rid_dir, 5.0) == data


async def test_wait_for_meta_sees_a_later_commit(empty_rid_dir: Path) -> None:
    waiter = asyncio.create_task(wait_for_meta(empty_rid_dir, 30.0))
    await asyncio.sleep(0)  # let it take its first (empty) look
    assert not waiter.done()
    data = write_dump(empty_rid_dir)
    assert await waiter == data


async def test_wait_for_meta_times_out_with_an_operator_hint(empty_rid_dir: Path) -> None:
    with pytest.raises(DumpError, match=r"no meta\.json in .* \(dump\.timeout\).*HSX_DUMP_ROOT"):
        await wait_for_meta(empty_rid_dir, 0.01)


async def test_wait_for_meta_missing_directory_times_out(rid_dir: Path) -> None:
    with pytest.raises(DumpError, match=r"no meta\.json"):
        await wait_for_meta(rid_dir, 0.01)


async def test_meta_as_a_link_is_refused(rid_dir: Path, tmp_path: Path) -> None:
    write_dump(rid_dir)
    replace_with_link(rid_dir / META_NAME, tmp_path / "meta.json")
    with pytest.raises(DumpError, match=r"meta\.json or its directory is a link"):
        await wait_for_meta(rid_dir, 5.0)


async def test_meta_that_is_not_a_file_is_refused(empty_rid_dir: Path) -> None:
    (empty_rid_dir / META_NAME).mkdir()
    with pytest.raises(DumpError, match=r"meta\.json is not a regular file"):
        await wait_for_meta(empty_rid_dir, 5.0)


async def test_oversized_meta_is_refused(empty_rid_dir: Path) -> None:
    write_dump(empty_rid_dir)
    os.truncate(empty_rid_dir / META_NAME, (1 << 20) + 1)  # NUL padding: size is the point
    with pytest.raises(DumpError, match="over 1048576 bytes"):
        await wait_for_meta(empty_rid_dir, 5.0)


# --- validation -------------------------------------------------------------------------


def test_valid_dump(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    (rid_dir / f".{part_name(10, 12)}.tmp").write_bytes(b"late write")  # temp: ignored
    (rid_dir / "notes.txt").write_bytes(b"not a part")  # not a part name: ignored
    dump = validate(rid_dir, meta)
    assert dump.path == rid_dir
    assert dump.meta.parts == PARTS
    assert dump.part_paths() == [rid_dir / part_name(0, 4), rid_dir / part_name(4, 10)]


def test_missing_part(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    (rid_dir / part_name(4, 10)).unlink()
    with pytest.raises(DumpError, match=r"part-0000000004-0000000010.bin is listed .* missing"):
        validate(rid_dir, meta)


def test_part_of_the_wrong_size(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    (rid_dir / part_name(0, 4)).write_bytes(bytes(4 * ROW - 2))
    with pytest.raises(DumpError, match=r"has 190 bytes, expected 192 \(4 rows × 48 bytes\)"):
        validate(rid_dir, meta)


def test_unlisted_part(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    (rid_dir / part_name(10, 12)).write_bytes(bytes(2 * ROW))
    with pytest.raises(DumpError, match=r"part-0000000010-0000000012\.bin is not listed"):
        validate(rid_dir, meta)


def test_symlinked_part(rid_dir: Path, tmp_path: Path) -> None:
    meta = write_dump(rid_dir)
    replace_with_link(rid_dir / part_name(0, 4), tmp_path / "real.bin")
    with pytest.raises(DumpError, match="is not a regular file"):
        validate(rid_dir, meta)


def test_part_that_is_a_directory(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    part = rid_dir / part_name(4, 10)
    part.unlink()
    part.mkdir()
    with pytest.raises(DumpError, match="is not a regular file"):
        validate(rid_dir, meta)


def test_rejecting_a_part_closes_its_dir(rid_dir: Path) -> None:
    meta = write_dump(rid_dir)
    part = rid_dir / part_name(4, 10)
    part.unlink()
    part.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DumpError):
            validate(rid_dir, meta)
    assert [w.message for w in caught if issubclass(w.category, ResourceWarning)] == []


@pytest.mark.parametrize(
    ("parts", "match"),
    [(((0, 4), (5, 10)), "gap at row 4"), (((0, 5), (4, 10)), "overlap at row 5")],
)
def test_bad_tiling(rid_dir: Path, parts: tuple[tuple[int, int], ...], match: str) -> None:
    meta = write_dump(rid_dir, parts=parts)
    with pytest.raises(DumpError, match=match):
        validate(rid_dir, meta)


@pytest.mark.parametrize(
    ("expected", "match"),
    [
        ({"rid": "other-rid"}, "rid is 'nonce-0-1', expected 'other-rid'"),
        ({"num_tokens": 11}, "num_tokens is 10, the request had 11"),
        ({"hidden_size": 16}, r"config \[model\].hidden_size is 16"),
        ({"aux_layers": (1, 3)}, r"config \[model\].aux_layers is \[1, 3\]"),
    ],
)
def test_dump_that_does_not_match_the_request(
    rid_dir: Path, expected: dict[str, Any], match: str
) -> None:
    meta = write_dump(rid_dir)
    with pytest.raises(DumpError, match=match):
        validate(rid_dir, meta, **expected)


def test_part_sizes_follow_the_dumps_own_storage(rid_dir: Path) -> None:
    """An FP8 dump with parts of bfloat16 size (48 bytes a row) fails: an FP8 row of the
    3 slots is 3 × 8 fp8 values + 3 float32 scales = 36 bytes."""
    fp8 = Storage(FP8, (0, 1, 2))
    meta = write_dump(rid_dir, storage=fp8)
    with pytest.raises(DumpError, match=r"expected 144 \(4 rows × 36 bytes\)"):
        validate(rid_dir, meta, storage=fp8)


def test_fp8_dump_of_other_slots_fails_and_bf16_dump_is_accepted(rid_dir: Path) -> None:
    """The dataset wants slots 0 and 1 quantized: a dump of all three cannot become that;
    a bfloat16 dump can (the writer quantizes it)."""
    wanted = Storage(FP8, (0, 1))
    meta = write_dump(rid_dir, storage=Storage(FP8, (0, 1, 2)))
    with pytest.raises(
        DumpError, match="stored as float8_e4m3fn \\(slots 0,1,2; scales per_token_slot\\)"
    ):
        validate(rid_dir, meta, storage=wanted)
    meta = write_dump(rid_dir)
    assert validate(rid_dir, meta, storage=wanted).meta.storage == BF16_STORAGE


def _fp8_dump(rid_dir: Path, storage: Storage, row: int) -> bytes:
    """A committed FP8 dump whose parts hold ``row`` bytes a token."""
    shutil.rmtree(rid_dir, ignore_errors=True)
    rid_dir.mkdir(parents=True)
    for start, end in PARTS:
        (rid_dir / part_name(start, end)).write_bytes(bytes((end - start) * row))
    meta = DumpMeta(rid_dir.name, 10, HIDDEN, AUX, PARTS, "m", "test", storage=storage)
    (rid_dir / META_NAME).write_bytes(meta.to_json())
    return meta.to_json()


def test_an_fp8_dump_of_another_layout_fails_and_part_sizes_follow_the_layout(
    rid_dir: Path,
) -> None:
    """The outliers layout's parts hold 16 × (2 + 2) bytes more per vector than
    per_token_slot's (PROTOCOL §3); a dump of the dataset's slots in the other layout
    cannot become the dataset's (it is not requantized: that would round twice)."""
    outliers = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT_OUTLIERS16)
    per_slot = Storage(FP8, (0, 1, 2))
    row = outliers.row_bytes(3, HIDDEN)
    assert row == 3 * (HIDDEN + 4 + 16 * 4) == per_slot.row_bytes(3, HIDDEN) + 3 * 64
    meta = _fp8_dump(rid_dir, outliers, row)
    assert validate(rid_dir, meta, storage=outliers).meta.storage == outliers
    with pytest.raises(DumpError, match="scales per_token_slot_outliers16\\) but this dataset"):
        validate(rid_dir, meta, storage=per_slot)
    meta = _fp8_dump(rid_dir, outliers, per_slot.row_bytes(3, HIDDEN))
    with pytest.raises(DumpError, match=f"expected {4 * row} \\(4 rows × {row} bytes\\)"):
        validate(rid_dir, meta, storage=outliers)


def test_meta_that_is_not_json(rid_dir: Path) -> None:
    write_dump(rid_dir)
    with pytest.raises(DumpError, match="not valid JSON"):
        validate(rid_dir, b"{")


def test_part_named_with_non_ascii_digits_does_not_count(rid_dir: Path) -> None:
    meta = write_dump(rid_dir, parts=((0, 4),), num_tokens=4)
    (rid_dir / part_name(0, 4)).unlink()
    arabic = "part-" + "\u0660" * 10 + "-" + "\u0660" * 9 + "\u0664" + ".bin"
    (rid_dir / arabic).write_bytes(bytes(4 * ROW))
    with pytest.raises(DumpError):
        validate(rid_dir, meta, num_tokens=4)


async def test_request_directory_that_is_a_link_is_a_dump_error(
    shm_root: Path, tmp_path: Path
) -> None:
    link = shm_root / "hsx-w0" / RID
    write_dump(link)
    replace_with_link(link, tmp_path / RID)
    with pytest.raises(DumpError):
        validate(link, await wait_for_meta(link, 5.0))


def test_a_stray_probe_dump_goes_and_nothing_else_does(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_dump(theirs / "ns-0" / "probe-1")
    (theirs / "ns-0" / "probe-2").mkdir()  # another probe of the run, not yet answered
    (theirs / "other-job").mkdir()
    remove_stray_dump(str(theirs), ours, "ns-0", "probe-1")
    assert sorted(p.name for p in theirs.rglob("*")) == ["ns-0", "other-job", "probe-2"]
    remove_stray_dump(str(theirs), ours, "ns-0", "probe-2")  # the last one: the namespace goes
    assert [p.name for p in theirs.iterdir()] == ["other-job"]
    # What the server does not say plainly, or says is ours, is left alone.
    write_dump(ours / "ns-0" / "probe-3")
    for said in (None, 7, "", "relative/dir", str(ours)):
        remove_stray_dump(said, ours, "ns-0", "probe-3")
    assert (ours / "ns-0" / "probe-3" / "meta.json").exists()


def test_a_stray_dump_behind_a_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    write_dump(target / "probe-1")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "ns-0").symlink_to(target)  # planted: the namespace is a link
    remove_stray_dump(str(theirs), tmp_path / "ours", "ns-0", "probe-1")
    assert (target / "probe-1" / "meta.json").exists()
