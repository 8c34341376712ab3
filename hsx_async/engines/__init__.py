"""The inference engines hsx speaks to, and how each one's wire differs (PROTOCOL §2).

Everything after the HTTP call — dump validation, writer, manifest, resume, metrics — is the
same for every engine; only the requests, the response checks, the info endpoints and the
words of a diagnosis differ. One module per engine (:mod:`.sglang`, :mod:`.vllm`), each
defining an :class:`~.engine.Engine`; this registry lists them. A new engine is one module
and its line in :data:`ENGINES`: ``[server].engine`` takes the names listed here
(:mod:`hsx_async.config`), and nothing else names an engine (on the server side, the
engine's hook is its own module and line in :mod:`hsx_async.server.hooks`).
``tests/engines/standin.py`` is a third engine registered by the tests.

Pure: no sockets.
"""

from __future__ import annotations

from hsx_async.engines import sglang, vllm
from hsx_async.engines.engine import Decoded, Decoding, Engine, EngineName, Finish
from hsx_async.engines.vllm import VLLM_PARAM_RID, check_vllm_response, vllm_body

# [server].engine's default: what a config that names no engine runs.
DEFAULT_ENGINE: EngineName = sglang.ENGINE.name

# The names [server].engine takes (config.py refuses any other with this table's names). A
# dict: a test registers a stand-in engine into it (tests/engines/standin.py).
ENGINES: dict[EngineName, Engine] = {
    e.name: e
    for e in (
        sglang.ENGINE,
        vllm.ENGINE,
    )
}
ENGINE_NAMES: tuple[EngineName, ...] = tuple(ENGINES)  # the engines hsx ships

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "ENGINE_NAMES",
    "VLLM_PARAM_RID",
    "Decoded",
    "Decoding",
    "Engine",
    "EngineName",
    "Finish",
    "check_vllm_response",
    "engine",
    "vllm_body",
]


def engine(name: EngineName) -> Engine:
    return ENGINES[name]
