"""Overhead: the client's fixed cost per request, measured with tiny samples (1-16 tokens).

    python bench/overhead.py            # ~2 minutes
    python bench/overhead.py --smoke    # tiny, checks the script runs (CI)

Each sample is still a full request: POST, dump, validation, a durable safetensors file
(fsync, rename, fsync of the directory) and a manifest line (group commit), but the bytes
are negligible, so requests/s and CPU per request are the per-request cost of hsx. The
fake server has no modelled latency; hidden size 512 by default (16 KiB a token). Every
configuration runs as its own ``hsx run`` with a fresh fake server; CPU per request is net
of the fixed cost of a run with no samples.
A null client (POST, wait for the commit, delete; no copy) shows what the fake server
itself can answer, and a "file floor" phase what the kernel charges for one small file
on the output disk alone (no hsx, one thread): create, write, close, rename, with and
without the syncs a durable sample needs.

No phase deletes files until the script ends, and each starts after a ``sync``: on an
ext4 without a journal (this machine's) every file create scans past the inodes freed in
the last ~30 s, so deleting one phase's 4,000 files made the next phase's creates cost
~0.7 ms more CPU each (``perf``: ``recently_deleted`` under ``ext4_create``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    Model,
    Scratch,
    ServerProcess,
    apply_common,
    client_config,
    common_args,
    fake_server_argv,
    fake_server_drained,
    machine_info,
    print_table,
    pyplot,
    run_hsx,
    save_results,
    scratch,
    usage_dict,
    write_samples,
)


@dataclass
class Ctx:
    args: argparse.Namespace
    s: Scratch
    model: Model
    dump_root: Path


def tiny_lengths(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 17, size=n)]


def hsx_run(
    ctx: Ctx, name: str, lengths: Sequence[int], concurrency: int, writer: dict[str, Any]
) -> dict[str, Any]:
    samples = ctx.s.work / f"{name}.jsonl"
    write_samples(samples, lengths, seed=len(lengths))
    out = ctx.s.fresh(f"{name}-out")
    argv = fake_server_argv(ctx.model, ctx.dump_root)
    with ServerProcess(argv, ctx.s.work / f"{name}-server.log") as srv:
        raw = client_config(
            url=srv.url,
            samples=samples,
            out_dir=out,
            dump_root=ctx.dump_root,
            model=ctx.model,
            workers={"concurrency": concurrency},
            writer=writer,
        )
        os.sync()  # the previous phase's writes are not flushed during this one
        cpu0 = srv.cpu_s()
        run = run_hsx(raw, ctx.s.work, name)
        server_cpu = srv.cpu_s() - cpu0
    return {  # the output stays until the end (see the module's docstring)
        "name": name,
        "concurrency": concurrency,
        "writer": writer,
        "samples": run.done,
        "tokens": run.tokens,
        "seconds": run.run_s,
        "requests_per_s": run.done / run.run_s if run.run_s else 0.0,
        "cpu_s": run.usage.cpu_s,
        "peak_rss_mb": run.usage.peak_rss / 1e6,
        "server_cpu_s": server_cpu,
        "usage": usage_dict(run.usage),
    }


def null_run(ctx: Ctx, lengths: Sequence[int], concurrency: int) -> dict[str, Any]:
    log = ctx.s.work / "null-server.log"
    seconds, _, server_cpu = fake_server_drained(
        ctx.model, ctx.dump_root, log, lengths, concurrency
    )
    return {
        "name": f"null client (no copy), concurrency {concurrency}",
        "concurrency": concurrency,
        "samples": len(lengths),
        "seconds": seconds,
        "requests_per_s": len(lengths) / seconds,
        "server_cpu_s": server_cpu,
    }


FILE_MODES = (
    ("create, write, rename (no sync)", False, 0),
    ("... + fsync file, fsync directory, each file", True, 1),
    ("... + fsync file, fsync directory per 32 files", True, 32),
)


def file_floor(ctx: Ctx, files: int, rounds: int = 3) -> list[dict[str, Any]]:
    """The kernel's price of one small file on the output disk, in this process and
    thread (nothing else runs meanwhile): what a tiny sample costs before any Python.
    Modes are taken in turn, ``rounds`` times; each figure is the median round."""
    data = np.random.default_rng(3).bytes(8192)
    results: dict[str, list[tuple[float, float, float]]] = {m[0]: [] for m in FILE_MODES}
    for r in range(rounds):
        for k, (name, sync, batch) in enumerate(FILE_MODES):
            d = ctx.s.fresh(f"file-floor-{r}-{k}")  # kept until the end, like the outputs
            os.sync()
            dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            ru0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
            for i in range(files):
                tmp, final = d / f".{i}.tmp", d / f"{i}.safetensors"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, data)
                if sync:
                    os.fsync(fd)
                os.close(fd)
                tmp.rename(final)
                if sync and (i + 1) % batch == 0:
                    os.fsync(dir_fd)
            if sync:
                os.fsync(dir_fd)
            ru1, t1 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
            os.close(dir_fd)
            results[name].append(
                (files / (t1 - t0), ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime)
            )
    rows = []
    for name, runs in results.items():
        rate, user, sys_ = sorted(runs)[len(runs) // 2]
        rows.append(
            {
                "name": name,
                "files": files,
                "files_per_s": rate,
                "user_ms_per_file": user / files * 1e3,
                "sys_ms_per_file": sys_ / files * 1e3,
                "rounds_files_per_s": [r[0] for r in runs],
            }
        )
    return rows


def configs(args: argparse.Namespace) -> list[tuple[str, int, dict[str, Any]]]:
    """(name, concurrency, [writer] keys): the defaults at several concurrencies, then more
    writer threads, which hides fsync latency when files are tiny."""
    out: list[tuple[str, int, dict[str, Any]]] = [(f"hsx c{c}", c, {}) for c in args.concurrency]
    top = max(args.concurrency)
    if not args.smoke:
        out.append((f"hsx c{top}, writer.threads 8", top, {"threads": 8, "queue_depth": 64}))
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    common_args(p)
    p.add_argument("--samples", type=int, default=4000, help="requests per configuration")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    # 512: 16 KiB a token, so bytes are negligible and the figure is the per-request cost;
    # --hidden-size 7168 adds up to 0.9 MB a request.
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--aux-layers", type=int, nargs="+", default=[2, 30, 58])
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.concurrency, args.hidden_size = 40, [4], 512
    return args


def run_all(ctx: Ctx) -> dict[str, Any]:
    lengths = tiny_lengths(ctx.args.samples)
    idle = hsx_run(ctx, "idle", [], 1, {})
    print(f"  no samples: {idle['cpu_s']:.2f} CPU s (the fixed cost of a run)", flush=True)
    rows = []
    for name, concurrency, writer in configs(ctx.args):
        row = hsx_run(ctx, name.replace(" ", "-").replace(",", ""), lengths, concurrency, writer)
        row["name"] = name
        row["cpu_ms_per_request"] = (row["cpu_s"] - idle["cpu_s"]) / row["samples"] * 1e3
        row["server_cpu_ms_per_request"] = row["server_cpu_s"] / row["samples"] * 1e3
        rows.append(row)
        print(f"  {name}: {row['requests_per_s']:,.0f} requests/s", flush=True)
    null = null_run(ctx, lengths, max(ctx.args.concurrency))
    print(f"  {null['name']}: {null['requests_per_s']:,.0f} requests/s", flush=True)
    floor = file_floor(ctx, min(len(lengths), 2000))
    return {"idle": idle, "runs": rows, "null": null, "file_floor": floor}


def report(data: dict[str, Any]) -> list[str]:
    rows: list[list[Any]] = [
        [r["name"], r["samples"], r["requests_per_s"], r["cpu_ms_per_request"],
         r["server_cpu_ms_per_request"], r["peak_rss_mb"]]
        for r in data["runs"]
    ]  # fmt: skip
    n = data["null"]
    rows.append([n["name"], n["samples"], n["requests_per_s"], "",
                 n["server_cpu_s"] / n["samples"] * 1e3, ""])  # fmt: skip
    idle = data["idle"]
    title = (
        f"Per-request overhead: 1-16 tokens a sample, hidden {data['hidden_size']} "
        f"(fixed cost of a run, subtracted: {idle['cpu_s']:.2f} CPU s)"
    )
    headers = ["client", "requests", "requests/s", "client CPU ms/request",
               "server CPU ms/request", "client peak RSS MB"]  # fmt: skip
    floor = [
        [f["name"], f["files"], f["files_per_s"], f["user_ms_per_file"] + f["sys_ms_per_file"],
         f["sys_ms_per_file"]]
        for f in data["file_floor"]
    ]  # fmt: skip
    floor_title = "File floor: 8 KiB files on the output disk, one thread, no hsx (median of 3)"
    floor_headers = ["what", "files", "files/s", "CPU ms/file", "of which system"]
    return [print_table(title, headers, rows), print_table(floor_title, floor_headers, floor)]


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    runs = data["runs"]
    names = [r["name"] for r in runs] + [data["null"]["name"]]
    rates = [r["requests_per_s"] for r in runs] + [data["null"]["requests_per_s"]]
    ax1.barh(names, rates, color=["#1f77b4"] * len(runs) + ["#ff7f0e"])
    ax1.axvline(1000, color="red", linestyle="--", label="target 1,000/s")
    ax1.invert_yaxis()
    ax1.set_xlabel("requests/s")
    ax1.legend()
    ax2.barh([r["name"] for r in runs], [r["cpu_ms_per_request"] for r in runs])
    ax2.invert_yaxis()
    ax2.set_xlabel("client CPU ms per request")
    m = data["machine"]
    fig.suptitle(f"hsx per-request overhead — {m['cores']} cores, {m['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    apply_common(args)
    model = Model(args.hidden_size, tuple(args.aux_layers))
    with scratch(args, "overhead") as s:
        ctx = Ctx(args, s, model, s.shm / "dumps")
        data: dict[str, Any] = {
            "machine": machine_info(args.out_dir, args.shm_dir),
            "smoke": args.smoke,
            "hidden_size": model.hidden_size,
        }
        data |= run_all(ctx)
    tables = report(data)
    path = save_results(args.results_dir, "overhead", data, tables)
    plot(data, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
