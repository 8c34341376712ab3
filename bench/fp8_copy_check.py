"""What the copy's outlier check costs: an FP8 dump of the outliers layout copied with the
check of each outlier's own FP8 value (issue 38: ±448 with its value's sign, as the copy's
buffer holds it) against the same copy without it, in one run, rounds alternating.

    python bench/fp8_copy_check.py            # 8 rounds of a 2,048-token dump each way
    python bench/fp8_copy_check.py --smoke    # tiny, checks the script runs (CI)

One dump of ``--tokens`` rows (H = ``--hidden``, 3 aux layers + the final state, every slot
quantized, ``per_token_slot_outliers16``) made by hsx's quantizer in ``--shm-dir``; each
round stages it once with the writer (``direct`` and ``sendfile``, no fsync: the copy's
CPU, not the disk's) and deletes the temp file. "unchecked" replaces the check with a
no-op: the per-vector sections are read and checked first either way. The figures are
the medians of the per-round ratios (checked / unchecked) of CPU per GB and of GB/s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS_DIR, machine_info, print_table, save_results

from hsx_async.dataset.layout import build_layout, data_relpath
from hsx_async.protocol import (
    FP8,
    META_NAME,
    PER_TOKEN_SLOT_OUTLIERS16,
    DumpMeta,
    Storage,
    part_name,
)
from hsx_async.quantize import encode_rows
from hsx_async.run.dumps import writer
from hsx_async.run.dumps.dump import Dump
from hsx_async.run.source import Sample

AUX = (2, 30, 58)
PART_ROWS = 1024  # rows per dump part, as a chunked prefill writes them


def make_dump(root: Path, tokens: int, hidden: int) -> writer.WriteJob:
    """A hook's dump of realistic rows: slots differing by orders, a sink token."""
    storage = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)
    gen = torch.Generator().manual_seed(0)
    rid_dir = root / "ns" / "r"
    rid_dir.mkdir(parents=True)
    parts = [(s, min(s + PART_ROWS, tokens)) for s in range(0, tokens, PART_ROWS)]
    for start, end in parts:
        rows = torch.randn((end - start, 4, hidden), generator=gen)
        rows *= torch.tensor([0.05, 1.0, 30.0, 2.0]).view(1, 4, 1)
        if start == 0:
            rows[0, :, :8] *= 3000.0  # massive channels: what the outliers keep exact
        blob = b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes()
            for t in encode_rows(rows.to(torch.bfloat16), storage)
        )
        (rid_dir / part_name(start, end)).write_bytes(blob)
    meta = DumpMeta("r", tokens, hidden, AUX, tuple(parts), "m", "bench", storage=storage)
    (rid_dir / META_NAME).write_bytes(meta.to_json())
    layout = build_layout(sample_id="b", num_tokens=tokens, hidden_size=hidden,
                          aux_layers=AUX, has_loss_mask=False, storage=storage)  # fmt: skip
    sample = Sample("b", 0, np.arange(tokens, dtype=np.int64), None)
    return writer.WriteJob(sample, Dump(rid_dir, meta), layout, data_relpath("b"), "bench")


@contextmanager
def unchecked() -> Iterator[None]:
    """The copy with its outlier check made a no-op (everything else as it is)."""
    real = writer._OutlierWatch.__call__  # the one thing measured
    writer._OutlierWatch.__call__ = lambda self, view, at: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        writer._OutlierWatch.__call__ = real  # type: ignore[method-assign]


def copy_round(fw: writer.FileWriter, job: writer.WriteJob) -> tuple[float, float]:
    """(GB/s, CPU s/GB) of one stage of the dump; its temp file deleted after."""
    t0, c0 = time.monotonic(), time.process_time()
    staged = fw.stage(job)
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    fw.forget(staged)
    gb = job.layout.total_bytes / 1e9
    return gb / wall, cpu / gb


def measure(shm: Path, out: Path, tokens: int, hidden: int, rounds: int) -> dict[str, Any]:
    job = make_dump(shm, tokens, hidden)
    result: dict[str, Any] = {"bytes": job.layout.total_bytes, "methods": {}}
    for method in ("direct", "sendfile"):
        fw = writer.FileWriter(out, method=method, fsync=False, row_bytes=4 * hidden * 2)
        try:
            copy_round(fw, job)  # warm: the buffers, the page cache of the dump
            sides: dict[str, list[tuple[float, float]]] = {"checked": [], "unchecked": []}
            for r in range(rounds):
                for name in ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked"):
                    if name == "checked":
                        sides[name].append(copy_round(fw, job))
                    else:
                        with unchecked():
                            sides[name].append(copy_round(fw, job))
        finally:
            fw.close()
        result["methods"][method] = summary(sides)
    return result


def summary(sides: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    pairs = list(zip(sides["checked"], sides["unchecked"], strict=True))
    cpu = [c[1] / u[1] for c, u in pairs]
    speed = [c[0] / u[0] for c, u in pairs]
    return {
        "gb_per_s": {k: [g for g, _ in v] for k, v in sides.items()},
        "cpu_s_per_gb": {k: [c for _, c in v] for k, v in sides.items()},
        "cpu_ratios": cpu,
        "speed_ratios": speed,
        "cpu_ratio_median": statistics.median(cpu),
        "speed_ratio_median": statistics.median(speed),
    }


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out-dir", type=Path, default=Path("/var/tmp/hsx-bench"))
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.rounds = 64, 1024, 2
    torch.set_num_threads(1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shm = Path(tempfile.mkdtemp(prefix="hsx-fp8-check-", dir=args.shm_dir))
    out = Path(tempfile.mkdtemp(prefix="hsx-fp8-check-", dir=args.out_dir))
    try:
        result = measure(shm, out, args.tokens, args.hidden, args.rounds)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    rows = [
        [method, statistics.median(m["gb_per_s"]["unchecked"]),
         statistics.median(m["cpu_s_per_gb"]["unchecked"]), m["speed_ratio_median"],
         m["cpu_ratio_median"]]
        for method, m in result["methods"].items()
    ]  # fmt: skip
    table = print_table(
        f"FP8 outliers copy, {args.tokens} tokens × H {args.hidden} "
        f"({result['bytes'] / 1e6:.0f} MB), {args.rounds} rounds each way: the outlier check "
        "(checked / unchecked, medians of the per-round ratios)",
        ["method", "GB/s unchecked", "CPU s/GB unchecked", "GB/s ratio", "CPU/GB ratio"],
        rows,
    )
    info = machine_info(args.out_dir, args.shm_dir)
    save_results(args.results_dir, "fp8_copy_check", {"machine": info, **result}, [table])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
