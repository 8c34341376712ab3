"""``hsx reference-server``: the hsx protocol served by a real transformers model on the CPU.

Its defaults are :class:`hsx_async.server.reference.server.ReferenceOptions`'s, restated
here so that ``--help`` imports no server module (``tests/server/reference`` holds them
equal).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _default_threads() -> int:
    # Leave a core to the event loop and to an hsx client on the same machine.
    return max(1, (os.cpu_count() or 2) - 1)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "reference-server",
        help="serve the hsx protocol with a real transformers model on the CPU",
        description=(
            "An SGLang stand-in that answers POST /generate like SGLang with the hsx hook and "
            "dumps REAL hidden states of a transformers causal LM (default: a tiny Llama "
            "built from --seed, no download)."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=30000, help="listen port")
    p.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model directory (default: the built-in tiny Llama)",
    )
    p.add_argument(
        "--aux-layers",
        default=None,
        help="layers to capture, comma-separated, e.g. 1,3,5 (default: SGLang's EAGLE-3 "
        "choice 2,L/2,L-3 for L layers; 1,3,5 for the built-in model)",
    )
    p.add_argument(
        "--dump-root",
        type=Path,
        default=None,
        help="where dumps go (default: $HSX_DUMP_ROOT, read as every hook reads it, or "
        "/dev/shm/hsx)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=64,
        help="most rows of one request per pass",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=256,
        help="tokens of one batched pass",
    )
    p.add_argument("--seed", type=int, default=0, help="weights of the built-in model")
    p.add_argument(
        "--threads",
        type=int,
        default=_default_threads(),
        help="torch threads (default: the CPUs less one, %(default)s here)",
    )
    p.set_defaults(handler="hsx_async.server.reference.server:reference_server_command")
