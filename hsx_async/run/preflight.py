"""``hsx check --config FILE``: everything that can be checked before a 70-hour job starts.

Config, input, output disk, dump root (a tmpfs both sides can write), every server
(``/health``, ``/get_model_info``, one tiny request through the full dump path with its
``meta.json`` checked against the config), and the size and time the job will take.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from hsx_async.config import Config, load_config
from hsx_async.dataset.inspection import human_bytes
from hsx_async.errors import DumpError, HsxError, InputError, RequestError
from hsx_async.run.client import Server, ServerPool, SGLangClient
from hsx_async.run.dump import prepare_namespace, remove_tree, validate_dump, wait_for_meta
from hsx_async.run.guard import free_bytes
from hsx_async.run.observe import eta_text
from hsx_async.run.source import BadLine, SampleReader, open_input

_PROBE_BYTES = 64 << 20


@dataclass
class Report:
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (level, check, detail)

    def add(self, level: str, check: str, detail: str) -> None:
        self.lines.append((level, check, detail))

    @property
    def failed(self) -> bool:
        return any(level == "FAIL" for level, _, _ in self.lines)

    def format(self) -> str:
        return "\n".join(f"{level:<4}  {check:<14} {detail}" for level, check, detail in self.lines)


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if (
            len(fields) >= 3
            and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/"))
            and len(fields[1]) >= len(best)
        ):
            best, kind = fields[1], fields[2]
    return kind


def check_input(config: Config, report: Report) -> int:
    """Validate every line; returns the number of tokens to extract."""
    reader = SampleReader(config.input.path, config.input.max_tokens)
    samples = bad = tokens = 0
    try:
        for item in reader.iter_sync():
            if isinstance(item, BadLine):
                bad += 1
            else:
                samples += 1
                tokens += item.num_tokens
    except HsxError as exc:
        report.add("FAIL", "input", str(exc))
        return 0
    level = "WARN" if bad else "OK"
    report.add(
        level, "input", f"{samples} samples, {tokens:,} tokens; {bad} lines would be quarantined"
    )
    return tokens


def check_disk_write(path: Path) -> float:
    """Durable write rate of the output disk in bytes/s (a 64 MiB temp file, fsynced)."""
    probe = path / f".hsx-check-{secrets.token_hex(4)}.tmp"
    data = os.urandom(1 << 20)
    started = time.monotonic()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for _ in range(_PROBE_BYTES >> 20):
            os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return _PROBE_BYTES / max(time.monotonic() - started, 1e-6)


def output_problem(out: Path) -> str:
    """'' when hsx can make files in ``out`` (created if missing), else one line saying
    why not: ``hsx check`` reports it, ``hsx run`` refuses to start with it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"output.dir {out} exists and is not a directory; point output.dir at a directory"
    except OSError as exc:
        return f"output.dir {out} cannot be created: {exc.strerror}; fix it or pick another"
    if not out.is_dir():
        return f"output.dir {out} is not a directory; point output.dir at a directory"
    try:
        _probe_write(out)
    except OSError as exc:
        return f"output.dir {out} is not writable: {exc.strerror}; fix its permissions or mount"
    return ""


def _probe_write(directory: Path) -> None:
    """Create a file in ``directory``: unnamed (O_TMPFILE) where the file system allows,
    so a process killed here leaves nothing behind; else a named one, removed at once."""
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    else:
        return
    probe = directory / f".hsx-probe-{secrets.token_hex(4)}.tmp"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    probe.unlink()


def dump_root_problem(root: Path) -> str:
    """'' when ``dump.root`` exists as a directory (created if missing), else why not."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"dump.root {root} cannot be created: {exc.strerror or exc}"
    if not root.is_dir():
        return f"dump.root {root} is not a directory; point dump.root at the servers' HSX_DUMP_ROOT"
    return ""


def operator_problem(config: Config) -> str:
    """The first operator mistake ``hsx check`` would report as a FAIL before any server
    is asked (one line naming the key), or '': ``hsx run`` refuses to start with the same
    words instead of a traceback. Blocking (a probe file, a stat)."""
    try:
        open_input(config.input.path).close()
    except InputError as exc:
        return str(exc)
    return output_problem(config.output.dir) or dump_root_problem(config.dump.root)


def check_output(config: Config, report: Report, need: int) -> float:
    out = config.output.dir
    problem = output_problem(out)
    if problem:
        report.add("FAIL", "output", problem)
        return 0.0
    try:
        rate = check_disk_write(out)
    except OSError as exc:
        report.add("FAIL", "output", f"{out} is not writable: {exc}")
        return 0.0
    free = free_bytes(out)
    level = "OK" if free >= need + config.output.disk_reserve else "FAIL"
    report.add(
        level,
        "output",
        f"{out}: {human_bytes(free)} free, job needs ~{human_bytes(need)} "
        f"+ reserve {human_bytes(config.output.disk_reserve)}; "
        f"durable writes ~{rate / 1e9:.2f} GB/s",
    )
    return rate


def check_dump_root(config: Config, report: Report) -> None:
    root = config.dump.root
    problem = dump_root_problem(root)
    if problem:
        report.add("FAIL", "dump root", problem)
        return
    kind = fs_type(root)
    free = free_bytes(root)
    level = "OK" if kind == "tmpfs" else "WARN"
    report.add(
        level,
        "dump root",
        f"{root} on {kind} ({'RAM' if kind == 'tmpfs' else 'not RAM: slow'}), "
        f"{human_bytes(free)} free, budget {human_bytes(config.dump.shm_budget)}",
    )
    if free < config.dump.shm_budget:
        report.add(
            "FAIL", "dump root", f"dump.shm_budget exceeds the free space of {root}; lower it"
        )


async def _tiny_request(client: SGLangClient, server: Server, config: Config) -> str:
    """One request through the whole dump path; '' on success, else the problem."""
    ns = f"{config.dump.namespace_prefix}-check"
    rid = f"check-{secrets.token_hex(6)}"
    ns_dir = await asyncio.to_thread(prepare_namespace, config.dump.root, ns)
    ids = np.array([1, 2, 3, 4], dtype=np.int64)
    try:
        await client.generate(
            server, rid=rid, ns=ns, input_ids=ids, timeout=config.server.request_timeout
        )
        meta = await wait_for_meta(ns_dir / rid, config.dump.timeout)
        validate_dump(
            ns_dir / rid,
            meta,
            rid=rid,
            num_tokens=4,
            hidden_size=config.model.hidden_size,
            aux_layers=config.model.aux_layers,
            row_bytes=config.model.row_bytes,
        )
    except (RequestError, DumpError) as exc:
        return str(exc)
    finally:
        await asyncio.to_thread(remove_tree, ns_dir)
    return ""


async def check_servers(config: Config, report: Report) -> None:
    pool = ServerPool(config.server.urls, health_interval=1.0, unreachable_timeout=1.0)
    async with aiohttp.ClientSession() as session:
        client = SGLangClient(session, pool)
        for server in pool.servers:
            error = await client.health(server.url)
            if error:
                report.add("FAIL", "server", f"{server.display}: {error}")
                continue
            info: Any = {}
            try:
                info = await client.get_json(server.url, "/get_model_info")
            except (HsxError, aiohttp.ClientError, ValueError) as exc:
                report.add("WARN", "server", f"{server.display}: /get_model_info failed: {exc}")
            model = info.get("model_path", "?") if isinstance(info, dict) else "?"
            problem = await _tiny_request(client, server, config)
            if problem:
                report.add("FAIL", "dump path", f"{server.display}: {problem}")
            else:
                report.add(
                    "OK",
                    "server",
                    f"{server.display}: healthy, model {model}, dump path OK "
                    f"(hidden {config.model.hidden_size}, layers {list(config.model.aux_layers)})",
                )


def run_checks(config: Config) -> Report:
    report = Report()
    report.add("OK", "config", f"{config.path}: valid")
    tokens = check_input(config, report)
    need = tokens * config.model.row_bytes
    rate = check_output(config, report, need)
    check_dump_root(config, report)
    asyncio.run(check_servers(config, report))
    if rate > 0 and need:
        report.add(
            "INFO",
            "estimate",
            f"{human_bytes(need)} to write; at the disk's {rate / 1e9:.2f} GB/s "
            f"that is {eta_text(need / rate)} if the servers keep up",
        )
    return report


def check_command(args: argparse.Namespace) -> int:
    report = run_checks(load_config(Path(args.config)))
    print(report.format())
    return 1 if report.failed else 0


def register_cli(sub: Any) -> None:
    p = sub.add_parser(
        "check", help="preflight: config, input, disks, servers, dump path, estimate"
    )
    p.add_argument("--config", required=True, help="TOML config file")
    p.set_defaults(handler=check_command)
