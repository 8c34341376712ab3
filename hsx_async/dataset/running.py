"""The runs going on in an output directory, and where each answers ``/status``.

While ``hsx run`` serves ``/status`` it keeps ``.hsx-running-<shard>.json`` (its URL and
pid) in the output directory, under its shard lock; ``hsx status OUT`` reads the rate and
the ETA from there (issue 26: it showed counts only). A file whose shard lock no process
holds is a killed run's, and is ignored.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.durable import is_locked, write_atomic
from hsx_async.dataset.provenance import shard_lock_path

_FILE = re.compile(r"\.hsx-running-([0-9]+)\.json")
_TIMEOUT_S = 2.0
_MAX_BODY = 1 << 20  # a /status answer is a few KB
# No proxy from the environment: the URL is the run's own listen address (loopback).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def running_file(out_dir: Path, shard_index: int) -> Path:
    return out_dir / f".hsx-running-{shard_index}.json"


def announce(out_dir: Path, shard_index: int, shard_count: int, url: str) -> None:
    """Say where this run's ``/status`` answers (called once it is bound)."""
    record = {"url": url, "pid": os.getpid(), "shard": f"{shard_index}/{shard_count}"}
    write_atomic(running_file(out_dir, shard_index), orjson.dumps(record) + b"\n")


def withdraw(out_dir: Path, shard_index: int) -> None:
    running_file(out_dir, shard_index).unlink(missing_ok=True)


@dataclass(frozen=True)
class Running:
    shard: str
    url: str
    status: dict[str, Any] | None  # the /status object, None when it did not answer
    error: str = ""


def running_runs(out_dir: Path) -> list[Running]:
    """Every run holding a shard of ``out_dir`` now that said where it answers."""
    found = []
    for path in sorted(out_dir.glob(".hsx-running-*.json")):
        match = _FILE.fullmatch(path.name)
        if match is None or not is_locked(shard_lock_path(out_dir, int(match[1]))):
            continue
        try:
            record = orjson.loads(path.read_bytes())
            url, shard = str(record["url"]), str(record["shard"])
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
            continue
        found.append(_ask(shard, url))
    return found


def _ask(shard: str, url: str) -> Running:
    try:
        with _OPENER.open(f"{url}/status", timeout=_TIMEOUT_S) as answer:
            body = answer.read(_MAX_BODY + 1)
        if len(body) > _MAX_BODY:
            return Running(shard, url, None, "its /status answer is over 1 MiB")
        status = orjson.loads(body)
    except (OSError, urllib.error.URLError, orjson.JSONDecodeError) as exc:
        return Running(shard, url, None, f"{url}/status did not answer: {exc}")
    if not isinstance(status, dict):
        return Running(shard, url, None, f"{url}/status answered no JSON object")
    return Running(shard, url, status)
