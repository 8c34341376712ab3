"""``hsx export``: the command line over :func:`~.driver.export_dataset`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.export.draft import DRAFT_CONFIG
from hsx_async.dataset.export.driver import ExportResult, export_dataset
from hsx_async.dataset.export.formats import FORMAT_NAMES, FORMATS
from hsx_async.dataset.export.plan import AUTO, DTYPE_CHOICES
from hsx_async.dataset.export.specforge import GROUP_SIZE as SPECFORGE_GROUP_SIZE


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
    fmt = FORMATS[result.fmt]
    print(
        f"exported {result.total} samples to {result.dest} ({result.fmt}): {result.written} "
        f"written ({result.bytes_written / 1e9:.2f} GB), {result.skipped} already there, "
        f"{result.seconds:.1f} s"
    )
    if result.converted:
        print(f"final state converted to {fmt.final_state} with the final norm of --model")
    print(f"hidden states written as {result.dtype}")
    if result.dtype_why:
        print(f"  (not FP8: {result.dtype_why})")
    if result.requantized:
        slots = ",".join(map(str, result.requantized))
        print(f"  (slot(s) {slots} quantized by the export: values the dataset holds no FP8 of)")
    print(f"{result.ids_line}\n  (written to {result.dest / DRAFT_CONFIG})")
    draft = orjson.loads((result.dest / DRAFT_CONFIG).read_bytes())
    print(fmt.hint(result.dest, result.dtype, draft))


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the dataset in SpecForge's or speculators' offline format",
        description=(
            "Export every sample of an hsx output directory (all shards) for an existing "
            "trainer. Streaming and resumable: run it again to finish an interrupted export "
            "or to add samples extracted since."
        ),
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT", help="hsx output directory")
    parser.add_argument("--format", required=True, choices=FORMAT_NAMES, help="target format")
    parser.add_argument(
        "--to", required=True, type=Path, dest="dest", metavar="DIR", help="directory to write"
    )
    parser.add_argument(
        "--file-group-size",
        type=int,
        default=SPECFORGE_GROUP_SIZE,
        metavar="N",
        help="specforge: files per rows_* directory (default: %(default)s, as SpecForge)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="the target model's local Hugging Face directory: its family gives the "
        "draft-config ids, its final norm converts the final state where the trainer "
        "reads the other kind (speculators: pre-norm)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=AUTO,
        help="hidden-state dtype of the files. auto: speculators gets the dataset's FP8 "
        "bytes unchanged when every slot is FP8 and the final state needs no conversion "
        "(train with --hidden-states-backend fp8), else bfloat16; SpecForge always gets "
        "bfloat16. bfloat16: always (a trainer without the fp8 backend). float8_e4m3fn: "
        "speculators gets FP8 always, the slots without FP8 bytes (kept bf16 slots, a "
        "converted final state, a bf16 dataset) quantized by the export",
    )
    parser.set_defaults(handler=export_command)
