"""``hsx verify``: :func:`~hsx_async.dataset.inspection.verify_dataset` (and ``--repair``,
``--deep``), printed for a person or as JSON; exit 1 when a problem is left."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from hsx_async.dataset.inspection import repair, verify_dataset


def verify_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    report = verify_dataset(out, threads=args.threads)
    as_json: dict[str, Any] = {"verify": report.to_dict()}
    if not args.json:
        print(report.format())
    ok = report.ok
    if args.repair and report.problems:
        dropped = repair(out, report.problems)
        as_json["repaired"] = dropped
        if not args.json:
            print(
                f"repaired: dropped {dropped} manifest entries; `hsx run` will extract them again"
            )
    if args.deep:
        # The audit decodes with torch: only --deep pays for loading it.
        from hsx_async.dataset.audit import audit_dataset  # noqa: PLC0415

        plot = Path(args.plot) if args.plot else None
        audit = audit_dataset(out, sample_fraction=args.fraction, plot_path=plot)
        as_json["deep"] = audit.to_dict()
        if not args.json:
            print(audit.format())
        ok = ok and not audit.problems
    if args.json:
        print(orjson.dumps(as_json, option=orjson.OPT_INDENT_2).decode())
    return 0 if ok else 1
