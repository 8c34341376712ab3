"""``hsx samples``: :func:`hsx_async.samples.write_synthetic`, and what it wrote."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.samples import write_synthetic


def samples_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    samples, size = write_synthetic(
        out,
        count=args.count,
        max_len=args.max_len,
        min_len=args.min_len,
        vocab=args.vocab,
        seed=args.seed,
    )
    print(f"hsx samples: wrote {samples:,} samples ({size:,} bytes) to {out}")
    return 0
