"""Live reload (SIGHUP): re-read the config file and apply the keys that may change live
(:data:`hsx_async.config.LIVE_KEYS`); any other change is refused, the running config kept."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import Config, diff_config, load_config, redact_url
from hsx_async.errors import ConfigError
from hsx_async.logs import configure_logging
from hsx_async.run.pipeline.guard import DiskGuard
from hsx_async.run.pipeline.pipeline import Pipeline
from hsx_async.run.servers.pool import ServerPool

log = structlog.get_logger("hsx.reload")


async def reload_config(
    current: Config, *, pipeline: Pipeline, servers: ServerPool, guard: DiskGuard
) -> tuple[str, Config]:
    """("applied", the new config), or ("refused" | "invalid", ``current``)."""
    new = await _read(current.path)
    if new is None:
        return "invalid", current
    diff = diff_config(current, new)
    if diff.restart:
        log.error(
            "reload_refused",
            needs_restart=sorted(diff.restart),
            kept="the running config",
            fix="restart hsx to change these keys (progress is kept)",
        )
        return "refused", current
    pipeline.apply(new)
    await servers.apply(new.server)
    guard.reserve = new.output.disk_reserve
    if current.daemon.log_level != new.daemon.log_level:
        configure_logging(new.daemon.log_format, new.daemon.log_level)
    # daemon.drain_timeout and daemon.progress_interval are read where they are used.
    shown = {k: [_shown(k, a), _shown(k, b)] for k, (a, b) in diff.live.items()}
    log.info("config_reloaded", changed=shown)
    return "applied", new


async def _read(path: Path | None) -> Config | None:
    if path is None:
        log.error("reload_invalid", error="this run has no config file to re-read")
        return None
    try:
        return await asyncio.to_thread(load_config, path)
    except ConfigError as exc:
        log.error("reload_invalid", error=str(exc), kept="the running config")
        return None


def _shown(key: str, value: Any) -> str:
    if key == "server.urls":
        return ", ".join(redact_url(u) for u in value)
    return str(value)
