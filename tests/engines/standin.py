"""A third engine, for the tests only: the whole of what a new engine is on the client side,
one descriptor and its line in the registry (:data:`hsx_async.engines.ENGINES`).

It speaks SGLang's bodies at paths of its own, so a request that reached SGLang's paths
would be a 404 of the fake server that serves it (:data:`FAKE_PATHS`). Run as a module it
is ``hsx`` with the stand-in registered: ``python -m tests.engines.standin run --config X``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hsx_async.engines import ENGINES, sglang
from hsx_async.engines.engine import Engine
from hsx_async.server.fake.server import FakePaths

ENGINE: Engine = dataclasses.replace(
    sglang.ENGINE,
    name="standin",
    generate_path="/standin/generate",
    model_info_path="/standin/model_info",
    version_path="/standin/server_info",
    decode_path="/standin/generate",
    deploy="deploy/standin",
)

# The fake server answering this engine's paths (and no other engine's).
FAKE_PATHS = FakePaths(
    generate=ENGINE.generate_path,
    model_info=ENGINE.model_info_path,
    server_info=ENGINE.version_path,
)


@contextmanager
def registered() -> Iterator[Engine]:
    """The stand-in in the registry for the block (the one line a real engine adds)."""
    ENGINES[ENGINE.name] = ENGINE
    try:
        yield ENGINE
    finally:
        del ENGINES[ENGINE.name]


def main(argv: Sequence[str]) -> int:
    from hsx_async.cli import main as hsx

    with registered():
        return hsx(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
