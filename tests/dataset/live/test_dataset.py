"""The live reader over a local dataset (PROTOCOL §6): samples as they commit, each to
exactly one rank, leases back after a kill, acknowledgements durable and final.

Samples are written as the pipeline writes them (tests/dataset_factory.py); extraction is
complete once the ``input`` event names the input's line count. The end-to-end tests with
a real run, SIGKILLs of both sides and the spool limit are in tests/run/test_online.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch.utils.data import DataLoader

from hsx_async.dataset import PadCollator
from hsx_async.dataset.live.dataset import HSX_ID, HSX_IDS, LiveCollator, LiveDataset
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.registry import ACKED, Registry, record_registry
from hsx_async.dataset.manifest import read_manifest
from hsx_async.errors import DatasetError, LiveError
from tests.dataset_factory import (
    WrittenSample,
    synthetic_hidden,
    synthetic_ids,
    write_dataset,
    write_sample,
)

pytestmark = pytest.mark.timeout(60)


def mark_input(out: Path, lines: int, shard: str = "0/1") -> None:
    """What the run's events log says once the feeder read the whole input."""
    rec = {"event": "input", "time": 0.0, "shard": shard, "lines": lines}
    with (out / "events.jsonl").open("ab") as fh:
        fh.write(orjson.dumps(rec) + b"\n")


def drain(live: LiveDataset, *, ack_every: int = 1) -> list[str]:
    seen = []
    for sample in live:
        seen.append(sample[HSX_ID])
        live.done(sample)
        if len(seen) % ack_every == 0:
            live.ack()
    live.ack()
    return seen


def test_yields_every_sample_once_as_hsx_reads_it(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=5)
    mark_input(tmp_path, 5)
    live = LiveDataset(tmp_path, consumer="train")
    got = {s[HSX_ID]: s for s in live}
    assert sorted(got) == sorted(str(w.id) for w in written)
    for w in written:
        sample = got[str(w.id)]
        assert torch.equal(sample["input_ids"], w.input_ids)
        assert torch.equal(sample["hidden_states"], w.hidden[:, -1])
        assert torch.equal(
            sample["aux_hidden_states"], w.hidden[:, :-1].reshape(w.hidden.shape[0], -1)
        )


def test_an_epoch_waits_for_samples_that_are_still_coming(tmp_path: Path) -> None:
    """The trainer starts before the first sample; samples arrive while it reads."""
    tmp_path.mkdir(exist_ok=True)
    live = LiveDataset(tmp_path, consumer="train", poll_interval=0.05)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(drain(live)))
    reader.start()
    written = [_write(tmp_path, i) for i in range(4)]
    mark_input(tmp_path, 4)
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert sorted(got) == sorted(str(w.id) for w in written)


def _write(out: Path, i: int, t: int = 6) -> WrittenSample:
    return write_sample(out, f"late{i}", input_ids=synthetic_ids(t, seed=i),
                        hidden=synthetic_hidden(t, 64, 4, seed=i), loss_mask=None)  # fmt: skip


def test_ranks_split_the_samples_exactly(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=12)
    mark_input(tmp_path, 12)
    ranks = [
        LiveDataset(tmp_path, consumer="train", rank=r, world_size=3, prefetch=1) for r in range(3)
    ]
    seen: list[list[str]] = [[] for _ in ranks]
    threads = [
        threading.Thread(target=lambda r=r: seen[r].extend(drain(ranks[r]))) for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    flat = [i for part in seen for i in part]
    assert sorted(flat) == sorted(str(w.id) for w in written)  # every sample, exactly once
    assert len(set(flat)) == len(flat)


def test_a_killed_trainer_gets_back_what_it_had_not_acknowledged(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=6)
    mark_input(tmp_path, 6)
    first = LiveDataset(tmp_path, consumer="train", prefetch=2)
    it = iter(first)
    trained = [next(it)[HSX_ID] for _ in range(3)]
    first.done(trained[:2])
    first.ack()  # the checkpoint after two samples
    first.done(trained[2:])  # trained, but the process dies before its next checkpoint
    # (nothing released: the generator is not closed, as when the process is killed)
    again = drain(LiveDataset(tmp_path, consumer="train"))
    assert trained[2] in again and not set(trained[:2]) & set(again)
    assert sorted(trained[:2] + again) == sorted(str(e.id) for e in read_manifest(tmp_path))


def test_a_checkpoint_holds_what_was_done_since_the_last_ack(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=5)
    mark_input(tmp_path, 5)
    first = LiveDataset(tmp_path, consumer="train", prefetch=1)
    it = iter(first)
    trained = [next(it)[HSX_ID] for _ in range(2)]
    first.done(trained)
    checkpoint = first.state_dict()  # saved with the model; the process dies before ack()
    second = LiveDataset(tmp_path, consumer="train")
    second.load_state_dict(checkpoint)
    rest = drain(second)
    assert not set(trained) & set(rest) and len(trained) + len(rest) == 5
    state = ConsumerLog(tmp_path, "train").refresh()
    assert state.acked[0] == set(trained) | set(rest) and state.duplicate_acks == 0
    with pytest.raises(DatasetError, match="another dataset, consumer or epoch"):
        LiveDataset(tmp_path, consumer="train").load_state_dict({**checkpoint, "consumer": "other"})


def test_another_dataset_s_checkpoint_is_refused(tmp_path: Path) -> None:
    """Issue 37 (2): load_state_dict compared consumer and epoch only; ids default to line
    numbers, so another job's checkpoint acknowledged samples never delivered here."""
    for out in (tmp_path / "a", tmp_path / "b"):
        write_dataset(out, num_samples=3)
        mark_input(out, 3)
    first = LiveDataset(tmp_path / "a", consumer="train")
    first.done([next(iter(first))[HSX_ID]])
    checkpoint = first.state_dict()
    with pytest.raises(DatasetError, match="another dataset"):
        LiveDataset(tmp_path / "b", consumer="train").load_state_dict(checkpoint)
    assert len(drain(LiveDataset(tmp_path / "b", consumer="train", rank=0))) == 3
    old = {k: v for k, v in checkpoint.items() if k not in ("dataset", "owner")}  # version 5
    with pytest.raises(DatasetError, match="older than protocol 6"):
        LiveDataset(tmp_path / "a", consumer="train").load_state_dict(old)


def test_a_vanished_rank_s_leases_lapse_to_the_others(tmp_path: Path) -> None:
    """A rank that leased and died (its generator never closed, its process gone): a rank
    still reading gets its samples at once (the lease followed the process)."""
    write_dataset(tmp_path, num_samples=4)
    gone = LiveDataset(
        tmp_path, consumer="train", rank=1, world_size=2, prefetch=4, lease_timeout=0.3
    )
    gone_iter = iter(gone)
    assert next(gone_iter)[HSX_ID]
    gone.source.close()  # what the kernel does for a killed process: its owner lock goes
    other = LiveDataset(tmp_path, consumer="train", rank=0, world_size=2, poll_interval=0.05,
                        lease_timeout=0.3, wait_timeout=20)  # fmt: skip
    seen = []
    for sample in other:  # extraction is not complete yet, so it keeps reading
        seen.append(sample[HSX_ID])
        if len(seen) == 4:
            mark_input(tmp_path, 4)  # now it is: the epoch ends
    assert sorted(seen) == sorted(str(e.id) for e in read_manifest(tmp_path))
    del gone_iter


def test_stopping_early_gives_the_unread_leases_back(tmp_path: Path) -> None:
    write_dataset(tmp_path, num_samples=4)
    mark_input(tmp_path, 4)
    live = LiveDataset(tmp_path, consumer="train", prefetch=4, lease_timeout=1e6)
    for sample in live:
        live.done(sample)
        break  # the generator closes: three leased samples go back
    live.ack()
    other = LiveDataset(tmp_path, consumer="train", rank=1, world_size=2, lease_timeout=1e6)
    assert len(drain(other)) == 3


def test_a_dataloader_with_workers_and_the_collator(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=10)
    mark_input(tmp_path, 10)
    live = LiveDataset(tmp_path, consumer="train", prefetch=2)
    loader = DataLoader(live, batch_size=3, num_workers=2, collate_fn=LiveCollator(PadCollator()))
    seen: list[str] = []
    for batch in loader:
        assert batch["hidden_states"].shape[0] == len(batch[HSX_IDS])
        seen.extend(batch[HSX_IDS])
        live.done(batch)
    live.ack()
    assert sorted(seen) == sorted(str(w.id) for w in written)
    state = ConsumerLog(tmp_path, "train").refresh()
    assert state.acked[0] == set(seen)


def test_the_spool_deletes_what_every_consumer_acknowledged(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, num_samples=4)
    mark_input(tmp_path, 4)
    record_registry(tmp_path, Registry(ACKED, ("a", "b"), 1 << 30), retired=0)
    drain(LiveDataset(tmp_path, consumer="a"))
    assert all(w.path.exists() for w in written)
    drain(LiveDataset(tmp_path, consumer="b"), ack_every=2)
    assert not any(w.path.exists() for w in written)
    assert read_manifest(tmp_path) == []
    with pytest.raises(DatasetError, match="'c' is not registered"):
        next(iter(LiveDataset(tmp_path, consumer="c")))
    with pytest.raises(DatasetError, match="after epoch 0"):
        next(iter(LiveDataset(tmp_path, consumer="a", epoch=1)))


def test_nothing_arriving_is_an_error_after_wait_timeout(tmp_path: Path) -> None:
    live = LiveDataset(tmp_path, consumer="train", wait_timeout=0.2, poll_interval=0.05)
    with pytest.raises(LiveError, match="no sample for consumer 'train'"):
        next(iter(live))


def test_arguments_are_checked() -> None:
    bad: list[dict[str, Any]] = [{"rank": 2, "world_size": 2}, {"view": "mine"}, {"prefetch": 0}]
    for kwargs in bad:
        with pytest.raises(ValueError):
            LiveDataset("/nonexistent", consumer="train", **kwargs)
    with pytest.raises(DatasetError, match="must match"):
        LiveDataset("/nonexistent", consumer="../x")


def test_trainer_views_are_the_exports_samples(tmp_path: Path) -> None:
    """view="specforge" / "speculators" hand over exactly what ``hsx export`` writes for
    that trainer (the same code), the final state converted with the model's norm."""
    from safetensors.torch import load_file

    from hsx_async.dataset.export import export_dataset, read_export_log
    from tests.dataset.test_export import model_dir

    src = tmp_path / "out"
    write_dataset(src, num_samples=4, hidden_size=16)
    mark_input(src, 4)
    model, _ = model_dir(tmp_path / "model", 16)
    for view, load in (("specforge", _torch_load), ("speculators", load_file)):
        dest = tmp_path / view
        export_dataset(src, dest, fmt=view, model=model)
        exported = {r.id: load(dest / r.path) for r in read_export_log(dest).values()}
        live = {s[HSX_ID]: s for s in LiveDataset(src, consumer=view, view=view, model=model)}
        assert sorted(live) == sorted(exported)
        for sample_id, sample in live.items():
            for key, tensor in exported[sample_id].items():
                assert torch.equal(sample[key], tensor), (view, key)
    with pytest.raises(DatasetError, match="give --model PATH"):
        next(iter(LiveDataset(src, consumer="x", view="speculators")))


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


def test_a_directory_that_is_no_dataset_is_refused_at_once(tmp_path: Path) -> None:
    """Issue 39 (2.2): LiveDataset on a directory that is no dataset hung silently and made
    consumers/ inside it."""
    (tmp_path / "model.safetensors").write_bytes(b"weights, not a dataset")
    with pytest.raises(DatasetError, match="is not an hsx dataset"):
        LiveDataset(tmp_path, consumer="train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with pytest.raises(DatasetError, match="not a directory"):
        LiveDataset(tmp_path / "model.safetensors", consumer="train")
    # A directory that does not exist yet is waited for (hsx run may start later), made
    # nothing in, and said in the log; wait_timeout ends the wait.
    typo = LiveDataset(tmp_path / "typo", consumer="train", wait_timeout=0.2, poll_interval=0.05)
    with pytest.raises(LiveError, match="no sample"):
        next(iter(typo))
    assert not (tmp_path / "typo").exists()
