"""``hsx quarantine``: the quarantine by cause and kind, and putting samples back."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quarantine",
        help="list quarantined samples by reason, or put them back for the next run",
        description=(
            "List the quarantine of an output directory by cause and kind; with --retry, put "
            "back the samples quarantined after failed attempts (or those of a --kind, or "
            "--all lines) so the next `hsx run` extracts them again. Each line put back is "
            "kept in quarantine-retried*.jsonl. Refused while a run writes the directory."
        ),
    )
    p.add_argument("out", help="output directory ([output].dir)")
    p.add_argument("--retry", action="store_true", help="put lines back (see --kind, --all)")
    p.add_argument(
        "--kind",
        action="append",
        metavar="TEXT",
        help="put back only lines whose kind contains TEXT (as listed: http_5xx, ...)",
    )
    p.add_argument(
        "--all", action="store_true", help="put back every line, the input's own faults too"
    )
    p.set_defaults(handler="hsx_async.cli.handlers.quarantine:quarantine_command")
