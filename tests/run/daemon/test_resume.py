"""Resume: the output directory is made to agree with its manifests before new work starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from hsx_async.config import ShardConfig
from hsx_async.dataset.layout import build_layout, canonical_id, data_relpath, sample_key
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError
from hsx_async.run.daemon.resume import Cleanup, check_entries, clean_orphans

ONE = ShardConfig(0, 1)


def shard_of_id(sample_id: str | int, count: int) -> int:
    """The shard that owns an id (the rule the reader and resume both follow)."""
    return xxhash.xxh3_64_intdigest(canonical_id(sample_id).encode()) % count


def ids_of_shard(shard: int, count: int, n: int, prefix: str = "id") -> list[str]:
    found: list[str] = []
    i = 0
    while len(found) < n:
        sid = f"{prefix}{i}"
        if shard_of_id(sid, count) == shard:
            found.append(sid)
        i += 1
    return found


def write_sample(out: Path, sample_id: str | int) -> ManifestEntry:
    """A small but real sample file at its final name; returns the entry it would get."""
    layout = build_layout(
        sample_id=sample_id, num_tokens=2, hidden_size=4, aux_layers=(1,), has_loss_mask=False
    )
    rel = data_relpath(sample_key(sample_id))
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    data = layout.header + bytes(layout.total_bytes - len(layout.header))
    path.write_bytes(data)
    return ManifestEntry(sample_id, rel, 2, len(data), xxhash.xxh3_64_hexdigest(data))


def temp_file(out: Path, entry: ManifestEntry, tag: str) -> Path:
    final = out / entry.path
    tmp = final.parent / f".{final.name}.{tag}.tmp"
    tmp.write_bytes(b"partial")
    return tmp


def data_files(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in (out / "data").rglob("*") if p.is_file()}


# --- one process ------------------------------------------------------------------------


def test_nothing_to_clean(tmp_path: Path) -> None:
    assert clean_orphans(tmp_path, [], ONE) == Cleanup(0, 0, 0)
    entry = write_sample(tmp_path, "a")
    assert clean_orphans(tmp_path, [entry], ONE) == Cleanup(0, 0, 0)
    assert data_files(tmp_path) == {entry.path}


def test_clean_orphans_deletes_temp_and_unnamed_files(tmp_path: Path) -> None:
    named = [write_sample(tmp_path, f"n{i}") for i in range(5)]
    unnamed = [write_sample(tmp_path, f"u{i}") for i in range(3)]  # renamed, line not durable
    temps = [temp_file(tmp_path, e, "s0-abc") for e in named[:2] + unnamed[:1]]
    bucket = (tmp_path / named[0].path).parent
    (bucket / "README").write_bytes(b"not ours to judge")  # neither temp nor a sample file
    (tmp_path / "data" / "loose.safetensors").write_bytes(b"x")  # not in a bucket
    assert clean_orphans(tmp_path, named, ONE) == Cleanup(temp_files=3, orphans=3, foreign=0)
    assert not any(t.exists() for t in temps)
    left = data_files(tmp_path)
    assert {e.path for e in named} <= left
    assert not {e.path for e in unnamed} & left
    assert (bucket / "README").exists()
    assert (tmp_path / "data" / "loose.safetensors").exists()


def test_clean_orphans_does_not_follow_a_bucket_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim.safetensors"
    victim.write_bytes(b"x")
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "ff").symlink_to(elsewhere)
    clean_orphans(out, [], ONE)
    assert victim.exists()


# --- shards sharing one directory -------------------------------------------------------


def test_sharded_cleanup_leaves_other_shards_alone(tmp_path: Path) -> None:
    mine = ids_of_shard(0, 2, 3)
    theirs = ids_of_shard(1, 2, 3)
    named = write_sample(tmp_path, mine[0])
    my_orphans = [write_sample(tmp_path, s) for s in mine[1:]]
    their_orphans = [write_sample(tmp_path, s) for s in theirs]  # may be mid-append
    my_temp = temp_file(tmp_path, named, "s0-aaaa")
    their_temp = temp_file(tmp_path, their_orphans[0], "s1-bbbb")
    garbage = (tmp_path / named.path).parent / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 16)  # no readable id: nobody can prove it is theirs
    result = clean_orphans(tmp_path, [named], ShardConfig(0, 2))
    assert result == Cleanup(temp_files=1, orphans=2, foreign=5)
    assert not my_temp.exists()
    assert their_temp.exists()
    assert garbage.exists()
    left = data_files(tmp_path)
    assert named.path in left
    assert not {e.path for e in my_orphans} & left
    assert {e.path for e in their_orphans} <= left


def test_shard_tags_are_not_prefixes_of_each_other(tmp_path: Path) -> None:
    entry = write_sample(tmp_path, "x")
    t11 = temp_file(tmp_path, entry, "s11-cccc")
    clean_orphans(tmp_path, [entry], ShardConfig(1, 12))
    assert t11.exists()
    clean_orphans(tmp_path, [entry], ShardConfig(11, 12))
    assert not t11.exists()


def test_a_key_that_looks_like_a_tag_does_not_fool_another_shard(tmp_path: Path) -> None:
    entry = write_sample(tmp_path, "a.s1-b")
    shard0_temp = temp_file(tmp_path, entry, "s0-dddd")
    clean_orphans(tmp_path, [entry], ShardConfig(1, 2))
    assert shard0_temp.exists()


# --- manifest entries against the files -------------------------------------------------


def test_check_entries_accepts_a_consistent_directory(tmp_path: Path) -> None:
    check_entries(tmp_path, [write_sample(tmp_path, s) for s in ("a", 1, "c/d")])
    check_entries(tmp_path, [])


@pytest.mark.parametrize("damage", ["missing", "truncated", "grown", "link"])
def test_check_entries_refuses_a_damaged_file(tmp_path: Path, damage: str) -> None:
    good = write_sample(tmp_path, "good")
    bad = write_sample(tmp_path, "bad")
    path = tmp_path / bad.path
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        os.truncate(path, bad.size - 1)
    elif damage == "grown":
        with path.open("ab") as fh:
            fh.write(b"x")
    else:
        real = tmp_path / "real.safetensors"
        path.rename(real)
        path.symlink_to(real)
    with pytest.raises(DatasetError, match="1 manifest entries name a missing or resized") as info:
        check_entries(tmp_path, [good, bad])
    assert bad.path in str(info.value)
    assert good.path not in str(info.value)
    assert "hsx verify" in str(info.value)


def test_check_entries_summarises_many_bad_files(tmp_path: Path) -> None:
    entries = [write_sample(tmp_path, f"s{i}") for i in range(8)]
    for e in entries:
        (tmp_path / e.path).unlink()
    with pytest.raises(DatasetError, match=r"8 manifest entries .* and 3 more"):
        check_entries(tmp_path, entries)
