"""``hsx prepare``: the options checked, :func:`hsx_async.prepare.pipeline.run_prepare`, and
its summary printed (for a person, or as one JSON line)."""

from __future__ import annotations

import argparse
import contextlib
import sys

import orjson

from hsx_async.errors import ArgumentError
from hsx_async.prepare.encode import EncodeOptions
from hsx_async.prepare.pipeline import PreparePaths, estimate_from_config, run_prepare
from hsx_async.prepare.summary import describe


def _check_arguments(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ArgumentError("--workers", f"is {args.workers}, expected at least 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ArgumentError("--max-tokens", f"is {args.max_tokens}, expected at least 1")
    if not args.input.is_file():
        raise ArgumentError("INPUT", f"{args.input} is not a file")
    if args.system == "override" and not args.system_prompt:
        raise ArgumentError(
            "--system override",
            "needs --system-prompt TEXT, the system prompt to put in every conversation",
        )


def prepare_command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    estimate = estimate_from_config(args.config)
    max_tokens = args.max_tokens or (estimate or {}).get("max_tokens") or 32768
    options = EncodeOptions(
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        system=args.system,
        system_prompt=args.system_prompt,
        max_tokens=max_tokens,
        length_policy=args.length_policy,
    )
    paths = PreparePaths.beside(args.input, args.out, args.quarantine)
    summary = run_prepare(options, paths, workers=args.workers, estimate=estimate)
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        print(describe(summary))
    if not summary["samples"]:
        with contextlib.suppress(OSError):
            sys.stderr.write(f"hsx: no sample written; see {paths.quarantine}\n")
        return 1
    return 0
