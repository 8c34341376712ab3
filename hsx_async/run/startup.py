"""What a run does before its first request: check and record provenance, resume from the
manifest (checking its tail, deleting orphans), open the logs, wait for a server."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import structlog

from hsx_async.config import Config, flatten_public, redact_url
from hsx_async.dataset.manifest import MANIFEST, QUARANTINE, AppendLog, DoneSet, load_done, log_name
from hsx_async.dataset.provenance import (
    Provenance,
    check_and_record,
    check_shard_layout,
    directory_lock,
    parse_final_norm,
    read_provenance,
    remove_stale_temps,
)
from hsx_async.errors import HsxError
from hsx_async.run.client import SGLangClient
from hsx_async.run.notify import Notifier
from hsx_async.run.resume import check_entries, clean_orphans
from hsx_async.run.source import fingerprint_input

log = structlog.get_logger("hsx.startup")


def provenance_for(
    config: Config,
    input_fp: dict[str, Any],
    model: str = "",
    server: str = "",
    final_norm: dict[str, Any] | None = None,
) -> Provenance:
    """The record of this job: what the dataset layer needs, taken from the job's config
    (the dataset layer never sees the config type)."""
    return Provenance(
        input=input_fp,
        hidden_size=config.model.hidden_size,
        aux_layers=list(config.model.aux_layers),
        config=flatten_public(config),
        model=model,
        server=server,
        final_norm=final_norm,
        storage=config.storage,
    )


def prepare_output(
    config: Config, stack: contextlib.ExitStack, *, allow_provenance_change: bool
) -> tuple[DoneSet, AppendLog, AppendLog]:
    """Blocking. Under the directory lock: the shard layout is checked, provenance recorded
    and this run's logs created (so a run starting next sees them), then the directory is
    made to agree with its manifests (resume). The logs close with ``stack``."""
    out, shard = config.output.dir, config.shard
    old = read_provenance(out)
    recorded = old.get("input", {}).get("bytes") if old else None
    input_fp = fingerprint_input(
        config.input.path, prefix=recorded if type(recorded) is int else None
    )
    record = provenance_for(config, input_fp)
    with directory_lock(out):
        remove_stale_temps(out)
        check_shard_layout(out, shard.count)
        check_and_record(out, record, allow_change=allow_provenance_change)
        manifest = AppendLog(out / log_name(MANIFEST, shard.index, shard.count))
        stack.callback(manifest.close)
        quarantine = AppendLog(out / log_name(QUARANTINE, shard.index, shard.count))
        stack.callback(quarantine.close)
        done = load_done(out)
        check_entries(out, done.manifest)
        clean_orphans(out, done.manifest, shard)
    return done, manifest, quarantine


async def wait_for_server(client: SGLangClient, config: Config, notifier: Notifier) -> None:
    """Probe every server; wait (saying so) until one is healthy, or NoServerError."""
    pool = client.pool
    await client.probe_all()
    if not pool.healthy():
        urls = [redact_url(u) for u in config.server.urls]
        notifier.status("waiting for a server: " + ", ".join(urls))
        log.warning("waiting_for_server", urls=urls, timeout_s=config.server.unreachable_timeout)
    # Probe while waiting: a server still loading its model (a Slurm task's own server
    # starting beside hsx) comes into rotation as soon as /health answers.
    prober = asyncio.create_task(client.probe_forever(), name="hsx-first-probe")
    try:
        await pool.wait_healthy()
    finally:
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober


async def record_server(
    client: SGLangClient, config: Config, *, allow_provenance_change: bool
) -> None:
    """Put the served model and server version into provenance; refuse another model."""
    server = client.pool.healthy()[0]
    model = version = ""
    final_norm = None
    engine = server.engine
    with contextlib.suppress(HsxError, aiohttp.ClientError, TimeoutError, ValueError):
        info = await client.get_json(server.url, engine.model_info_path)
        model = engine.model_of(info)
        final_norm = parse_final_norm(
            info.get("hsx_final_norm") if isinstance(info, dict) else None
        )
    with contextlib.suppress(HsxError, aiohttp.ClientError, TimeoutError, ValueError):
        info = await client.get_json(server.url, engine.version_path)
        version = str(info.get("version", "")) if isinstance(info, dict) else ""
    if not model:
        return
    out = config.output.dir
    old = await asyncio.to_thread(read_provenance, out) or {}
    record = provenance_for(config, old.get("input", {}), model, version, final_norm)
    await asyncio.to_thread(check_and_record, out, record, allow_change=allow_provenance_change)
