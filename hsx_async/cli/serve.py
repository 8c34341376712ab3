"""``hsx serve``: a live dataset for trainers on other nodes (PROTOCOL §6.4)."""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:9470"
MAX_STREAMS = 8
MAX_CONNECTIONS = 256


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a live dataset (leases, acks, sample files) to trainers on other nodes",
        description=(
            "Serve OUT's samples to LiveDataset readers elsewhere (LiveDataset('http://HOST:"
            "PORT', consumer=...)): leases and acknowledgements in OUT's consumer logs, files "
            "checked against the manifest on arrival. Runs beside hsx run, or after it; "
            "stopped and started again, it goes on from the logs. Readers other nodes run "
            "need the shared secret (Authorization: Bearer, on every endpoint /metrics "
            "included): --secret-file, or HSX_SERVE_SECRET_FILE / HSX_SERVE_SECRET in the "
            "environment, never on the command line."
        ),
    )
    p.add_argument("out", help="output directory ([output].dir)")
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help="HOST:PORT to listen on (0.0.0.0:PORT for trainers on other nodes: needs a secret)",
    )
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the shared secret (chmod 600, at least 16 characters; default: "
        "$HSX_SERVE_SECRET_FILE, else $HSX_SERVE_SECRET); readers send the same",
    )
    p.add_argument("--tls-cert", metavar="PEM", help="TLS certificate (chain): serve https://")
    p.add_argument("--tls-key", metavar="PEM", help="the TLS certificate's private key")
    p.add_argument("--max-streams", type=int, default=MAX_STREAMS, help="sample files sent at once")
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections at most (one more evicts the longest waiting one)",
    )
    p.set_defaults(handler="hsx_async.cli.handlers.serve:serve_command")
