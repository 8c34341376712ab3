"""Helpers for end-to-end tests: sample files, configs and a dataset checker.

Shared by the pipeline, crash, fault and benchmark smoke tests.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import tomli_w
import torch
import xxhash
from safetensors.torch import load_file

from hsx_async.config import Config, config_from_dict
from hsx_async.dataset.layout import canonical_id, data_relpath, sample_key
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.pipeline.metrics import Totals
from hsx_async.server.fake.server import expected_hidden_states

BAD_LINES = (
    b"this is not json",
    b'{"id": "broken", "input_ids": []}',
    b'{"input_ids": [1, -2, 3]}',
    b'{"input_ids": [1, 2.5]}',
    b'{"input_ids": [1, 2], "loss_mask": [1]}',
    b'{"input_ids": [1, 2], "loss_mask": [1, 7]}',
    b"[1, 2, 3]",
    b'{"id": true, "input_ids": [1]}',
    b"\xff\xfe not utf-8",
    b"",
)


@dataclass(frozen=True)
class SampleSet:
    path: Path
    good: dict[str, dict[str, Any]]  # canonical id -> the sample's JSON object
    bad_lines: dict[int, bytes]  # line number -> raw line


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (every test server listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_samples(
    path: Path,
    n: int,
    *,
    seed: int = 0,
    max_len: int = 200,
    bad_every: int = 0,
    with_duplicates: bool = False,
) -> SampleSet:
    """``n`` good samples (ids ``s<i>``, some with loss masks), optionally interleaved with
    one bad line every ``bad_every`` lines and a duplicate of an earlier id."""
    rng = random.Random(seed)
    lines: list[bytes] = []
    good: dict[str, dict[str, Any]] = {}
    bad: dict[int, bytes] = {}
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            bad[len(lines)] = BAD_LINES[len(bad) % len(BAD_LINES)]
            lines.append(bad[len(lines)])
        length = rng.randint(1, max_len)
        obj: dict[str, Any] = {
            "id": f"s{i}",
            "input_ids": [rng.randrange(50_000) for _ in range(length)],
        }
        if i % 3 == 0:
            obj["loss_mask"] = [rng.randint(0, 1) for _ in range(length)]
        good[obj["id"]] = obj
        lines.append(orjson.dumps(obj))
    if with_duplicates and good:
        dup = orjson.dumps({"id": "s0", "input_ids": [1, 2, 3]})
        bad[len(lines)] = dup
        lines.append(dup)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return SampleSet(path, good, bad)


def make_config(
    tmp: Path,
    samples: Path,
    urls: list[str],
    dump_root: Path,
    *,
    hidden_size: int = 64,
    aux_layers: tuple[int, ...] = (1, 3, 5),
    **overrides: dict[str, Any],
) -> Config:
    """A small, fast config; ``overrides`` maps a section to keys replacing the defaults."""
    raw = config_raw(
        tmp, samples, urls, dump_root, hidden_size=hidden_size, aux_layers=aux_layers, **overrides
    )
    return config_from_dict(raw, base=tmp)


def write_config(tmp: Path, raw: dict[str, Any], name: str = "hsx.toml") -> Path:
    path = tmp / name
    path.write_text(tomli_w.dumps(raw))
    return path


def config_raw(
    tmp: Path,
    samples: Path,
    urls: list[str],
    dump_root: Path,
    *,
    hidden_size: int = 64,
    aux_layers: tuple[int, ...] = (1, 3, 5),
    **overrides: dict[str, Any],
) -> dict[str, Any]:
    """The raw dict behind :func:`make_config` (to write as TOML for subprocess runs)."""
    raw: dict[str, Any] = {
        "server": {
            "urls": urls,
            "request_timeout": 10.0,
            "health_interval": 0.05,
            "unreachable_timeout": 20.0,
        },
        "input": {"path": str(samples), "max_tokens": 4096},
        "output": {"dir": str(tmp / "out"), "disk_reserve": 0},
        "dump": {"root": str(dump_root), "timeout": 5.0, "shm_budget": "64MiB"},
        "model": {"hidden_size": hidden_size, "aux_layers": list(aux_layers)},
        "workers": {
            "concurrency": 4,
            "max_attempts": 8,
            "backoff_base": 0.001,
            "backoff_max": 0.01,
        },
        "writer": {"threads": 2, "queue_depth": 4},
        "daemon": {"drain_timeout": 10.0, "metrics_listen": ""},
    }
    for section, keys in overrides.items():
        raw.setdefault(section, {}).update(keys)
    return raw


def check_dataset(
    out: Path, samples: SampleSet, *, hidden_size: int, num_layers: int, expect_all: bool = True
) -> None:
    """Every good sample exactly once, bit-exact; every bad line quarantined; no strays."""
    manifest = read_manifest(out)
    quarantine = read_quarantine(out)
    ids = [canonical_id(e.id) for e in manifest]
    assert len(ids) == len(set(ids)), "a sample is in the manifest twice"
    q_ids = [canonical_id(q.own_id) for q in quarantine if q.own_id is not None]
    assert not set(ids) & set(q_ids), "a sample is both written and quarantined"
    assert len(q_ids) == len(set(q_ids)), "an id is quarantined twice"
    if expect_all:
        assert set(ids) == set(samples.good), (
            f"missing {sorted(set(samples.good) - set(ids))[:5]}, "
            f"quarantined: {[q for q in quarantine if q.id is not None][:3]}"
        )
        assert {q.line for q in quarantine} == set(samples.bad_lines)
    for entry in manifest:
        path = out / entry.path
        data = path.read_bytes()
        assert entry.path == data_relpath(sample_key(entry.id))
        assert len(data) == entry.size
        assert xxhash.xxh3_64_hexdigest(data) == entry.xxh3_64
        tensors = load_file(path)
        obj = samples.good[canonical_id(entry.id)]
        ids_arr = np.array(obj["input_ids"], dtype=np.int64)
        np.testing.assert_array_equal(tensors["input_ids"].numpy(), ids_arr)
        expected = expected_hidden_states(ids_arr, hidden_size, num_layers)
        hidden = tensors["hidden_states"]
        assert hidden.dtype == torch.bfloat16
        assert tuple(hidden.shape) == (len(ids_arr), num_layers, hidden_size)
        assert hidden.view(torch.int16).numpy().tobytes() == expected.tobytes(), entry.id
        if "loss_mask" in obj:
            np.testing.assert_array_equal(tensors["loss_mask"].numpy(), np.array(obj["loss_mask"]))
        else:
            assert "loss_mask" not in tensors
    named = {e.path for e in manifest}
    on_disk = {str(p.relative_to(out)) for p in (out / "data").rglob("*") if p.is_file()}
    assert on_disk == named, f"stray files: {sorted(on_disk - named)[:5]}"


def shm_leftovers(root: Path) -> list[str]:
    """Files or directories left under a dump root (namespace dirs included)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def after_done(daemon: Daemon, n: int, action: Callable[[], None]) -> None:
    """Run ``action`` once, right after the ``n``-th sample became durable."""
    fired = False

    def check(totals: Totals) -> None:
        nonlocal fired
        if not fired and totals.samples_done >= n:
            fired = True
            action()

    daemon.metrics.on_sample_done.append(check)


def when_done(daemon: Daemon, n: int) -> asyncio.Event:
    """An event set once ``n`` samples are durable."""
    event = asyncio.Event()
    after_done(daemon, n, event.set)
    return event
