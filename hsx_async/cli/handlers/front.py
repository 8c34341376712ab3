"""``hsx front speculators``: the front's options, :func:`hsx_async.front.speculators.serve`,
and the URL it serves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

from hsx_async.config import load_config
from hsx_async.front.mooncake import MooncakeOptions
from hsx_async.front.speculators import conversion, serve
from hsx_async.logs import configure_logging


def front_command(args: argparse.Namespace) -> int:
    """``hsx front speculators`` (``hsx_async.cli.front``)."""
    configure_logging("auto", "info")
    config = load_config(Path(args.config))
    options = MooncakeOptions(
        master=args.mooncake_master,
        local_hostname=args.mooncake_host,
        protocol=args.mooncake_protocol,
        segment_bytes=args.mooncake_segment_mib << 20,
        buffer_bytes=args.mooncake_buffer_mib << 20,
    )
    name = args.served_model_name or config.model.name or "hsx"

    def announce(url: str) -> None:
        print(f"hsx front speculators: serving {name} on {url}", flush=True)

    model = Path(args.model) if args.model else None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(
                config,
                options,
                listen=args.listen,
                model_name=name,
                final=conversion(model),
                on_bound=announce,
            )
        )
    return 0
