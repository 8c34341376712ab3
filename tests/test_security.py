"""Security (issue 7). Threat model: request data (``ns``, ``rid``) is untrusted by the
servers; a server, or anyone who can write in the dump root, is untrusted by the client;
the output directory belongs to the operator. No path built from a request leaves the dump
root; the client never follows a link out of its namespace or its output directory, never
copies a file it did not validate, and never deletes outside what it owns; the HTTP
endpoints listen on loopback unless told otherwise; no credential is logged or recorded.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import structlog
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_async.cli import build_parser
from hsx_async.config import DaemonConfig
from hsx_async.dataset.layout import build_layout, data_relpath, sample_key
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.errors import DumpError, HsxError, NoServerError
from hsx_async.logs import configure_logging
from hsx_async.net import listen_address
from hsx_async.protocol import (
    DumpMeta,
    generate_body,
    part_name,
    row_bytes,
    valid_ns,
    valid_rid,
)
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.dumps.dump import Dump, prepare_namespace, sweep_namespace, validate_dump
from hsx_async.run.dumps.writer import FileWriter, WriteJob
from hsx_async.run.source import Sample
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part
from hsx_async.server.fake.server import running_fake_server
from hsx_async.server.hook_core import HookConfig, ReqView
from hsx_async.server.rows import BatchHidden
from tests.crash_driver import AUX, H, fake_options
from tests.e2e import make_config, shm_leftovers, write_samples
from tests.run.dumps.test_writer import write_one

RB = row_bytes(H, AUX)
# Names a hostile client might send as hsx_ns or rid: every one must be refused.
HOSTILE_NAMES = (
    "", ".", "..", "../x", "../../etc", "a/../../b", "a/b", "/", "/etc", "/etc/passwd",
    "/dev/shm/other", "a\x00b", "\x00", "x\n", "x\r", " x", "x ", "-x", "_x", ".hidden",
    "..\\..\\x", "a\\b", "%2e%2e%2fetc", "~root", "$HOME", "x" * 200, "ns:1", "a*b",
    "\u2215etc", "\uff0e\uff0e", "é", "x\t", "a|b", "a;b",
)  # fmt: skip
TOO_LONG_NS, TOO_LONG_RID = "n" * 65, "r" * 129


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


def test_hostile_names_are_invalid_and_the_limits_hold() -> None:
    for name in HOSTILE_NAMES:
        assert not valid_ns(name) and not valid_rid(name), repr(name)
    assert valid_ns("n" * 64) and not valid_ns(TOO_LONG_NS)
    assert valid_rid("r" * 128) and not valid_rid(TOO_LONG_RID)


# --- servers: no path from a request leaves the dump root -----------------------------------


def test_request_dir_fd_refuses_hostile_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for name in (*HOSTILE_NAMES, TOO_LONG_NS):
        with pytest.raises(DumpError), request_dir_fd(root, name, "r1"):
            pass
    for name in (*HOSTILE_NAMES, TOO_LONG_RID):
        with pytest.raises(DumpError), request_dir_fd(root, "ns", name):
            pass
    assert _tree(tmp_path) <= {"root"}  # at most the root itself was created


_NAME_CHARS = st.sampled_from("aZ09._-/\\\x00\n ~%:")
_NAMES = st.one_of(st.text(max_size=140), st.text(_NAME_CHARS, max_size=140))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ns=_NAMES, rid=_NAMES)
def test_request_dir_fd_stays_under_the_root_for_any_name(ns: str, rid: str) -> None:
    """Whatever the names: refused, or a plain directory exactly at ``<root>/<ns>/<rid>``,
    and nothing anywhere else."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root = base / "root"
        try:
            with request_dir_fd(root, ns, rid) as fd:
                write_part(fd, 0, 1, b"\0" * 8)
        except DumpError:
            assert not (valid_ns(ns) and valid_rid(rid))
            assert _tree(base) <= {"root"}
            return
        assert valid_ns(ns) and valid_rid(rid)
        assert _tree(base) == {"root", f"root/{ns}", f"root/{ns}/{rid}",
                               f"root/{ns}/{rid}/{part_name(0, 1)}"}  # fmt: skip


@pytest.mark.parametrize("where", ["ns", "ns/r1"])
def test_request_dir_fd_refuses_a_planted_link(where: str, tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (root / where).parent.mkdir(parents=True, exist_ok=True)
    (root / where).symlink_to(outside)
    with pytest.raises(DumpError, match="not a plain directory"), request_dir_fd(root, "ns", "r1"):
        pass
    assert _tree(outside) == set()


def _hostile_bodies() -> Iterator[dict[str, Any]]:
    for name in (*HOSTILE_NAMES, TOO_LONG_NS):
        yield generate_body("r1", name, [1, 2, 3])
    for name in (*HOSTILE_NAMES, TOO_LONG_RID):
        yield generate_body(name, "ns", [1, 2, 3])
    yield {"rid": ["../x"], "input_ids": [1], "sampling_params": {
        "max_new_tokens": 0, "custom_params": {"hsx_ns": {"..": 1}}}}  # fmt: skip


async def _post_all(url: str) -> list[int]:
    async with aiohttp.ClientSession() as session:
        statuses = []
        for body in _hostile_bodies():
            async with session.post(f"{url}/generate", data=orjson.dumps(body)) as resp:
                await resp.read()
                statuses.append(resp.status)
    return statuses


async def test_fake_server_refuses_hostile_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with running_fake_server(fake_options(root)) as fake:
        statuses = await _post_all(fake.url)
        assert fake.stats.hsx_requests == 0
    assert set(statuses) == {400}
    assert _tree(tmp_path) <= {"root"}


async def test_reference_server_refuses_hostile_names(tmp_path: Path) -> None:
    from hsx_async.server.reference.server import ReferenceOptions, running_reference_server

    root = tmp_path / "root"
    async with running_reference_server(ReferenceOptions(dump_root=root)) as server:
        statuses = await _post_all(server.url)
    assert set(statuses) == {400}
    assert _tree(tmp_path) <= {"root"}


def test_hook_refuses_hostile_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    dumper = PrefillDumper(HookConfig(dump_root=root, aux_layers=AUX, model="m", server="s"))
    reqs = [ReqView(rid="r1", ns=n, num_tokens=1, max_new_tokens=0, start=0, rows=1)
            for n in (*HOSTILE_NAMES, TOO_LONG_NS)]  # fmt: skip
    reqs += [ReqView(rid=n, ns="ns", num_tokens=1, max_new_tokens=0, start=0, rows=1)
             for n in (*HOSTILE_NAMES, TOO_LONG_RID)]  # fmt: skip
    rows = len(reqs)
    hidden = BatchHidden(
        aux=np.zeros((rows, len(AUX), H), dtype="<u2"),
        final=np.zeros((rows, H), dtype="<u2"),
        aux_layers=AUX,
    )
    report = dumper.dump_batch(reqs, lambda: hidden)
    assert report.parts == [] and report.committed == []
    assert len(report.rejects) == len(reqs)
    assert _tree(tmp_path) == set()


# --- the client and a hostile server (or a hostile neighbour in the dump root) -------------


SECRET = b"S3CR3T-BYTES!"


def _secret_file(path: Path, size: int) -> Path:
    path.write_bytes((SECRET * (size // len(SECRET) + 1))[:size])
    return path


# (rid dir, rid, tokens, a directory outside) -> the files it placed outside
Plant = Callable[[Path, str, int, Path], list[Path]]


def _meta(rid: str, tokens: int) -> DumpMeta:
    return DumpMeta(rid, tokens, H, AUX, ((0, tokens),), "evil", "evil")


def _plant_part_link(rid_dir: Path, rid: str, tokens: int, outside: Path) -> list[Path]:
    rid_dir.mkdir()
    target = _secret_file(outside / rid, tokens * RB)
    (rid_dir / part_name(0, tokens)).symlink_to(target)
    (rid_dir / "meta.json").write_bytes(_meta(rid, tokens).to_json())
    return [target]


def _plant_meta_link(rid_dir: Path, rid: str, tokens: int, outside: Path) -> list[Path]:
    rid_dir.mkdir()
    (rid_dir / part_name(0, tokens)).write_bytes(b"\0" * tokens * RB)
    target = outside / f"{rid}.json"
    target.write_bytes(_meta(rid, tokens).to_json())
    (rid_dir / "meta.json").symlink_to(target)
    return [target]


def _plant_rid_link(rid_dir: Path, rid: str, tokens: int, outside: Path) -> list[Path]:
    elsewhere = outside / rid
    elsewhere.mkdir()
    part = _secret_file(elsewhere / part_name(0, tokens), tokens * RB)
    (elsewhere / "meta.json").write_bytes(_meta(rid, tokens).to_json())
    rid_dir.symlink_to(elsewhere)
    return [part, elsewhere / "meta.json"]


def _plant_part_fifo(rid_dir: Path, rid: str, tokens: int, outside: Path) -> list[Path]:
    rid_dir.mkdir()
    os.mkfifo(rid_dir / part_name(0, tokens))  # opening it to copy would block forever
    (rid_dir / "meta.json").write_bytes(_meta(rid, tokens).to_json())
    return []


PLANTS: dict[str, tuple[Plant, str]] = {
    "part_link": (_plant_part_link, "not a regular file"),
    "meta_link": (_plant_meta_link, "link"),
    "rid_link": (_plant_rid_link, "link"),
    "part_fifo": (_plant_part_fifo, "not a regular file"),
}


@asynccontextmanager
async def hostile_server(
    root: Path, plant: Plant, outside: Path, placed: list[Path], rids: list[str]
) -> AsyncIterator[str]:
    """A server that answers correctly but leaves a booby-trapped dump (for every request,
    its admission probes too); ``rids`` gets each request's id."""

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        rid, ns = body["rid"], body["sampling_params"]["custom_params"]["hsx_ns"]
        tokens = len(body["input_ids"])
        rids.append(rid)
        placed.extend(await asyncio.to_thread(plant, root / ns / rid, rid, tokens, outside))
        meta = {"id": rid, "prompt_tokens": tokens, "cached_tokens": 0}
        return web.json_response({"text": "", "meta_info": meta})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", PLANTS)
async def test_client_refuses_booby_trapped_dumps(
    kind: str, tmp_path: Path, shm_root: Path
) -> None:
    """Links and FIFOs in a dump are never followed, copied or deleted through. A server
    whose every dump is booby-trapped is at fault, not the samples (issue 24): it is refused
    at its probe, so no sample is sent, charged or quarantined; the run ends with the
    reason (exit 3 at the CLI), the dataset holds no byte of the target, the target
    survives and the probe's dump is cleaned away."""
    plant, reason = PLANTS[kind]
    outside = tmp_path / "outside"
    outside.mkdir()
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8, seed=1)
    placed: list[Path] = []
    rids: list[str] = []
    async with hostile_server(shm_root, plant, outside, placed, rids) as url:
        config = make_config(tmp_path, samples.path, [url], shm_root,
                             workers={"max_attempts": 2}, dump={"timeout": 1.0},
                             server={"unreachable_timeout": 1.0})  # fmt: skip
        with pytest.raises(NoServerError, match=reason):
            async with asyncio.timeout(30):
                await Daemon(config).run()
    out = config.output.dir
    assert read_manifest(out) == [] and read_quarantine(out) == []
    assert rids and all("-probe-" in rid for rid in rids), rids  # no sample was sent
    for path in out.rglob("*"):
        assert not path.is_file() or SECRET not in path.read_bytes(), path
    assert placed or kind == "part_fifo"
    assert all(p.exists() for p in placed), "a link target was deleted"
    assert shm_leftovers(shm_root) == []


def _one_dump(root: Path, rid: str, tokens: int = 4) -> Dump:
    with request_dir_fd(root, "ns", rid) as fd:
        write_part(fd, 0, tokens, b"\0" * tokens * RB)
        write_meta(fd, _meta(rid, tokens))
    rid_dir = root / "ns" / rid
    meta = (rid_dir / "meta.json").read_bytes()
    return validate_dump(rid_dir, meta, rid=rid, num_tokens=tokens, hidden_size=H,
                         aux_layers=AUX)  # fmt: skip


def _job(dump: Dump, sample_id: str = "x") -> WriteJob:
    tokens = dump.meta.num_tokens
    sample = Sample(sample_id, 0, np.arange(tokens, dtype=np.int64), None)
    layout = build_layout(sample_id=sample_id, num_tokens=tokens, hidden_size=H,
                          aux_layers=AUX, has_loss_mask=False)  # fmt: skip
    return WriteJob(sample, dump, layout, data_relpath(sample_key(sample_id)), "s0-test")


def _writer(out: Path) -> FileWriter:
    return FileWriter(out, method="auto", fsync=False, row_bytes=RB)


def test_part_swapped_for_a_link_after_validation_is_not_copied(tmp_path: Path) -> None:
    dump = _one_dump(tmp_path / "root", "r1")
    part = dump.part_paths()[0]
    part.unlink()
    part.symlink_to(_secret_file(tmp_path / "secret", 4 * RB))
    with pytest.raises(DumpError):
        write_one(_writer(tmp_path / "out"), _job(dump))
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


def test_rid_dir_swapped_for_a_link_after_validation_is_not_copied(tmp_path: Path) -> None:
    dump = _one_dump(tmp_path / "root", "r1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _secret_file(elsewhere / part_name(0, 4), 4 * RB)
    shutil.rmtree(dump.path)
    dump.path.symlink_to(elsewhere)
    with pytest.raises(DumpError):
        write_one(_writer(tmp_path / "out"), _job(dump))


def test_namespace_planted_as_a_link_is_replaced_not_followed(tmp_path: Path) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    root.mkdir()
    (root / "hsx-w0").symlink_to(victim)
    ns_dir = prepare_namespace(root, "hsx-w0")
    assert ns_dir.is_dir() and not ns_dir.is_symlink()
    assert (victim / "keep.txt").read_text() == "precious"


def test_sweep_never_deletes_through_a_namespace_swapped_for_a_link(tmp_path: Path) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    ns_dir = prepare_namespace(root, "hsx-w0")
    ns_dir.rmdir()
    ns_dir.symlink_to(victim)
    sweep_namespace(ns_dir, keep=set())
    assert (victim / "keep.txt").read_text() == "precious"


def test_output_temp_name_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    dump = _one_dump(tmp_path / "root", "r1")
    job = _job(dump)
    out = tmp_path / "out"
    final = out / job.relpath
    final.parent.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    (final.parent / f".{final.name}.{job.tmp_tag}.tmp").symlink_to(target)
    with pytest.raises(HsxError):
        write_one(_writer(out), job)
    assert target.read_bytes() == b"untouched"
    assert not final.exists()


def test_output_final_name_planted_as_a_link_is_replaced(tmp_path: Path) -> None:
    dump = _one_dump(tmp_path / "root", "r1")
    job = _job(dump)
    out = tmp_path / "out"
    final = out / job.relpath
    final.parent.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    final.symlink_to(target)
    entry = write_one(_writer(out), job)
    assert target.read_bytes() == b"untouched"
    assert final.is_file() and not final.is_symlink()
    assert final.stat().st_size == entry.size


def test_output_bucket_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    dump = _one_dump(tmp_path / "root", "r1")
    job = _job(dump)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    bucket = (out / job.relpath).parent
    bucket.parent.mkdir(parents=True)
    bucket.symlink_to(elsewhere)
    with pytest.raises(HsxError):
        write_one(_writer(out), job)
    assert _tree(elsewhere) == set()


# --- listening and logging ----------------------------------------------------------------


def test_http_endpoints_listen_on_loopback_by_default() -> None:
    host, _ = listen_address(DaemonConfig().metrics_listen)
    assert host == "127.0.0.1"
    parser = build_parser()
    for command in ("fake-server", "reference-server"):
        args = parser.parse_args([command])
        assert args.host == "127.0.0.1", command


@contextmanager
def captured_logs() -> Iterator[io.StringIO]:
    """Every log line of the block, rendered as the daemon would write them."""
    stream = io.StringIO()
    configure_logging("json", "debug", stream=stream)
    try:
        yield stream
    finally:
        structlog.reset_defaults()


async def test_url_credentials_are_never_logged_or_recorded(tmp_path: Path, shm_root: Path) -> None:
    password = "pw-" + os.urandom(6).hex()
    samples = write_samples(tmp_path / "in.jsonl", 8, max_len=8, seed=2)
    options = fake_options(shm_root, fault_rate=0.5, faults=("http_500", "drop_before"), seed=3)
    with captured_logs() as logs:
        async with running_fake_server(options) as fake:
            url = fake.url.replace("http://", f"http://hsx:{password}@")
            config = make_config(tmp_path, samples.path, [url], shm_root,
                                 workers={"max_attempts": 1})  # fmt: skip
            daemon = Daemon(config)
            await daemon.run()
            status = orjson.dumps(daemon.status()).decode()
    assert password not in logs.getvalue()
    assert password not in status
    for path in config.output.dir.rglob("*"):
        assert not path.is_file() or password.encode() not in path.read_bytes(), path
