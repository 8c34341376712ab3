"""``hsx prepare``: conversations → samples with the assistant loss mask."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prepare",
        help="conversations (ShareGPT/OpenAI JSONL) → samples with the assistant loss mask",
        description=(
            "Render each conversation with the tokenizer's chat template and write PROTOCOL "
            "§1 samples whose loss_mask is 1 on exactly the assistant's tokens."
        ),
    )
    p.add_argument("input", type=Path, help="conversations, one JSON object a line")
    p.add_argument("--tokenizer", type=Path, required=True, help="local tokenizer directory")
    p.add_argument("--out", type=Path, required=True, help="samples JSONL to write")
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja template file")
    p.add_argument(
        "--system",
        choices=("keep", "drop", "override"),
        default="keep",
        help="the records' system prompts: keep them, drop them, or replace them with "
        "--system-prompt",
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        metavar="TEXT",
        help="a system prompt: with --system keep, given to the conversations that have none; "
        "with --system override, to every conversation in place of its own",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="default: [input].max_tokens")
    p.add_argument(
        "--length-policy",
        choices=("skip", "truncate"),
        default="skip",
        help="a conversation over --max-tokens: quarantine it (skip) or cut it at the limit "
        "(truncate); either is counted in the summary",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes encoding in parallel (default: one per CPU, %(default)s here)",
    )
    p.add_argument(
        "--quarantine",
        type=Path,
        default=None,
        help="where the refused conversations go, one JSON line each (id, line, reason) "
        "(default: beside --out, its name ending .quarantine.jsonl instead of .jsonl)",
    )
    p.add_argument("--config", type=Path, default=None, help="job.toml: size estimate")
    p.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object instead"
    )
    p.set_defaults(handler="hsx_async.cli.handlers.prepare:prepare_command")
