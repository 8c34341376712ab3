"""``hsx front speculators``: hsx as the capture side of speculators' online trainer."""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:8000"
DEFAULT_MASTER = "127.0.0.1:50051"  # hs-connectors' own default


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "front",
        help="answer a trainer's online requests from hsx (speculators over Mooncake)",
        description=(
            "Serve /v1/models and /v1/completions as speculators' online trainer calls them "
            "(token ids, max_tokens=1, return_token_ids), extract each prompt through hsx "
            "from the servers of --config, and publish the sample to Mooncake Store in "
            "hs-connectors 0.9.0's format (a failure as its {handle}:error marker). Point "
            "the trainer at --listen with --hidden-states-backend mooncake. Samples live in "
            "this process's Mooncake segment: keep it up while the trainer reads. The servers "
            "are admitted and taken out of rotation as hsx run does; /metrics on the same "
            "port counts requests, failures and what Mooncake holds."
        ),
    )
    p.add_argument("trainer", choices=["speculators"], help="whose online pipeline to feed")
    p.add_argument("--config", required=True, help="hsx config (its [server], [model], [dump])")
    p.add_argument(
        "--model",
        default=None,
        help="the target model's local HF directory: its final norm converts a post-norm "
        "final state to the pre-norm one speculators reads",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to listen on")
    p.add_argument("--served-model-name", default="", help="the model name the trainer asks for")
    p.add_argument("--mooncake-master", default=DEFAULT_MASTER, help="mooncake_master HOST:PORT")
    p.add_argument(
        "--mooncake-host", default="127.0.0.1", help="this host's address, as trainers reach it"
    )
    p.add_argument(
        "--mooncake-protocol", choices=["tcp", "rdma"], default="tcp", help="Mooncake transport"
    )
    p.add_argument(
        "--mooncake-segment-mib", type=int, default=1024, help="memory for unread samples"
    )
    p.add_argument(
        "--mooncake-buffer-mib", type=int, default=256, help="the largest sample it publishes"
    )
    p.set_defaults(handler="hsx_async.cli.handlers.front:front_command")
