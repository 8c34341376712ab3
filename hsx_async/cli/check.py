"""``hsx check``: the preflight of a job."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check", help="preflight: config, input, disks, servers, dump path, estimate"
    )
    p.add_argument("--config", required=True, help="TOML config file")
    p.set_defaults(handler="hsx_async.run.preflight:check_command")
