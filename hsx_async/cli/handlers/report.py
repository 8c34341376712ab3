"""``hsx report``: :func:`hsx_async.run.report.numbers.write_report`, and where it wrote."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.logs import configure_logging
from hsx_async.run.report.numbers import write_report


def report_command(args: argparse.Namespace) -> int:
    configure_logging("auto", "warning")  # a skipped events line is said on stderr
    json_path, png_path, hint = write_report(Path(args.out), png=not args.no_png)
    print(f"report: {json_path}")
    if png_path is not None:
        print(f"report: {png_path}")
    if hint:
        print(f"hsx report: no PNG: {hint}")
    return 0
