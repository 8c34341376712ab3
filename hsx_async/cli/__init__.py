"""``hsx``: the command line, a thin layer (STYLE 4b). The only place that exits or turns
errors into exit codes.

Each command has a parser module here, named after it (``hsx_async.cli.run`` for ``hsx
run``): its ``add_parser(subparsers)`` declares the options and names the handler as
``"module:function"``, a callable ``(argparse.Namespace) -> int``, in
:mod:`hsx_async.cli.handlers` (``hsx_async.cli.handlers.export:export_command``): it calls
the domain with typed arguments, prints and chooses the exit code. The parser modules
import only the standard library (and the export formats' table of names), so ``hsx
--help`` and ``hsx <command> --help`` load no domain module; the handler's module is
imported when its command runs (``tests/cli/test_help_imports.py`` holds both).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from hsx_async import __version__
from hsx_async.cli import (
    check,
    demo,
    export,
    fake_server,
    front,
    inspect,
    merge,
    prepare,
    quarantine,
    reference_server,
    regenerate,
    report,
    run,
    samples,
    serve,
    status,
    verify,
)
from hsx_async.cli.help import CommandParser
from hsx_async.errors import ForcedExit, HsxError, NoServerError

# Order is the order of ``hsx --help``.
COMMANDS = (
    run,
    check,
    prepare,
    regenerate,
    status,
    quarantine,
    verify,
    report,
    merge,
    demo,
    samples,
    export,
    serve,
    front,
    inspect,
    fake_server,
    reference_server,
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Extract EAGLE-3 hidden states from SGLang into a dataset."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def load_handler(spec: str) -> Handler:
    """``"package.module:function"`` → the function (its module imported now)."""
    module, _, name = spec.partition(":")
    handler: Handler = getattr(importlib.import_module(module), name)
    return handler


# hsx makes no BLAS call, but numpy's OpenBLAS starts a thread per core at import that
# spins for a while: ~0.08 CPU-s of every command's start-up on this machine kind. An
# explicit setting is kept.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(*BLAS_THREADS)  # before any handler imports numpy
    args = build_parser().parse_args(argv)
    try:
        code: int = load_handler(args.handler)(args)
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
