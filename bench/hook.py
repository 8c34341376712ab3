"""The server hook's cost on SGLang's scheduler thread (issue 16), before and after, in one run.

Prefill passes at Kimi-K2.5's shape (H 7168, 3 aux layers + the final state, 16,384-row
passes: 0.94 GB of dumps each) go through

- the real SGLang glue (``hsx_async.server.sglang.hook``, installed on the stand-in SGLang
  classes the tests use, ``tests/server/sglang/standins.py``): ``copy_to_cpu`` and
  ``process_batch_result_prefill`` exactly as SGLang calls them on its scheduler thread;
- ``dumper.PrefillDumper.dump_batch`` directly (what the reference and fake servers call).

Each configuration runs in its own process (so peak RSS is its own) and reports the
scheduler thread's wall time and CPU time inside the hook per GB dumped (stalls on a full
write queue included, and shown apart), the CPU of every other thread (the background
writers) per GB, the sustained dump rate (first pass handed in → last byte written) and
peak RSS. "main" rows are the code before issue 16 (assemble each part, write it on the
calling thread: kept here, in :class:`AssembleNow`, not in the hook); the others are the
new paths. The "float32 model" rows (issue 28) hand the hook a float32 model's rows: "cast
on the scheduler thread" is the code before issue 28 (the glue rounded them to bfloat16 in
``load_hidden``, reproduced here by :func:`old_tensor_bits`), "rounded by the writers" the
code now. Between passes the scheduler waits ``--interval-ms`` (the GPU computing the next
pass; 300 ms ≈ a 16k-token pass at 50k tokens/s), except in the "flat out" row.

One host buffer holds every pass's rows (SGLang's caching pinned allocator reuses its
blocks too), so peak RSS shows the hook's own memory, and "queued MB max" the host bytes
the writers held at most (bounded by ``--queue-mb``). The bench deletes each committed dump
as the client would. While the GPU would compute the next pass, the scheduler thread runs
a Python busy loop: its speed ("sched Python Mops/s") shows what the writer threads take
from SGLang's own Python (the GIL, and cores), against the synchronous rows.

    python bench/hook.py                  # 2 rounds × 8 configurations × 8 passes, ~6 min
    python bench/hook.py --modes float32  # only the issue-28 pair (before/after), ~2 min
    python bench/hook.py --smoke          # tiny passes, what tests/test_bench_smoke.py runs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

GB = 1e9
NS = "bench"
# Old ÷ new, per GB: wall time in the hook, the same without stalls, its thread CPU.
RATIO_KEYS = ("sched_ms_per_gb", "sched_ms_per_gb_without_stalls", "sched_cpu_ms_per_gb")
# The issue-28 pair: a float32 model's rows, cast on the scheduler thread vs by the writers.
CAST_BEFORE = "glue, float32 model, cast on the scheduler thread (main)"
CAST_AFTER = "glue, float32 model, rounded by the writers"


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    path: str  # "glue" or "dumper"
    background: bool
    assemble: bool
    paced: bool = True
    float32: bool = False  # the model's rows are float32 (issue 28)
    old_cast: bool = False  # ... cast to bfloat16 on the scheduler thread, as before

    @property
    def old(self) -> bool:
        """The code before the change the row measures (issue 16, or issue 28)."""
        return (self.assemble and not self.background) or self.old_cast


MODES = (
    Mode("glue, sync, assemble (main)", "glue", background=False, assemble=True),
    Mode("glue, sync, writev", "glue", background=False, assemble=False),
    Mode("glue, background writers", "glue", background=True, assemble=False),
    Mode("glue, background, flat out", "glue", background=True, assemble=False, paced=False),
    Mode("PrefillDumper, sync, assemble (main)", "dumper", background=False, assemble=True),
    Mode("PrefillDumper, background writers", "dumper", background=True, assemble=False),
    Mode(CAST_BEFORE, "glue", background=True, assemble=False, float32=True, old_cast=True),
    Mode(CAST_AFTER, "glue", background=True, assemble=False, float32=True),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_args(parser)
    add = parser.add_argument
    add("--rows", type=int, default=16384, help="rows per pass (scale down for a quick run)")
    add("--passes", type=int, default=8, help="passes per configuration")
    add("--requests-per-pass", type=int, default=8, help="marked requests sharing a pass")
    add("--hidden-size", type=int, default=7168)
    add("--aux-layers", default="2,30,58")
    add("--threads", type=int, default=4, help="background writer threads")
    add("--queue-mb", type=int, default=2048, help="the writers' byte budget (MiB)")
    add("--interval-ms", type=float, default=300.0, help="GPU time per pass (paced rows)")
    add("--rounds", type=int, default=2, help="each configuration this many times (medians)")
    add(
        "--modes", help="only the configurations whose names contain one of these (comma-separated)"
    )
    add("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one configuration, in its own process --------------------------------------------------


def vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Child:
    """One configuration: its dumper (and glue), the pass template, the measured loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.set_num_threads(1)  # no torch worker threads counted as "background"

        from hsx_async.server.dumper import PrefillDumper
        from hsx_async.server.hook_core import HookConfig
        from hsx_async.server.hook_writer import BackgroundWriter
        from hsx_async.server.sglang import hook as glue
        from tests.server.sglang.standins import make_api

        self.args = args
        self.mode = next(m for m in MODES if m.name == args.child)
        self.layers = tuple(int(x) for x in args.aux_layers.split(","))
        k, h = len(self.layers), args.hidden_size
        self.per_req = args.rows // args.requests_per_pass
        self.root = Path(args.shm_dir)
        cfg = HookConfig(dump_root=self.root, aux_layers=self.layers, model="b", server="b")
        self.background = None
        if self.mode.background:
            self.background = BackgroundWriter(
                self.root, threads=args.threads, queue_bytes=args.queue_mb << 20
            )
        sink = AssembleNow(self.root) if self.mode.assemble else self.background
        self.dumper = PrefillDumper(cfg, model="b", sink=sink)
        self.api = dataclasses.replace(make_api([]), async_d2h=lambda t: t)  # CPU: no copy
        if self.mode.old_cast:
            glue.host_rows = old_tensor_bits
        if self.mode.path == "glue":
            state = glue.HookState(cfg, self.dumper, writer=True, background=self.background)
            state.stack = SimpleNamespace(layers_to_capture=list(self.layers))
            state.graph_layers = self.layers
            glue.install(state, self.api)
        gen = torch.Generator().manual_seed(0)
        shapes = ((args.rows, k * h), (args.rows, h))
        if self.mode.float32:
            # A float32 model's activations (values, not bit patterns: they are rounded).
            self.template = tuple(torch.randn(shape, generator=gen) for shape in shapes)
        else:
            # Random bit patterns made as 2-byte integers: no 4-byte temporary inflates
            # the peak RSS (the values are never read as numbers).
            self.template = tuple(
                torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(
                    torch.bfloat16
                )
                for shape in shapes
            )
        self.pass_bytes = self.per_req * args.requests_per_pass * (k + 1) * h * 2

    def one_pass(self, p: int) -> tuple[float, float, list[Path]]:
        """Hand one pass to the hook; (wall s, thread CPU s) in it, and the dump dirs."""
        from hsx_async.server.hook_core import ReqView
        from tests.server.sglang.standins import params

        # What SGLang hands the hook: this pass's host rows and its requests. One host
        # buffer serves every pass (as SGLang's caching pinned-memory allocator reuses
        # its blocks): a fresh 0.94 GB allocation per pass would cost this 2-core machine
        # more than the hook does, and measure the page faults instead of the writers.
        aux, final = self.template
        n, api = self.per_req, self.api
        rids = [f"p{p}-r{j}" for j in range(self.args.requests_per_pass)]
        views = [ReqView(r, NS, n, 0, 0, n) for r in rids]
        reqs = [api.req_cls(r, range(n), params(ns=NS)) for r in rids]
        batch = SimpleNamespace(reqs=reqs, prefix_lens=[0] * len(reqs), extend_lens=[n] * len(reqs))
        out = SimpleNamespace(
            hidden_states=aux, last_hidden_states=final, hidden_states_token_indices=None
        )
        result = api.result_cls(out, [n] * len(reqs))
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.mode.path == "glue":
            result.copy_to_cpu(False, return_hidden_states=True)
            api.processor_cls().process_batch_result_prefill(batch, result)
        else:
            self.dumper.dump_batch(views, lambda: hidden_of(aux, final, self.layers))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return wall, cpu, [self.root / NS / r for r in rids]

    def run(self) -> dict[str, Any]:
        args, mode = self.args, self.mode
        reset_peak_rss()  # from here on, VmHWM is the passes' peak
        rss_base = vm_kb("VmRSS") * 1024
        idle_s, idle_ops = busy_python(time.perf_counter() + 0.5, 0.0, 0)  # no writer busy
        interval = args.interval_ms / 1000 if mode.paced else 0.0
        hook_wall = hook_cpu = busy_s = 0.0
        busy_ops = 0
        per_pass_ms: list[float] = []
        outstanding: list[Path] = []
        ru0, main0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        started = time.perf_counter()
        for p in range(args.passes):
            wall, cpu, dirs = self.one_pass(p)
            hook_wall, hook_cpu = hook_wall + wall, hook_cpu + cpu
            per_pass_ms.append(wall * 1000)
            outstanding = collect(outstanding + dirs)
            # The GPU computes the next pass; the scheduler thread meanwhile runs its own
            # Python (here a busy loop whose speed shows what the writer threads take
            # from it: the GIL, and cores).
            busy_s, busy_ops = busy_python(started + (p + 1) * interval, busy_s, busy_ops)
        if self.background is not None:
            assert self.background.flush(600.0), "the writers did not drain"
        finished = time.perf_counter()
        ru1, main1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        outstanding = collect(outstanding)
        assert not outstanding, f"{len(outstanding)} dumps never committed"
        stats = dataclasses.asdict(self.background.stats) if self.background else {}
        if self.background is not None:
            self.background.close()
        gb = self.pass_bytes * args.passes / GB
        process_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        return {
            "mode": mode.name,
            "old": mode.old,
            "background": mode.background,
            "gb": gb,
            "passes": args.passes,
            "sched_ms_per_gb": hook_wall * 1000 / gb,
            "sched_cpu_ms_per_gb": hook_cpu * 1000 / gb,
            "sched_ms_per_pass_max": max(per_pass_ms),
            "stall_s": stats.get("stall_s", 0.0),
            "stalls": stats.get("stalls", 0),
            "background_cpu_s_per_gb": max(0.0, process_cpu - (main1 - main0)) / gb,
            "gb_per_s": gb / (finished - started),
            "peak_rss_mb": vm_kb("VmHWM") * 1024 / 1e6,
            "rss_base_mb": rss_base / 1e6,
            "peak_queued_mb": stats.get("peak_queued_bytes", 0) / 1e6,
            "committed": args.passes * args.requests_per_pass,
            "sched_python_mops_per_s": busy_ops / busy_s / 1e6 if busy_s else 0.0,
            "sched_python_vs_idle": (busy_ops / busy_s) / (idle_ops / idle_s) if busy_s else None,
            "sched_ms_per_gb_without_stalls": (hook_wall - stats.get("stall_s", 0.0)) * 1000 / gb,
        }


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def busy_python(deadline: float, spent: float, ops: int) -> tuple[float, int]:
    """Run small Python steps until ``deadline``; adds the time and the step count."""
    start = now = time.perf_counter()
    while now < deadline:
        for _ in range(1000):
            ops += 1
        now = time.perf_counter()
    return spent + (now - start), ops


def hidden_of(aux: Any, final: Any, layers: tuple[int, ...]) -> Any:
    from hsx_async.server.rows import BatchHidden
    from hsx_async.server.sglang.hook import host_rows

    return BatchHidden(aux=host_rows(aux), final=host_rows(final), aux_layers=layers)


def old_tensor_bits(tensor: Any) -> Any:
    """The glue's host conversion before issue 28: a float32 model's rows rounded to
    bfloat16 on the scheduler thread, in ``load_hidden``."""
    import torch

    t = tensor.detach()
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.view(torch.int16).numpy()


class AssembleNow:
    """The hook's write path before issue 16, kept here (not in the hook) for the "main"
    rows: on the calling thread, each part assembled with one copy, then written, and a
    request's ``meta.json`` after its last part. A PartSink for PrefillDumper."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def submit(self, hidden: Any, jobs: Any) -> None:
        from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part
        from hsx_async.server.rows import assemble_rows

        for job in jobs:
            w = job.write
            with request_dir_fd(self.root, w.ns, w.rid) as fd:
                write_part(fd, w.start, w.end, assemble_rows(hidden, w.batch_row, w.rows).data)
                if job.meta is not None:
                    write_meta(fd, job.meta)


def collect(dirs: list[Path]) -> list[Path]:
    """Delete the committed dumps (the client's job); the rest are still being written."""
    left = []
    for d in dirs:
        if (d / "meta.json").exists():
            shutil.rmtree(d)
        else:
            left.append(d)
    return left


# -- the parent: every configuration, side by side ------------------------------------------


def run_mode(args: argparse.Namespace, mode: Mode, shm: Path) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", mode.name, "--shm-dir", str(shm)]
    for flag in ("rows", "passes", "requests_per_pass", "hidden_size", "aux_layers"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("threads", "queue_mb", "interval_ms"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    row: dict[str, Any] = orjson.loads(done.stdout.strip().splitlines()[-1])
    return row


def median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode.name]
        if not mine:
            continue
        row = dict(mine[0])
        for key, value in mine[0].items():
            if isinstance(value, float):
                row[key] = statistics.median(r[key] for r in mine)
        out.append(row | {"rounds": len(mine)})
    return out


def plot(
    rows: list[dict[str, Any]],
    path: Path,
    *,
    old: Callable[[dict[str, Any]], bool] = lambda row: bool(row["old"]),
    sched_goal_ms: float | None = 20.0,
    rate_target: float | None = None,
) -> None:
    """The scheduler thread's ms per GB (log scale) beside the sustained dump rate, the
    rows ``old`` picks in red (bench/hook_gpu.py draws its table with it too)."""
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["mode"] for r in rows]
    colors = ["tab:red" if old(r) else "tab:blue" for r in rows]
    left.barh(names, [max(r["sched_ms_per_gb"], 1e-3) for r in rows], color=colors)
    left.set_xscale("log")
    goal = "" if sched_goal_ms is None else f" (goal ≤ {sched_goal_ms:g})"
    left.set_xlabel(f"scheduler thread in the hook, ms per GB{goal}")
    if sched_goal_ms is not None:
        left.axvline(sched_goal_ms, color="k", linestyle="--", linewidth=1)
    left.invert_yaxis()
    right.barh(names, [r["gb_per_s"] for r in rows], color=colors)
    target = "" if rate_target is None else f" (target ≥ {rate_target:g})"
    right.set_xlabel(f"sustained dump rate, GB/s{target}")
    if rate_target is not None:
        right.axvline(rate_target, color="k", linestyle="--", linewidth=1)
    right.set_yticklabels([])
    right.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.child:
        print(orjson.dumps(Child(args).run()).decode(), flush=True)
        return
    if args.smoke:
        args.rows, args.passes, args.rounds, args.interval_ms = 256, 3, 1, 0.0
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)  # (all dumps go to tmpfs)
    shm = Path(args.shm_dir) / f"hsx-bench-hook-{os.getpid()}"
    shm.mkdir(parents=True)
    runs = []
    wanted = [w.strip() for w in (args.modes or "").split(",") if w.strip()]
    modes = [m for m in MODES if not wanted or any(w in m.name for w in wanted)]
    try:
        for round_ in range(args.rounds):
            order = modes if round_ % 2 == 0 else modes[::-1]  # alternate against drift
            for mode in order:
                runs.append(run_mode(args, mode, shm))
                print(f"  round {round_ + 1}: {mode.name}", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    rows = median_rows(runs)
    layers = [int(x) for x in args.aux_layers.split(",")]
    pass_gb = args.rows * (len(layers) + 1) * args.hidden_size * 2 / GB
    headers = [
        "configuration",
        "sched ms/GB",
        "of it, not stalled",
        "sched CPU ms/GB",
        "worst pass ms",
        "stall s",
        "bg CPU s/GB",
        "GB/s",
        "peak RSS MB",
        "queued MB max",
        "sched Python vs idle",
    ]
    table = common.print_table(
        f"hook cost, {args.rows:,}-row passes ({pass_gb:.2f} GB), H {args.hidden_size}, "
        f"{len(layers)} aux + final, {args.passes} passes, medians of {args.rounds}",
        headers,
        [
            [
                r["mode"],
                r["sched_ms_per_gb"],
                r["sched_ms_per_gb_without_stalls"],
                r["sched_cpu_ms_per_gb"],
                r["sched_ms_per_pass_max"],
                r["stall_s"],
                r["background_cpu_s_per_gb"],
                r["gb_per_s"],
                r["peak_rss_mb"],
                r["peak_queued_mb"],
                "-" if r["sched_python_vs_idle"] is None else f"{r['sched_python_vs_idle']:.2f}",
            ]
            for r in rows
        ],
    )
    pairs = {
        "glue": ("glue, sync, assemble (main)", "glue, background writers"),
        "PrefillDumper": (
            "PrefillDumper, sync, assemble (main)",
            "PrefillDumper, background writers",
        ),
        "float32 cast (issue 28)": (CAST_BEFORE, CAST_AFTER),
    }
    ratios = {}
    for label, (old_name, new_name) in pairs.items():
        before = next((r for r in rows if r["mode"] == old_name), None)
        after = next((r for r in rows if r["mode"] == new_name), None)
        if before is not None and after is not None:
            ratios[label] = {key: before[key] / max(after[key], 1e-9) for key in RATIO_KEYS}
    for label, ratio in ratios.items():
        print(f"{label}: old ÷ new " + ", ".join(f"{k} {v:.1f}×" for k, v in ratio.items()))
    data = {
        "smoke": args.smoke,
        "machine": common.machine_info(Path(args.out_dir), Path(args.shm_dir)),
        "shape": {
            "rows": args.rows,
            "hidden_size": args.hidden_size,
            "aux_layers": layers,
            "pass_gb": pass_gb,
            "requests_per_pass": args.requests_per_pass,
        },
        "settings": {
            "threads": args.threads,
            "queue_mb": args.queue_mb,
            "interval_ms": args.interval_ms,
            "passes": args.passes,
            "rounds": args.rounds,
        },
        "rows": rows,
        "runs": runs,
        "speedup_sched_old_over_new": ratios,
    }
    results = Path(args.results_dir)
    common.save_results(results, "hook", data, [table])
    plot(rows, results / "hook.png")


if __name__ == "__main__":
    main()
