"""Crash-consistency driver (issue 7): run ``hsx run`` as a child process against a fake
server in this event loop, stop it hard at chosen or random moments, resume it, and check
the dataset against an uninterrupted run.

Synchronisation is event driven: the child logs JSON lines (``daemon.log_format = "json"``,
``log_level = "debug"``) and the driver reacts to them (``run_started``, ``sample_done``,
``stop_requested``, ...). The only timed waits are the random extra delays of random kills,
which choose *where* a kill lands, not *when* something is ready.

Shared by ``tests/run/test_crash.py`` (a CI-sized subset) and ``bench/crash_soak.py`` (hundreds
of kills).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import tomli_w

from hsx_async.dataset.layout import DATA_DIR
from hsx_async.dataset.manifest import read_manifest
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.dumps.failpoints import POINTS
from hsx_async.server.fake.server import (
    FakeOptions,
    FakeServerHandle,
    FakeStats,
    running_fake_server,
)
from tests.e2e import (
    SampleSet,
    check_dataset,
    make_config,
    shm_leftovers,
    write_samples,
)

REPO = Path(__file__).resolve().parents[1]
H, AUX = 64, (1, 3, 5)
L = len(AUX) + 1
CHILD_TIMEOUT_S = 90.0  # one child run; a healthy small run takes a few seconds
# Variables that would change what the child does behind the driver's back.
_SCRUBBED_ENV = ("HSX_FAILPOINT", "JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "HSX_SHARD_COUNT")
BAD_TAIL = (b"not json at all", b'{"id": "empty", "input_ids": []}', b'{"input_ids": [1, 2.5]}')

ManifestKey = tuple[str, str, int]  # (id, xxh3_64, bytes)


def fake_options(root: Path, **kw: Any) -> FakeOptions:
    kw.setdefault("hidden_size", H)
    kw.setdefault("aux_layers", AUX)
    return FakeOptions(dump_root=root, **kw)


def crash_samples(path: Path, n: int, *, seed: int = 0, max_len: int = 64) -> SampleSet:
    """``n`` good samples followed by a few bad lines. The bad lines come last so that the
    first commits of a run are manifest lines (a failpoint at commit N hits a data file)."""
    good = write_samples(path, n, seed=seed, max_len=max_len)
    lines = path.read_bytes().rstrip(b"\n").split(b"\n")
    bad = {len(lines) + i: raw for i, raw in enumerate(BAD_TAIL)}
    path.write_bytes(b"\n".join([*lines, *BAD_TAIL]) + b"\n")
    return SampleSet(path, good.good, bad)


def client_config(
    tmp: Path, samples: Path, url: str, root: Path, **overrides: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The child's configuration: small and fast, JSON debug logs for the driver to read."""
    raw: dict[str, dict[str, Any]] = {
        "server": {"urls": [url], "request_timeout": 10.0, "health_interval": 0.05,
                   "unreachable_timeout": 30.0},
        "input": {"path": str(samples), "max_tokens": 4096},
        "output": {"dir": str(tmp / "out"), "disk_reserve": 0},
        "dump": {"root": str(root), "timeout": 5.0, "shm_budget": "64MiB"},
        "model": {"hidden_size": H, "aux_layers": list(AUX)},
        "workers": {"concurrency": 4, "max_attempts": 8, "backoff_base": 0.001,
                    "backoff_max": 0.01},
        "writer": {"threads": 2, "queue_depth": 4},
        "daemon": {"drain_timeout": 10.0, "metrics_listen": "", "log_format": "json",
                   "log_level": "debug"},
    }  # fmt: skip
    for section, keys in overrides.items():
        raw.setdefault(section, {}).update(keys)
    return raw


def write_config(path: Path, raw: dict[str, dict[str, Any]]) -> Path:
    path.write_text(tomli_w.dumps(raw))
    return path


# --- one child run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """Send ``sig`` to the child once it has logged ``after`` events named ``event`` (or once
    ``when`` is set, if given), ``delay`` seconds later. A random ``delay`` spreads kills
    over every step of the write path."""

    event: str = "sample_done"
    after: int = 1
    delay: float = 0.0
    sig: int = signal.SIGKILL
    when: asyncio.Event | None = None


@dataclass
class ChildRun:
    returncode: int = 0
    seconds: float = 0.0
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    records: list[dict[str, Any]] = field(default_factory=list)  # parsed JSON log lines
    text: list[str] = field(default_factory=list)  # stdout and non-JSON stderr lines
    signalled: list[float] = field(default_factory=list)  # monotonic times of signals sent
    ended: float = 0.0  # monotonic time the child was reaped

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def first(self, event: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("event") == event), None)

    def tail(self, n: int = 25) -> str:
        shown = [orjson.dumps(r).decode() for r in self.records[-n:]] + self.text[-n:]
        return f"exit {self.returncode}\n" + "\n".join(shown)


def child_env(failpoint: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    if failpoint is not None:
        name = failpoint.partition(":")[0]
        if name not in POINTS:  # a typo must not make a crash test pass vacuously
            raise ValueError(f"unknown failpoint {name!r}")
        env["HSX_FAILPOINT"] = failpoint
    return env


class _Watch:
    """Turns the child's log lines into the events its kills wait for."""

    def __init__(self, run: ChildRun, kills: list[Kill]) -> None:
        self.run = run
        self.kills = kills
        self.fire = [k.when or asyncio.Event() for k in kills]

    def see(self, record: dict[str, Any]) -> None:
        event = str(record.get("event"))
        self.run.records.append(record)
        self.run.events[event] += 1
        for kill, fire in zip(self.kills, self.fire, strict=True):
            if kill.when is None and event == kill.event and self.run.events[event] == kill.after:
                fire.set()


async def _read_stderr(stream: asyncio.StreamReader, watch: _Watch) -> None:
    async for raw in stream:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            watch.see(record)
        else:
            watch.run.text.append(line)


async def _read_stdout(stream: asyncio.StreamReader, run: ChildRun) -> None:
    async for raw in stream:
        run.text.append(raw.decode("utf-8", "replace").rstrip("\n"))


async def _killer(proc: asyncio.subprocess.Process, watch: _Watch) -> None:
    for kill, fire in zip(watch.kills, watch.fire, strict=True):
        await fire.wait()
        if kill.delay > 0:
            await asyncio.sleep(kill.delay)  # chooses where the kill lands; not a synchronisation
        if proc.returncode is not None:
            return
        try:
            proc.send_signal(kill.sig)
        except ProcessLookupError:
            return
        watch.run.signalled.append(time.monotonic())


async def run_child(
    config: Path,
    *,
    failpoint: str | None = None,
    kills: list[Kill] | None = None,
    timeout: float = CHILD_TIMEOUT_S,
) -> ChildRun:
    """Run ``python -m hsx_async run --config CONFIG`` to its end, or until a kill ends it."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hsx_async", "run", "--config", str(config),
        cwd=REPO, env=child_env(failpoint), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    run = ChildRun()
    watch = _Watch(run, kills or [])
    killer = asyncio.create_task(_killer(proc, watch))
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(_read_stderr(proc.stderr, watch), _read_stdout(proc.stdout, run))
            run.returncode = await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"hsx run did not end within {timeout} s:\n{run.tail()}") from None
    finally:
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
    run.ended = time.monotonic()
    run.seconds = run.ended - started
    return run


# --- the dataset under test ---------------------------------------------------------------


def manifest_set(out: Path) -> set[ManifestKey]:
    return {(str(e.id), e.xxh3_64, e.size) for e in read_manifest(out)}


async def reference_run(samples: SampleSet, tmp: Path, root: Path) -> set[ManifestKey]:
    """An uninterrupted in-process run of the same input: the dataset to compare with."""
    async with running_fake_server(fake_options(root)) as fake:
        config = make_config(tmp, samples.path, [fake.url], root)
        summary = await Daemon(config).run()
    assert summary.done == len(samples.good) and summary.unfinished == 0
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    return manifest_set(config.output.dir)


@dataclass(frozen=True)
class KillState:
    """What a kill left behind, before any resume cleans it up."""

    temp_files: int  # .<name>.<tag>.tmp under data/
    orphans: int  # data files without a manifest line
    done_dumps: int  # complete dumps in /dev/shm of samples already in the manifest
    manifest_lines: int


def line_ids(samples: SampleSet) -> dict[int, str]:
    """Input line number -> canonical sample id (the line number when the line has none)."""
    ids = {}
    for line, raw in enumerate(samples.path.read_bytes().split(b"\n")):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            ids[line] = str(obj.get("id", line))
    return ids


def _dump_line(rid: str) -> int | None:
    """The input line of a client rid, ``<nonce>-<line>-<attempt>``."""
    parts = rid.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def kill_state(out: Path, root: Path, samples: SampleSet) -> KillState:
    named = {e.path for e in read_manifest(out)}
    done_ids = {str(e.id) for e in read_manifest(out)}
    temp = orphans = 0
    data = out / DATA_DIR
    for path in data.rglob("*") if data.is_dir() else ():
        if path.name.endswith(".tmp"):
            temp += 1
        elif path.is_file() and str(path.relative_to(out)) not in named:
            orphans += 1
    ids = line_ids(samples)
    done_dumps = 0
    for meta in root.glob("*/*/meta.json"):
        line = _dump_line(meta.parent.name)
        done_dumps += line is not None and ids.get(line) in done_ids
    return KillState(temp, orphans, done_dumps, len(named))


def requests_seen(stats: FakeStats, n: int) -> asyncio.Event:
    """An event set once the fake server has accepted ``n`` hsx requests in all."""
    event = asyncio.Event()
    note = stats.note_received

    def counting(rid: str, fault: str | None) -> None:
        note(rid, fault)
        if stats.hsx_requests >= n:
            event.set()

    stats.note_received = counting  # type: ignore[method-assign]
    return event


def pause_at_request(fake: FakeServerHandle, n: int) -> asyncio.Event:
    """Stop the fake server forming passes as its ``n``-th hsx request arrives (in the
    same call, so no pass can start in between); the event is set then. Pausing once some
    samples are durable instead races the run: by then the server may have served all."""
    paused = asyncio.Event()
    note = fake.stats.note_received

    def counting(rid: str, fault: str | None) -> None:
        note(rid, fault)
        if fake.stats.hsx_requests == n:
            fake.pause_passes()
            paused.set()

    fake.stats.note_received = counting  # type: ignore[method-assign]
    return paused


def requests_queued(stats: FakeStats, n: int) -> asyncio.Event:
    """An event set once ``n`` hsx requests are in the fake server and not committed:
    with passes paused, they wait in its queue. (Counting ``n`` *new* arrivals instead can
    wait forever: a worker whose request is already queued sends no other.)"""
    event = asyncio.Event()
    note = stats.note_received

    def check() -> None:
        if stats.hsx_requests - stats.commits >= n:
            event.set()

    def counting(rid: str, fault: str | None) -> None:
        note(rid, fault)
        check()

    stats.note_received = counting  # type: ignore[method-assign]
    check()
    return event


def verify(out: Path, root: Path, samples: SampleSet, reference: set[ManifestKey]) -> None:
    """The acceptance of a crash cycle: the same dataset as the uninterrupted run."""
    got = manifest_set(out)
    assert got == reference, (
        f"manifest differs from the uninterrupted run: missing {sorted(reference - got)[:3]}, "
        f"unexpected {sorted(got - reference)[:3]}"
    )
    check_dataset(out, samples, hidden_size=H, num_layers=L)
    temp = sorted(str(p.relative_to(out)) for p in out.rglob("*.tmp"))
    assert not temp, f"temp files left in the output directory: {temp[:5]}"
    assert shm_leftovers(root) == [], f"left in the dump root: {shm_leftovers(root)[:5]}"


@dataclass
class CrashBed:
    """One output directory, its input, its config file and the fake server it talks to."""

    tmp: Path
    root: Path
    samples: SampleSet
    fake: FakeServerHandle
    config: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    async def barrier(self) -> None:
        """Restart the server: requests of a killed client stop here, so nothing it asked
        for is written into the dump root while the next run (or the final check) looks."""
        await self.fake.restart()

    async def resume(self, max_runs: int = 3) -> list[ChildRun]:
        """Run again (no failpoint) until a run exits 0."""
        runs = []
        for _ in range(max_runs):
            run = await run_child(self.config)
            runs.append(run)
            if run.returncode == 0:
                return runs
            assert run.returncode == 1, f"resume exited {run.returncode}:\n{run.tail()}"
        raise AssertionError(f"{max_runs} resumes did not finish:\n{runs[-1].tail()}")


def make_bed(tmp: Path, root: Path, samples: SampleSet, fake: FakeServerHandle,
             **overrides: dict[str, Any]) -> CrashBed:  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    raw = client_config(tmp, samples.path, fake.url, root, **overrides)
    return CrashBed(tmp, root, samples, fake, write_config(tmp / "hsx.toml", raw))


def cleanup_counts(runs: list[ChildRun]) -> tuple[int, int]:
    """(temp files, orphans) the resumes reported removing."""
    temp = orphans = 0
    for run in runs:
        for record in run.records:
            if record.get("event") == "resume_cleanup":
                temp += int(record.get("temp_files", 0))
                orphans += int(record.get("orphans", 0))
    return temp, orphans
