"""Shared helpers of the bench scripts: workloads, measured processes, servers, reports.

Every figure comes from a separate process measured from the outside: the client runs as
``python -m hsx_async run --config X`` and its CPU time and peak RSS are read from
``wait4()`` (the kernel's own accounting, the same as ``/proc/<pid>/stat`` utime+stime and
``VmHWM``), so the servers and the bench itself, which share the same cores, are never
counted as client cost.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import tomli_w

from hsx_async.protocol import row_bytes
from hsx_async.run.dumps.mounts import mount_of

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
PYTHON = sys.executable
GB = 1e9
MB = 1e6
_START_TIMEOUT = 60.0
_LISTENING = re.compile(rb"listening on (http://\S+)")
_SUMMARY = re.compile(
    r"(?P<done>[\d,]+) samples written, (?P<quarantined>[\d,]+) quarantined.*?"
    r"(?P<tokens>[\d,]+) tokens, [\d.]+ \S+ in (?P<seconds>[\d.]+) s"
)


# -- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    hidden_size: int = 7168
    aux_layers: tuple[int, ...] = (2, 30, 58)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.hidden_size, self.aux_layers)

    @property
    def layers(self) -> int:
        return len(self.aux_layers) + 1


def lognormal_lengths(
    total_bytes: float,
    bytes_per_token: int,
    *,
    mean: float = 2350.0,
    sigma: float = 1.0,
    min_len: int = 16,
    max_len: int = 32768,
    seed: int = 0,
) -> list[int]:
    """Prompt lengths drawn from a log-normal of the given mean, clipped to
    [min_len, max_len], until they add up to ``total_bytes`` of hidden states."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma * sigma / 2  # the log-normal's mean is exp(mu + sigma²/2)
    lengths: list[int] = []
    budget = total_bytes / bytes_per_token
    while sum(lengths) < budget:
        draw = round(float(rng.lognormal(mu, sigma)))
        lengths.append(min(max_len, max(min_len, draw)))
    return lengths


def write_samples(path: Path, lengths: Sequence[int], *, seed: int = 0) -> None:
    """A JSONL input with one sample per length (ids ``b<i>``, random token ids)."""
    rng = np.random.default_rng(seed)
    with path.open("wb") as fh:
        for i, n in enumerate(lengths):
            ids = rng.integers(0, 128_000, size=n, dtype=np.int64)
            fh.write(
                orjson.dumps({"id": f"b{i}", "input_ids": ids}, option=orjson.OPT_SERIALIZE_NUMPY)
            )
            fh.write(b"\n")


def length_stats(lengths: Sequence[int], bytes_per_token: int) -> dict[str, float]:
    arr = np.asarray(lengths)
    return {
        "samples": len(lengths),
        "tokens": int(arr.sum()),
        "bytes": int(arr.sum()) * bytes_per_token,
        "mean_len": float(arr.mean()),
        "median_len": float(np.median(arr)),
        "max_len": int(arr.max()),
    }


# -- measured processes ---------------------------------------------------------------------


@dataclass
class Usage:
    """What a finished child process cost, from the kernel's accounting."""

    wall_s: float
    user_s: float
    sys_s: float
    # Bytes: the last VmHWM read before the exit (tmpfs pages mapped included). Not
    # ru_maxrss: Linux carries the parent's RSS at fork/exec into the child's ru_maxrss.
    peak_rss: int
    returncode: int
    peak_anon: int = 0  # bytes, highest RssAnon seen by the sampler (private memory)
    peak_shmem: int = 0  # bytes, highest RssShmem seen (tmpfs pages mapped)
    threads: dict[str, dict[str, float]] = field(default_factory=dict)  # CPU by thread kind

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


class _ProcSampler(threading.Thread):
    """Polls /proc/<pid> while the child runs: VmHWM (the peak RSS), the split of RSS into
    private and mapped-tmpfs memory, and the CPU time of each thread (user, system)."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_anon = self.peak_shmem = self.hwm = 0
        self.threads: dict[int, tuple[str, int, int]] = {}  # tid -> (name, utime, stime) ticks
        self.stop = threading.Event()

    def run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        polls = 0
        while not self.stop.wait(self.interval):
            try:
                text = status.read_text()
            except OSError:
                return
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            self.peak_anon = max(self.peak_anon, _kb(fields.get("RssAnon")))
            self.peak_shmem = max(self.peak_shmem, _kb(fields.get("RssShmem")))
            self.hwm = max(self.hwm, _kb(fields.get("VmHWM")))
            polls += 1
            if polls % 5 == 1:
                self._read_threads()

    def _read_threads(self) -> None:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    text = (task / "stat").read_text()
                    name = text[text.index("(") + 1 : text.rindex(")")]
                    rest = text[text.rindex(")") + 2 :].split()
                    self.threads[int(task.name)] = (name, int(rest[11]), int(rest[12]))

    def cpu_by_thread(self) -> dict[str, dict[str, float]]:
        """CPU seconds (user, system) of the main thread (the event loop) and of all the
        other threads together (I/O pool, resolver...). Python does not name OS threads,
        so nothing finer is visible from outside. The last poll is up to 0.1 s early."""
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, dict[str, float]] = {}
        for tid, (_, utime, stime) in self.threads.items():
            kind = "main" if tid == self.pid else "other threads"
            entry = out.setdefault(kind, {"user_s": 0.0, "sys_s": 0.0, "threads": 0})
            entry["user_s"] += utime / tick
            entry["sys_s"] += stime / tick
            entry["threads"] += 1
        return out


def _kb(value: str | None) -> int:
    return int(value.split()[0]) * 1024 if value else 0


def wait_usage(proc: subprocess.Popen[bytes], started: float, timeout: float) -> Usage:
    """Reap ``proc`` with wait4 (its rusage is the child's alone); kill it past timeout."""
    sampler = _ProcSampler(proc.pid)
    sampler.start()
    deadline = started + timeout
    try:
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)  # a poll for the child's exit, not synchronisation
    finally:
        sampler.stop.set()
    wall = time.monotonic() - started
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    return Usage(
        wall_s=wall,
        user_s=ru.ru_utime,
        sys_s=ru.ru_stime,
        peak_rss=sampler.hwm,
        returncode=code,
        peak_anon=sampler.peak_anon,
        peak_shmem=sampler.peak_shmem,
        threads=sampler.cpu_by_thread(),
    )


def child_env() -> dict[str, str]:
    """The children's environment, with bytecode caching on (in a private cache): with
    PYTHONDONTWRITEBYTECODE set, every start would compile hsx from source, a cost no
    installed copy pays."""
    env = dict(os.environ)
    env["HSX_BENCH_EMPTY_INPUT"] = "1"  # the "empty run" (start-up only) is let through
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "hsx-bench-pycache"))
    return env


def warm_up(src: Path = REPO) -> None:
    """Fill the bytecode cache once, so that no measured start compiles anything."""
    subprocess.run(
        [PYTHON, "-m", "hsx_async", "--help"],
        env=child_env(),
        cwd=src,
        stdout=subprocess.DEVNULL,
        check=True,
    )


def run_measured(
    argv: Sequence[str], log_path: Path, timeout: float = 1800.0, *, cwd: Path = REPO
) -> Usage:
    """Run to completion with stdout+stderr in ``log_path``; returns its cost."""
    with log_path.open("wb") as log:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=child_env()
        )
        return wait_usage(proc, started, timeout)


class ServerProcess:
    """A server in its own process that prints ``listening on URL`` once ready (or what
    ``listening`` matches, its group 1 the URL: the reference server logs ``url=URL``)."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        listening: re.Pattern[bytes] = _LISTENING,
        cwd: Path = REPO,
    ) -> None:
        self.argv = list(argv)
        self.cwd = cwd  # `python -m hsx_async` runs the hsx of this source tree
        self.log_path = log_path
        self.listening = listening
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.usage: Usage | None = None

    def __enter__(self) -> ServerProcess:
        self.started = time.monotonic()
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=self.cwd,
            env=child_env(),
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        try:
            self.url = _wait_listening(self.proc.stdout, self.log_path, self.listening)
        except BaseException:
            self.proc.kill()
            wait_usage(self.proc, self.started, 30.0)
            self.proc.stdout.close()
            self._log.close()
            raise
        # Keep draining stdout so the server never blocks on a full pipe.
        self._drain = threading.Thread(target=self.proc.stdout.read, daemon=True)
        self._drain.start()
        return self

    def cpu_s(self) -> float:
        """CPU seconds the server used so far (utime + stime from /proc)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:
            return orjson.loads(resp.read())

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)
                self.usage = wait_usage(self.proc, self.started, 30.0)
            self._drain.join(timeout=10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        self._log.close()


def _wait_listening(stream: Any, log_path: Path, pattern: re.Pattern[bytes]) -> str:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + _START_TIMEOUT
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=deadline - time.monotonic()):
                break
            line = stream.readline()
            if not line:
                break
            m = pattern.search(line)
            if m:
                return m.group(1).decode()
    finally:
        sel.close()
    raise RuntimeError(f"server did not start; see {log_path}:\n{_tail(log_path)}")


def _tail(path: Path, n: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    return ""


def fake_server_argv(
    model: Model,
    dump_root: Path,
    *,
    latency_base_ms: float = 0.0,
    latency_per_token_us: float = 0.0,
    max_batch_tokens: int = 16384,
) -> list[str]:
    return [
        PYTHON, "-m", "hsx_async", "fake-server", "--port", "0",
        "--hidden-size", str(model.hidden_size),
        "--aux-layers", ",".join(map(str, model.aux_layers)),
        "--dump-root", str(dump_root),
        "--max-batch-tokens", str(max_batch_tokens),
        "--latency-base-ms", str(latency_base_ms),
        "--latency-per-token-us", str(latency_per_token_us),
    ]  # fmt: skip


class StatsPoller(threading.Thread):
    """Samples the fake server's ``tokens_dumped`` over time, for steady-state rates."""

    def __init__(self, server: ServerProcess, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.server, self.interval = server, interval
        self.points: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            with contextlib.suppress(OSError, ValueError):
                tokens = int(self.server.get_json("/hsx_fake/stats")["tokens_dumped"])
                self.points.append((time.monotonic(), tokens))

    def steady_rate(self, lo: float = 0.1, hi: float = 0.9) -> float:
        """Tokens/s between the moments ``lo`` and ``hi`` of the final count were reached:
        the start-up of the processes and the drain of the last pass are left out."""
        self.stop.set()
        if len(self.points) < 3 or self.points[-1][1] == 0:
            return 0.0
        total = self.points[-1][1]
        t_lo = next(t for t, n in self.points if n >= lo * total)
        n_lo = next(n for t, n in self.points if n >= lo * total)
        t_hi, n_hi = next((t, n) for t, n in self.points if n >= hi * total)
        return (n_hi - n_lo) / (t_hi - t_lo) if t_hi > t_lo else 0.0


def drain_server(
    url: str, lengths: Sequence[int], *, concurrency: int, dump_root: Path, ns_prefix: str
) -> tuple[float, int]:
    """A null client: keeps ``concurrency`` requests in flight and deletes each dump as
    soon as it is committed, copying nothing. Measures what the server alone can produce.
    Returns (seconds, tokens)."""
    import asyncio

    import aiohttp

    from hsx_async.protocol import generate_body
    from hsx_async.run.dumps.dump import prepare_namespace, remove_tree, wait_for_meta

    todo = list(enumerate(lengths))
    rng = np.random.default_rng(1)

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        ns = f"{ns_prefix}-w{w}"
        ns_dir = await asyncio.to_thread(prepare_namespace, dump_root, ns)
        while todo:
            i, n = todo.pop()
            rid = f"drain-{i}"
            ids = rng.integers(0, 128_000, size=n, dtype=np.int64)
            body = orjson.dumps(generate_body(rid, ns, ids), option=orjson.OPT_SERIALIZE_NUMPY)
            async with session.post(f"{url}/generate", data=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}")
            await wait_for_meta(ns_dir / rid, 120.0)
            await asyncio.to_thread(remove_tree, ns_dir / rid)
        await asyncio.to_thread(remove_tree, ns_dir)

    async def main() -> float:
        started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session, asyncio.TaskGroup() as tg:
            for w in range(concurrency):
                tg.create_task(worker(w, session))
        return time.monotonic() - started

    return asyncio.run(main()), sum(lengths)


def fake_server_drained(
    model: Model, dump_root: Path, log: Path, lengths: Sequence[int], concurrency: int
) -> tuple[float, int, float]:
    """A fresh fake server (no latency model) drained by the null client: what the server
    alone can produce here. Returns (seconds, tokens, the server's CPU seconds)."""
    with ServerProcess(fake_server_argv(model, dump_root), log) as srv:
        cpu0 = srv.cpu_s()
        seconds, tokens = drain_server(
            srv.url, lengths, concurrency=concurrency, dump_root=dump_root, ns_prefix="null"
        )
        return seconds, tokens, srv.cpu_s() - cpu0


# -- the hsx client -------------------------------------------------------------------------


def client_config(
    *, url: str, samples: Path, out_dir: Path, dump_root: Path, model: Model, **sections: Any
) -> dict[str, dict[str, Any]]:
    """An ``hsx run`` config: production defaults but quiet logs and no metrics port."""
    raw: dict[str, dict[str, Any]] = {
        "server": {"urls": [url]},
        "input": {"path": str(samples)},
        "output": {"dir": str(out_dir), "disk_reserve": 0},
        "dump": {"root": str(dump_root)},
        "model": {"hidden_size": model.hidden_size, "aux_layers": list(model.aux_layers)},
        # info: run_started and run_finished time the pipeline; nothing per sample is logged.
        "daemon": {"log_format": "json", "log_level": "info", "metrics_listen": ""},
    }
    for name, keys in sections.items():
        raw.setdefault(name, {}).update(keys)
    return raw


@dataclass
class ClientRun:
    usage: Usage
    done: int
    quarantined: int
    tokens: int
    run_s: float  # run_started → run_finished: process start-up and set-up excluded
    bytes_on_disk: int
    # The first server_admitted → run_finished: the copy alone, the admission's probe of the
    # server (a fixed cost of every run, like start-up) excluded. None: no server admitted.
    copy_s: float | None = None
    # The CPU run_finished reports (every thread, from the run's start): imports and
    # set-up excluded, counted by the process itself. None: a client that does not say.
    run_cpu_s: float | None = None

    @property
    def gb(self) -> float:
        return self.bytes_on_disk / GB


PROFILE: dict[str, Any] = {"dir": None, "gil": False}  # set by --profile-dir, --profile-gil
KEEP_LOGS: dict[str, Path | None] = {"dir": None}  # set by --keep-logs


def run_hsx(
    raw_config: dict[str, dict[str, Any]], work: Path, name: str, *, src: Path = REPO
) -> ClientRun:
    """``python -m hsx_async run`` in its own process; raises if it did not finish.
    ``src``: the source tree whose ``hsx_async`` runs (started there, so it is the one
    imported): another checkout, to measure two versions side by side in one run.

    With ``--profile-dir`` the client runs under ``py-spy record`` (collapsed stacks,
    one file per run): its figures then include py-spy's own cost, so use them for the
    profile only."""
    config = work / f"{name}.toml"
    keep = KEEP_LOGS["dir"]
    if keep is not None:  # every event, to read a run's timeline afterwards
        daemon = {**raw_config.get("daemon", {}), "log_level": "debug"}
        raw_config = {**raw_config, "daemon": daemon}
    config.write_text(tomli_w.dumps(raw_config))
    log = work / f"{name}.log"
    argv = [PYTHON, "-m", "hsx_async", "run", "--config", str(config), "--no-report"]
    if PROFILE["dir"] is not None:
        PROFILE["dir"].mkdir(parents=True, exist_ok=True)
        spy = Path(PYTHON).parent / "py-spy"
        out = PROFILE["dir"] / f"{name}.txt"
        gil = ["--gil"] if PROFILE["gil"] else []
        argv = [str(spy), "record", "--threads", *gil, "--rate", "200", "--format",
                "raw", "--output", str(out), "--", *argv]  # fmt: skip
    usage = run_measured(argv, log, cwd=src)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, keep / log.name)
    m = _SUMMARY.search(_tail(log, 4000))
    marks = _pipeline_marks(log)
    if usage.returncode != 0 or m is None:
        raise RuntimeError(f"hsx run failed ({usage.returncode}); see {log}:\n{_tail(log)}")
    out = Path(raw_config["output"]["dir"])
    return ClientRun(
        usage=usage,
        done=int(m["done"].replace(",", "")),
        quarantined=int(m["quarantined"].replace(",", "")),
        tokens=int(m["tokens"].replace(",", "")),
        run_s=marks.run_s or float(m["seconds"]),
        bytes_on_disk=dataset_bytes(out),
        copy_s=marks.copy_s,
        run_cpu_s=marks.cpu_s,
    )


@dataclass(frozen=True)
class _Marks:
    run_s: float | None  # run_started → run_finished
    copy_s: float | None  # the first server_admitted → run_finished
    cpu_s: float | None  # run_finished's cpu_s


def _pipeline_marks(log: Path) -> _Marks:
    """What a JSON log's ``run_started``, first ``server_admitted`` and ``run_finished``
    events say about the run's time and CPU."""
    from datetime import datetime

    stamps: dict[str, float] = {}
    cpu: float | None = None
    for line in log.read_bytes().splitlines():
        if not line.startswith(b"{"):
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            event = orjson.loads(line)
            name = event["event"]
            if name in ("run_started", "server_admitted", "run_finished"):
                stamp = datetime.fromisoformat(event["timestamp"]).timestamp()
                stamps.setdefault(name, stamp)
            if name == "run_finished" and isinstance(event.get("cpu_s"), int | float):
                cpu = float(event["cpu_s"])
    end = stamps.get("run_finished")
    start, admitted = stamps.get("run_started"), stamps.get("server_admitted")
    return _Marks(
        run_s=end - start if end is not None and start is not None else None,
        copy_s=end - admitted if end is not None and admitted is not None else None,
        cpu_s=cpu,
    )


def dataset_bytes(out_dir: Path) -> int:
    total = 0
    for line in (out_dir / "manifest.jsonl").read_bytes().splitlines():
        if line.strip():
            total += int(orjson.loads(line)["bytes"])
    return total


# -- the machine ----------------------------------------------------------------------------


def drop_caches() -> bool:
    """Write back and drop the page cache so a phase does not read the previous one's
    cache (needs root; skipped otherwise)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def machine_info(out_dir: Path, shm_dir: Path) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(mem / GB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "out_fs": mount_text(out_dir),
        "shm_fs": mount_text(shm_dir),
        "load_avg_at_start": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def mount_text(path: Path) -> str:
    """``device on point (fstype, options)`` of the mount holding ``path``."""
    mount = mount_of(path)
    return str(mount) if mount else ""


# -- scratch space --------------------------------------------------------------------------


@dataclass
class Scratch:
    """Unique working directories on the output disk and in /dev/shm, removed at the end."""

    disk: Path
    shm: Path
    work: Path  # configs, inputs and logs (on the disk, kept small)

    def fresh(self, name: str, *, on_shm: bool = False) -> Path:
        path = (self.shm if on_shm else self.disk) / name
        remove(path)
        path.mkdir(parents=True)
        return path


@contextlib.contextmanager
def scratch(args: argparse.Namespace, name: str) -> Iterator[Scratch]:
    tag = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    disk = Path(args.out_dir) / tag
    shm = Path(args.shm_dir) / tag
    for path in (disk, shm, disk / "work"):
        path.mkdir(parents=True)
    try:
        yield Scratch(disk=disk, shm=shm, work=disk / "work")
    finally:
        results = Path(args.results_dir)
        logs = disk / "work"
        if logs.is_dir():  # keep the logs and configs next to the results
            dest = results / f"{name}-logs"
            remove(dest)
            shutil.copytree(logs, dest)
        remove(disk)
        remove(shm)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def common_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny sizes: checks the script runs (CI)")
    add("--results-dir", type=Path, default=RESULTS_DIR, help="JSON, PNG and logs go here")
    add(
        "--out-dir",
        type=Path,
        default=Path("/var/tmp/hsx-bench"),
        help="scratch directory on the disk under test (emptied after each phase)",
    )
    add("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for dumps")
    add("--profile-dir", type=Path, help="run each hsx client under py-spy; stacks go here")
    add(
        "--keep-logs",
        type=Path,
        help="copy each hsx run's JSON log here, at log level debug (every sample's "
        "events, time-stamped: a run's timeline); debug logging costs the client a little",
    )
    add(
        "--profile-gil",
        action="store_true",
        help="with --profile-dir: sample only the thread holding the GIL (the serial "
        "Python work that bounds a GIL-bound client); summarise with bench/profile_summary.py",
    )


def apply_common(args: argparse.Namespace) -> None:
    PROFILE["dir"] = args.profile_dir
    PROFILE["gil"] = args.profile_gil
    KEEP_LOGS["dir"] = args.keep_logs
    warm_up()


# -- reports --------------------------------------------------------------------------------


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (also valid Markdown); printed and returned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    text = f"\n{title}\n\n" + "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def save_results(results_dir: Path, name: str, data: dict[str, Any], tables: list[str]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    data = {**data, "tables": tables}
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    (results_dir / f"{name}.md").write_text("".join(tables))
    print(f"results: {path}", flush=True)
    return path


def usage_dict(usage: Usage) -> dict[str, Any]:
    return asdict(usage) | {"cpu_s": usage.cpu_s}


def pyplot() -> Any:
    """matplotlib with the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
