"""The engine hooks hsx ships, one :class:`HookSpec` each: the registry a hook for a new
engine adds its one line to (``README.md`` in this package says what a hook implements;
``tests/server/test_hooks.py`` holds every hook listed here to it).

Pure: importing it loads no engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hsx_async.protocol import POST_NORM, PRE_NORM


@dataclass(frozen=True, slots=True)
class HookSpec:
    """One engine's hook."""

    engine: str  # the client's [server].engine for this engine (hsx_async.engines)
    final_state: str  # what the last layer slot of its dumps holds (PROTOCOL §3)
    entry: str  # what the engine is told to load ("module:attribute"), as deploy/ names it
    core: str  # the glue's engine-free part: marks, layers, dumps; tested without the engine


HOOKS: Mapping[str, HookSpec] = {
    spec.engine: spec
    for spec in (
        # --forward-hooks: every scheduler process calls the factory while it builds its
        # model runner; the dumps hold the post-norm state SGLang's logits processor sees.
        HookSpec(
            engine="sglang",
            final_state=POST_NORM,
            entry="hsx_async.server.sglang_hook:hsx_hook_factory",
            core="hsx_async.server.sglang.hook",
        ),
        # --kv-transfer-config: a KV connector on the extract_hidden_states method, whose
        # last captured id is the residual stream entering the final norm.
        HookSpec(
            engine="vllm",
            final_state=PRE_NORM,
            entry="hsx_async.server.vllm.connector:HsxHiddenStatesConnector",
            core="hsx_async.server.vllm.core",
        ),
    )
}
