"""``hsx export``: the dataset in an existing trainer's offline format.

The formats are the registry's (:mod:`hsx_async.dataset.export.formats`, a table of names
that imports no format). The dtypes and SpecForge's group size are those of
:mod:`hsx_async.dataset.export`, restated here so that ``--help`` imports no export code
(``tests/cli/test_parsers.py`` holds them equal).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.dataset.export.formats import format_names

DTYPE_CHOICES = ("auto", "bfloat16", "float8_e4m3fn")
SPECFORGE_GROUP_SIZE = 2000  # SpecForge's --file-group-size default


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    formats = format_names()
    parser = subparsers.add_parser(
        "export",
        help=f"write the dataset in a trainer's offline format ({', '.join(formats)})",
        description=(
            "Export every sample of an hsx output directory (all shards) for an existing "
            "trainer. Streaming and resumable: run it again to finish an interrupted export "
            "or to add samples extracted since."
        ),
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT", help="hsx output directory")
    parser.add_argument("--format", required=True, choices=formats, help="target format")
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
        default="auto",
        help="hidden-state dtype of the files. auto: speculators gets the dataset's FP8 "
        "bytes unchanged when every slot is FP8 and the final state needs no conversion "
        "(train with --hidden-states-backend fp8), else bfloat16; SpecForge always gets "
        "bfloat16. bfloat16: always (a trainer without the fp8 backend). float8_e4m3fn: "
        "speculators gets FP8 always, the slots without FP8 bytes (kept bf16 slots, a "
        "converted final state, a bf16 dataset) quantized by the export",
    )
    parser.set_defaults(handler="hsx_async.cli.handlers.export:export_command")
