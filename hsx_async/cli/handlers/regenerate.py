"""``hsx regenerate``'s handler: the config, the logging, one regenerate, its summary
printed (lines, or one JSON object)."""

from __future__ import annotations

import argparse
import sys

import orjson
import uvloop

from hsx_async.config import load_config
from hsx_async.errors import ArgumentError
from hsx_async.logs import configure_logging
from hsx_async.prepare.regenerate.run import regenerate


def regenerate_command(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    if not args.input.is_file():
        raise ArgumentError("INPUT", f"{args.input} is not a file")
    summary = uvloop.run(
        regenerate(
            config,
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            handle_signals=True,
        )
    )
    if args.json:
        sys.stdout.write(orjson.dumps(summary.to_json()).decode() + "\n")
    else:
        print("\n".join(summary.lines()))
    return 0
