"""``hsx verify``: every file re-hashed against the manifest (``--deep``: decoded too)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    v = sub.add_parser("verify", help="re-hash every file against the manifest")
    v.add_argument("out", help="output directory ([output].dir)")
    v.add_argument(
        "--deep", action="store_true", help="also decode tensors: NaN/Inf, zero rows, norms"
    )
    v.add_argument(
        "--fraction", type=float, default=1.0, help="with --deep: share of samples to decode"
    )
    v.add_argument("--plot", help="with --deep: write the per-layer norm plot (PNG) here")
    v.add_argument(
        "--repair",
        action="store_true",
        help="drop failing entries and their files so `hsx run` redoes them",
    )
    v.add_argument("--threads", type=int, default=2, help="hashing threads")
    v.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (the checks, and with --deep the audit: storage, "
        "per-layer statistics and FP8 error, problems, warnings) instead of text",
    )
    v.set_defaults(handler="hsx_async.cli.handlers.verify:verify_command")
