"""Read throughput of the training-side reader, from the page cache.

Builds a synthetic dataset laid out exactly as the pipeline writes it (or takes
``--dataset DIR``), reads every file once so it sits in the page cache, then measures
samples/s and GB/s (bytes of sample files delivered per second) for:

- ``raw read``: ``readinto`` of every file into a reused buffer (the page-cache ceiling);
- ``dataset, views``: ``HiddenStateDataset[i]`` only (opening + zero-copy views; no data
  is read, so its GB/s is notional: the per-sample overhead);
- ``dataset + collate``: batches from ``LengthGroupedBatchSampler`` padded by
  ``PadCollator`` in this process (the one copy a trainer needs);
- ``DataLoader, N workers``: the same through ``torch.utils.data.DataLoader`` (second epoch,
  persistent workers, so worker start-up is not counted).

Prints a table and writes ``<out>.json`` and ``<out>.png`` side by side (default
``bench/results/read_throughput``). ``--smoke`` runs a tiny version in a few seconds.

    python bench/read_throughput.py            # ~0.9 GB dataset, medians of 3
    python bench/read_throughput.py --smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
import xxhash
from torch.utils.data import DataLoader

from hsx_async.dataset.layout import build_layout, data_relpath, sample_key
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.dataset.reader import HiddenStateDataset, LengthGroupedBatchSampler, PadCollator

AUX_LAYERS = (2, 30, 58)
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    samples: int
    bytes: int
    seconds: float  # median over repeats
    cpu_seconds: float | None  # this process's CPU time (median); None when workers do the work

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def cpu_s_per_gb(self) -> float | None:
        return None if self.cpu_seconds is None else self.cpu_seconds / (self.bytes / 1e9)


def build_dataset(
    out: Path, *, samples: int, hidden_size: int, min_tokens: int, max_tokens: int, seed: int
) -> None:
    """Sample files as the pipeline lays them out; the values are random bf16 patterns."""
    rng = np.random.default_rng(seed)
    layers = len(AUX_LAYERS) + 1
    block = (rng.standard_normal(max_tokens * layers * hidden_size, dtype=np.float32) * 8).astype(
        np.float32
    )
    pool = torch.from_numpy(block).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with (out / "manifest.jsonl").open("ab") as manifest:
        for i in range(samples):
            t = int(rng.integers(min_tokens, max_tokens + 1))
            sample_id = f"bench-{i:06d}"
            layout = build_layout(
                sample_id=sample_id,
                num_tokens=t,
                hidden_size=hidden_size,
                aux_layers=AUX_LAYERS,
                has_loss_mask=True,
            )
            ids = rng.integers(0, 128_000, t, dtype=np.int64).astype("<i8").tobytes()
            parts = (layout.header, ids, pool[: layout.hidden_bytes], b"\x01" * t)
            relpath = data_relpath(sample_key(sample_id))
            (out / relpath).parent.mkdir(parents=True, exist_ok=True)
            (out / relpath).write_bytes(b"".join(parts))
            hasher = xxhash.xxh3_64()
            for part in parts:
                hasher.update(part)
            entry = ManifestEntry(sample_id, relpath, t, layout.total_bytes, hasher.hexdigest())
            manifest.write(entry.to_line())


def warm_cache(paths: Sequence[Path]) -> int:
    """Read every file once so the measurements come from the page cache."""
    total = 0
    for path in paths:
        with path.open("rb") as fh:
            while chunk := fh.read(8 << 20):
                total += len(chunk)
    return total


Timing = tuple[float, float]  # (wall seconds, CPU seconds of this process), medians


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _median_seconds(run: Callable[[], None], repeat: int) -> Timing:
    """Wall and CPU time: on a shared machine CPU time is the steadier of the two."""
    walls, cpus = [], []
    for _ in range(repeat):
        cpu, started = _cpu(), time.perf_counter()
        run()
        walls.append(time.perf_counter() - started)
        cpus.append(_cpu() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def measure_raw(paths: Sequence[Path], repeat: int) -> Timing:
    buffer = bytearray(max(p.stat().st_size for p in paths))
    view = memoryview(buffer)

    def run() -> None:
        for path in paths:
            with path.open("rb", buffering=0) as fh:
                fh.readinto(view)

    return _median_seconds(run, repeat)


def measure_views(ds: HiddenStateDataset, repeat: int) -> Timing:
    def run() -> None:
        for i in range(len(ds)):
            ds[i]

    return _median_seconds(run, repeat)


def measure_collate(ds: HiddenStateDataset, batch_size: int, repeat: int) -> Timing:
    sampler = LengthGroupedBatchSampler(ds.lengths, batch_size=batch_size, seed=0)
    collate = PadCollator()

    def run() -> None:
        for batch in sampler:
            collate([ds[i] for i in batch])

    return _median_seconds(run, repeat)


def measure_loader(ds: HiddenStateDataset, batch_size: int, workers: int, repeat: int) -> Timing:
    sampler = LengthGroupedBatchSampler(ds.lengths, batch_size=batch_size, seed=0)
    loader = DataLoader(
        ds,
        batch_sampler=sampler,
        collate_fn=PadCollator(),
        num_workers=workers,
        persistent_workers=workers > 0,
    )

    def run() -> None:
        for _ in loader:
            pass

    run()  # starts the workers; not counted
    return _median_seconds(run, repeat)


def run_all(ds: HiddenStateDataset, args: argparse.Namespace) -> list[Result]:
    paths = [ds.path(i) for i in range(len(ds))]
    n, nbytes = len(ds), sum(e.size for e in ds.entries)
    timed: list[tuple[str, Timing, bool]] = [
        ("raw read (readinto)", measure_raw(paths, args.repeat), True),
        ("dataset, views (no data read)", measure_views(ds, args.repeat), True),
        (
            f"dataset + collate (B={args.batch_size})",
            measure_collate(ds, args.batch_size, args.repeat),
            True,
        ),
    ]
    for workers in args.workers:
        timing = measure_loader(ds, args.batch_size, workers, args.repeat)
        timed.append((f"DataLoader, {workers} workers", timing, workers == 0))
    return [
        Result(name, n, nbytes, wall, cpu if in_process else None)
        for name, (wall, cpu), in_process in timed
    ]


def table(results: Sequence[Result]) -> str:
    lines = [f"{'method':<30} {'samples/s':>11} {'GB/s':>7} {'CPU s/GB':>9} {'seconds':>9}"]
    for r in results:
        cpu = "workers" if r.cpu_s_per_gb is None else f"{r.cpu_s_per_gb:.3f}"
        lines.append(
            f"{r.name:<30} {r.samples_per_s:>11.1f} {r.gb_per_s:>7.2f} {cpu:>9} {r.seconds:>9.3f}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [r.name for r in results]
    bars = ax.barh(names, [r.gb_per_s for r in results])
    for bar, r in zip(bars, results, strict=True):
        ax.annotate(
            f" {r.gb_per_s:.2f} GB/s, {r.samples_per_s:.0f} samples/s",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
        )
    ax.invert_yaxis()
    ax.set_xscale("log")  # views-only touches no data: orders of magnitude above the rest
    ax.set_xlabel("GB/s of sample files, from the page cache (log scale)")
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.6)
    fig.savefig(path, dpi=100)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=Path, help="measure this output directory instead")
    parser.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--torch-threads", type=int, help="torch intra-op threads here (workers always use 1)"
    )
    parser.add_argument("--out", type=Path, help="output prefix (default bench/results/...)")
    parser.add_argument("--workdir", type=Path, help="where to build the dataset (a temp dir)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples, args.hidden_size, args.min_tokens, args.max_tokens = 12, 256, 16, 96
        args.repeat = 1
    args.out = args.out or RESULTS / ("read_throughput-smoke" if args.smoke else "read_throughput")
    return args


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _build(args: argparse.Namespace) -> Path:
    out = Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=args.workdir))
    build_dataset(
        out,
        samples=args.samples,
        hidden_size=args.hidden_size,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=0,
    )
    return out


def _measure(
    out_dir: Path, args: argparse.Namespace
) -> tuple[HiddenStateDataset, int, list[Result]]:
    ds = HiddenStateDataset(out_dir)
    if len(ds) == 0:
        raise SystemExit(f"{out_dir}: no samples in the manifest")
    nbytes = warm_cache([ds.path(i) for i in range(len(ds))])
    if nbytes > _available_memory() // 2:
        print("warning: dataset is over half the free memory; not all from page cache")
    return ds, nbytes, run_all(ds, args)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    built = _build(args) if args.dataset is None else None
    try:
        ds, nbytes, results = _measure(built or args.dataset, args)
    finally:
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
    shape = f"{len(ds)} samples, {nbytes / 1e9:.2f} GB"
    if built is not None:
        shape += f", H={args.hidden_size}, L={len(AUX_LAYERS) + 1}, "
        shape += f"T={args.min_tokens}..{args.max_tokens}"
    load = os.getloadavg()[0]
    title = (
        f"hsx read throughput: {shape}; {os.cpu_count()} CPUs (load {load:.1f}), "
        f"torch {torch.__version__}"
    )
    print(title)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "title": title,
        "command": " ".join(["python bench/read_throughput.py", *(argv or sys.argv[1:])]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min": load,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "dataset": {"samples": len(ds), "bytes": nbytes, "path": str(args.dataset or "built")},
        "results": [
            {
                **asdict(r),
                "samples_per_s": r.samples_per_s,
                "gb_per_s": r.gb_per_s,
                "cpu_s_per_gb": r.cpu_s_per_gb,
            }
            for r in results
        ],
    }
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    json_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    plot(results, png_path, title)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
