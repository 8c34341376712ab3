"""``hsx front speculators|specforge``: hsx as the capture side of a trainer's online
pipeline (speculators' trainer, SpecForge's producer and consumer)."""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:8000"  # vLLM's port, which speculators' trainer calls
DEFAULT_SPECFORGE_LISTEN = "127.0.0.1:30000"  # SGLang's, which SpecForge's producer calls
DEFAULT_MASTER = "127.0.0.1:50051"  # hs-connectors' own default


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "front",
        help="answer a trainer's online requests from hsx (speculators or SpecForge, over "
        "Mooncake)",
        description=(
            "Serve /v1/models and /v1/completions as speculators' online trainer calls them "
            "(token ids, max_tokens=1, return_token_ids), extract each prompt through hsx "
            "from the servers of --config, and publish the sample to Mooncake Store in "
            "hs-connectors 0.9.0's format (a failure as its {handle}:error marker). Point "
            "the trainer at --listen with --hidden-states-backend mooncake. Samples live in "
            "this process's Mooncake segment: keep it up while the trainer reads. The servers "
            "are admitted and taken out of rotation as hsx run does; /metrics on the same "
            "port counts requests, failures and what Mooncake holds. "
            "With specforge: serve /generate as SpecForge 0.2.0's online producer calls a "
            "spec-capture SGLang (its spec_capture request and answer), publish each feature "
            "as the raw hard-pinned object its MooncakeFeatureStore reads (aux layers "
            "concatenated, the post-norm final state, its passthrough tensors), and keep "
            "them until SpecForge removes them; point its producer's server URL at --listen "
            "(default 127.0.0.1:30000)."
        ),
    )
    p.add_argument(
        "trainer", choices=["speculators", "specforge"], help="whose online pipeline to feed"
    )
    p.add_argument("--config", required=True, help="hsx config (its [server], [model], [dump])")
    p.add_argument(
        "--model",
        default=None,
        help="the target model's local HF directory: its final norm converts the servers' "
        "final state to the trainer's (pre-norm for speculators, post-norm for SpecForge); "
        "specforge needs it: the target's family decides the layer ids SpecForge checks",
    )
    p.add_argument(
        "--listen",
        default=None,
        help=f"HOST:PORT to listen on (default {DEFAULT_LISTEN} for speculators, "
        f"{DEFAULT_SPECFORGE_LISTEN} for specforge)",
    )
    p.add_argument(
        "--served-model-name", default="", help="the model name speculators' trainer asks for"
    )
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
