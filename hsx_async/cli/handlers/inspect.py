"""``hsx inspect``: :func:`hsx_async.dataset.audit.inspect_path` of each file, printed."""

from __future__ import annotations

import argparse

from hsx_async.dataset.audit import inspect_path


def inspect_command(args: argparse.Namespace) -> int:
    for path in args.files:
        print(inspect_path(path))
    return 0
