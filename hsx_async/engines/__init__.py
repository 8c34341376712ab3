"""The inference engines hsx speaks to, and how each one's wire differs (PROTOCOL §2).

Everything after the HTTP call — dump validation, writer, manifest, resume, metrics — is the
same for every engine; only the requests, the response checks and the info endpoints
differ. One module per engine (:mod:`.sglang`, :mod:`.vllm`), each defining an
:class:`~.engine.Engine`; this registry lists them. A new engine is one module, its entry
here and its name in :data:`EngineName` (and, on the server side, its hook).

Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from hsx_async.engines import sglang, vllm
from hsx_async.engines.engine import Decoded, Decoding, Engine, Finish
from hsx_async.engines.vllm import VLLM_PARAM_RID, check_vllm_response, vllm_body

# The names [server].engine takes (config.py refuses any other with this list).
EngineName = Literal["sglang", "vllm"]

ENGINES: Mapping[EngineName, Engine] = {
    e.name: e
    for e in (
        sglang.ENGINE,
        vllm.ENGINE,
    )
}
ENGINE_NAMES: tuple[EngineName, ...] = tuple(ENGINES)

__all__ = [
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
