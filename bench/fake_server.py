"""The fake server alone, against another checkout's fake server, in one run.

The client benches (throughput.py, scaling.py) take the fake server as their source of
dumps; this measures what it can produce by itself: a fresh ``hsx fake-server`` (no latency
model) per round, drained by the null client of bench/common.py (``concurrency`` requests in
flight, each dump deleted once committed, nothing copied). With ``--compare-src`` the rounds
alternate between this checkout's server and that checkout's (each run from its own source
tree), so the ratio of the two is measured on the same machine in the same minutes.

    python bench/fake_server.py --compare-src /path/to/other/checkout   # ~2 min
    python bench/fake_server.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

GB = 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_args(parser)
    add = parser.add_argument
    add("--compare-src", type=Path, help="another checkout whose fake server runs in turn")
    add("--compare-name", default="other", help="its name in the table")
    add("--gb", type=float, default=4.0, help="dump bytes one round produces (GB)")
    add("--mean-len", type=float, default=2350.0)
    add("--max-len", type=int, default=32768)
    add("--hidden-size", type=int, default=7168)
    add("--aux-layers", default="2,30,58")
    add("--concurrency", type=int, default=8)
    add("--rounds", type=int, default=3, help="rounds of each server (alternating)")
    return parser.parse_args()


def one_round(src: Path, model: common.Model, lengths: list[int], args: argparse.Namespace,
              log: Path) -> dict[str, Any]:  # fmt: skip
    dump_root = Path(args.shm_dir) / f"hsx-bench-fake-{log.stem}"
    dump_root.mkdir(parents=True)
    try:
        with common.ServerProcess(common.fake_server_argv(model, dump_root), log, cwd=src) as srv:
            cpu0 = srv.cpu_s()
            seconds, tokens = common.drain_server(
                srv.url, lengths, concurrency=args.concurrency, dump_root=dump_root,
                ns_prefix="null",
            )  # fmt: skip
            cpu = srv.cpu_s() - cpu0
    finally:
        common.remove(dump_root)
    moved = tokens * model.row_bytes
    return {"gb_per_s": moved / seconds / GB, "server_cpu_s_per_gb": cpu / (moved / GB),
            "tokens": tokens, "seconds": seconds}  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.gb, args.mean_len, args.max_len, args.rounds = 0.02, 200.0, 400, 1
    layers = tuple(int(x) for x in args.aux_layers.split(","))
    model = common.Model(hidden_size=args.hidden_size, aux_layers=layers)
    per_token = model.row_bytes
    lengths = common.lognormal_lengths(
        args.gb * GB, per_token, mean=args.mean_len, max_len=args.max_len
    )
    servers = [("this checkout", common.REPO)]
    if args.compare_src is not None:
        servers.append((args.compare_name, args.compare_src.resolve()))
        common.warm_up(args.compare_src.resolve())
    common.warm_up()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    logs = Path(args.results_dir) / "fake_server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in servers}
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]  # alternate against drift
        for name, src in order:
            log = logs / f"{name.replace(' ', '-')}-{r}.log"
            runs[name].append(one_round(src, model, lengths, args, log))
            print(f"  round {r + 1}: {name}: {runs[name][-1]['gb_per_s']:.2f} GB/s", flush=True)
    rows = []
    for name, src in servers:
        mine = runs[name]
        rows.append({
            "name": name, "src": str(src), "rounds": len(mine),
            "gb_per_s": statistics.median(x["gb_per_s"] for x in mine),
            "server_cpu_s_per_gb": statistics.median(x["server_cpu_s_per_gb"] for x in mine),
        })  # fmt: skip
    table = common.print_table(
        f"fake server alone (null client, concurrency {args.concurrency}): {len(lengths)} "
        f"samples, {sum(lengths) * per_token / GB:.2f} GB a round, medians of {args.rounds}",
        ["server", "GB/s", "server CPU s/GB"],
        [[r["name"], r["gb_per_s"], r["server_cpu_s_per_gb"]] for r in rows],
    )
    ratio = rows[0]["gb_per_s"] / rows[1]["gb_per_s"] if len(rows) == 2 else None
    if ratio is not None:
        print(f"this checkout ÷ {args.compare_name}: {ratio:.2f}× GB/s")
    data = {"smoke": args.smoke, "machine": common.machine_info(Path(args.out_dir),
            Path(args.shm_dir)), "rows": rows, "runs": runs, "ratio": ratio}  # fmt: skip
    results = Path(args.results_dir)
    common.save_results(results, "fake_server", data, [table])
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["name"] for r in rows], [r["gb_per_s"] for r in rows])
    ax.set_xlabel("dumps produced, GB/s")
    fig.tight_layout()
    fig.savefig(results / "fake_server.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
