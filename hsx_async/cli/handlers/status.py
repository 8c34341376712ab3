"""``hsx status``: :func:`hsx_async.dataset.inspection.dataset_status`, printed."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.dataset.inspection import dataset_status
from hsx_async.logs import configure_logging


def status_command(args: argparse.Namespace) -> int:
    configure_logging("auto", "warning")  # a skipped events line is said on stderr
    print(dataset_status(Path(args.out)).format())
    return 0
