"""``hsx demo``: :func:`hsx_async.demo.run_demo` on the reference server, its steps and
what it made printed, the exit code the dataset's verification's."""

from __future__ import annotations

import argparse
from pathlib import Path

import uvloop

from hsx_async.dataset.inspection import verify_dataset
from hsx_async.demo import demo_samples, describe, run_demo
from hsx_async.logs import configure_logging
from hsx_async.run.report.numbers import write_report


def _say(text: str) -> None:
    print(f"  {text}", flush=True)


def demo_command(args: argparse.Namespace) -> int:
    configure_logging("auto", "warning")
    out = Path(args.out).resolve()
    samples = Path(args.samples) if args.samples else demo_samples()
    print(f"hsx demo: reference server (tiny Llama on CPU) → {samples.name} → {out}")
    summary, config = uvloop.run(run_demo(out, samples, say=_say))
    print(describe(summary, config))
    json_path, png_path, hint = write_report(out)
    print(f"report:    {png_path or json_path}" + (f" ({hint})" if hint else ""))
    return 0 if verify_dataset(out).ok else 1
