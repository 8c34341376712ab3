"""``hsx inspect``: shapes, dtypes, metadata and statistics of sample files."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "inspect",
        help="show shapes, dtypes, metadata and statistics of sample files",
        description=(
            "Decode one or more dataset files (data/…/*.safetensors) and print their header, "
            "per-layer row-norm statistics and any NaN/Inf, zero rows or duplicated layers."
        ),
    )
    parser.add_argument(
        "files", nargs="+", type=Path, metavar="FILE", help="sample files (data/…/*.safetensors)"
    )
    parser.set_defaults(handler="hsx_async.cli.handlers.inspect:inspect_command")
