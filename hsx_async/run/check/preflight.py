"""``hsx check --config FILE``: everything that can be checked before a 70-hour job starts.

Config, input, output disk, dump root (a tmpfs both sides can write), every server
(``/health``, ``/get_model_info``, one tiny request through the full dump path with its
``meta.json`` checked against the config), and the size and time the job will take.

The time is the job's tokens over the slowest of three rates, each measured and printed:
the servers' prefill (a few of the input's own samples sent at once to each server,
timed from send to validated dump, summed over servers), the output disk's durable
writes and the client's read + hash of dumps from the dump root (both over the bytes
per token, ``row_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from hsx_async.config import Config
from hsx_async.dataset.manifest import load_done
from hsx_async.dataset.target import read_config
from hsx_async.errors import DatasetError, DumpError, HsxError, InputError, RequestError
from hsx_async.layer_ids import architecture_of, draft_ids, num_layers_of
from hsx_async.net import listen_problem
from hsx_async.protocol import Storage
from hsx_async.run.check.spool_estimate import SpoolRates, spool_lines
from hsx_async.run.dumps.dump import (
    Dump,
    prepare_namespace,
    remove_tree,
    validate_dump,
    wait_for_meta,
)
from hsx_async.run.dumps.mounts import fs_type, huge_always, mount_of
from hsx_async.run.dumps.writer import check_sections
from hsx_async.run.notify import Notifier
from hsx_async.run.pipeline.guard import free_bytes
from hsx_async.run.servers.admission import Admission, Examination
from hsx_async.run.servers.client import EngineClient, connected
from hsx_async.run.servers.identity import Identity, JobRecord
from hsx_async.run.servers.pool import Server, server_pool
from hsx_async.run.servers.probe import DumpProbe
from hsx_async.run.source import BadLine, SampleReader, open_input, require_samples
from hsx_async.units import eta_text, human_bytes

_PROBE_BYTES = 64 << 20
_PROBE_SAMPLES = 4  # real samples sent at once to each server to measure its prefill rate


@dataclass
class InputScan:
    """What is left to extract: the input's valid samples less those the output directory
    holds already (its manifest or quarantine), as a resumed ``hsx run`` skips them."""

    samples: int = 0
    tokens: int = 0
    probe: list[npt.NDArray[np.int64]] = field(default_factory=list)  # the first samples
    done: int = 0  # valid samples already in the dataset

    @property
    def finished(self) -> bool:
        """Every sample is in the dataset: ``hsx run`` contacts no server and writes nothing."""
        return self.done > 0 and self.samples == 0


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


def check_input(config: Config, report: Report) -> InputScan:
    """Validate every line; the tokens to extract and the samples to probe servers with."""
    reader = SampleReader(config.input.path, config.input.max_tokens)
    scan = InputScan()
    samples = tokens = bad = 0
    first_bad: list[str] = []
    try:
        require_samples(config.input.path)  # an empty input: FAIL, as hsx run refuses it
        done = load_done(config.output.dir) if config.output.dir.is_dir() else None
        for item in reader.iter_sync():
            if isinstance(item, BadLine):
                bad += 1
                if len(first_bad) < 3:
                    first_bad.append(f"line {item.line + 1}: {item.reason}")
                continue
            samples += 1
            tokens += item.num_tokens
            if done is not None and done.is_done(item.id, item.line):
                scan.done += 1
                continue
            scan.samples += 1
            scan.tokens += item.num_tokens
            if len(scan.probe) < _PROBE_SAMPLES:
                scan.probe.append(item.input_ids)
    except HsxError as exc:
        report.add("FAIL", "input", str(exc))
        return InputScan()
    level = "WARN" if bad else "OK"
    counts = f"{samples:,} samples, {tokens:,} tokens; {bad:,} lines would be quarantined"
    report.add(level, "input", counts)
    for text in first_bad:
        report.add("WARN", "input", text)
    _report_done(config.output.dir, scan, report)
    return scan


def _report_done(out: Path, scan: InputScan, report: Report) -> None:
    """What a resumed run would skip, so the job's needs below are what is left."""
    if scan.finished:
        report.add(
            "INFO",
            "input",
            f"all {scan.done:,} are in {out} already (its manifest or quarantine): hsx run "
            "has nothing left to extract",
        )
    elif scan.done:
        report.add(
            "INFO",
            "input",
            f"{scan.done:,} of them are in {out} already: {scan.samples:,} samples, "
            f"{scan.tokens:,} tokens left to extract",
        )


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


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or its closest ancestor that exists: where a missing directory
    would be created, and on which file system."""
    missing = _missing_dirs(path)
    return missing[-1].parent if missing else path


def _creatable(path: Path, key: str) -> str:
    """'' when ``mkdir -p path`` would succeed, else why not (nothing is created)."""
    parent = nearest_existing(path)
    if not parent.is_dir():
        why = "is not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK):
        why = "is not writable"
    else:
        return ""
    return f"{key} {path} cannot be created: {parent} {why}; fix it or pick another"


def output_problem(out: Path, *, create: bool = True) -> str:
    """'' when hsx can make files in ``out`` (created if missing; with ``create=False``, as
    ``hsx check`` asks: a missing ``out`` that could be created), else one line saying
    why not: ``hsx check`` reports it, ``hsx run`` refuses to start with it."""
    if not create and not os.path.lexists(out):
        return _creatable(out, "output.dir")
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


def dump_root_problem(root: Path, *, create: bool = True) -> str:
    """'' when ``dump.root`` exists as a directory (created if missing; with
    ``create=False``: or could be created), else why not."""
    if not create and not os.path.lexists(root):
        return _creatable(root, "dump.root")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"dump.root {root} cannot be created: {exc.strerror or exc}"
    if not root.is_dir():
        return f"dump.root {root} is not a directory; point dump.root at the servers' HSX_DUMP_ROOT"
    return ""


# bench/ measures hsx run's start-up alone with an input of no sample (its "empty run"):
# this variable, set by bench/common.py's child_env, lets that one input through. An
# operator's empty input is refused (an older checkout the bench pairs with ignores it).
BENCH_EMPTY_INPUT = "HSX_BENCH_EMPTY_INPUT"


def operator_problem(config: Config) -> str:
    """The first operator mistake ``hsx check`` would report as a FAIL before any server
    is asked (one line naming the key), or '': ``hsx run`` refuses to start with the same
    words instead of a traceback. Blocking (a probe file, a stat)."""
    try:
        if os.environ.get(BENCH_EMPTY_INPUT) == "1":
            open_input(config.input.path).close()
        else:
            require_samples(config.input.path)
    except InputError as exc:
        return str(exc)
    # The port before the directories: a refused run has created nothing.
    return (
        listen_problem(config.daemon.metrics_listen)
        or output_problem(config.output.dir)
        or dump_root_problem(config.dump.root)
    )


def check_output(config: Config, report: Report, need: int) -> float:
    """The output disk's space and durable write rate. Creates nothing: a missing
    ``output.dir`` is reported with the file system it would be created on (a mount that
    is not there shows up as the root file system), its write rate not measured."""
    out = config.output.dir
    problem = output_problem(out, create=False)
    if problem:
        report.add("FAIL", "output", problem)
        return 0.0
    if not out.exists():
        return _report_missing_output(config, report, need)
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
        f"durable writes ~{human_bytes(rate)}/s",
    )
    return rate


def check_metrics(config: Config, report: Report) -> None:
    listen = config.daemon.metrics_listen
    problem = listen_problem(listen)
    if problem:
        report.add("FAIL", "metrics", problem)
    elif listen:
        report.add("OK", "metrics", f"{listen} is free (/metrics and /status of hsx run)")


def _report_missing_output(config: Config, report: Report, need: int) -> float:
    """A new job's output.dir: measured where it would be made (a probe file, removed)."""
    out = config.output.dir
    where = nearest_existing(out)
    try:
        rate = check_disk_write(where)
    except OSError:
        rate = 0.0
    free = free_bytes(where)
    enough = free >= need + config.output.disk_reserve
    writes = (
        f"durable writes ~{human_bytes(rate)}/s there" if rate else "durable writes not measured"
    )
    report.add(
        "WARN" if enough else "FAIL",
        "output",
        f"{out} does not exist: hsx run will create it in {where} (on {fs_type(where)}), "
        f"{human_bytes(free)} free, job needs ~{human_bytes(need)} + reserve "
        f"{human_bytes(config.output.disk_reserve)}; {writes}. If {out} belongs on a mount, "
        "mount it first",
    )
    return rate


def check_dump_root(config: Config, report: Report) -> None:
    """Creates nothing: a missing ``dump.root`` is reported with where it would be made."""
    root = config.dump.root
    problem = dump_root_problem(root, create=False)
    if problem:
        report.add("FAIL", "dump root", problem)
        return
    where = nearest_existing(root)
    mount = mount_of(where)
    kind = mount.fstype if mount else "unknown"
    free = free_bytes(where)
    level = "OK" if kind == "tmpfs" and where == root else "WARN"
    place = str(root) if where == root else f"{root} does not exist yet (hsx run creates it)"
    report.add(
        level,
        "dump root",
        f"{place} on {kind} ({'RAM' if kind == 'tmpfs' else 'not RAM: slow'}), "
        f"{human_bytes(free)} free, budget {human_bytes(config.dump.shm_budget)}",
    )
    if mount is not None and huge_always(mount):
        report.add(
            "WARN",
            "dump root",
            f"the tmpfs at {mount.point} is mounted huge=always: every small file (each "
            "probe part, each meta.json) takes and zeroes a 2 MiB page, which slows every "
            "server's first answer; remount it with huge=within_size (README, "
            '"Dump root on huge pages")',
        )
    if free < config.dump.shm_budget:
        report.add(
            "FAIL", "dump root", f"dump.shm_budget exceeds the free space of {root}; lower it"
        )


async def _dump_once(
    client: EngineClient, server: Server, config: Config, ns_dir: Path, ids: npt.NDArray[np.int64]
) -> Dump:
    """One request through the whole dump path, its dump validated against the config."""
    rid = f"check-{secrets.token_hex(6)}"
    await client.generate(
        server,
        rid=rid,
        ns=ns_dir.name,
        input_ids=ids,
        timeout=config.server.request_timeout,
        storage=config.storage,
    )
    meta = await wait_for_meta(ns_dir / rid, config.dump.timeout)
    dump = validate_dump(
        ns_dir / rid,
        meta,
        rid=rid,
        num_tokens=len(ids),
        hidden_size=config.model.hidden_size,
        aux_layers=config.model.aux_layers,
        storage=config.storage,
    )
    await asyncio.to_thread(check_sections, dump)  # what the copy would refuse
    return dump


@contextlib.asynccontextmanager
async def scratch_namespace(config: Config) -> AsyncIterator[Path]:
    """The check's own namespace in ``dump.root``, removed afterwards with every directory
    it needed to create (a missing dump root too), so ``hsx check`` leaves nothing."""
    root = config.dump.root
    missing = await asyncio.to_thread(_missing_dirs, root)
    ns = f"{config.dump.namespace_prefix}-check"
    ns_dir = await asyncio.to_thread(prepare_namespace, root, ns)
    try:
        yield ns_dir
    finally:
        await asyncio.to_thread(remove_tree, ns_dir)
        await asyncio.to_thread(_remove_empty, missing)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist, innermost first."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for made in dirs:  # innermost first; one that another process wrote into stays
        try:
            made.rmdir()
        except OSError:
            return


def _storage_line(server: Server, config: Config, dumped: Storage) -> tuple[str, str, str]:
    """Where an FP8 dataset's rows are quantized: by the server's hook (the dump is
    already FP8: half the /dev/shm and copy bytes) or by the client's writer."""
    want = config.storage.describe()
    if dumped == config.storage:
        return "OK", "storage", f"{server.display}: the hook stores {want} itself"
    return (
        "WARN",
        "storage",
        f"{server.display}: the hook dumps bfloat16; the client quantizes to {want} "
        "(client CPU per GB: bench/README.md, FP8). Deploy this version's hook to quantize "
        "on the server",
    )


async def _probe_prefill(
    client: EngineClient, server: Server, config: Config, probe: list[npt.NDArray[np.int64]]
) -> float:
    """Tokens/s of ``server`` for a few real samples sent at once (send → validated dump)."""
    async with scratch_namespace(config) as ns_dir:
        started = time.monotonic()
        await asyncio.gather(*(_dump_once(client, server, config, ns_dir, ids) for ids in probe))
    return sum(len(ids) for ids in probe) / max(time.monotonic() - started, 1e-6)


def check_dump_read(root: Path) -> float:
    """The client's rate reading + hashing a dump from the dump root, in bytes/s."""
    probe = root / f".hsx-check-{secrets.token_hex(4)}.tmp"
    data = os.urandom(1 << 20)
    try:
        with probe.open("wb") as fh:
            for _ in range(_PROBE_BYTES >> 20):
                fh.write(data)
        hasher = xxhash.xxh3_64()
        buf = bytearray(8 << 20)
        started = time.monotonic()
        with probe.open("rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                hasher.update(memoryview(buf)[:n])
        return _PROBE_BYTES / max(time.monotonic() - started, 1e-6)
    finally:
        probe.unlink(missing_ok=True)


async def check_servers(
    config: Config, report: Report, probe: list[npt.NDArray[np.int64]] | None = None
) -> float:
    """Check every server through the examination a run admits it by (one after
    another: the first that passes pins the identity and rows the others must match);
    returns their summed prefill rate in tokens/s (0: not measured)."""
    pool = server_pool(config, admission=False)
    total = 0.0
    async with connected(pool) as client, scratch_namespace(config) as ns_dir:
        examination = Admission(
            config, client,
            probe=DumpProbe(config, client, nonce=f"check-{secrets.token_hex(4)}",
                            namespace=ns_dir.name),
            record=None, job=JobRecord(), final_states=None, notifier=Notifier(None),
            stop_requested=asyncio.Event(),
        )  # fmt: skip
        await examination.probe.open()
        for server in pool.servers:
            found = await examination.check(server)
            if found.identity is None or found.fault is not None:
                _report_refusal(report, found)
                continue
            if config.storage.is_fp8 and found.meta is not None:
                report.add(*_storage_line(server, config, found.meta.storage))
            report.add("OK", "server", _admitted_line(found.identity, server, config))
            report.add(
                *draft_ids_line({"model_path": found.identity.model}, config.model.aux_layers)
            )
            total += await _server_rate(client, server, config, probe or [], report)
        await examination.probe.settle()
    _report_claims(report, examination)
    return total


def _admitted_line(identity: Identity, server: Server, config: Config) -> str:
    said = ", ".join(
        f"{what} {value}"
        for what, value in (("revision", identity.revision), ("version", identity.version))
        if value
    )
    return (
        f"{server.display}: healthy ({identity.engine}), model {identity.model or '?'}"
        f"{f' ({said})' if said else ''}, dump path OK (hidden {config.model.hidden_size}, "
        f"layers {list(config.model.aux_layers)}); admitted as {identity.served_as!r}, "
        f"hook protocol {identity.hook}, final state {identity.final_state}"
    )


def _report_refusal(report: Report, found: Examination) -> None:
    """A server a run would refuse: the check it failed, its words, and the fault's
    cause and kind (what a run would do with it: :mod:`hsx_async.run.servers.faults`)."""
    if found.claim is not None:
        return  # judged once every server was heard from (_report_claims)
    fault = found.fault
    assert fault is not None
    check = {"unreachable": "server", "identity": "identity"}.get(fault.kind, "dump path")
    report.add("FAIL", check, f"{fault.reason} [{fault.cause} fault: {fault.kind}]")


def _report_claims(report: Report, examination: Admission) -> None:
    """The servers that disagree with the config: the config's fault when every server was
    heard from and they all say the same, else theirs (the rule of ``hsx run``)."""
    error, faults = examination.config_fault()
    if error is not None:
        report.add("FAIL", "config", str(error))
    for text in faults:
        report.add("FAIL", "server", text)


def draft_ids_line(info: object, aux_layers: tuple[int, ...]) -> tuple[str, str, str]:
    """The drafter-config ids for the served model's family (from its ``config.json``,
    found through ``/get_model_info``'s ``model_path``), or what is missing to know them."""
    path = info.get("model_path") if isinstance(info, dict) else None
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return (
            "INFO",
            "draft ids",
            f"model {path!r} has no config.json here: run hsx export with --model PATH to "
            "get the drafter's eagle_aux_hidden_state_layer_ids",
        )
    try:
        model_config = read_config(Path(path))
    except DatasetError as exc:
        return "WARN", "draft ids", str(exc)
    arch, layers = architecture_of(model_config), num_layers_of(model_config)
    if arch is None or layers is None:
        return "WARN", "draft ids", f"{path}/config.json names no architecture or layer count"
    ids = draft_ids(arch, aux_layers, layers)
    return ("INFO" if ids.ids is not None else "WARN"), "draft ids", ids.describe(aux_layers)


async def _server_rate(
    client: EngineClient,
    server: Server,
    config: Config,
    probe: list[npt.NDArray[np.int64]],
    report: Report,
) -> float:
    if not probe:
        return 0.0
    try:
        rate = await _probe_prefill(client, server, config, probe)
    except (RequestError, DumpError) as exc:
        report.add("WARN", "server", f"{server.display}: prefill probe failed: {exc}")
        return 0.0
    tokens = sum(len(ids) for ids in probe)
    report.add(
        "INFO",
        "server",
        f"{server.display}: prefill ~{rate:,.0f} tokens/s "
        f"({len(probe)} input samples, {tokens:,} tokens, sent at once)",
    )
    return rate


def estimate(tokens: int, rates: dict[str, float]) -> tuple[float, str] | None:
    """(seconds, the bound) from tokens/s of each part; None when nothing was measured."""
    measured = {name: rate for name, rate in rates.items() if rate > 0}
    if not measured or not tokens:
        return None
    bound = min(measured, key=lambda name: measured[name])
    return tokens / measured[bound], bound


def _report_estimate(
    report: Report, tokens: int, row_bytes: int, *, disk: float, client: float, servers: float
) -> tuple[float, str] | None:
    """Reports the job's time; returns the extraction rate (tokens/s, what bounds it)."""
    need = tokens * row_bytes
    rates = {"servers": servers, "disk": disk / row_bytes, "client": client / row_bytes}
    report.add(
        "INFO",
        "estimate",
        f"{tokens:,} tokens, {human_bytes(need)} to write; tokens/s: servers "
        f"{_rate_text(servers)}, disk {_rate_text(rates['disk'])} "
        f"({human_bytes(disk)}/s durable), client {_rate_text(rates['client'])} "
        f"({human_bytes(client)}/s read + hash of dumps)",
    )
    result = estimate(tokens, rates)
    if result is None:
        return None
    seconds, bound = result
    caveat = "" if servers > 0 else " (servers not measured: at least this)"
    report.add(
        "INFO", "estimate", f"~{eta_text(seconds)} for the job, bound by the {bound}{caveat}"
    )
    # Without the servers the rate is an upper bound of disk or client, not extraction's.
    return (rates[bound], bound) if servers > 0 else None


def _rate_text(rate: float) -> str:
    return f"~{rate:,.0f}" if rate > 0 else "not measured"


def run_checks(config: Config, spool: SpoolRates | None = None) -> Report:
    report = Report()
    report.add("OK", "config", f"{config.path}: valid")
    scan = check_input(config, report)
    check_metrics(config, report)
    row_bytes = config.dataset_bytes_per_token  # in the dataset's storage
    disk = check_output(config, report, scan.tokens * row_bytes)
    check_dump_root(config, report)
    try:
        client = check_dump_read(config.dump.root) if config.dump.root.is_dir() else 0.0
    except OSError:
        client = 0.0  # check_dump_root has said why
    if scan.finished:  # hsx run would contact no server and write nothing: no estimate
        report.add("INFO", "server", "not asked: with nothing left to extract, hsx run asks none")
        return report
    servers = asyncio.run(check_servers(config, report, scan.probe))
    measured = _report_estimate(
        report, scan.tokens, row_bytes, disk=disk, client=client, servers=servers
    )
    for line in spool_lines(config, samples=scan.samples, tokens=scan.tokens,
                            measured=measured, rates=spool or SpoolRates()):  # fmt: skip
        report.add(*line)
    return report
