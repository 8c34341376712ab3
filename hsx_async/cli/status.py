"""``hsx status``: what an output directory holds."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="what an output directory holds")
    p.add_argument("out", help="output directory ([output].dir)")
    p.set_defaults(handler="hsx_async.cli.handlers.status:status_command")
