"""``hsx merge``: :func:`hsx_async.dataset.merge.merge`, and what it did."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.dataset.merge import merge
from hsx_async.units import human_bytes


def merge_command(args: argparse.Namespace) -> int:
    result = merge([Path(s) for s in args.sources], Path(args.to))
    print(
        f"merged {result.copied} samples ({human_bytes(result.bytes)}), {result.skipped} already "
        f"there, {result.quarantined} quarantine lines → {args.to}"
    )
    return 0
