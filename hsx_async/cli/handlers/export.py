"""``hsx export``: :func:`hsx_async.dataset.export.driver.export_dataset`, its progress and
what it wrote."""

from __future__ import annotations

import argparse
import sys

import orjson

from hsx_async.dataset.export.draft import DRAFT_CONFIG
from hsx_async.dataset.export.driver import ExportResult, export_dataset
from hsx_async.dataset.export.format import export_format
from hsx_async.units import human_bytes


def export_command(args: argparse.Namespace) -> int:
    def report(done: int, total: int) -> None:
        if done % 1000 == 0 or done == total:
            print(f"hsx export: {done}/{total} samples", file=sys.stderr)

    result = export_dataset(
        args.out_dir,
        args.dest,
        fmt=args.format,
        file_group_size=args.file_group_size,
        model=args.model,
        dtype=args.dtype,
        progress=report,
    )
    _print_result(result)
    return 0


def _print_result(result: ExportResult) -> None:
    fmt = export_format(result.fmt)
    print(
        f"exported {result.total} samples to {result.dest} ({result.fmt}): {result.written} "
        f"written ({human_bytes(result.bytes_written)}), {result.skipped} already there, "
        f"{result.seconds:.1f} s"
    )
    if result.converted:
        print(f"final state converted to {fmt.final_state} with the final norm of --model")
    print(f"hidden states written as {result.dtype}")
    if result.dtype_why:
        print(f"  (not FP8: {result.dtype_why})")
    if result.requantized:
        slots = ",".join(map(str, result.requantized))
        print(
            f"  (slot(s) {slots} quantized by the export, one scale per token and layer: "
            "values the dataset holds no such FP8 of)"
        )
    print(f"{result.ids_line}\n  (written to {result.dest / DRAFT_CONFIG})")
    draft = orjson.loads((result.dest / DRAFT_CONFIG).read_bytes())
    print(fmt.hint(result.dest, result.dtype, draft))
