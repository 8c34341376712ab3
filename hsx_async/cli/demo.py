"""``hsx demo``: the bundled samples extracted with the built-in reference model."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="extract the bundled samples with the built-in reference model")
    p.add_argument("--out", default="hsx-demo", help="output directory (default: ./hsx-demo)")
    p.add_argument("--samples", help="JSONL samples (default: the set shipped with hsx)")
    p.set_defaults(handler="hsx_async.cli.handlers.demo:demo_command")
