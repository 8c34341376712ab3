"""A bounded spool in a run (PROTOCOL §6): intake pauses rather than pass
``[output].spool_limit``, resumes as consumers acknowledge, and the spool never holds
more than the limit (in flight included), against the fake server, in process.

The consumer is a LiveDataset in a thread. The kill-both-sides test against the reference
server is tests/run/test_online.py."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.registry import read_registry
from hsx_async.dataset.manifest import RETIRED, read_manifest
from hsx_async.errors import ConfigError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.daemon.spool import Spool, _Seen, file_bytes
from hsx_async.run.source import Sample
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import make_config, shm_leftovers, when_done, write_samples

pytestmark = pytest.mark.timeout(120)
H, AUX = 64, (1, 3, 5)


class DiskWatch:
    """The bytes under ``data/`` (sample files and temp files), looked at until stopped:
    what the spool limit bounds, measured on the disk rather than taken from hsx."""

    def __init__(self, out: Path) -> None:
        self.data = out / "data"
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, data_bytes(self.data))
            self._stop.wait(0.002)  # a sampling interval, not a synchronisation

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def data_bytes(data: Path) -> int:
    total = 0
    for root, _, files in os.walk(data):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except FileNotFoundError:
                continue  # renamed or deleted between the listing and the look
    return total


def consume(out: Path, name: str, seen: list[str], ack_every: int, **kw: Any) -> None:
    live = LiveDataset(out, consumer=name, poll_interval=0.02, wait_timeout=60, **kw)
    for n, sample in enumerate(live, start=1):
        seen.append(sample[HSX_ID])
        live.done(sample)
        if n % ack_every == 0:
            live.ack()
    live.ack()


def _spool_config(
    tmp_path: Path, samples: Path, url: str, shm: Path, limit: int, *, max_tokens: int
) -> Any:
    output = {"retention": "acked", "consumers": ["train"], "spool_limit": limit}
    # input.max_tokens: the limit must hold one sample of that length
    inputs = {"max_tokens": max_tokens}
    return make_config(tmp_path, samples, [url], shm, output=output, input=inputs)


async def test_peak_disk_stays_under_the_limit_and_every_sample_arrives_once(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=120, seed=5)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        probe = make_config(tmp_path, samples.path, [fake.url], shm_root)
        sizes = [file_bytes(probe, _sample(obj)) for obj in samples.good.values()]
        limit = 4 * max(sizes)  # a small fraction of the dataset
        assert limit < sum(sizes) / 3
        config = _spool_config(tmp_path, samples.path, fake.url, shm_root, limit, max_tokens=120)
        seen: list[str] = []
        daemon = Daemon(config)
        with DiskWatch(config.output.dir) as watch:
            consumer = threading.Thread(
                target=consume, args=(config.output.dir, "train", seen, 3), daemon=True
            )
            consumer.start()
            summary = await daemon.run()
            await asyncio.to_thread(consumer.join, 60)
        assert not consumer.is_alive()
    assert summary.done == len(samples.good)
    assert sorted(seen) == sorted(samples.good)  # every sample, exactly once
    assert 0 < watch.peak <= limit, (watch.peak, limit)
    assert daemon.spool is not None and daemon.spool.peak <= limit
    assert daemon.spool.paused_s > 0  # the consumer, not the disk, set the pace
    assert read_manifest(config.output.dir) == []  # everything consumed and deleted
    assert len(read_manifest(config.output.dir, retired=True)) == len(samples.good)
    assert data_bytes(config.output.dir / "data") == 0
    assert shm_leftovers(shm_root) == []
    state = ConsumerLog(config.output.dir, "train").refresh()
    assert state.acked[0] == set(samples.good) and state.duplicate_acks == 0


def _sample(obj: dict[str, Any]) -> Sample:
    import numpy as np

    mask = obj.get("loss_mask")
    return Sample(
        id=obj["id"],
        line=0,
        input_ids=np.array(obj["input_ids"], dtype=np.int64),
        loss_mask=None if mask is None else np.array(mask, dtype=np.uint8),
    )


async def test_a_full_spool_pauses_until_acknowledged_then_a_stop_drains_at_once(
    tmp_path: Path, shm_root: Path
) -> None:
    """No consumer yet: intake pauses at the limit (status and gauges say so); SIGTERM then
    ends the run without waiting for the drain deadline; a resume with a consumer ends it."""
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=60, seed=2)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        probe = make_config(tmp_path, samples.path, [fake.url], shm_root)
        limit = 2 * max(file_bytes(probe, _sample(o)) for o in samples.good.values())
        config = _spool_config(tmp_path, samples.path, fake.url, shm_root, limit, max_tokens=60)
        daemon = Daemon(config)
        paused = asyncio.Event()
        daemon.guard.on_change.append(lambda open_: None if open_ else paused.set())
        first = when_done(daemon, 1)
        run = asyncio.create_task(daemon.run())
        await asyncio.wait_for(paused.wait(), 30)
        await asyncio.wait_for(first.wait(), 30)  # what fits is written; the rest waits
        status = daemon.status()
        assert status["paused"] and status["spool"]["waiting"]
        assert status["spool"]["held"] <= limit
        assert "spool full" in daemon.guard.reason
        daemon.request_stop()
        summary = await asyncio.wait_for(run, config.daemon.drain_timeout / 2)
        assert summary.stopped and 0 < summary.done < len(samples.good)
        seen: list[str] = []
        consumer = threading.Thread(target=consume, args=(config.output.dir, "train", seen, 1))
        consumer.start()
        again = await Daemon(config).run()
        await asyncio.to_thread(consumer.join, 60)
    assert summary.done + again.done == len(samples.good)
    assert sorted(seen) == sorted(samples.good)
    assert read_registry(config.output.dir) is not None


@pytest.mark.parametrize(
    ("output", "key"),
    [
        ({"retention": "acked"}, "output.consumers"),
        ({"spool_limit": "1GiB", "consumers": ["a"]}, "output.spool_limit"),
        ({"retention": "acked", "consumers": ["a"], "spool_limit": 1000}, "output.spool_limit"),
        ({"consumers": ["a/b"]}, "output.consumers[0]"),
        ({"consumers": ["a", "a"]}, "output.consumers"),
    ],
)
def test_spool_settings_are_checked(
    tmp_path: Path, shm_root: Path, output: dict[str, Any], key: str
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 1)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], shm_root, output=output)


def test_the_spool_frees_a_sample_however_its_lines_are_seen(
    tmp_path: Path, shm_root: Path
) -> None:
    """A sample can be committed, consumed and retired between the two reads of one look
    (its retired line first): it is freed all the same. A retired file a killed retirer
    left behind is deleted by the run, whose room it holds."""
    samples = write_samples(tmp_path / "in.jsonl", 1, max_len=8)
    config = _spool_config(tmp_path, samples.path, "http://127.0.0.1:1", shm_root, 1 << 20,
                           max_tokens=8)  # fmt: skip
    spool = Spool(config)
    rel = "data/aa/x.safetensors"
    spool.apply(_Seen(retired=[rel]))
    spool.apply(_Seen(committed=[("x", rel, 1000)]))
    assert spool.used == 1000 and spool.retiring == {rel}
    spool.apply(_Seen(gone={rel}))
    assert spool.used == 0 and spool.retired == 1
    # A retired line whose unlink never ran: the next look deletes the file.
    out = config.output.dir
    left = out / "data" / "bb" / "y.safetensors"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"x" * 100)
    (out / "manifest.jsonl").write_bytes(
        orjson.dumps({"id": "y", "path": "data/bb/y.safetensors", "num_tokens": 1,
                      "bytes": 100, "xxh3_64": "0" * 16}) + b"\n"
    )  # fmt: skip
    (out / RETIRED).write_bytes(orjson.dumps({"id": "y", "path": "data/bb/y.safetensors"}) + b"\n")
    spool.apply(spool.look())
    assert not left.exists()
    spool.apply(spool.look())
    assert spool.used == 0 and spool.retired == 2
