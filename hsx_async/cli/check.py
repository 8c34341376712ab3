"""``hsx check``: the preflight of a job."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check", help="preflight: config, input, disks, servers, dump path, estimate"
    )
    p.add_argument("--config", required=True, help="TOML config file")
    p.add_argument(
        "--consumer-rate",
        type=_rate,
        metavar="TOKENS/S",
        help='with retention = "acked": the consumers\' rate, all ranks together (the '
        "slowest consumer); estimates the spool the job needs",
    )
    p.add_argument(
        "--ack-interval",
        type=_rate,
        default=60.0,
        metavar="SECONDS",
        help="how often the consumers acknowledge (a checkpoint or optimizer step; default 60)",
    )
    p.add_argument(
        "--extraction-rate",
        type=_rate,
        metavar="TOKENS/S",
        help="use this extraction rate for the spool estimate instead of the measured one",
    )
    p.set_defaults(handler="hsx_async.cli.handlers.check:check_command")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value
