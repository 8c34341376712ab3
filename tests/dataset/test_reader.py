"""The training-side Dataset: values, zero-copy views, lazy reads, sampler and collate."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hsx_async.dataset.layout import build_layout
from hsx_async.dataset.manifest import ManifestEntry, read_manifest
from hsx_async.dataset.reader import (
    FIELDS,
    HiddenStateDataset,
    LengthGroupedBatchSampler,
    PadCollator,
    padded_fraction,
    read_header,
    read_sample,
    select_entries,
    split_of,
)
from hsx_async.errors import DatasetError
from hsx_async.run.daemon.daemon import Daemon
from tests.dataset_factory import (
    WrittenSample,
    pipeline_dataset,
    synthetic_ids,
    write_dataset,
    write_sample,
)
from tests.e2e import make_config


def _expected(sample: WrittenSample) -> dict[str, torch.Tensor]:
    t, layers, size = sample.hidden.shape
    mask = sample.loss_mask
    return {
        "input_ids": sample.input_ids,
        "loss_mask": torch.ones(t, dtype=torch.uint8) if mask is None else mask,
        "hidden_states": sample.hidden[:, layers - 1, :],
        "aux_hidden_states": sample.hidden[:, : layers - 1, :].reshape(t, (layers - 1) * size),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def test_factory_files_are_plain_safetensors(tmp_path: Path) -> None:
    (sample,) = write_dataset(tmp_path, num_samples=1, loss_mask="all")
    loaded = load_file(sample.path)
    assert torch.equal(loaded["hidden_states"], sample.hidden)
    assert torch.equal(loaded["input_ids"], sample.input_ids)
    assert sample.loss_mask is not None
    assert torch.equal(loaded["loss_mask"], sample.loss_mask)
    header = read_header(sample.path)
    assert header.metadata == {
        "id": "s0000",
        "aux_layers": "2,30,58",
        "protocol": "4",
        "final_state": "post_norm",
    }
    assert (header.num_tokens, header.num_layers, header.hidden_size) == (5, 4, 64)


def test_dataset_yields_eagle3_tensors(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=5, hidden_size=32)
    ds = HiddenStateDataset(tmp_path)
    assert len(ds) == 5
    assert ds.lengths == [s.entry.num_tokens for s in written]
    for i, sample in enumerate(written):
        item = ds[i]
        _assert_same(item, _expected(sample))
        t = sample.entry.num_tokens
        assert item["hidden_states"].shape == (t, 32)
        assert item["aux_hidden_states"].shape == (t, 3 * 32)
        assert item["hidden_states"].dtype == torch.bfloat16


def test_ids_of_any_kind(tmp_path: Path) -> None:
    ids: list[str | int] = [7, "a/b c", "ü-unicode", "x" * 150]
    written = write_dataset(tmp_path, num_samples=4, ids=ids, loss_mask="none")
    ds = HiddenStateDataset(tmp_path)
    by_id = {str(s.id): s for s in written}
    for i in range(len(ds)):
        _assert_same(ds[i], _expected(by_id[str(ds.ids[i])]))


def test_views_share_one_private_mapping_of_the_file(tmp_path: Path) -> None:
    (sample,) = write_dataset(tmp_path, num_samples=1, hidden_size=64, lengths=[9])
    item = read_sample(sample.path)
    final, aux = item["hidden_states"], item["aux_hidden_states"]
    layers, size = sample.hidden.shape[1], sample.hidden.shape[2]
    # Both are views of one storage: final row 0 starts right after the k aux rows.
    assert final.untyped_storage().data_ptr() == aux.untyped_storage().data_ptr()
    assert final.data_ptr() - aux.data_ptr() == (layers - 1) * size * 2
    assert final.stride() == (layers * size, 1)
    assert aux.stride() == (layers * size, 1)
    # ... and that storage is a mapping of the file itself, not a buffer it was read into.
    assert _mapped_file(aux.data_ptr()) == str(sample.path.resolve())
    assert _mapped_file(item["input_ids"].data_ptr()) == str(sample.path.resolve())
    # Copy-on-write: a trainer that edits a tensor in place cannot change the dataset.
    before = sample.path.read_bytes()
    final.fill_(1.0)
    aux.zero_()
    assert sample.path.read_bytes() == before


def _mapped_file(address: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def _data_bytes(path: Path, start: int, end: int) -> int:
    """Bytes of ``[start, end)`` that are data blocks, not holes (SEEK_DATA / SEEK_HOLE)."""
    fd = os.open(path, os.O_RDONLY)
    total, pos = 0, start
    try:
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole follows
                break
            if data >= end:
                break
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            total += min(hole, end) - data
            pos = hole
    finally:
        os.close(fd)
    return total


def test_reading_some_tensors_leaves_hidden_states_unread(shm_root: Path) -> None:
    """hidden_states is written as a hole on tmpfs: any read of its pages allocates them,
    which SEEK_DATA reports. Reading ids and mask must leave it a hole."""
    t, layers, size = 64, 4, 256  # 128 KiB of hidden states, page aligned at both ends
    mask = (torch.arange(t) % 2).to(torch.uint8)
    sample = write_sample(
        shm_root,
        "lazy",
        input_ids=synthetic_ids(t, seed=1),
        hidden=torch.zeros(t, layers, size, dtype=torch.bfloat16),
        loss_mask=mask,
        sparse_hidden=True,
    )
    layout = build_layout(
        sample_id="lazy", num_tokens=t, hidden_size=size, aux_layers=(2, 30, 58), has_loss_mask=True
    )
    start, end = layout.hidden_offset, layout.hidden_offset + layout.hidden_bytes
    assert end % 4096 == 0
    assert _data_bytes(sample.path, 0, start) == start  # the probe sees written pages...
    assert _data_bytes(sample.path, start, end) == 0  # ...and the hole

    ds = HiddenStateDataset(shm_root, fields=("input_ids", "loss_mask"))
    item = ds[0]
    assert torch.equal(item["input_ids"], sample.input_ids)
    assert torch.equal(item["loss_mask"], mask)
    assert _data_bytes(sample.path, start, end) == 0

    # Views of hidden_states cost at most the page safetensors probes when mapping it...
    full = read_sample(sample.path)
    assert _data_bytes(sample.path, start, end) <= 4096
    # ...until the values are used: then every page is read (the probe sees reads).
    assert float(full["aux_hidden_states"].float().sum()) == 0.0
    assert _data_bytes(sample.path, start, end) == end - start


def test_sharded_manifests_are_one_dataset(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=7, shards=3)
    assert len(list(tmp_path.glob("manifest.shard-*-of-00003.jsonl"))) == 3
    ds = HiddenStateDataset(tmp_path)
    assert sorted(map(str, ds.ids)) == sorted(str(s.id) for s in written)
    assert ds.ids == sorted(ds.ids, key=str)


def test_max_tokens_filter(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=6, lengths=[3, 40, 8, 41, 40, 1])
    ds = HiddenStateDataset(tmp_path, max_tokens=40)
    assert sorted(ds.lengths) == [1, 3, 8, 40, 40]
    assert all(ds[i]["input_ids"].shape[0] <= 40 for i in range(len(ds)))


def test_split_is_stable_disjoint_and_order_free(tmp_path: Path) -> None:
    ids = [f"q{i}" for i in range(40)]
    write_dataset(tmp_path / "a", num_samples=40, ids=ids, lengths=[4] * 40, hidden_size=8)
    write_dataset(
        tmp_path / "b", num_samples=40, ids=ids[::-1], lengths=[4] * 40, hidden_size=8, shards=4
    )
    sides = {}
    for name in ("a", "b"):
        train = HiddenStateDataset(tmp_path / name, split="train", val_fraction=0.25, seed=3)
        val = HiddenStateDataset(tmp_path / name, split="val", val_fraction=0.25, seed=3)
        assert not set(train.ids) & set(val.ids)
        assert set(train.ids) | set(val.ids) == set(ids)
        sides[name] = (train.ids, val.ids)
    assert sides["a"] == sides["b"]
    assert 0 < len(sides["a"][1]) < 40
    # Adding samples never moves an existing one; another seed gives another split.
    assert all(split_of(i, val_fraction=0.25, seed=3) == "val" for i in sides["a"][1])
    many = [split_of(i, val_fraction=0.1) for i in range(5000)]
    assert 400 < many.count("val") < 600
    assert [split_of(i, val_fraction=0.5, seed=1) for i in range(64)] != [
        split_of(i, val_fraction=0.5, seed=2) for i in range(64)
    ]


def test_collate_pads_and_copies_values(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=3, lengths=[4, 9, 2], hidden_size=16)
    ds = HiddenStateDataset(tmp_path)
    batch = PadCollator(pad_token_id=-1, pad_to_multiple_of=8)([ds[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 16)
    assert batch["hidden_states"].shape == (3, 16, 16)
    assert batch["aux_hidden_states"].shape == (3, 16, 48)
    assert batch["lengths"].tolist() == [4, 9, 2]
    assert batch["attention_mask"].sum(dim=1).tolist() == [4, 9, 2]
    for row, sample in enumerate(written):
        t = sample.entry.num_tokens
        want = _expected(sample)
        for key in FIELDS:
            assert torch.equal(batch[key][row, :t], want[key]), key
        assert (batch["input_ids"][row, t:] == -1).all()
        assert (batch["loss_mask"][row, t:] == 0).all()
        assert (batch["hidden_states"][row, t:] == 0).all()
        # The batch owns its memory: it is not a view of the file.
        assert batch["hidden_states"].untyped_storage().data_ptr() != (
            want["hidden_states"].untyped_storage().data_ptr()
        )
    with pytest.raises(ValueError, match="empty batch"):
        PadCollator()([])


def test_length_grouped_sampler() -> None:
    lengths = [
        int(x) for x in torch.randint(1, 2000, (500,), generator=torch.Generator().manual_seed(0))
    ]
    sampler = LengthGroupedBatchSampler(lengths, batch_size=8, seed=5, group_size=128)
    epoch0 = list(sampler)
    assert sorted(i for b in epoch0 for i in b) == list(range(500))
    assert all(1 <= len(b) <= 8 for b in epoch0)
    assert epoch0 == list(LengthGroupedBatchSampler(lengths, batch_size=8, seed=5, group_size=128))
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    assert len(sampler) == len(epoch0)
    plain = [list(range(i, min(i + 8, 500))) for i in range(0, 500, 8)]
    assert padded_fraction(lengths, epoch0) < padded_fraction(lengths, plain) / 3

    budget = LengthGroupedBatchSampler(lengths, max_batch_tokens=4000, seed=1)
    batches = list(budget)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 4000 for b in batches)


def test_sampler_drop_last_and_replicas() -> None:
    lengths = [3] * 21
    dropped = list(LengthGroupedBatchSampler(lengths, batch_size=4, drop_last=True, shuffle=False))
    assert len(dropped) == 5 and all(len(b) == 4 for b in dropped)
    oversized = list(LengthGroupedBatchSampler([10, 50, 10], max_batch_tokens=20, shuffle=False))
    assert sorted(map(sorted, oversized)) == [[0, 2], [1]]
    ranks = [
        list(LengthGroupedBatchSampler(lengths, batch_size=2, seed=9, num_replicas=3, rank=r))
        for r in range(3)
    ]
    assert len({len(r) for r in ranks}) == 1
    seen = [i for r in ranks for b in r for i in b]
    assert len(seen) == len(set(seen))
    with pytest.raises(ValueError, match="batch_size"):
        LengthGroupedBatchSampler(lengths)


def test_dataloader_with_workers(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=10, hidden_size=16)
    ds = HiddenStateDataset(tmp_path)
    by_id = {s.id: s for s in written}
    sampler = LengthGroupedBatchSampler(ds.lengths, batch_size=3, seed=2)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=PadCollator(), num_workers=2)
    seen = 0
    for batch, indices in zip(loader, sampler, strict=True):
        for row, index in enumerate(indices):
            want = _expected(by_id[ds.ids[index]])
            t = ds.lengths[index]
            for key in FIELDS:
                assert torch.equal(batch[key][row, :t], want[key])
            seen += 1
    assert seen == 10


def test_unreadable_samples_raise_dataset_errors(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=3)
    written[0].path.unlink()
    written[1].path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    ds = HiddenStateDataset(tmp_path)
    with pytest.raises(DatasetError, match="missing"):
        ds[ds.ids.index("s0000")]
    with pytest.raises(DatasetError, match="not a readable safetensors"):
        ds[ds.ids.index("s0001")]
    entry = written[2].entry
    with pytest.raises(DatasetError, match="the manifest says 99"):
        read_sample(written[2].path, num_tokens=99)
    doubled = [*read_manifest(tmp_path), entry]
    with pytest.raises(DatasetError, match="twice"):
        select_entries(doubled)
    with pytest.raises(ValueError, match="unknown field"):
        HiddenStateDataset(tmp_path, fields=("hidden",))
    with pytest.raises(DatasetError, match="not a directory"):
        HiddenStateDataset(tmp_path / "nope")
    assert isinstance(entry, ManifestEntry)


def test_foreign_safetensors_file_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(DatasetError, match=r"(?i)not an hsx sample file"):
        read_sample(path)
    save_file(
        {"input_ids": torch.zeros(3, dtype=torch.int64), "hidden_states": torch.zeros(3, 2, 4)},
        str(path),
        metadata={"aux_layers": "1"},
    )
    with pytest.raises(DatasetError, match="expected BF16"):
        read_sample(path)


async def test_reads_what_the_pipeline_writes_fake_server(tmp_path: Path, shm_root: Path) -> None:
    """The full pipeline (daemon + fake server, chunked dumps) into the Dataset: values,
    zero-copy views and a DataLoader with workers."""
    written = await pipeline_dataset(tmp_path, shm_root, num_samples=14, seed=2)
    ds = HiddenStateDataset(written.out_dir)
    assert sorted(map(str, ds.ids)) == sorted(written.samples.good)
    for index in range(len(ds)):
        ids, hidden, mask = written.expected(ds.ids[index])
        t, k, size = len(ids), len(written.aux_layers), written.hidden_size
        want = {
            "input_ids": ids,
            "loss_mask": torch.ones(t, dtype=torch.uint8) if mask is None else mask,
            "hidden_states": hidden[:, -1],
            "aux_hidden_states": hidden[:, :-1].reshape(t, k * size),
        }
        item = ds[index]
        _assert_same(item, want)
        assert _mapped_file(item["aux_hidden_states"].data_ptr()) == str(ds.path(index).resolve())
        assert (
            item["hidden_states"].data_ptr() - item["aux_hidden_states"].data_ptr() == k * size * 2
        )
    sampler = LengthGroupedBatchSampler(ds.lengths, batch_size=4, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=PadCollator(), num_workers=2)
    assert sum(int(batch["lengths"].sum()) for batch in loader) == sum(ds.lengths)


async def test_reads_what_the_pipeline_writes_reference_server(
    tmp_path: Path, shm_root: Path
) -> None:
    """Real hidden states (tiny Llama, chunked and batched passes): the Dataset's final and
    aux tensors equal one direct forward pass of the model, layer by layer."""
    from hsx_async.demo import demo_samples
    from hsx_async.server.reference.model import bf16_mismatch
    from hsx_async.server.reference.server import (
        ReferenceOptions,
        reference_hidden_states,
        running_reference_server,
    )

    lines = demo_samples().read_bytes().splitlines()[:4]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    by_id = {str(o["id"]): o for o in map(orjson.loads, lines)}
    options = ReferenceOptions(dump_root=shm_root, chunk_size=32, max_batch_tokens=128)
    async with running_reference_server(options) as srv:
        config = make_config(tmp_path, tmp_path / "in.jsonl", [srv.url], shm_root,
                             hidden_size=srv.hidden_size, aux_layers=srv.aux_layers,
                             server={"request_timeout": 60.0}, dump={"timeout": 30.0})  # fmt: skip
        summary = await Daemon(config).run()
        model, aux, size = srv.model, srv.aux_layers, srv.hidden_size
    assert summary.done == len(lines)
    ds = HiddenStateDataset(config.output.dir)
    for index in range(len(ds)):
        ids = by_id[str(ds.ids[index])]["input_ids"]
        truth = reference_hidden_states(model, ids, aux)
        item = ds[index]
        t, k = len(ids), len(aux)
        assert item["aux_hidden_states"].shape == (t, k * size)
        assert bf16_mismatch(item["hidden_states"], truth[:, -1]) is None
        for layer in range(k):
            got = item["aux_hidden_states"][:, layer * size : (layer + 1) * size]
            assert bf16_mismatch(got, truth[:, layer]) is None, (ds.ids[index], layer)


def test_collate_in_a_worker_allocates_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a DataLoader worker the batch is built in shared memory directly, so sending it to
    the main process costs no extra copy (torch's default_collate does the same)."""
    write_dataset(tmp_path, num_samples=2, hidden_size=16)
    ds = HiddenStateDataset(tmp_path)
    samples = [ds[0], ds[1]]
    assert not PadCollator()(samples)["hidden_states"].untyped_storage().is_shared()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", object)
    batch = PadCollator()(samples)
    assert (
        batch["hidden_states"].untyped_storage().is_shared()
        and batch["aux_hidden_states"].untyped_storage().is_shared()
    )
    assert torch.equal(batch["hidden_states"][0, : ds.lengths[0]], samples[0]["hidden_states"])
