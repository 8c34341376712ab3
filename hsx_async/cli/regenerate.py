"""``hsx regenerate``: each assistant turn replaced with the target model's own answer."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "regenerate",
        help="replace each assistant turn with the target model's own answer",
        description=(
            "Turn by turn, send each conversation's prompt to the servers of [server] and "
            "keep the answer; durable and resumable like hsx run. Sampling: [regenerate]."
        ),
    )
    p.add_argument("input", type=Path, help="conversations (ShareGPT/OpenAI JSONL)")
    p.add_argument("--config", type=Path, required=True, help="job.toml ([server], [regenerate])")
    p.add_argument("--out", type=Path, required=True, help="regenerated conversations JSONL")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: regenerate.tokenizer")
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja template file")
    p.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object instead"
    )
    p.set_defaults(handler="hsx_async.cli.handlers.regenerate:regenerate_command")
