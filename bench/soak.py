"""Leak soak (issue 7): one long ``hsx run`` against the fake server with faults on,
watching the client's RSS, open file descriptors, threads and the /dev/shm it holds.

The fake server runs in this process, throttled like a GPU (one forward pass per
``--concurrency / --rate`` seconds, so at most ``--rate`` samples/s; faults, retries and
chunking make it less), injects ``--fault-rate`` faults of every kind (hangs included)
and restarts every ``--restart-every`` seconds. ``hsx run`` is a child process; every
``--interval`` seconds this script samples ``/proc/<pid>`` and the dump root. After
``--minutes`` it sends SIGTERM (the run must drain and exit 0), then checks the dataset:
every manifest line names a file of its size and hash, no file is outside the manifest,
a random subset is bit-exact, /dev/shm is empty.

    python -m bench.soak --minutes 30            # from the repository root
    python -m bench.soak --minutes 2 --rate 100  # a quick look

Writes ``bench/results/soak-<time>.json`` and ``.png`` and prints whether anything grew.
Exit 1 when something grew or a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import stat
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import xxhash

from hsx_async.dataset.manifest import read_manifest
from hsx_async.logs import configure_logging
from hsx_async.server.fake.server import ALL_FAULTS, FakeServerHandle, running_fake_server
from tests.crash_driver import REPO, H, L, client_config, fake_options, write_config
from tests.e2e import shm_leftovers

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = os.sysconf("SC_PAGE_SIZE")
# Growth that counts as a leak, comparing the first and last quarter after warm-up.
RSS_GROWTH = (1.25, 32 << 20)  # both: more than +25% and more than +32 MiB
FD_GROWTH = 8
THREAD_GROWTH = 4


@dataclass
class Probe:
    t: float
    rss: int
    fds: int
    threads: int
    cpu_s: float
    shm_bytes: int
    shm_entries: int
    done: int


@dataclass
class Soak:
    args: argparse.Namespace
    work: Path
    root: Path
    probes: list[Probe] = field(default_factory=list)
    restarts: int = 0


def write_input(path: Path, n: int, max_len: int, seed: int) -> None:
    """``n`` samples ``s<i>`` (line i), lengths 1..max_len, every third with a loss mask."""
    rng = np.random.default_rng(seed)
    with path.open("wb") as fh:
        for i in range(n):
            length = int(rng.integers(1, max_len + 1))
            obj: dict[str, Any] = {"id": f"s{i}", "input_ids": rng.integers(0, 50_000, length)}
            if i % 3 == 0:
                obj["loss_mask"] = rng.integers(0, 2, length)
            fh.write(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


def _proc(pid: int) -> tuple[int, int, int, float]:
    """(RSS bytes, open fds, threads, CPU seconds) of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, threads, rss_pages = int(stat[11]), int(stat[12]), int(stat[17]), int(stat[21])
    fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    return rss_pages * PAGE, fds, threads, (utime + stime) / os.sysconf("SC_CLK_TCK")


def _shm(root: Path) -> tuple[int, int]:
    """Bytes and entries under ``root``. Dumps come and go while it looks: os.walk skips a
    directory that vanishes between listing and entering it (Path.rglob raises)."""
    size = entries = 0
    for dirpath, dirnames, filenames in os.walk(root):
        entries += len(dirnames) + len(filenames)
        for name in filenames:
            try:
                st = (Path(dirpath) / name).lstat()
            except FileNotFoundError:
                continue
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return size, entries


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as fh:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def probe(soak: Soak, pid: int, started: float) -> Probe:
    rss, fds, threads, cpu = _proc(pid)
    shm_bytes, shm_entries = _shm(soak.root)
    done = _lines(soak.work / "out" / "manifest.jsonl")
    return Probe(time.monotonic() - started, rss, fds, threads, cpu, shm_bytes, shm_entries, done)


async def watch(soak: Soak, proc: asyncio.subprocess.Process, fake: FakeServerHandle) -> None:
    """Sample until the deadline, restarting the server now and then; then SIGTERM."""
    args = soak.args
    started = time.monotonic()
    deadline = started + args.minutes * 60
    next_restart = started + args.restart_every
    while time.monotonic() < deadline and _alive(proc):
        # The sampling period is the point of this loop, not a synchronisation.
        await asyncio.sleep(args.interval)
        if not _alive(proc):
            break
        soak.probes.append(await asyncio.to_thread(probe, soak, proc.pid, started))
        if args.restart_every and time.monotonic() >= next_restart:
            await fake.restart()
            soak.restarts += 1
            next_restart += args.restart_every
        if len(soak.probes) % 12 == 0:
            p = soak.probes[-1]
            print(f"  {p.t / 60:5.1f} min: {p.done} done, RSS {p.rss / 2**20:.0f} MiB, "
                  f"{p.fds} fds, {p.threads} threads, shm {p.shm_bytes / 2**20:.1f} MiB",
                  flush=True)  # fmt: skip
    if _alive(proc):
        proc.send_signal(signal.SIGTERM)


def _alive(proc: asyncio.subprocess.Process) -> bool:
    return proc.returncode is None


def _quarter_change(values: list[float]) -> tuple[float, float]:
    """(median of the first quarter, median of the last) after a 20% warm-up."""
    warm = values[len(values) // 5 :]
    q = max(1, len(warm) // 4)
    return statistics.median(warm[:q]), statistics.median(warm[-q:])


def leak_verdict(probes: list[Probe]) -> dict[str, Any]:
    if len(probes) < 10:
        return {"enough_samples": False}
    rss0, rss1 = _quarter_change([p.rss for p in probes])
    fd0, fd1 = _quarter_change([p.fds for p in probes])
    th0, th1 = _quarter_change([p.threads for p in probes])
    warm = probes[len(probes) // 5 :]
    t = np.array([p.t for p in warm])
    slope = float(np.polyfit(t, np.array([p.rss for p in warm], dtype=float), 1)[0])
    return {
        "enough_samples": True,
        "rss_start_mib": rss0 / 2**20,
        "rss_end_mib": rss1 / 2**20,
        "rss_slope_mib_per_hour": slope * 3600 / 2**20,
        "rss_peak_mib": max(p.rss for p in probes) / 2**20,
        "fds_start": fd0,
        "fds_end": fd1,
        "fds_max": max(p.fds for p in probes),
        "threads_start": th0,
        "threads_end": th1,
        "shm_peak_mib": max(p.shm_bytes for p in probes) / 2**20,
        "shm_entries_peak": max(p.shm_entries for p in probes),
        "rss_grew": rss1 > rss0 * RSS_GROWTH[0] and rss1 - rss0 > RSS_GROWTH[1],
        "fds_grew": fd1 - fd0 > FD_GROWTH,
        "threads_grew": th1 - th0 > THREAD_GROWTH,
    }


def check_output(out: Path, inputs: Path, root: Path, subset: int) -> dict[str, Any]:
    """Consistency of the whole dataset, bit-exactness of a random subset."""
    from hsx_async.server.fake.server import expected_hidden_states

    entries = read_manifest(out)
    ids = [str(e.id) for e in entries]
    problems = []
    if len(ids) != len(set(ids)):
        problems.append("an id is in the manifest twice")
    for e in entries:
        data = (out / e.path).read_bytes()
        if len(data) != e.size or xxhash.xxh3_64_hexdigest(data) != e.xxh3_64:
            problems.append(f"{e.path}: size or hash differs from the manifest")
    named = {e.path for e in entries}
    on_disk = {str(p.relative_to(out)) for p in (out / "data").rglob("*") if p.is_file()}
    problems += [f"not in the manifest: {p}" for p in sorted(on_disk - named)[:5]]
    lines = inputs.read_bytes().split(b"\n")
    for e in random.Random(0).sample(entries, min(subset, len(entries))):
        obj = orjson.loads(lines[int(str(e.id)[1:])])
        # bf16 has no numpy dtype: compare the raw bit patterns.
        raw = (out / e.path).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = orjson.loads(raw[8 : 8 + n])
        start, end = header["hidden_states"]["data_offsets"]
        hidden = np.frombuffer(raw[8 + n + start : 8 + n + end], dtype="<u2")
        want = expected_hidden_states(obj["input_ids"], H, L).reshape(-1)
        if not np.array_equal(hidden, want):
            problems.append(f"{e.path}: hidden states differ from what the server dumped")
    left = shm_leftovers(root)
    if left:
        problems.append(f"left in /dev/shm: {left[:5]}")
    return {"samples_checked": len(entries), "bit_exact_checked": min(subset, len(entries)),
            "problems": problems[:20]}  # fmt: skip


def plot(probes: list[Probe], path: Path) -> None:
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [p.t / 60 for p in probes]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    series = [
        ([p.rss / 2**20 for p in probes], "client RSS (MiB)"),
        ([p.fds for p in probes], "open fds"),
        ([p.shm_bytes / 2**20 for p in probes], "/dev/shm held (MiB)"),
        ([p.done for p in probes], "samples in manifest"),
    ]
    for ax, (values, label) in zip(axes, series, strict=True):
        ax.plot(t, values)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("hsx soak: fake server with faults")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


async def run_soak(args: argparse.Namespace, work: Path, root: Path) -> dict[str, Any]:
    soak = Soak(args, work, root)
    inputs = work / "in.jsonl"
    n = int(args.rate * args.minutes * 60 * 1.5) + 1000  # never runs dry before the deadline
    await asyncio.to_thread(write_input, inputs, n, args.max_len, args.seed)
    # One pass of `concurrency` requests per latency: about `rate` samples/s, GPU-like.
    latency_ms = 1000.0 * args.concurrency / args.rate
    faults = tuple(ALL_FAULTS)
    options = fake_options(
        root, fault_rate=args.fault_rate, faults=faults, late_meta_s=0.05,
        latency_base_ms=latency_ms, random_chunks=True, seed=args.seed,
    )  # fmt: skip
    async with running_fake_server(options) as fake:
        raw = client_config(work, inputs, fake.url, root,
                            server={"request_timeout": 2.0}, dump={"timeout": 3.0},
                            workers={"concurrency": args.concurrency, "max_attempts": 10},
                            daemon={"log_level": "info", "drain_timeout": 60.0,
                                    "progress_interval": 30.0})  # fmt: skip
        config = write_config(work / "hsx.toml", raw)
        with (work / "hsx.log").open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hsx_async", "run", "--config", str(config),
                cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
            await watch(soak, proc, fake)
            code = await proc.wait()
        faults_met = dict(fake.stats.faults)
    verdict = leak_verdict(soak.probes)
    output = await asyncio.to_thread(check_output, work / "out", inputs, root, args.subset)
    return {
        "args": vars(args),
        "exit_code": code,
        "server_restarts": soak.restarts,
        "faults_injected": sum(faults_met.values()),
        "faults_by_kind": faults_met,
        "verdict": verdict,
        "output": output,
        "client_cpu_s": soak.probes[-1].cpu_s if soak.probes else None,
        "probes": [vars(p) for p in soak.probes],
    }


def report(result: dict[str, Any], stem: Path) -> bool:
    v, out = result["verdict"], result["output"]
    grew = [k for k in ("rss_grew", "fds_grew", "threads_grew") if v.get(k)]
    ok = result["exit_code"] == 0 and not grew and not out["problems"] and v["enough_samples"]
    print(f"soak: {result['args']['minutes']} min, exit {result['exit_code']}, "
          f"{out['samples_checked']} samples in the manifest "
          f"({out['bit_exact_checked']} checked bit-exact), "
          f"{result['faults_injected']} faults injected, "
          f"{result['server_restarts']} server restarts")  # fmt: skip
    if v["enough_samples"]:
        print(f"  RSS {v['rss_start_mib']:.0f} -> {v['rss_end_mib']:.0f} MiB "
              f"(peak {v['rss_peak_mib']:.0f}, slope {v['rss_slope_mib_per_hour']:+.1f} MiB/h); "
              f"fds {v['fds_start']:.0f} -> {v['fds_end']:.0f} (max {v['fds_max']}); "
              f"threads {v['threads_start']:.0f} -> {v['threads_end']:.0f}; "
              f"/dev/shm peak {v['shm_peak_mib']:.1f} MiB")  # fmt: skip
    print(f"  grew: {', '.join(grew) or 'nothing'}; problems: {out['problems'] or 'none'}")
    print(f"  {stem}.json, {stem}.png")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--rate", type=float, default=40.0, help="server speed cap, samples/s")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--fault-rate", type=float, default=0.05)
    p.add_argument("--restart-every", type=float, default=120.0, help="seconds; 0: never")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    p.add_argument("--subset", type=int, default=300, help="files checked bit-exact")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    configure_logging("console", "error")
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-soak-"))
    root = Path("/dev/shm") / f"hsx-soak-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    try:
        result = asyncio.run(run_soak(args, work, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    stem = RESULTS / f"soak-{time.strftime('%Y%m%dT%H%M%S')}"
    stem.with_suffix(".json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    plot([Probe(**p) for p in result["probes"]], stem.with_suffix(".png"))
    return 0 if report(result, stem) else 1


if __name__ == "__main__":
    raise SystemExit(main())
