"""``hsx run``: extract hidden states for every sample of the input."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="extract hidden states for every sample of the input")
    p.add_argument("--config", required=True, help="TOML config file (see README)")
    p.add_argument(
        "--allow-provenance-change",
        action="store_true",
        help="resume even though the input or model differs from the dataset's",
    )
    p.add_argument(
        "--no-report",
        action="store_true",
        help="do not write OUT/report.png and report.json at the end (see `hsx report`)",
    )
    p.set_defaults(handler="hsx_async.cli.handlers.run:run_command")
