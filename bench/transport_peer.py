"""One side of a transport measured by ``bench/transport.py``, in a process of its own.

Roles (each prints one JSON line with the bytes it moved and its own CPU seconds over the
transfer window alone, from ``getrusage``; start-up and imports are outside the window):

- ``local FILE...``: read each file into a reused buffer and XXH3 it — what a reader on
  the node that holds the dataset, or on a shared file system from its page cache, pays
  to have the bytes verified in memory.
- ``http URL ENTRIES_JSON``: ``hsx serve``'s reader (``RemoteSource.fetch``): each file
  over HTTP into the private tmpfs directory, checked against its manifest hash.
- ``mc-serve FILE...`` (in a Python with ``mooncake-transfer-engine-non-cuda``): load every
  file into one registered buffer (that load is the producer's cost: Mooncake moves memory,
  not files), print the port and addresses, serve until stdin closes.
- ``mc-read PORT JSON``: Mooncake's TCP transport on 127.0.0.1, ``transfer_sync_read`` of
  each file's bytes into a registered local buffer, then XXH3 of it.
"""

from __future__ import annotations

import json
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Any


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def report(nbytes: int, wall: float, cpu_s: float, **extra: Any) -> None:
    print(json.dumps({"bytes": nbytes, "wall_s": wall, "cpu_s": cpu_s, **extra}), flush=True)


def local(files: list[str]) -> None:
    import xxhash

    buf = bytearray(8 << 20)
    view = memoryview(buf)
    t0, c0, total = time.perf_counter(), cpu(), 0
    for name in files:
        hasher = xxhash.xxh3_64()
        with open(name, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                hasher.update(view[:n])
                total += n
        hasher.hexdigest()
    report(total, time.perf_counter() - t0, cpu() - c0)


def http(url: str, entries_json: str) -> None:
    from hsx_async.dataset.live.remote import RemoteSource
    from hsx_async.dataset.manifest import manifest_entry

    entries = [manifest_entry(rec, "bench") for rec in json.loads(Path(entries_json).read_bytes())]
    source = RemoteSource(url, "bench")
    owner = secrets.token_hex(8)
    rank = int(Path(entries_json).stem.rsplit("-", 1)[1])  # entries-<i>.json: one rank a peer
    # Files go only to the owner of their lease (PROTOCOL 6): this peer leases as many
    # samples as its listing names (the bench's samples are all one size), fetches them,
    # and gives them back for the next round.
    t0, c0, total = time.perf_counter(), cpu(), 0
    leased: list[Any] = []
    while len(leased) < len(entries):
        got = source.lease(owner, rank, 0, len(entries) - len(leased)).entries
        assert got, f"hsx serve leased {len(leased)} samples, the listing names {len(entries)}"
        leased += got
    for entry in leased:
        path, _ = source.fetch(owner, 0, entry)
        total += path.stat().st_size
        path.unlink()
    report(total, time.perf_counter() - t0, cpu() - c0)
    source.release(owner, 0, [str(e.id) for e in leased])
    source.close()


def _engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    return engine


def mc_serve(files: list[str]) -> None:
    import numpy as np

    sizes = [Path(f).stat().st_size for f in files]
    engine = _engine()
    buf = np.empty(sum(sizes), dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("mooncake: register_memory failed")
    t0, c0, offsets, at = time.perf_counter(), cpu(), [], 0
    for name, size in zip(files, sizes, strict=True):
        with open(name, "rb", buffering=0) as fh:
            fh.readinto(buf.data[at : at + size])
        offsets.append([buf.ctypes.data + at, size])
        at += size
    load = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0}
    print(json.dumps({"port": engine.get_rpc_port(), "regions": offsets, "load": load}), flush=True)
    c1 = cpu()
    sys.stdin.read()  # until the bench closes our stdin
    print(json.dumps({"serve_cpu_s": cpu() - c1}), flush=True)


def mc_read(port: str, regions_json: str) -> None:
    import numpy as np
    import xxhash

    regions = json.loads(regions_json)
    engine = _engine()
    largest = max(size for _, size in regions)
    buf = np.empty(largest, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("mooncake: register_memory failed")
    t0, c0, total = time.perf_counter(), cpu(), 0
    for addr, size in regions:
        if engine.transfer_sync_read(f"127.0.0.1:{port}", buf.ctypes.data, addr, size) != 0:
            raise SystemExit("mooncake: transfer_sync_read failed")
        xxhash.xxh3_64(buf.data[:size]).hexdigest()
        total += size
    report(total, time.perf_counter() - t0, cpu() - c0)


def main() -> None:
    role, args = sys.argv[1], sys.argv[2:]
    {"local": lambda: local(args), "http": lambda: http(*args),
     "mc-serve": lambda: mc_serve(args), "mc-read": lambda: mc_read(*args)}[role]()  # fmt: skip


if __name__ == "__main__":
    main()
