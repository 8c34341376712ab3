"""Scaling: hsx against a GPU-like fake server, concurrency 1 to 64, and the serial baseline.

    python bench/scaling.py             # ~6 minutes
    python bench/scaling.py --smoke     # tiny, checks the script runs (CI)

The fake server models a forward pass as ``base + per_token × rows`` and batches the
waiting requests first come, first served, up to ``max_batch_tokens`` rows a pass. Its
modelled capacity is ``max_batch_tokens / (base + per_token × max_batch_tokens)`` tokens/s;
one request at a time pays ``base`` for a few thousand rows and leaves it mostly idle.

Defaults (base 1 s, 10 µs a token, 32,768 tokens a pass, hidden 512) keep the modelled
capacity, ~24.7k tokens/s or ~100 MB/s, well under what this machine's disk and 2 cores
move, so the curve shows how the request path scales, not the copy (``throughput.py``
covers bytes). The fake server writes each pass's parts after the modelled GPU time
(it does not overlap them), so what it really delivers is measured too: a null client
that deletes dumps without copying them, at the highest concurrency ("measured
ceiling"). Each point is a fresh server and a fresh ``hsx run``; its rate is the steady
rate between 10% and 90% of the tokens (from the server's counters), next to the whole
run's rate.

A last point runs ``workers.concurrency = "auto"`` (``run/pipeline/autotune.py``) for
``--auto-seconds`` against the same server: it starts at 4 and must find the rate of the
best fixed concurrency by itself; its row shows the rate over the second half of its
tokens, and its ``concurrency_changed`` events are kept in the JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from common import (
    PYTHON,
    ClientRun,
    Model,
    Scratch,
    ServerProcess,
    StatsPoller,
    apply_common,
    client_config,
    common_args,
    drain_server,
    drop_caches,
    fake_server_argv,
    lognormal_lengths,
    machine_info,
    print_table,
    pyplot,
    remove,
    run_hsx,
    run_measured,
    save_results,
    scratch,
    usage_dict,
    write_samples,
)

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Latency:
    base_ms: float
    per_token_us: float
    max_batch_tokens: int

    def pass_s(self, rows: float) -> float:
        return self.base_ms / 1e3 + self.per_token_us * rows / 1e6

    @property
    def capacity(self) -> float:
        """Tokens/s with every pass full."""
        return self.max_batch_tokens / self.pass_s(self.max_batch_tokens)

    def serial_rate(self, mean_len: float) -> float:
        """Tokens/s one request at a time, if the client cost nothing."""
        return mean_len / self.pass_s(mean_len)


@dataclass
class Ctx:
    args: argparse.Namespace
    s: Scratch
    model: Model
    lat: Latency
    dump_root: Path


def workload(
    ctx: Ctx, concurrency: int, name: str, seconds: float | None = None
) -> tuple[Path, list[int]]:
    """Enough samples for ``--seconds`` at the expected rate, and at least 3 per worker."""
    a, lat = ctx.args, ctx.lat
    expected = min(lat.capacity, concurrency * lat.serial_rate(a.mean_len))
    tokens = max((seconds or a.seconds) * expected, 3 * concurrency * a.mean_len)
    lengths = lognormal_lengths(
        tokens, 1, mean=a.mean_len, max_len=min(a.max_len, lat.max_batch_tokens), seed=concurrency
    )
    path = ctx.s.work / f"{name}.jsonl"
    write_samples(path, lengths, seed=concurrency)
    return path, lengths


def server(ctx: Ctx, name: str) -> ServerProcess:
    argv = fake_server_argv(
        ctx.model,
        ctx.dump_root,
        latency_base_ms=ctx.lat.base_ms,
        latency_per_token_us=ctx.lat.per_token_us,
        max_batch_tokens=ctx.lat.max_batch_tokens,
    )
    return ServerProcess(argv, ctx.s.work / f"{name}-server.log")


def server_row(srv: ServerProcess, poller: StatsPoller, lat: Latency) -> dict[str, Any]:
    stats = srv.get_json("/hsx_fake/stats")
    passes = max(1, int(stats["passes"]))
    return {
        "steady_tokens_per_s": poller.steady_rate(),
        "passes": passes,
        "mean_pass_fill": stats["tokens_dumped"] / passes / lat.max_batch_tokens,
        "max_pass_requests": stats["max_pass_requests"],
        "server_cpu_s": srv.cpu_s(),
    }


def measured_run(
    ctx: Ctx, name: str, samples: Path, workers: dict[str, Any]
) -> tuple[dict[str, Any], StatsPoller, ClientRun]:
    """One ``hsx run`` against a fresh server: its row, the server's counters over time."""
    out = ctx.s.fresh(f"{name}-out")
    drop_caches()
    with server(ctx, name) as srv:
        poller = StatsPoller(srv)
        poller.start()
        raw = client_config(
            url=srv.url,
            samples=samples,
            out_dir=out,
            dump_root=ctx.dump_root,
            model=ctx.model,
            workers=workers,
        )
        run = run_hsx(raw, ctx.s.work, name)
        row = server_row(srv, poller, ctx.lat)
    remove(out)
    return row | client_row(run), poller, run


def hsx_point(ctx: Ctx, concurrency: int) -> dict[str, Any]:
    name = f"hsx-c{concurrency}"
    samples, _ = workload(ctx, concurrency, name)
    row, _, _ = measured_run(ctx, name, samples, {"concurrency": concurrency})
    return row | {"name": f"hsx, concurrency {concurrency}", "concurrency": concurrency}


def client_row(run: ClientRun) -> dict[str, Any]:
    return {
        "samples": run.done,
        "tokens": run.tokens,
        "run_tokens_per_s": run.tokens / run.run_s,
        "client_cpu_s": run.usage.cpu_s,
        "client_peak_rss_mb": run.usage.peak_rss / 1e6,
        "usage": usage_dict(run.usage),
    }


def auto_point(ctx: Ctx) -> dict[str, Any]:
    """``concurrency = "auto"`` from its start (4) up to the largest fixed level: a longer
    run (``--auto-seconds``) so that the controller's search is a small part of it. Its
    "settled" rate is the steady rate over the second half of the tokens."""
    top = max(ctx.args.concurrency)
    samples, _ = workload(ctx, top, "hsx-auto", ctx.args.auto_seconds)
    workers = {"concurrency": "auto", "max_concurrency": top}
    row, poller, _ = measured_run(ctx, "hsx-auto", samples, workers)
    changes = concurrency_changes(ctx.s.work / "hsx-auto.log")
    final = changes[-1]["new"] if changes else 4
    return row | {
        "name": f"hsx, concurrency auto (≤ {top}; ended at {final})",
        "concurrency": "auto",
        "settled_tokens_per_s": poller.steady_rate(0.5, 0.9),
        "changes": changes,
    }


def concurrency_changes(log: Path) -> list[dict[str, Any]]:
    """The ``concurrency_changed`` events of a JSON log, in order."""
    out = []
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{") and b"concurrency_changed" in line:
            event = orjson.loads(line)
            out.append({k: event.get(k) for k in ("old", "new", "reason", "tokens_per_s")})
    return out


def baseline_point(ctx: Ctx) -> dict[str, Any]:
    name = "serial"
    samples, _ = workload(ctx, 1, name)
    out = ctx.s.fresh(f"{name}-out")
    drop_caches()
    with server(ctx, name) as srv:
        poller = StatsPoller(srv)
        poller.start()
        argv = [
            PYTHON, str(HERE / "baseline_serial.py"), "--url", srv.url, "--input", str(samples),
            "--out", str(out), "--dump-root", str(ctx.dump_root),
        ]  # fmt: skip
        log = ctx.s.work / f"{name}.log"
        usage = run_measured(argv, log)
        if usage.returncode != 0:
            raise RuntimeError(f"baseline failed; see {log}")
        row = server_row(srv, poller, ctx.lat)
    remove(out)
    result = orjson.loads(log.read_bytes().strip().splitlines()[-1])
    return row | {
        "name": "one request at a time (clear, send, scan)",
        "concurrency": 1,
        "samples": result["samples"],
        "tokens": result["tokens"],
        "run_tokens_per_s": result["tokens"] / result["seconds"],
        "client_cpu_s": usage.cpu_s,
        "client_peak_rss_mb": usage.peak_rss / 1e6,
        "usage": usage_dict(usage),
    }


def ceiling_point(ctx: Ctx, concurrency: int) -> dict[str, Any]:
    _, lengths = workload(ctx, concurrency, "ceiling")
    with server(ctx, "ceiling") as srv:
        poller = StatsPoller(srv)
        poller.start()
        seconds, tokens = drain_server(
            srv.url, lengths, concurrency=concurrency, dump_root=ctx.dump_root, ns_prefix="null"
        )
        row = server_row(srv, poller, ctx.lat)
    return row | {
        "name": f"null client (no copy), concurrency {concurrency}",
        "concurrency": concurrency,
        "tokens": tokens,
        "run_tokens_per_s": tokens / seconds,
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    common_args(p)
    add = p.add_argument
    add("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    add("--latency-base-ms", type=float, default=1000.0)
    add("--latency-per-token-us", type=float, default=10.0)
    add("--max-batch-tokens", type=int, default=32768)
    add("--hidden-size", type=int, default=512)
    add("--aux-layers", type=int, nargs="+", default=[2, 30, 58])
    add("--mean-len", type=float, default=2350.0)
    add("--max-len", type=int, default=32768)
    add("--seconds", type=float, default=15.0, help="target length of each point")
    add("--auto-seconds", type=float, default=90.0, help='length of the "auto" point (0: none)')
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency = [1, 4]
        args.latency_base_ms, args.latency_per_token_us, args.max_batch_tokens = 50.0, 5.0, 4096
        args.hidden_size, args.mean_len, args.max_len, args.seconds = 512, 200.0, 1024, 0.5
        args.auto_seconds = 1.0
    return args


def run_all(ctx: Ctx) -> dict[str, Any]:
    top = max(ctx.args.concurrency)
    ceiling = ceiling_point(ctx, top)
    _progress(ceiling)
    baseline = baseline_point(ctx)
    _progress(baseline)
    points = []
    for c in sorted(ctx.args.concurrency):
        points.append(hsx_point(ctx, c))
        _progress(points[-1])
    out: dict[str, Any] = {"ceiling": ceiling, "baseline": baseline, "points": points}
    if ctx.args.auto_seconds > 0:
        out["auto"] = auto_point(ctx)
        _progress(out["auto"])
    return out


def _progress(row: dict[str, Any]) -> None:
    print(
        f"  {row['name']}: {row['steady_tokens_per_s']:,.0f} tokens/s steady, "
        f"{row['run_tokens_per_s']:,.0f} whole run, passes {row['mean_pass_fill']:.0%} full",
        flush=True,
    )


def report(data: dict[str, Any]) -> list[str]:
    cap, ceil = data["model_capacity"], data["ceiling"]["steady_tokens_per_s"]
    base = data["baseline"]["steady_tokens_per_s"]
    rows = []
    for r in [data["baseline"], *data["points"]]:
        rate = r["steady_tokens_per_s"]
        rows.append([r["name"], rate, r["run_tokens_per_s"], rate / cap, rate / ceil, rate / base,
                     r["mean_pass_fill"], r["client_cpu_s"], r["client_peak_rss_mb"]])  # fmt: skip
    best = max(data["points"], key=lambda r: r["steady_tokens_per_s"])
    auto = data.get("auto")
    if auto is not None:
        rate = auto["settled_tokens_per_s"]
        rows.append([auto["name"] + ", second half", rate, auto["run_tokens_per_s"], rate / cap,
                     rate / ceil, rate / base, auto["mean_pass_fill"], auto["client_cpu_s"],
                     auto["client_peak_rss_mb"]])  # fmt: skip
    c = data["ceiling"]
    rows.append([c["name"], ceil, c["run_tokens_per_s"], ceil / cap, 1.0, ceil / base,
                 c["mean_pass_fill"], "", ""])  # fmt: skip
    lat = data["latency"]
    title = (
        f"Scaling against the modelled server (pass = {lat['base_ms']:g} ms + "
        f"{lat['per_token_us']:g} µs × rows, ≤ {lat['max_batch_tokens']:,} rows; modelled "
        f"capacity {cap:,.0f} tokens/s; hidden {data['hidden_size']})"
    )
    headers = ["client", "tokens/s (steady)", "tokens/s (whole run)", "of modelled capacity",
               "of measured ceiling", "× baseline", "pass fill", "client CPU s",
               "client peak RSS MB"]  # fmt: skip
    data["summary"] = {
        "best_concurrency": best["concurrency"],
        "best_of_capacity": best["steady_tokens_per_s"] / cap,
        "best_of_ceiling": best["steady_tokens_per_s"] / ceil,
        "best_vs_baseline": best["steady_tokens_per_s"] / base,
        "first_concurrency_at_90pct_of_ceiling": next(
            (r["concurrency"] for r in data["points"] if r["steady_tokens_per_s"] >= 0.9 * ceil),
            None,
        ),
    }
    if auto is not None:
        data["summary"]["auto_settled_vs_best_fixed"] = (
            auto["settled_tokens_per_s"] / best["steady_tokens_per_s"]
        )
        data["summary"]["auto_final_concurrency"] = (
            auto["changes"][-1]["new"] if auto["changes"] else None
        )
    return [print_table(title, headers, rows)]


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    pts = data["points"]
    xs = [p["concurrency"] for p in pts]
    ax.plot(xs, [p["steady_tokens_per_s"] for p in pts], "o-", label="hsx (steady)")
    ax.plot(xs, [p["run_tokens_per_s"] for p in pts], "o:", alpha=0.6, label="hsx (whole run)")
    cap = data["model_capacity"]
    ax.axhline(cap, color="black", label=f"modelled capacity {cap:,.0f}")
    ax.axhline(0.9 * cap, color="black", linestyle=":", linewidth=0.8, label="90% of it")
    ceil = data["ceiling"]["steady_tokens_per_s"]
    ax.axhline(ceil, color="green", linestyle="--", label=f"measured ceiling {ceil:,.0f}")
    base = data["baseline"]["steady_tokens_per_s"]
    ax.axhline(base, color="red", linestyle="--", label=f"one at a time {base:,.0f}")
    if "auto" in data:
        auto = data["auto"]["settled_tokens_per_s"]
        ax.axhline(auto, color="purple", linestyle="-.", label=f'concurrency "auto" {auto:,.0f}')
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("workers.concurrency")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(0, max(cap, ceil) * 1.1)
    ax.set_title(f"hsx scaling — {data['machine']['cores']} cores, {data['machine']['cpu']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    apply_common(args)
    model = Model(args.hidden_size, tuple(args.aux_layers))
    lat = Latency(args.latency_base_ms, args.latency_per_token_us, args.max_batch_tokens)
    with scratch(args, "scaling") as s:
        ctx = Ctx(args, s, model, lat, s.shm / "dumps")
        data: dict[str, Any] = {
            "machine": machine_info(args.out_dir, args.shm_dir),
            "smoke": args.smoke,
            "hidden_size": model.hidden_size,
            "aux_layers": list(model.aux_layers),
            "latency": {
                "base_ms": lat.base_ms,
                "per_token_us": lat.per_token_us,
                "max_batch_tokens": lat.max_batch_tokens,
            },
            "model_capacity": lat.capacity,
            "model_serial_rate": lat.serial_rate(args.mean_len),
            "mean_len": args.mean_len,
        }
        data |= run_all(ctx)
    tables = report(data)
    path = save_results(args.results_dir, "scaling", data, tables)
    plot(data, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
