"""``hsx serve``: a live dataset for trainers on other nodes (PROTOCOL §6.4)."""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:9470"
MAX_STREAMS = 8


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a live dataset (leases, acks, sample files) to trainers on other nodes",
        description=(
            "Serve OUT's samples to LiveDataset readers elsewhere (LiveDataset('http://HOST:"
            "PORT', consumer=...)): leases and acknowledgements in OUT's consumer logs, files "
            "checked against the manifest on arrival. Runs beside hsx run, or after it; "
            "stopped and started again, it goes on from the logs."
        ),
    )
    p.add_argument("out", help="output directory ([output].dir)")
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help="HOST:PORT to listen on (0.0.0.0:PORT for trainers on other nodes)",
    )
    p.add_argument("--max-streams", type=int, default=MAX_STREAMS, help="sample files sent at once")
    p.set_defaults(handler="hsx_async.dataset.live.serve:serve_command")
