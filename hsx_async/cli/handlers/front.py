"""``hsx front speculators|specforge``: the front's options, its ``serve``
(:mod:`hsx_async.front.speculators`, :mod:`hsx_async.front.specforge`), and the URL it
serves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from hsx_async.cli.front import DEFAULT_LISTEN, DEFAULT_SPECFORGE_LISTEN
from hsx_async.config import load_config
from hsx_async.front import specforge, speculators
from hsx_async.front.extract import final_conversion
from hsx_async.front.mooncake import MooncakeOptions
from hsx_async.logs import configure_logging
from hsx_async.protocol import POST_NORM


def front_command(args: argparse.Namespace) -> int:
    """``hsx front speculators|specforge`` (``hsx_async.cli.front``)."""
    configure_logging("auto", "info")
    config = load_config(Path(args.config))
    options = MooncakeOptions(
        master=args.mooncake_master,
        local_hostname=args.mooncake_host,
        protocol=args.mooncake_protocol,
        segment_bytes=args.mooncake_segment_mib << 20,
        buffer_bytes=args.mooncake_buffer_mib << 20,
    )
    model = Path(args.model) if args.model else None

    def announce(what: str, url: str) -> None:
        print(f"hsx front {args.trainer}: {what} on {url}", flush=True)

    serving: Coroutine[Any, Any, None]
    if args.trainer == "specforge":
        what = "capturing for SpecForge's producer"
        serving = specforge.serve(
            config,
            options,
            listen=args.listen or DEFAULT_SPECFORGE_LISTEN,
            final=final_conversion(POST_NORM, model),
            layer_ids=specforge.capture_layer_ids(config, model),
            on_bound=lambda url: announce(what, url),
        )
    else:
        name = args.served_model_name or config.model.name or "hsx"
        what = f"serving {name}"
        serving = speculators.serve(
            config,
            options,
            listen=args.listen or DEFAULT_LISTEN,
            model_name=name,
            final=speculators.conversion(model),
            on_bound=lambda url: announce(what, url),
        )

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serving)
    return 0
