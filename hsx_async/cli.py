"""``hsx``: the command line. The only place that turns errors into exit codes.

Each subcommand lives in the module of its concept, which exposes
``register_cli(subparsers)``; that function adds a parser and sets ``handler`` to a
callable ``(argparse.Namespace) -> int``. Modules are imported here, so they must not
import torch or transformers at module level (``hsx --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from hsx_async import __version__
from hsx_async.errors import ForcedExit, HsxError, NoServerError

# Order is the order of ``hsx --help``.
COMMAND_MODULES = (
    "hsx_async.run.daemon",
    "hsx_async.run.preflight",
    "hsx_async.prepare.command",
    "hsx_async.prepare.regenerate",
    "hsx_async.dataset.inspection",
    "hsx_async.run.report",
    "hsx_async.dataset.merge",
    "hsx_async.run.demo",
    "hsx_async.samples",
    "hsx_async.dataset.export",
    "hsx_async.dataset.audit",
    "hsx_async.server.fake.server",
    "hsx_async.server.reference.server",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Extract EAGLE-3 hidden states from SGLang into a dataset."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except ForcedExit as exc:
        print(f"hsx: {exc}", file=sys.stderr)
        sys.stderr.flush()
        # Leave now: do not wait for I/O threads; every durable step is resumable.
        os._exit(130)
    except NoServerError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return 3
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
