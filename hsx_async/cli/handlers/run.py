"""``hsx run``'s handler: the config, the logging, one :class:`~hsx_async.run.daemon.daemon.Daemon`
run, its summary and the job report printed, the exit code."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import uvloop

from hsx_async.config import load_config
from hsx_async.errors import HsxError
from hsx_async.logs import configure_logging
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.report.numbers import write_report


def run_command(args: argparse.Namespace) -> int:
    config = load_config(Path(args.config))
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    daemon = Daemon(config, allow_provenance_change=args.allow_provenance_change)
    # What start-up made (modules, the config) stays alive for the whole run: out of the
    # collector's sight, every collection of the run no longer walks it again.
    gc.freeze()
    summary = uvloop.run(daemon.run())
    print(summary.line())
    step = summary.next_step(config.path)
    if step:
        print(f"hsx: {step}")
    if not args.no_report:
        print_report(config.output.dir)
    if summary.unfinished and not summary.stopped:
        return 1
    return 0


def print_report(out: Path) -> None:
    """The job report after each run; a failure to draw it never fails the run."""
    try:
        json_path, png_path, hint = write_report(out)
    except (HsxError, OSError, ValueError) as exc:
        print(f"hsx: no job report: {exc}")
        return
    print(f"report: {png_path or json_path}" + (f" ({hint})" if hint else ""))
