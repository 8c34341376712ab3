"""Training while extracting, for real (issue 29's acceptance): ``hsx run`` against the
reference server with a bounded spool a fraction of the dataset, and a trainer's data side
(a LiveDataset acknowledging as it goes) together, each a child process, both SIGKILLed at
random moments and started again.

Checked: the bytes under ``data/`` never pass ``[output].spool_limit`` (watched on the
disk, temp files included); every sample is acknowledged exactly once (the consumer's
durable log: no second ack of anything); nothing acknowledged is ever delivered again (no
incarnation of the consumer receives a sample an earlier one reported acknowledged); the
run's dataset holds every sample once (its manifest, the retired ones included) and ends
empty on disk, every file deleted once consumed.

Synchronisation is by events: each kill waits for its victim's next sign of progress (a
``sample_done`` log line of hsx, a ``got`` line of the consumer), then a random extra
delay (seeded; ``HSX_ONLINE_SEED`` replays one) picks *where* the kill lands. Every wait
is bounded. The same with the consumer on another "node": through ``hsx serve``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest

from hsx_async.config import config_from_dict, spool_bytes_bound
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.manifest import read_manifest
from tests.dataset.live.procs import Child, server_faults, start_consumer, start_server
from tests.e2e import config_raw, free_port, shm_leftovers, write_config
from tests.run.daemon.test_spool import DiskWatch, data_bytes

pytestmark = pytest.mark.timeout(300)
SAMPLES = 36
MAX_LEN = 120
KILLS = 6
STEP_S = 60.0  # the longest any one step may take on a busy machine


@dataclass
class Online:
    """The two sides of the job and what each incarnation of the consumer reported."""

    config: Path
    out: Path
    source: str
    hsx: Child | None = None
    consumer: Child | None = None
    runs: list[Child] = field(default_factory=list)  # every incarnation of hsx run
    consumers: list[Child] = field(default_factory=list)

    async def start_hsx(self) -> None:
        self.hsx = await Child.start("hsx run", "-m", "hsx_async", "run", "--config",
                                     str(self.config), "--no-report", logs=True)  # fmt: skip
        self.runs.append(self.hsx)

    async def start_consumer(self) -> None:
        self.consumer = await start_consumer(self.source, "--ack-every", "2", "--prefetch", "2",
                                             "--lease-timeout", "600")  # fmt: skip
        self.consumers.append(self.consumer)

    def acked_before(self, index: int) -> set[str]:
        return {i for c in self.consumers[:index] for i in c.acked()}


async def kill_hsx(online: Online, rng: random.Random) -> bool:
    """After hsx's next committed sample and a random delay: SIGKILL, start again."""
    assert online.hsx is not None
    try:
        await online.hsx.until("event", STEP_S, value="sample_done")
    except EOFError:
        return False  # it finished first
    await asyncio.sleep(rng.uniform(0.0, 0.3))  # where the kill lands, not a wait for state
    if online.hsx.proc.returncode is not None:
        return False
    await online.hsx.kill()
    await online.start_hsx()
    return True


async def kill_consumer(online: Online, rng: random.Random) -> bool:
    assert online.consumer is not None
    try:
        await online.consumer.until("got", STEP_S)
    except EOFError:
        return False
    await asyncio.sleep(rng.uniform(0.0, 0.3))  # where the kill lands, not a wait for state
    if online.consumer.proc.returncode is not None:
        return False
    await online.consumer.kill()
    await online.start_consumer()
    return True


async def _finish(online: Online) -> None:
    assert online.hsx is not None and online.consumer is not None
    assert await online.hsx.finish(STEP_S * 3) == 0, "\n".join(online.hsx.lines[-20:])
    assert await online.consumer.finish(STEP_S * 3) == 0


def write_inputs(path: Path, vocab: int = 1024) -> Path:
    """Samples of 8–MAX_LEN tokens the reference model's vocabulary holds (some with masks)."""
    rng = random.Random(29)
    rows = []
    for i in range(SAMPLES):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(8, MAX_LEN))]
        row: dict[str, object] = {"id": f"s{i}", "input_ids": ids}
        if i % 3 == 0:
            row["loss_mask"] = [int(j >= len(ids) // 3) for j in range(len(ids))]
        rows.append(orjson.dumps(row))
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def _job(
    tmp: Path,
    url: str,
    hidden: int,
    aux: tuple[int, ...],
    shm: Path,
    *,
    online: bool = True,
    consumers: Sequence[str] = ("train",),
) -> tuple[Path, int]:
    """The job's config and its spool limit; ``online=False``: the same job offline."""
    samples = write_inputs(tmp / "in.jsonl")
    raw = config_raw(tmp, samples, [url], shm, hidden_size=hidden, aux_layers=aux,
                     input={"max_tokens": MAX_LEN}, workers={"concurrency": 3},
                     server={"request_timeout": 60.0},
                     daemon={"log_format": "json", "log_level": "debug"})  # fmt: skip
    probe = config_from_dict(raw, base=tmp)
    limit = 3 * spool_bytes_bound(probe, MAX_LEN)  # room for ~3 of the longest samples
    if online:
        raw["output"] |= {"retention": "acked", "consumers": list(consumers), "spool_limit": limit}
    return write_config(tmp, raw), limit


@pytest.mark.parametrize("transport", ["local", "hsx serve"])
async def test_train_while_extracting_exactly_once_under_random_kills(
    tmp_path: Path, shm_root: Path, reference: tuple[str, int, tuple[int, ...]], transport: str
) -> None:
    url, hidden, aux = reference
    config, limit = _job(tmp_path, url, hidden, aux, shm_root)
    out = tmp_path / "out"
    out.mkdir()
    seed = int(os.environ.get("HSX_ONLINE_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    server = None
    if transport == "hsx serve":
        server, source = await start_server(out, free_port())
    else:
        source = str(out)
    online = Online(config, out, source)
    try:
        with DiskWatch(out) as watch:
            await online.start_consumer()  # the trainer starts first: nothing to read yet
            await online.start_hsx()
            kills = {"hsx": 0, "consumer": 0}
            for _ in range(KILLS):
                victim = rng.choice(["hsx", "consumer"])
                killed = await (kill_hsx if victim == "hsx" else kill_consumer)(online, rng)
                kills[victim] += int(killed)
            await _finish(online)
    finally:
        for child in (online.hsx, online.consumer, server):
            if child is not None:
                await child.kill()
    for run in online.runs:  # a killed run's last lines are still in its pipe: read them
        await run.finish()
    paused = sum(run.count("event", "intake_paused_limit") for run in online.runs)
    note = f"seed {seed}, kills {kills}, spool pauses {paused}"
    print(note)
    assert sum(kills.values()) >= KILLS // 2, note  # most kills landed before the end
    # The spool never held more than its limit, on the disk, in flight included; the
    # consumer, not the disk, set the pace.
    assert 0 < watch.peak <= limit, (watch.peak, limit, note)
    assert paused > 0, note
    # The run: every sample once in its manifest, every file deleted once consumed.
    written = [canonical_id(e.id) for e in read_manifest(out, retired=True)]
    assert len(written) == len(set(written)) == SAMPLES, note
    assert read_manifest(out) == [] and data_bytes(out / "data") == 0, note
    # The trainer: every sample acknowledged exactly once, durably.
    state = ConsumerLog(out, "train").refresh()
    assert state.acked[0] == set(written), note
    assert state.duplicate_acks == 0, note
    # Nothing acknowledged was delivered again, to any later incarnation.
    for index, consumer in enumerate(online.consumers):
        again = set(consumer.got()) & online.acked_before(index)
        assert not again, (index, sorted(again), note)
    assert shm_leftovers(shm_root) == []
    if server is not None:
        assert await server_faults(server) == [], note  # no request failed inside it
