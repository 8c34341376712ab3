"""How much an engine's probe rows vary between batches (issue 38): the admission's probe
(:data:`~hsx_async.run.servers.probe.PROBE_IDS`) sent alone, then again while other prompts
are in flight (so it is prefilled in other batches), each dump read back as the admission
reads it (:func:`~hsx_async.run.fingerprint.fingerprint`) and compared with the first.
Used by the real-engine tiers (tests/real_sglang, tests/real_vllm)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from hsx_async.engines import EngineName
from hsx_async.protocol import Storage
from hsx_async.run.dumps.dump import prepare_namespace, remove_tree, validate_dump, wait_for_meta
from hsx_async.run.dumps.writer import check_sections
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.fingerprint import Fingerprint, fingerprint
from hsx_async.run.servers.pool import Server, ServerPool
from hsx_async.run.servers.probe import PROBE_IDS

ROUNDS = 3
BESIDE = 6  # prompts in flight beside each batched probe
TIMEOUT = 120.0


@dataclass(frozen=True)
class Spread:
    """Distances of probes to the first one: sent alone, and sent beside other prompts."""

    alone: list[float]
    batched: list[float]
    rows: Fingerprint  # the first probe's

    @property
    def worst(self) -> float:
        return max(self.alone + self.batched)


@dataclass(frozen=True)
class _Target:
    url: str
    engine: EngineName
    dump_root: Path
    hidden_size: int
    aux_layers: tuple[int, ...]
    storage: Storage


async def probe_spread(
    url: str,
    engine: EngineName,
    dump_root: Path,
    *,
    hidden_size: int,
    aux_layers: tuple[int, ...],
    storage: Storage,
    vocab: int = 1000,
) -> Spread:
    target = _Target(url, engine, dump_root, hidden_size, aux_layers, storage)
    pool = ServerPool([url], health_interval=1.0, unreachable_timeout=5.0, engines=[engine])
    ns_dir = prepare_namespace(dump_root, f"hsx-tolerance-{secrets.token_hex(4)}")
    rng = np.random.default_rng(0)
    try:
        async with aiohttp.ClientSession() as session:
            client = EngineClient(session, pool)
            server = pool.servers[0]
            first = await _probe(client, server, target, ns_dir, PROBE_IDS)
            alone = [first.distance(await _probe(client, server, target, ns_dir, PROBE_IDS))
                     for _ in range(ROUNDS)]  # fmt: skip
            batched = []
            for _ in range(ROUNDS):
                others = [rng.integers(3, vocab, size=int(n), dtype=np.int64)
                          for n in rng.integers(20, 120, size=BESIDE)]  # fmt: skip
                found = await asyncio.gather(
                    *(_probe(client, server, target, ns_dir, ids) for ids in others[:3]),
                    _probe(client, server, target, ns_dir, PROBE_IDS),
                    *(_probe(client, server, target, ns_dir, ids) for ids in others[3:]),
                )
                batched.append(first.distance(found[3]))
    finally:
        remove_tree(ns_dir)
    assert all(d is not None for d in alone + batched)
    return Spread([d for d in alone if d is not None], [d for d in batched if d is not None], first)


async def _probe(
    client: EngineClient, server: Server, target: _Target, ns_dir: Path, ids: np.ndarray
) -> Fingerprint:
    rid = f"tol-{secrets.token_hex(6)}"
    await client.generate(server, rid=rid, ns=ns_dir.name, input_ids=ids, timeout=TIMEOUT,
                          storage=target.storage)  # fmt: skip
    raw = await wait_for_meta(ns_dir / rid, TIMEOUT)
    dump = validate_dump(ns_dir / rid, raw, rid=rid, num_tokens=len(ids),
                         hidden_size=target.hidden_size, aux_layers=target.aux_layers,
                         storage=target.storage)  # fmt: skip
    check_sections(dump)
    try:
        return fingerprint(dump)
    finally:
        remove_tree(ns_dir / rid)
