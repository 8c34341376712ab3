"""Throughput: hsx end to end against the raw limit of the same bytes, in one run.

    python bench/throughput.py            # ~5 GB a round, 3 rounds: ~8 minutes here
    python bench/throughput.py --smoke    # tiny, checks the script runs (CI)

Workload: hidden 7168, 3 aux layers + the final state (57,344 bytes per token), prompt
lengths from a log-normal of mean 2,350 tokens clipped to 32k. Phases, in this order:

1. **raw**: the dumps' bytes are written once to /dev/shm (one directory per sample, parts
   of at most 16,384 rows like chunked prefill), then copied to the disk, one file per
   sample, fsync each, 1 and 2 streams: ``sendfile``; ``O_DIRECT`` writes from an mmap of
   the part; and ``O_DIRECT`` writes from a huge-page buffer the part is read into (what
   hsx's writer does, without the header, hash and rename). The best is the raw limit.
2. **hsx, prefab server**: the same directories are handed to hsx by a server that does no
   work (it renames a prepared dump into ``<root>/<ns>/<rid>/`` and commits it), so the
   server is not the bottleneck and hsx copies exactly the bytes of phase 1.
   Phases 1 and 2 run ``--repeat`` rounds in turn (default 3; the bytes are written afresh
   for each) and each figure is the median round: the virtual disk's speed drifts by
   ±15% from minute to minute. hsx's place in the round rotates (first, middle, last), so
   the after-effects of one phase on the disk (write-back, discards of the output just
   deleted) fall on every method alike.
3. **paired**: ``--pairs`` short rounds (``--pair-gb`` each, a fresh draw of lengths per
   round), each the raw copy with fsync (read + O_DIRECT, 2 streams; ``--pair-method``
   picks another) and hsx (prefab server) back to back on the same bytes, their order
   alternating; the figure is the median of the per-round ratios. Two neighbours a few
   seconds apart see the same disk, so this ratio is steadier than one of medians taken
   minutes apart.
4. **fake server alone**: ``hsx fake-server`` drained by a null client (no copy): what the
   fake server can produce on this machine.
5. **hsx, fake server**: the real end to end, fake server and hsx sharing the cores.
6. **memory**: peak RSS of hsx with 1k-token and with 32k-token samples (prefab server),
   and of a run with no samples (the fixed cost of the process).

Client CPU and peak RSS are the ``hsx run`` process's own (wait4), start-up included.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import mmap
import os
import queue
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    GB,
    PYTHON,
    REPO,
    ClientRun,
    Model,
    Scratch,
    ServerProcess,
    apply_common,
    client_config,
    common_args,
    drop_caches,
    fake_server_argv,
    fake_server_drained,
    length_stats,
    lognormal_lengths,
    machine_info,
    mount_text,
    print_table,
    pyplot,
    remove,
    run_hsx,
    save_results,
    scratch,
    self_cpu_s,
    usage_dict,
    warm_up,
    write_samples,
)

from hsx_async.protocol import part_name, row_bytes

ALIGN = 4096
CHUNK = 8 << 20
PHASES = ("raw", "prefab", "paired", "nofsync", "fake", "memory")
PAIRED_METHOD = "read + O_DIRECT, huge-page buffer"  # the best raw copy from /dev/shm here
NAN = float("nan")  # a figure a client does not report (an older checkout: no cpu_s)
PART_ROWS = 16384  # the fake server's default max_batch_tokens: a long prompt's part size
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@dataclass(frozen=True)
class Prefab:
    """A dump prepared in /dev/shm: its directory and its parts (path, bytes) in row order."""

    tokens: int
    path: Path
    parts: tuple[tuple[Path, int], ...]

    @property
    def size(self) -> int:
        return sum(s for _, s in self.parts)


# -- the bytes ------------------------------------------------------------------------------


def make_prefabs(root: Path, lengths: Sequence[int], model: Model) -> list[Prefab]:
    """One directory ``<i>-<tokens>`` per sample holding its parts (random bytes)."""
    block = memoryview(np.random.default_rng(7).bytes(64 << 20))
    root.mkdir(parents=True, exist_ok=True)
    prefabs = []
    offset = 0
    for i, n in enumerate(lengths):
        d = root / f"{i:05d}-{n}"
        d.mkdir()
        parts = []
        for start in range(0, n, PART_ROWS):
            end = min(n, start + PART_ROWS)
            path, size = d / part_name(start, end), (end - start) * model.row_bytes
            offset = _fill(path, size, block, offset)
            parts.append((path, size))
        prefabs.append(Prefab(n, d, tuple(parts)))
    return prefabs


def _fill(path: Path, size: int, block: memoryview, offset: int) -> int:
    fd = os.open(path, _NEW, 0o644)
    try:
        left = size
        while left:
            offset %= len(block)
            n = os.write(fd, block[offset : offset + min(left, len(block) - offset)])
            left, offset = left - n, offset + n + 4160  # shift: files do not share content
    finally:
        os.close(fd)
    return offset


# -- phase 1: the raw limit -----------------------------------------------------------------


def copy_sendfile(parts: Sequence[tuple[Path, int]], dst: Path, sync: bool) -> None:
    fd = os.open(dst, _NEW, 0o644)
    try:
        for path, size in parts:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                done = 0
                while done < size:
                    done += os.sendfile(fd, src, done, size - done)
            finally:
                os.close(src)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def copy_direct(parts: Sequence[tuple[Path, int]], dst: Path, sync: bool) -> None:
    """O_DIRECT writes straight from an mmap of each tmpfs part (sizes here are whole
    pages: 57,344 bytes per token), in 8 MiB steps."""
    fd = os.open(dst, _NEW | os.O_DIRECT, 0o644)
    try:
        for path, size in parts:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                with mmap.mmap(src, size, prot=mmap.PROT_READ) as mm, memoryview(mm) as view:
                    for off in range(0, size, CHUNK):
                        with view[off : off + CHUNK] as chunk:
                            _write_all(fd, chunk)
            finally:
                os.close(src)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


# The raw copy's buffers: made and touched once, reused by every copy of the run, as a
# long-running copier would (the first touch of fresh memory costs ~2.3 CPU-s/GB on this
# VM, PERF-NOTES: made per copy, it would slow the raw copy of each short pair).
_raw_buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()


def _raw_buffer() -> mmap.mmap:
    try:
        return _raw_buffers.get_nowait()
    except queue.Empty:
        buf = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, CHUNK, mmap.PAGESIZE):
            buf[offset] = 0
        return buf


def copy_read_direct(parts: Sequence[tuple[Path, int]], dst: Path, sync: bool) -> None:
    """Each 8 MiB of a part read into a private buffer on transparent huge pages, then
    written with O_DIRECT: one memory copy, and the device gets 2 MiB segments."""
    buf = _raw_buffer()
    try:
        _copy_read_direct(parts, dst, sync, buf)
    finally:
        _raw_buffers.put(buf)


def _copy_read_direct(
    parts: Sequence[tuple[Path, int]], dst: Path, sync: bool, buf: mmap.mmap
) -> None:
    fd = os.open(dst, _NEW | os.O_DIRECT, 0o644)
    try:
        with memoryview(buf) as whole:
            for path, size in parts:
                src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    for off in range(0, size, CHUNK):
                        with whole[: min(CHUNK, size - off)] as block:
                            os.preadv(src, [block], off)
                            _write_all(fd, block)
                finally:
                    os.close(src)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        with view[done:] as rest:
            done += os.write(fd, rest)


COPIES: dict[str, Callable[[Sequence[tuple[Path, int]], Path, bool], None]] = {
    "sendfile": copy_sendfile,
    "O_DIRECT from mmap": copy_direct,
    "read + O_DIRECT, huge-page buffer": copy_read_direct,
}


def raw_copy(
    prefabs: Sequence[Prefab],
    dest: Path,
    method: str,
    threads: int,
    *,
    named: bool = False,
    sync: bool = True,
) -> dict[str, Any]:
    """Copy every prefab to ``dest`` with ``threads`` streams. ``named``: like hsx, write
    under a temporary name, fsync, rename, fsync the directory, so that the file's name is
    as durable as its bytes (PROTOCOL §4); otherwise fsync the file only, or nothing when
    not ``sync`` (a diagnostic: the device's write cache then absorbs the bytes)."""
    copy = COPIES[method]
    dest.mkdir()
    drop_caches()

    def one(p: Prefab) -> None:
        final = dest / f"{p.path.name}.bin"
        if not named:
            copy(p.parts, final, sync)
            return
        tmp = dest / f".{final.name}.tmp"
        copy(p.parts, tmp, sync)
        tmp.rename(final)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    cpu0, t0 = self_cpu_s(), _now()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, prefabs))
    wall, cpu = _now() - t0, self_cpu_s() - cpu0
    moved = sum(p.size for p in prefabs)
    remove(dest)
    drop_caches()
    suffix = ", + rename + fsync dir" if named else ("" if sync else ", no fsync")
    return {
        "name": f"raw {method} ×{threads}{suffix}",
        "method": method,
        "threads": threads,
        "named": named,
        "sync": sync,
        "bytes": moved,
        "seconds": wall,
        "gb_per_s": moved / wall / GB,
        "cpu_s": cpu,
        "cpu_s_per_gb": cpu / (moved / GB),
    }


def _now() -> float:
    import time

    return time.monotonic()


# -- the prefab server ----------------------------------------------------------------------


def serve_prefab(args: argparse.Namespace) -> int:
    """``throughput.py serve-prefab``: answers each request with a prepared dump of the
    same length, moved into place by one rename; no content is produced or copied."""
    import uvloop
    from aiohttp import web

    # What the handlers import, imported before the server listens: a real server is warm,
    # and a first import at hsx's admission probe (~15 ms) fell into its measured run.
    import hsx_async.server.dumpwrite  # noqa: F401

    index: dict[int, list[Path]] = defaultdict(list)
    for d in sorted(Path(args.prefab).iterdir(), reverse=True):
        index[int(d.name.split("-")[1])].append(d)
    model = Model(args.hidden_size, tuple(args.aux_layers))
    handler = _prefab_handler(index, Path(args.dump_root), model)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/generate", handler)
    app.router.add_get("/health", _health)
    uvloop.run(_serve(app))
    return 0


async def _health(_: Any) -> Any:
    from aiohttp import web

    return web.Response(status=200)


def _prefab_handler(index: dict[int, list[Path]], root: Path, model: Model) -> Any:
    import orjson
    from aiohttp import web

    from hsx_async.protocol import valid_ns, valid_rid
    from hsx_async.server.front import generate_response

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid, n = body.get("rid"), len(body["input_ids"])
        ns = body["sampling_params"]["custom_params"]["hsx_ns"]
        if not (valid_ns(ns) and valid_rid(rid)):
            return web.Response(status=400, text="bad ns or rid")
        dest = root / ns / rid
        if not index.get(n) and n <= _PROBE_TOKENS:
            # hsx's admission probe (a few tokens, before any sample): a zero dump.
            await asyncio.to_thread(_write_probe, dest, n=n, model=model)
        elif not index.get(n):
            return web.Response(status=500, text=f"no prepared dump of {n} tokens left")
        else:
            await asyncio.to_thread(_publish, index[n].pop(), dest, n=n, model=model)
        answer = orjson.dumps(generate_response(rid, n))
        return web.Response(body=answer, content_type="application/json")

    return generate


_PROBE_TOKENS = 16  # a request this short, of no prepared length, is hsx's probe


def _write_probe(dest: Path, *, n: int, model: Model) -> None:
    from hsx_async.protocol import DumpMeta
    from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part

    meta = DumpMeta(dest.name, n, model.hidden_size, model.aux_layers, ((0, n),), "prefab",
                    "bench-prefab")  # fmt: skip
    with request_dir_fd(dest.parent.parent, dest.parent.name, dest.name) as dir_fd:
        write_part(dir_fd, 0, n, bytes(n * meta.row_bytes))
        write_meta(dir_fd, meta)


def _publish(src: Path, dest: Path, *, n: int, model: Model) -> None:
    from hsx_async.protocol import DumpMeta, parse_part_name
    from hsx_async.server.dumpwrite import request_dir_fd, write_meta

    src.rename(dest)  # same tmpfs: the whole dump appears at once, meta.json last
    spans = sorted(s for s in (parse_part_name(p.name) for p in dest.iterdir()) if s)
    meta = DumpMeta(
        rid=dest.name,
        num_tokens=n,
        hidden_size=model.hidden_size,
        aux_layers=model.aux_layers,
        parts=tuple(spans),
        model="prefab",
        server="bench-prefab",
    )
    with request_dir_fd(dest.parent.parent, dest.parent.name, dest.name) as dir_fd:
        write_meta(dir_fd, meta)


async def _serve(app: Any) -> None:
    import signal

    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"bench prefab server listening on http://127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def prefab_server(prefab: Path, dump_root: Path, model: Model, log: Path) -> ServerProcess:
    argv = [
        PYTHON, str(Path(__file__).resolve()), "serve-prefab",
        "--prefab", str(prefab), "--dump-root", str(dump_root),
        "--hidden-size", str(model.hidden_size),
        "--aux-layers", *map(str, model.aux_layers),
    ]  # fmt: skip
    return ServerProcess(argv, log)


# -- phases 2-5: hsx ------------------------------------------------------------------------


@dataclass
class Ctx:
    args: argparse.Namespace
    s: Scratch
    model: Model
    dump_root: Path


def client_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Config sections changed from the defaults by the command line."""
    out: dict[str, dict[str, Any]] = {}
    if args.writer_threads:
        out["writer"] = {"threads": args.writer_threads}
    if args.concurrency:
        out["workers"] = {"concurrency": args.concurrency}
    return out


def hsx_row(name: str, run: ClientRun, server_cpu: float | None = None) -> dict[str, Any]:
    u = run.usage
    gb = run.gb
    return {
        "name": name,
        "samples": run.done,
        "tokens": run.tokens,
        "bytes": run.bytes_on_disk,
        "seconds": run.run_s,
        "process_wall_s": u.wall_s,
        "gb_per_s": gb / run.run_s if run.run_s else 0.0,
        "gb_per_s_process": gb / u.wall_s,
        "tokens_per_s": run.tokens / run.run_s if run.run_s else 0.0,
        "cpu_s": u.cpu_s,
        "cpu_s_per_gb": u.cpu_s / gb if gb else float("nan"),
        # The copy alone: from the first server admitted (its probe is a fixed cost of
        # each run, like start-up), and the CPU hsx counts itself from its run's start.
        "copy_seconds": run.copy_s,
        "gb_per_s_copy": gb / run.copy_s if run.copy_s else NAN,
        "run_cpu_s": run.run_cpu_s,
        "cpu_s_per_gb_run": run.run_cpu_s / gb if gb and run.run_cpu_s is not None else NAN,
        "peak_rss_mb": u.peak_rss / 1e6,
        "peak_anon_mb": u.peak_anon / 1e6,
        "peak_shmem_mb": u.peak_shmem / 1e6,
        "server_cpu_s": server_cpu,
        "usage": usage_dict(u),
    }


def hsx_prefab(
    ctx: Ctx,
    name: str,
    lengths: Sequence[int],
    prefabs: Path | None,
    *,
    fsync: bool = True,
    src: Path = REPO,
) -> ClientRun:
    """hsx (the one in ``src``) over ``lengths`` served from ``prefabs`` (prepared before
    the call)."""
    s = ctx.s
    samples = s.work / f"{name}.jsonl"
    write_samples(samples, lengths, seed=len(lengths))
    prefab_dir = prefabs or s.fresh(f"{name}-prefab", on_shm=True)
    out = s.fresh(f"{name}-out")
    drop_caches()
    with prefab_server(prefab_dir, ctx.dump_root, ctx.model, s.work / f"{name}-server.log") as srv:
        raw = client_config(
            url=srv.url,
            samples=samples,
            out_dir=out,
            dump_root=ctx.dump_root,
            model=ctx.model,
            **client_overrides(ctx.args),
        )
        if not fsync:
            raw.setdefault("writer", {})["fsync"] = False
        run = run_hsx(raw, s.work, name, src=src)
    remove(out)
    remove(prefab_dir)
    if run.done != len(lengths):  # a figure over fewer bytes is no figure: stop here
        log = (s.work / f"{name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"hsx in {src} committed {run.done} of {len(lengths)} samples "
            f"({run.quarantined} quarantined); its log ends:\n{log}"
        )
    return run


def hsx_fake(ctx: Ctx, samples: Path) -> tuple[ClientRun, float]:
    s = ctx.s
    out = s.fresh("hsx-fake-out")
    drop_caches()
    argv = fake_server_argv(ctx.model, ctx.dump_root)
    with ServerProcess(argv, s.work / "fake-server.log") as srv:
        raw = client_config(
            url=srv.url,
            samples=samples,
            out_dir=out,
            dump_root=ctx.dump_root,
            model=ctx.model,
            **client_overrides(ctx.args),
        )
        run = run_hsx(raw, s.work, "hsx-fake")
        server_cpu = srv.cpu_s()
    remove(out)
    return run, server_cpu


def fake_alone(ctx: Ctx, lengths: Sequence[int], concurrency: int) -> dict[str, Any]:
    log = ctx.s.work / "fake-alone.log"
    seconds, tokens, cpu = fake_server_drained(ctx.model, ctx.dump_root, log, lengths, concurrency)
    moved = tokens * ctx.model.row_bytes
    return {
        "name": "fake server alone (null client)",
        "tokens": tokens,
        "bytes": moved,
        "seconds": seconds,
        "gb_per_s": moved / seconds / GB,
        "tokens_per_s": tokens / seconds,
        "server_cpu_s": cpu,
    }


# -- the run --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    common_args(p)
    p.add_argument("--gb", type=float, default=5.0, help="hidden-state bytes to move (GB)")
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--aux-layers", type=int, nargs="+", default=[2, 30, 58])
    p.add_argument("--mean-len", type=float, default=2350.0)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="rounds of raw copies and hsx")
    p.add_argument(
        "--writer-threads", type=int, help="hsx [writer].threads (default: the config default)"
    )
    p.add_argument("--concurrency", type=int, help="hsx [workers].concurrency (default: ditto)")
    p.add_argument("--pairs", type=int, help="paired rounds (raw copy, hsx); default 8 (smoke: 2)")
    p.add_argument("--pair-gb", type=float, default=1.5, help="GB moved by each of a pair")
    p.add_argument(
        "--pair-method", choices=sorted(COPIES), default=PAIRED_METHOD,
        help="the raw copy of each pair (default: the best from /dev/shm here)",
    )  # fmt: skip
    p.add_argument(
        "--compare-src", type=Path,
        help="paired phase: also run the hsx of this source tree in every pair (e.g. "
        "`git worktree add /tmp/hsx-before main`): a before/after measured in one run",
    )  # fmt: skip
    p.add_argument("--compare-name", default="hsx before", help="its name in the tables")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (default: all)",
    )
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phase {sorted(unknown)[0]!r}; known: {', '.join(PHASES)}")
    if args.smoke:
        args.gb, args.hidden_size, args.mean_len, args.max_len = 0.05, 512, 200.0, 2048
        args.repeat, args.pair_gb = 1, 0.02
    if args.pairs is None:
        args.pairs = 2 if args.smoke else 8
    return args


def memory_workloads(args: argparse.Namespace) -> dict[str, list[int]]:
    """Same bytes in 1k-token samples and in 32k-token samples (smoke: scaled down)."""
    small, large = (64, 1024) if args.smoke else (1024, 32768)
    n_large = 2  # the writer's two threads each on a long sample at once
    return {
        f"{small} tokens": [small] * (n_large * large // small),
        f"{large} tokens": [large] * n_large,
    }


def run_all(ctx: Ctx) -> dict[str, Any]:
    args, s, model = ctx.args, ctx.s, ctx.model
    lengths = lognormal_lengths(
        args.gb * GB, model.row_bytes, mean=args.mean_len, max_len=args.max_len, seed=args.seed
    )
    samples = s.work / "samples.jsonl"
    write_samples(samples, lengths, seed=args.seed)
    data: dict[str, Any] = {
        "workload": length_stats(lengths, model.row_bytes)
        | {"hidden_size": model.hidden_size, "aux_layers": list(model.aux_layers)},
        "raw": [],
        "hsx": [],
        "fake_alone": None,
        "memory": [],
        "nofsync": [],
        "paired": None,
    }
    if {"raw", "prefab"} & set(args.phases):
        raw_runs, hsx_runs = side_by_side(ctx, lengths)
        data["raw"] = [median_row(rows) for rows in raw_runs]
        data["hsx"] = [median_row(hsx_runs)] if hsx_runs else []
    if "paired" in args.phases:
        data["paired"] = paired_phase(ctx)
    if "nofsync" in args.phases:
        data["nofsync"] = no_fsync_phase(ctx, lengths)
    if "fake" in args.phases:
        data["fake_alone"] = fake_alone(ctx, lengths, concurrency=8)
        print_progress(data["fake_alone"])
        run, server_cpu = hsx_fake(ctx, samples)
        data["hsx"].append(hsx_row("hsx, fake server", run, server_cpu))
        print_progress(data["hsx"][-1])
    if "memory" in args.phases:
        data["memory"] = memory_phase(ctx)
    return data


def side_by_side(
    ctx: Ctx, lengths: Sequence[int]
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """``--repeat`` rounds of every raw copy then hsx (prefab server), on the same bytes:
    the disk's speed drifts (a virtual disk, shared), so each figure is a median of rounds
    taken in turn. hsx consumes the dumps: they are written afresh for each round."""
    args, s = ctx.args, ctx.s
    variants = raw_variants(args.smoke) if "raw" in args.phases else []
    raw_runs: list[list[dict[str, Any]]] = [[] for _ in variants]
    hsx_runs: list[dict[str, Any]] = []
    for round_ in range(args.repeat):
        prefab_dir = s.fresh(f"prefab-{round_}", on_shm=True)
        prefabs = make_prefabs(prefab_dir, lengths, ctx.model)
        # hsx's place in the round rotates (first, middle, last ...): whatever the disk
        # carries over from the phase before (write-back, discards of the deleted output)
        # falls on every method alike. hsx consumes the dumps, so it copies them last.
        hsx_at = round_ * (len(variants) + 1) // max(args.repeat, 1)
        for i, (runs, (method, threads, named)) in enumerate(zip(raw_runs, variants, strict=True)):
            if i == hsx_at and "prefab" in args.phases:
                hsx_runs.append(_hsx_round(ctx, round_, lengths, prefab_dir, prefabs))
            runs.append(raw_copy(prefabs, s.disk / "raw", method, threads, named=named))
            print_progress(runs[-1])
        if hsx_at >= len(variants) and "prefab" in args.phases:
            hsx_runs.append(_hsx_round(ctx, round_, lengths, prefab_dir, prefabs))
        remove(prefab_dir)
    return raw_runs, hsx_runs


def _hsx_round(
    ctx: Ctx, round_: int, lengths: Sequence[int], prefab_dir: Path, prefabs: list[Prefab]
) -> dict[str, Any]:
    """hsx over this round's dumps, which it consumes; they are written again after it
    for the raw copies still to come (same lengths, same bytes)."""
    run = hsx_prefab(ctx, f"hsx-prefab-{round_}", lengths, prefab_dir)  # removes the dir
    row = hsx_row("hsx, prefab server", run)
    print_progress(row)
    prefabs[:] = make_prefabs(prefab_dir, lengths, ctx.model)
    return row


@dataclass(frozen=True)
class Client:
    """One ``hsx`` measured in the paired phase: this checkout, or ``--compare-src``."""

    name: str
    src: Path


def pair_clients(args: argparse.Namespace) -> list[Client]:
    clients = [Client("hsx", REPO)]
    if args.compare_src is not None:
        clients.append(Client(args.compare_name, args.compare_src.resolve()))
    return clients


def pair_orders(members: int, pairs: int) -> list[tuple[int, ...]]:
    """The order of the members (0 = the raw copy) in each pair: every permutation next to
    its reverse, so that in each two pairs running one after the other each member comes
    before each other one once (a drift within a pair favours none); those with the raw
    copy in the middle first (each hsx right next to it)."""
    couples: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for perm in itertools.permutations(range(members)):
        if all(perm not in c for c in couples):
            couples.append((perm, perm[::-1]))
    couples.sort(key=lambda c: abs(c[0].index(0) - (members - 1) / 2))
    orders = [order for couple in couples for order in couple]
    return [orders[i % len(orders)] for i in range(pairs)]


def idle_cpu(ctx: Ctx, client: Client, tag: str) -> float:
    """The CPU of a run with no samples (imports, start-up, shutdown): what "net of
    start-up" takes off each run of that client."""
    run = hsx_prefab(ctx, f"idle-{tag}", [], None, src=client.src)
    return run.usage.cpu_s


def fixed_run_cpu(ctx: Ctx, client: Client, tag: str) -> float:
    """The CPU a run counts in itself (``run_finished``'s ``cpu_s``: imports and set-up
    excluded) for one tiny sample: what every run spends whatever its bytes (the admission
    probe, the threads' start, the first commit). Taken off the in-run CPU of each pair,
    it leaves the CPU per GB the copy itself costs."""
    run = hsx_prefab(ctx, f"fixed-{tag}", [_PROBE_TOKENS], None, src=client.src)
    return run.run_cpu_s if run.run_cpu_s is not None else NAN


def deletion_cpu(prefab_dir: Path) -> float:
    """CPU seconds this process spends deleting the dumps the raw copy read (what hsx does
    with every dump it consumed; the raw copy's own figures leave it out, as the issue's
    raw copy does): on 4 KiB tmpfs pages the kernel frees each page."""
    cpu0 = self_cpu_s()
    remove(prefab_dir)
    return self_cpu_s() - cpu0


def paired_phase(ctx: Ctx) -> dict[str, Any]:
    """Raw copy and hsx back to back on the same bytes, ``--pairs`` times, the order
    changing (so a drift within a pair favours each side alike): the median of the
    per-pair ratios is the figure. With ``--compare-src`` another checkout's hsx runs in
    every pair too (a before/after in one run). Each client's CPU net of start-up is its
    CPU less the median of its empty runs (one before the pairs, one after)."""
    args, s = ctx.args, ctx.s
    clients = pair_clients(args)
    idle: dict[str, list[float]] = {c.name: [idle_cpu(ctx, c, f"{k}-0")] for k, c in
                                    enumerate(clients)}  # fmt: skip
    fixed: dict[str, list[float]] = {c.name: [fixed_run_cpu(ctx, c, f"{k}-0")] for k, c in
                                     enumerate(clients)}  # fmt: skip
    streams = 1 if args.smoke else 2
    pairs = []
    for i, order in enumerate(pair_orders(len(clients) + 1, args.pairs)):
        lengths = lognormal_lengths(
            args.pair_gb * GB, ctx.model.row_bytes, mean=args.mean_len,
            max_len=args.max_len, seed=args.seed + 1000 + i,
        )  # fmt: skip
        prefab_dir = s.fresh(f"pair-{i}", on_shm=True)
        prefabs = make_prefabs(prefab_dir, lengths, ctx.model)
        load = os.getloadavg()[0]
        raw: dict[str, Any] = {}
        runs: dict[str, dict[str, Any]] = {}
        consumed = False  # hsx consumes the dumps: whoever follows gets them written again
        for member in order:
            if consumed:
                prefabs = make_prefabs(prefab_dir, lengths, ctx.model)
                consumed = False
            if member == 0:
                raw = raw_copy(prefabs, s.disk / "raw", args.pair_method, streams)
                raw["delete_cpu_s_per_gb"] = deletion_cpu(prefab_dir) / (raw["bytes"] / GB)
                consumed = True  # deleted, as hsx deletes each dump it consumed
                continue
            c = clients[member - 1]
            runs[c.name] = hsx_row(c.name, hsx_prefab(ctx, f"pair-{i}-{member}", lengths,
                                                      prefab_dir, src=c.src))  # fmt: skip
            consumed = True
        remove(prefab_dir)
        pairs.append(_pair_record(order, load, raw, runs, clients))
        print("  pair " + str(i + 1) + ": " + ", ".join(
            f"{name} {gbps:.3f} GB/s" for name, gbps in
            [("raw", raw["gb_per_s"]), *((n, r["gb_per_s"]) for n, r in runs.items())]
        ) + f"; ratio {pairs[-1]['ratio']:.2f} (load {load:.1f})", flush=True)  # fmt: skip
    for k, c in enumerate(clients):
        idle[c.name].append(idle_cpu(ctx, c, f"{k}-1"))
        fixed[c.name].append(fixed_run_cpu(ctx, c, f"{k}-1"))
    idle_s = {name: float(np.median(v)) for name, v in idle.items()}
    fixed_s = {name: float(np.median(v)) for name, v in fixed.items()}
    for p in pairs:
        for name, run in [("hsx", p), *p["others"].items()]:
            gb = run["bytes"] / GB
            run["hsx_cpu_s_per_gb_net"] = (run["hsx_cpu_s"] - idle_s[name]) / gb
            # In-run CPU less a one-sample run's: the copy's own cost per GB.
            per_gb = run["hsx_cpu_s_per_gb_run"] - fixed_s[name] / gb
            run["hsx_cpu_s_per_gb_copy"] = per_gb
            run["cpu_over_raw_copy"] = per_gb / p["raw_cpu_s_per_gb"]
            consumer = p["raw_cpu_s_per_gb"] + p["raw_delete_cpu_s_per_gb"]
            run["cpu_over_raw_consumer_copy"] = per_gb / consumer
    return {
        "raw_method": f"raw {args.pair_method} ×{streams}",
        "pair_gb": args.pair_gb,
        # huge=always vs huge=within_size changes a run's start-up (bench/README.md)
        "dump_root_mount": mount_text(s.shm),
        "clients": [{"name": c.name, "src": str(c.src)} for c in clients],
        "idle_cpu_s": idle_s,
        "idle_cpu_s_runs": idle,
        "fixed_run_cpu_s": fixed_s,
        "fixed_run_cpu_s_runs": fixed,
        "pairs": pairs,
        **_pair_summary(pairs, clients),
    }


def _pair_record(
    order: tuple[int, ...],
    load: float,
    raw: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    clients: list[Client],
) -> dict[str, Any]:
    """One pair: this checkout's figures at the top level, another client's in ``others``."""

    def of(row: dict[str, Any]) -> dict[str, Any]:
        return {"hsx_gb_per_s": row["gb_per_s"], "ratio": row["gb_per_s"] / raw["gb_per_s"],
                "ratio_copy": row["gb_per_s_copy"] / raw["gb_per_s"],
                "bytes": row["bytes"], "samples": row["samples"], "hsx_cpu_s": row["cpu_s"],
                "hsx_cpu_s_per_gb_run": row["cpu_s_per_gb_run"],
                "cpu_over_raw_run": row["cpu_s_per_gb_run"] / raw["cpu_s_per_gb"],
                "process_wall_s": row["process_wall_s"]}  # fmt: skip

    names = ["raw", *(c.name for c in clients)]
    main = runs["hsx"]
    return {
        "order": [names[m] for m in order],
        "hsx_first": order.index(1) < order.index(0),
        "load_avg_1m": load,
        "raw_gb_per_s": raw["gb_per_s"],
        "raw_cpu_s_per_gb": raw["cpu_s_per_gb"],
        "raw_delete_cpu_s_per_gb": raw["delete_cpu_s_per_gb"],
        **of(main),
        "others": {name: of(row) for name, row in runs.items() if name != "hsx"},
    }


def _median_quartiles(values: Sequence[float]) -> tuple[float, list[float]]:
    return float(np.median(values)), [float(q) for q in np.percentile(values, [25, 75])]


def _pair_summary(pairs: list[dict[str, Any]], clients: list[Client]) -> dict[str, Any]:
    """Medians and quartiles of the per-pair ratios (and of the other client's)."""
    median, quartiles = _median_quartiles([p["ratio"] for p in pairs])
    raw_cpu, raw_cpu_q = _median_quartiles([p["raw_cpu_s_per_gb"] for p in pairs])
    copy, copy_q = _median_quartiles([p["ratio_copy"] for p in pairs])
    deletion, deletion_q = _median_quartiles([p["raw_delete_cpu_s_per_gb"] for p in pairs])
    run_cpu, run_cpu_q = _median_quartiles([p["cpu_over_raw_run"] for p in pairs])
    out: dict[str, Any] = {"median_ratio": median, "quartiles": quartiles,
                           "median_ratio_copy": copy, "quartiles_copy": copy_q,
                           "cpu_over_raw_run_median": run_cpu,
                           "cpu_over_raw_run_quartiles": run_cpu_q,
                           "delete_cpu_s_per_gb_median": deletion,
                           "delete_cpu_s_per_gb_quartiles": deletion_q,
                           "raw_cpu_s_per_gb_median": raw_cpu,
                           "raw_cpu_s_per_gb_quartiles": raw_cpu_q,
                           "load_avg_1m": [p["load_avg_1m"] for p in pairs]}  # fmt: skip
    others = {}
    for c in clients[1:]:
        med, q = _median_quartiles([p["others"][c.name]["ratio"] for p in pairs])
        vs, vs_q = _median_quartiles(
            [p["hsx_gb_per_s"] / p["others"][c.name]["hsx_gb_per_s"] for p in pairs]
        )
        others[c.name] = {"median_ratio": med, "quartiles": q,
                          "hsx_over_it_median": vs, "hsx_over_it_quartiles": vs_q}  # fmt: skip
    out["others"] = others
    return out


def no_fsync_phase(ctx: Ctx, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """A diagnostic, not durable: the best raw copy and hsx with every fsync off, once.
    With the device's write cache absorbing the bytes, what is left is the pipeline's own
    limit; the gap to the durable figures is what the syncs cost on this disk."""
    prefab_dir = ctx.s.fresh("prefab-nofsync", on_shm=True)
    prefabs = make_prefabs(prefab_dir, lengths, ctx.model)
    method = "read + O_DIRECT, huge-page buffer"
    rows = [raw_copy(prefabs, ctx.s.disk / "raw", method, 2, sync=False)]
    print_progress(rows[-1])
    run = hsx_prefab(ctx, "hsx-nofsync", lengths, prefab_dir, fsync=False)
    rows.append(hsx_row("hsx, prefab server, writer.fsync = false", run))
    print_progress(rows[-1])
    return rows


def median_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median rate, with every round's rate alongside."""
    ranked = sorted(rows, key=lambda r: r["gb_per_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["gb_per_s_rounds"] = [r["gb_per_s"] for r in rows]
    mid["cpu_s_per_gb_rounds"] = [r["cpu_s_per_gb"] for r in rows]
    return mid


def raw_variants(smoke: bool) -> list[tuple[str, int, bool]]:
    """(method, streams, named): each method with 1 and 2 streams, then the two O_DIRECT
    methods with 2 streams and a durable name, the durability hsx gives."""
    out = [(m, t, False) for m in COPIES for t in ((1,) if smoke else (1, 2))]
    out += [(m, 1 if smoke else 2, True) for m in list(COPIES)[1:]]
    return out


def memory_phase(ctx: Ctx) -> list[dict[str, Any]]:
    rows = [hsx_row("no samples (start-up only)", hsx_prefab(ctx, "idle", [], None))]
    for name, lens in memory_workloads(ctx.args).items():
        prefab = ctx.s.fresh(f"mem-{lens[0]}", on_shm=True)
        make_prefabs(prefab, lens, ctx.model)
        rows.append(hsx_row(f"samples of {name}", hsx_prefab(ctx, f"mem-{lens[0]}", lens, prefab)))
        print_progress(rows[-1])
    return rows


def print_progress(row: dict[str, Any]) -> None:
    extra = f", {row['cpu_s_per_gb']:.2f} CPU s/GB" if "cpu_s_per_gb" in row else ""
    rss = f", peak RSS {row['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in row else ""
    print(f"  {row['name']}: {row['gb_per_s']:.3f} GB/s{extra}{rss}", flush=True)


WORKLOAD_HEADERS = ["samples", "tokens", "GB", "mean len", "median len", "max len", "hidden", "L"]
THROUGHPUT_HEADERS = [
    "what",
    "GB/s",
    "tokens/s",
    "ratio",
    "ratio, durable names",
    "copier CPU s/GB",
    "CPU s/GB net of start-up",
    "peak RSS MB",
    "GB/s incl. start-up",
]
MEMORY_HEADERS = [
    "run",
    "samples",
    "GB",
    "peak RSS MB",
    "peak private MB",
    "peak shared MB",
    "CPU s",
    "wall s",
]


def report(data: dict[str, Any]) -> list[str]:
    raw = data["raw"]
    best = max(raw, key=lambda r: r["gb_per_s"]) if raw else None
    data["best_raw"] = best["name"] if best else None
    named = [r for r in raw if r.get("named")]
    best_named = max(named, key=lambda r: r["gb_per_s"]) if named else None
    data["best_raw_named"] = best_named["name"] if best_named else None
    w = data["workload"]
    workload = [w["samples"], w["tokens"], w["bytes"] / GB, w["mean_len"], w["median_len"]]
    workload += [w["max_len"], w["hidden_size"], len(w["aux_layers"]) + 1]
    tables = [print_table("Workload", WORKLOAD_HEADERS, [workload])]
    bests = (best, best_named)
    rows = [_throughput_row(r, bests, data["row_bytes"]) for r in raw + data["hsx"]]
    if data["fake_alone"]:
        rows.append(_throughput_row(data["fake_alone"], bests, data["row_bytes"]))
    rows += [_throughput_row(r, bests, data["row_bytes"]) for r in data["nofsync"]]
    if rows:
        title = "Throughput" + (f" (ratio: to the best raw copy, {best['name']})" if best else "")
        tables.append(print_table(title, THROUGHPUT_HEADERS, rows))
    if data["paired"]:
        tables += _paired_tables(data["paired"])
    if data["memory"]:
        mem = [_memory_row(m) for m in data["memory"]]
        tables.append(print_table("Client memory and fixed cost", MEMORY_HEADERS, mem))
    return tables


def _paired_tables(pr: dict[str, Any]) -> list[str]:
    """Each pair's rates, ratios and CPU; then the medians (quartiles) of every client."""
    names = ["hsx", *pr["others"]]

    def client(p: dict[str, Any], name: str) -> dict[str, Any]:
        return p if name == "hsx" else p["others"][name]

    headers = ["pair", "order", "load", "raw GB/s", "raw CPU s/GB"]
    for name in names:
        headers += [f"{name} GB/s", f"{name} ratio", f"{name} ratio, copy",
                    f"{name} CPU s/GB net", f"{name} CPU s/GB in run"]  # fmt: skip
    rows = []
    for i, p in enumerate(pr["pairs"]):
        row = [i + 1, " → ".join(p["order"]), p["load_avg_1m"], p["raw_gb_per_s"],
               p["raw_cpu_s_per_gb"]]  # fmt: skip
        for name in names:
            c = client(p, name)
            row += [c["hsx_gb_per_s"], c["ratio"], c.get("ratio_copy", NAN),
                    c["hsx_cpu_s_per_gb_net"], c.get("hsx_cpu_s_per_gb_run", NAN)]  # fmt: skip
        rows.append(row)
    lo, hi = pr["quartiles"]
    title = (
        f"Paired rounds: {pr['raw_method']} (fsync) and hsx (prefab server) on the same "
        f"bytes, {pr['pair_gb']:g} GB each — median ratio {pr['median_ratio']:.2f} "
        f"(quartiles {lo:.2f}–{hi:.2f}); dump root {pr.get('dump_root_mount') or 'unknown'}"
    )
    tables = [print_table(title, headers, rows)]
    raw_cpu = pr["raw_cpu_s_per_gb_median"]
    summary = []
    for name in names:
        ratio, (r_lo, r_hi) = (
            (pr["median_ratio"], pr["quartiles"]) if name == "hsx"
            else (pr["others"][name]["median_ratio"], pr["others"][name]["quartiles"])
        )  # fmt: skip
        cpu = [client(p, name)["hsx_cpu_s_per_gb_net"] for p in pr["pairs"]]
        med, (c_lo, c_hi) = _median_quartiles(cpu)
        copy, (k_lo, k_hi) = _median_quartiles([client(p, name)["ratio_copy"] for p in pr["pairs"]])
        run, (u_lo, u_hi) = _median_quartiles(
            [client(p, name)["cpu_over_raw_run"] for p in pr["pairs"]]
        )
        own, (o_lo, o_hi) = _median_quartiles(
            [client(p, name).get("cpu_over_raw_copy", NAN) for p in pr["pairs"]]
        )
        both, (b_lo, b_hi) = _median_quartiles(
            [client(p, name).get("cpu_over_raw_consumer_copy", NAN) for p in pr["pairs"]]
        )
        per_gb = float(np.median([client(p, name).get("hsx_cpu_s_per_gb_copy", NAN)
                                  for p in pr["pairs"]]))  # fmt: skip
        summary.append([name, ratio, f"{r_lo:.2f}–{r_hi:.2f}", copy, f"{k_lo:.2f}–{k_hi:.2f}",
                        med, f"{c_lo:.2f}–{c_hi:.2f}", med / raw_cpu, run,
                        f"{u_lo:.2f}–{u_hi:.2f}", per_gb, own, f"{o_lo:.2f}–{o_hi:.2f}", both,
                        f"{b_lo:.2f}–{b_hi:.2f}", pr["idle_cpu_s"][name],
                        pr.get("fixed_run_cpu_s", {}).get(name, NAN)])  # fmt: skip
    loads = pr["load_avg_1m"]
    d_lo, d_hi = pr["delete_cpu_s_per_gb_quartiles"]
    title = (
        f"Paired summary (raw copy: CPU {raw_cpu:.2f} s/GB median; deleting its source after "
        f"it, as hsx deletes each dump: {pr['delete_cpu_s_per_gb_median']:.2f} s/GB "
        f"({d_lo:.2f}–{d_hi:.2f}); load average {min(loads):.1f}–{max(loads):.1f} over the pairs)"
    )
    headers = ["client", "ratio to raw, median", "quartiles", "ratio, copy (from admission)",
               "quartiles", "CPU s/GB net of start-up, median", "quartiles", "CPU / raw copy's",
               "CPU in run / raw copy's, per pair", "quartiles",
               "copy CPU s/GB (in run, less a 1-sample run's)",
               "copy CPU / raw copy's, per pair", "quartiles",
               "copy CPU / (raw copy + deleting its source), per pair", "quartiles",
               "start-up CPU s (empty run)", "fixed in-run CPU s (1-sample run)"]  # fmt: skip
    tables.append(print_table(title, headers, summary))
    for name, o in pr["others"].items():
        lo, hi = o["hsx_over_it_quartiles"]
        print(f"hsx / {name}, per pair: median {o['hsx_over_it_median']:.2f} "
              f"(quartiles {lo:.2f}–{hi:.2f})", flush=True)  # fmt: skip
    return tables


def _memory_row(m: dict[str, Any]) -> list[Any]:
    return [
        m["name"],
        m["samples"],
        m["bytes"] / GB,
        m["peak_rss_mb"],
        m["peak_anon_mb"],
        m["peak_shmem_mb"],
        m["cpu_s"],
        m["process_wall_s"],
    ]


def _throughput_row(
    r: dict[str, Any], bests: tuple[dict[str, Any] | None, ...], per_token: int
) -> list[Any]:
    tokens_per_s = r.get("tokens_per_s", r["gb_per_s"] * GB / per_token)
    ratios = [r["gb_per_s"] / b["gb_per_s"] if b else "" for b in bests]
    return [
        r["name"],
        r["gb_per_s"],
        tokens_per_s,
        *ratios,
        r.get("cpu_s_per_gb", ""),
        r.get("cpu_s_per_gb_net", ""),
        r.get("peak_rss_mb", ""),
        r.get("gb_per_s_process", ""),
    ]


def net_of_startup(data: dict[str, Any]) -> None:
    """CPU per GB without the fixed cost of a run (imports, set-up, shutdown), measured
    by the run with no samples: what a multi-terabyte job pays per GB."""
    idle = next((m for m in data["memory"] if m["samples"] == 0), None)
    if idle is None:
        return
    for r in data["hsx"]:
        if r["bytes"]:
            r["cpu_s_per_gb_net"] = (r["cpu_s"] - idle["cpu_s"]) / (r["bytes"] / GB)


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig = plt.figure(figsize=(15, 10))
    grid = fig.add_gridspec(2, 2, height_ratios=(1.3, 1))
    ax1 = fig.add_subplot(grid[0, :])
    ax2, ax3 = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    fake = [data["fake_alone"]] if data["fake_alone"] else []
    entries = [*data["raw"], *data["hsx"], *fake, *data["nofsync"]]
    colors = ["#999999"] * len(data["raw"]) + ["#1f77b4"] * len(data["hsx"])
    colors += ["#ff7f0e"] * len(fake) + ["#dddddd"] * len(data["nofsync"])
    ax1.barh([e["name"] for e in entries], [e["gb_per_s"] for e in entries], color=colors)
    ax1.invert_yaxis()
    ax1.set_xlabel("GB/s to disk (durable; light grey: no fsync, a diagnostic)")
    ax1.set_title("tmpfs → disk throughput (median of rounds)")
    cpu = [*data["raw"], *data["hsx"]]
    ax2.barh([e["name"] for e in cpu], [e["cpu_s_per_gb"] for e in cpu], color=colors[: len(cpu)])
    ax2.invert_yaxis()
    ax2.axvline(0.5, color="red", linestyle="--", label="target 0.5")
    ax2.set_xlabel("CPU s per GB of the copying process (hsx: start-up included)")
    ax2.legend()
    mem = data["memory"]
    ax3.bar([m["name"].removeprefix("samples of ") for m in mem], [m["peak_rss_mb"] for m in mem])
    ax3.axhline(400, color="red", linestyle="--", label="target 400 MB")
    ax3.set_ylabel("hsx client peak RSS (MB)")
    ax3.legend()
    m = data["machine"]
    disk = m["out_fs"].split(",")[0] + ")"
    fig.suptitle(f"hsx throughput — {m['cores']} cores {m['cpu']}; output {disk}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["serve-prefab"]:
        p = argparse.ArgumentParser()
        p.add_argument("--prefab", required=True)
        p.add_argument("--dump-root", required=True)
        p.add_argument("--hidden-size", type=int, required=True)
        p.add_argument("--aux-layers", type=int, nargs="+", required=True)
        return serve_prefab(p.parse_args(argv[1:]))
    args = parse_args(argv)
    apply_common(args)
    if args.compare_src is not None:
        warm_up(args.compare_src.resolve())
    model = Model(args.hidden_size, tuple(args.aux_layers))
    with scratch(args, "throughput") as s:
        ctx = Ctx(args, s, model, s.shm / "dumps")
        data = {
            "machine": machine_info(args.out_dir, args.shm_dir),
            "row_bytes": row_bytes(model.hidden_size, model.aux_layers),
            "smoke": args.smoke,
        }
        data |= run_all(ctx)
    net_of_startup(data)
    tables = report(data)
    path = save_results(args.results_dir, "throughput", data, tables)
    plot(data, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
