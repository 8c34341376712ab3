"""``hsx serve``: :func:`hsx_async.dataset.live.http.run_serve`, and the URL it serves."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.dataset.live.http import Limits, run_serve
from hsx_async.logs import configure_logging


def serve_command(args: argparse.Namespace) -> int:
    configure_logging("auto", "info")
    out = Path(args.out)
    limits = Limits(max_streams=args.max_streams, max_connections=args.max_connections)

    def announce(url: str) -> None:
        print(f"hsx serve: {out} on {url}", flush=True)

    run_serve(
        out,
        args.listen,
        limits=limits,
        secret_file=args.secret_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        on_bound=announce,
    )
    return 0
