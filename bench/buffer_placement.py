"""Where the copy's buffer lies: O_DIRECT writes from a buffer on a huge-page boundary
(hsx's :class:`~hsx_async.run.dumps.writer.HugePageBuffer`) against one where the kernel placed
the mapping (the writer before issue 27's fifth round), in one run, rounds alternating.

    python bench/buffer_placement.py             # 10 rounds of 0.5 GB each way
    python bench/buffer_placement.py --smoke     # tiny, checks the script runs (CI)

Each round writes ``--gb`` with 8 MiB O_DIRECT writes from the buffer's two CHUNK halves
in turn into one file on ``--out-dir``, then fsyncs it: what the writer's flusher does,
without the read and the hash. The figure is the median of the per-round ratios
(aligned / kernel's) of GB/s, and each side's CPU per GB.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, machine_info, print_table, save_results

from hsx_async.run.dumps.writer import CHUNK, HUGE_PAGE, SUB, HugePageBuffer, address

SIZE = 2 * CHUNK + SUB  # one copy's buffer


def kernel_placed() -> tuple[mmap.mmap, memoryview]:
    """A copy's buffer as the writer made it before: the mapping where the kernel put it."""
    buf = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    for offset in range(0, SIZE, mmap.PAGESIZE):
        buf[offset] = 0
    return buf, memoryview(buf)


def write_round(view: memoryview, path: Path, chunks: int) -> tuple[float, float]:
    """(GB/s, CPU s/GB) of ``chunks`` O_DIRECT writes from the two halves, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t0, c0 = time.monotonic(), time.process_time()
    try:
        with view[:CHUNK] as first, view[CHUNK : 2 * CHUNK] as second:
            for i in range(chunks):
                block = first if i % 2 == 0 else second
                done = 0
                while done < CHUNK:
                    with block[done:] as rest:
                        done += os.write(fd, rest)
        os.fsync(fd)
    finally:
        os.close(fd)
    gb = chunks * CHUNK / 1e9
    return gb / (time.monotonic() - t0), (time.process_time() - c0) / gb


def measure(out_dir: Path, gb: float, rounds: int) -> dict[str, Any]:
    # Two buffers made back to back, as the writer's pool makes one per copy: the second
    # is where a run's second copy wrote from.
    kernel = [kernel_placed() for _ in range(2)][1][1]
    aligned = HugePageBuffer(SIZE).view
    chunks = max(2, int(gb * 1e9) // CHUNK)
    path = out_dir / "buffer-placement.bin"
    sides: dict[str, list[tuple[float, float]]] = {"kernel": [], "aligned": []}
    views = {"kernel": kernel, "aligned": aligned}
    try:
        for r in range(rounds):
            for name in ("kernel", "aligned") if r % 2 == 0 else ("aligned", "kernel"):
                sides[name].append(write_round(views[name], path, chunks))
    finally:
        path.unlink(missing_ok=True)
    ratios = [a[0] / k[0] for a, k in zip(sides["aligned"], sides["kernel"], strict=True)]
    return {
        "bytes_per_round": chunks * CHUNK,
        "offset_in_huge_page": {
            "kernel": address(kernel) % HUGE_PAGE,
            "aligned": address(aligned) % HUGE_PAGE,
        },
        "gb_per_s": {k: [g for g, _ in v] for k, v in sides.items()},
        "cpu_s_per_gb": {k: [c for _, c in v] for k, v in sides.items()},
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "cpu_s_per_gb_median": {k: statistics.median(c for _, c in v) for k, v in sides.items()},
    }


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--out-dir", type=Path, default=Path("/var/tmp/hsx-bench"))
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--gb", type=float, default=0.5, help="bytes written per round (GB)")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    if args.smoke:
        args.gb, args.rounds = 0.05, 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = measure(args.out_dir, args.gb, args.rounds)
    except OSError as exc:  # tmpfs and some others refuse O_DIRECT
        print(f"error: O_DIRECT writes to {args.out_dir} failed ({exc}); pass --out-dir "
              "on the disk under test", file=sys.stderr)  # fmt: skip
        return 2
    rows = [
        [name, result["offset_in_huge_page"][name], statistics.median(result["gb_per_s"][name]),
         result["cpu_s_per_gb_median"][name]]
        for name in ("kernel", "aligned")
    ]  # fmt: skip
    table = print_table(
        f"O_DIRECT from the copy's buffer, {args.rounds} rounds of "
        f"{result['bytes_per_round'] / 1e9:.2f} GB each way — aligned / kernel's, median "
        f"{result['median_ratio']:.3f} (per round: "
        + ", ".join(f"{r:.2f}" for r in result["ratios"]) + ")",
        ["buffer", "offset in its huge page (bytes)", "GB/s, median", "CPU s/GB, median"],
        rows,
    )  # fmt: skip
    info = machine_info(args.out_dir, Path("/dev/shm"))
    save_results(args.results_dir, "buffer_placement", {"machine": info, **result}, [table])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
