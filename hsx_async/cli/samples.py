"""``hsx samples``: a synthetic samples file (JSONL input) of a given size."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "samples",
        help="write a synthetic samples file (JSONL input) of a given size",
        description=(
            "Write COUNT random samples (PROTOCOL §1: one JSON object with id and input_ids "
            "per line) to FILE. The same arguments always write the same file."
        ),
    )
    p.add_argument("--count", type=int, required=True, help="number of samples")
    p.add_argument("--max-len", type=int, default=512, help="longest sample, in tokens")
    p.add_argument(
        "--min-len", type=int, help="shortest sample, in tokens (default: 16, or --max-len)"
    )
    p.add_argument("--vocab", type=int, default=1024, help="token ids are drawn from [3, VOCAB)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--out", required=True, metavar="FILE", help="the JSONL file to write")
    p.set_defaults(handler="hsx_async.cli.handlers.samples:samples_command")
