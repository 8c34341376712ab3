"""``hsx check``'s handler: the checks run, their report printed, exit 1 when one failed."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.config import load_config
from hsx_async.run.check.preflight import run_checks
from hsx_async.run.check.spool_estimate import SpoolRates


def check_command(args: argparse.Namespace) -> int:
    rates = SpoolRates(args.consumer_rate, args.ack_interval, args.extraction_rate)
    report = run_checks(load_config(Path(args.config)), rates)
    print(report.format())
    return 1 if report.failed else 0
