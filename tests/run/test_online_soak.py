"""The online mode across processes that misbehave (issue 37's acceptance): ``hsx run``,
``hsx serve`` (with its secret) and four trainer ranks on two consumers (``near`` reads
the output directory, ``far`` goes through ``hsx serve``), each a child process on
127.0.0.1. The test SIGKILLs every side at random moments (a killed trainer restarts from
its last checkpoint, or the one before), SIGSTOPs trainers past their lease timeout,
replaces a rank that goes on acknowledging, and runs one reader with its clock 700 s
ahead, while a peer without the secret hammers serve.

Checked: every sample is acknowledged by each consumer, and no acknowledgement is applied
twice (a second one comes only from a checkpoint restored after its ack); what every
trainer got is byte-equal to an offline run of the same input; the spool never holds
more than its limit on disk; the replaced rank's acknowledgements are refused and it is
told; every request of the peer without the secret is refused (401) and changes nothing;
serve's descriptors and memory stay flat.

Every wait is bounded; kills follow signs of progress (a ``got`` line, a committed
sample) plus a seeded random delay (``HSX_ONLINE_SEED`` replays one).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.manifest import read_manifest
from hsx_async.dataset.reader import read_sample
from tests.dataset.live.consumer_driver import _digest
from tests.dataset.live.procs import Child, start_consumer, start_server
from tests.e2e import free_port, shm_leftovers
from tests.run.daemon.test_spool import DiskWatch
from tests.run.test_online import STEP_S, Online, _job

pytestmark = pytest.mark.timeout(600)
ACTIONS = 10
LEASE_S = 2.0  # far ranks: serve lets go of one it has not heard from for this long
RANKS = {"near": 2, "far": 2}
SECRET = "9c4e1b7a2f6d0e8c3b5a7f9e1d2c4b6a"


@dataclass
class Rank:
    consumer: str
    rank: int
    source: str
    checkpoint: Path
    skew: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    child: Child | None = None
    every: list[Child] = field(default_factory=list)  # every incarnation
    replaced: list[Child] = field(default_factory=list)  # left running when replaced

    async def start(self) -> None:
        args = ["--consumer", self.consumer, "--rank", str(self.rank), "--world",
                str(RANKS[self.consumer]), "--ack-every", "2", "--prefetch", "2",
                "--lease-timeout", str(LEASE_S), "--checkpoint", str(self.checkpoint),
                "--hashes", "--wait-timeout", "240", "--clock-skew", str(self.skew)]  # fmt: skip
        self.child = await start_consumer(self.source, *args, env=self.env, logs=True)
        self.every.append(self.child)


@dataclass
class Soak:
    online: Online
    ranks: list[Rank]
    serve_port: int
    secret: Path
    serve: Child | None = None
    serves: list[Child] = field(default_factory=list)
    serve_start: tuple[int, int] = (0, 0)  # the last serve's descriptors and bytes at start
    kills: dict[str, int] = field(default_factory=dict)

    async def start_serve(self) -> None:
        self.serve, _ = await start_server(
            self.online.out, self.serve_port, "--secret-file", str(self.secret)
        )
        self.serve_start = (_fds(self.serve), _rss(self.serve))
        self.serves.append(self.serve)

    def count(self, what: str) -> None:
        self.kills[what] = self.kills.get(what, 0) + 1


async def _progress(child: Child, key: str, value: str | None = None) -> bool:
    try:
        await child.until(key, STEP_S, value=value)
    except (EOFError, TimeoutError):
        return False
    return child.proc.returncode is None


async def act(soak: Soak, rng: random.Random) -> None:
    """One misfortune, after a sign of progress of its victim."""
    what = rng.choice(["hsx", "serve", "kill", "kill", "stop", "replace"])
    rank = rng.choice(soak.ranks)
    assert rank.child is not None and soak.online.hsx is not None and soak.serve is not None
    if what == "hsx":
        if await _progress(soak.online.hsx, "event", "sample_done"):
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # where the kill lands
            await soak.online.hsx.kill()
            await soak.online.start_hsx()
            soak.count(what)
    elif what == "serve":
        await asyncio.sleep(rng.uniform(0.0, 0.5))  # where the kill lands
        await soak.serve.kill()
        await soak.start_serve()
        soak.count(what)
    elif not await _progress(rank.child, "got"):
        return
    elif what == "kill":
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        await rank.child.kill()
        older = rank.checkpoint.with_suffix(".prev")
        if rng.random() < 0.5 and older.is_file():  # from the checkpoint before the last
            older.replace(rank.checkpoint)
            soak.count("older checkpoint")
        await rank.start()  # from its (restored) checkpoint
        soak.count(what)
    elif what == "stop":  # a pause past the lease timeout (a long checkpoint, an eval)
        rank.child.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(LEASE_S * 1.5)  # the pause itself, not a synchronisation
        rank.child.proc.send_signal(signal.SIGCONT)
        soak.count(what)
    else:  # the scheduler starts a new process of the rank; the old one goes on
        rank.replaced.append(rank.child)
        await rank.start()
        soak.count(what)


def _offline_digests(out: Path) -> dict[str, str]:
    return {
        canonical_id(e.id): _digest(dict(read_sample(out / e.path, num_tokens=e.num_tokens)))
        for e in read_manifest(out)
    }


def _acks_applied_twice(out: Path, consumer: str) -> list[str]:
    """Ids acknowledged again by another owner than the first, not on behalf of a
    checkpoint's owner (``from``): a second process that trained them too. (The first
    owner repeating its own ack — a retry — is counted by the ledger, and harmless.)"""
    first: dict[str, str] = {}
    twice = []
    for raw in (out / "consumers" / consumer / "log.jsonl").read_bytes().splitlines():
        rec = orjson.loads(raw)
        if rec["op"] != "ack":
            continue
        for sample in rec["ids"]:
            by = first.setdefault(sample, rec.get("from", rec["owner"]))
            if by not in (rec["owner"], rec.get("from")):
                twice.append(sample)
    return twice


def _fds(child: Child) -> int:
    return len(list(Path(f"/proc/{child.proc.pid}/fd").iterdir()))


def _rss(child: Child) -> int:
    """Resident bytes of ``child`` now."""
    for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def hammer(port: int, stop: asyncio.Event, answers: list[int]) -> None:
    """A peer on the network that is not the job's trainer: leases, acks, fetches and
    reads the facts as the consumer "far", without the secret, until ``stop``."""
    fields = {"rank": 0, "epoch": 0, "count": 8, "timeout": 60, "wait": 0, "ids": ["s0"]}
    body = orjson.dumps({"consumer": "far", "owner": "ee" * 8, "call": "ff" * 8, **fields})
    requests = [("POST", "/v1/lease", body), ("POST", "/v1/ack", body), ("GET", "/v1/info", b""),
                ("GET", "/v1/file?path=data/00/s0.safetensors", b"")]  # fmt: skip
    while not stop.is_set():
        for method, path, data in requests:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                writer.write(head.encode() + b"Connection: close\r\n\r\n" + data)
                try:
                    status = await asyncio.wait_for(reader.readline(), 30)
                finally:
                    writer.close()
                if status:  # b"": a serve killed mid-request closed the connection
                    answers.append(int(status.split()[1]))
        await asyncio.sleep(0.05)  # a steady stream of requests, not a synchronisation


async def _offline(tmp: Path, server: tuple[str, int, tuple[int, ...]], shm: Path) -> Path:
    url, hidden, aux = server
    await asyncio.to_thread(tmp.mkdir)
    config, _ = _job(tmp, url, hidden, aux, shm, online=False)
    run = await Child.start("hsx run", "-m", "hsx_async", "run", "--config", str(config),
                            "--no-report", logs=True)  # fmt: skip
    assert await run.finish(STEP_S * 3) == 0, "\n".join(run.lines[-20:])
    return tmp / "out"


async def test_every_consumer_gets_every_sample_once_whatever_each_side_does(
    tmp_path: Path, shm_root: Path, fake: tuple[str, int, tuple[int, ...]]
) -> None:
    offline = _offline_digests(await _offline(tmp_path / "offline", fake, shm_root))
    url, hidden, aux = fake
    config, limit = _job(tmp_path, url, hidden, aux, shm_root, consumers=list(RANKS))
    out = tmp_path / "out"
    out.mkdir()
    seed = int(os.environ.get("HSX_ONLINE_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    secret = tmp_path / "serve.secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    soak = Soak(Online(config, out, str(out)), [], free_port(), secret)
    await soak.start_serve()
    far = f"http://127.0.0.1:{soak.serve_port}"
    for consumer, count in RANKS.items():
        for index in range(count):
            skew = 700.0 if (consumer, index) == ("far", 1) else 0.0
            soak.ranks.append(Rank(consumer, index, str(out) if consumer == "near" else far,
                                   tmp_path / f"{consumer}-{index}.ckpt", skew,
                                   {"HSX_SERVE_SECRET_FILE": str(secret)}))  # fmt: skip
    stop, refused = asyncio.Event(), list[int]()
    peer = asyncio.create_task(hammer(soak.serve_port, stop, refused))
    try:
        with DiskWatch(out) as watch:
            for rank in soak.ranks:
                await rank.start()  # the trainers start first: nothing to read yet
            await soak.online.start_hsx()
            for _ in range(ACTIONS):
                await act(soak, rng)
            assert soak.online.hsx is not None
            assert await soak.online.hsx.finish(STEP_S * 3) == 0
            for rank in soak.ranks:
                assert rank.child is not None
                assert await rank.child.finish(STEP_S * 4) == 0, rank.child.lines[-5:]
            assert soak.serve is not None
            fds_after, rss_after = _fds(soak.serve), _rss(soak.serve)
            fds_before, rss_before = soak.serve_start
    finally:
        stop.set()
        await peer
        children = [soak.online.hsx, *soak.serves]
        children += [c for r in soak.ranks for c in (*r.every, *r.replaced)]
        for child in children:
            if child is not None:
                await child.kill()
    note = f"seed {seed}, actions {soak.kills}, peer's requests {len(refused)}"
    print(
        note, f"serve fds {fds_before}->{fds_after}, rss {rss_before >> 20}->{rss_after >> 20} MiB"
    )
    assert refused and set(refused) == {401}, (sorted(set(refused)), note)
    await _check(soak, offline, note)
    assert 0 < watch.peak <= limit, (watch.peak, limit, note)
    assert fds_after <= fds_before + 16, (fds_before, fds_after, note)
    assert rss_after <= rss_before + (64 << 20), (rss_before, rss_after, note)
    assert shm_leftovers(shm_root) == []


async def _check(soak: Soak, offline: dict[str, str], note: str) -> None:
    out = soak.online.out
    written = {canonical_id(e.id) for e in read_manifest(out, retired=True)}
    assert written == set(offline) and len(written) > 0, note
    for consumer in RANKS:
        state = ConsumerLog(out, consumer).refresh()
        assert state.acked[0] == written, (consumer, note)
        assert _acks_applied_twice(out, consumer) == [], (consumer, note)
    assert read_manifest(out) == [], note  # every file deleted once both consumers had it
    for rank in soak.ranks:
        # What each trainer got equals the offline run's sample, byte for byte.
        got = [e for child in rank.every for e in child.events if "got" in e]
        assert all(e["xxh3"] == offline[e["got"]] for e in got), note
        # A replaced rank was told, and nothing it acknowledged afterwards was applied.
        for old in rank.replaced:
            code = await old.finish(STEP_S)
            told = any("replaced by a newer one" in e.get("error", "") for e in old.events)
            assert code == 0 or (code == 3 and told), (code, old.lines[-3:], note)
