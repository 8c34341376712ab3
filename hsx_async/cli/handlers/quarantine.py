"""``hsx quarantine``: the quarantine's kinds listed (:func:`~hsx_async.dataset.quarantine.
kinds`), or lines put back (:func:`~hsx_async.dataset.quarantine.retry`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.dataset.inspection import require_dataset
from hsx_async.dataset.quarantine import RETRIED, kinds, retried_before, retry


def quarantine_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    require_dataset(out)
    if args.retry or args.kind or args.all:
        done = retry(out, kinds=args.kind or (), everything=args.all)
        for kind, count in done.by_kind.items():
            print(f"put back: {count:,}  {kind}")
        print(
            f"{done.lines:,} lines put back (history: {RETRIED}*.jsonl), {done.kept:,} still "
            "quarantined" + ("; run `hsx run` again to extract them" if done.lines else "")
        )
        return 0
    found = kinds(out)
    for k in found:
        label = "retriable" if k.retriable else "input    "
        example = k.example if len(k.example) <= 80 else k.example[:79] + "…"
        print(f"{k.count:>8,}  {label}  {k.cause or '?':<6}  {k.kind:<24}  e.g. {example}")
    total, retriable = sum(k.count for k in found), sum(k.count for k in found if k.retriable)
    hint = (
        f"`hsx quarantine {out} --retry` puts those back (--kind TEXT: by kind, --all: every line)"
        if retriable
        else "nothing for --retry to put back (the input's own faults would be quarantined "
        "again; --all puts them back anyway)"
        if total
        else "nothing to put back"
    )
    print(
        f"{total:,} quarantined, {retriable:,} after failed attempts; {hint}; "
        f"{retried_before(out):,} put back before"
    )
    return 0
