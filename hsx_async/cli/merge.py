"""``hsx merge``: shard outputs combined into one dataset."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("merge", help="combine shard outputs into one dataset")
    p.add_argument("sources", nargs="+", help="output directories of the shards")
    p.add_argument(
        "--to",
        required=True,
        metavar="DIR",
        help="destination directory (created; run again to resume an interrupted merge)",
    )
    p.set_defaults(handler="hsx_async.cli.handlers.merge:merge_command")
