"""``hsx report``: the one-page job report of an output directory."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="one-page job report of an output directory (report.png + report.json)",
        description=(
            "Write OUT/report.json and OUT/report.png: rate over time, quarantine reasons, "
            "per-server share and retries, from the manifests, the quarantine and the "
            "events log hsx run keeps. Safe while a run is going."
        ),
    )
    p.add_argument("out", help="output directory ([output].dir)")
    p.add_argument("--no-png", action="store_true", help="write report.json only")
    p.set_defaults(handler="hsx_async.cli.handlers.report:report_command")
