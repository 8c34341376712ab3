"""What servers say against the config, and whose fault that is (issue 38). Pure.

A server that reports another shape than the config (its info endpoint's hidden size or
layers, the dump root it writes under, the engine it is) is either misconfigured itself or
proof that the *config* is wrong. One rule decides, for ``hsx run``'s admission and
``hsx check`` alike: the config is wrong only when every server has been heard from and
all of them say the same thing against it; one wrong server among right ones — or servers
that disagree among themselves — is the fault of the servers that disagree: they are
refused, and the job goes on with the others (or waits for them). A server not heard from
yet (not up, unreachable) does not count for either side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hsx_async.config import Config
from hsx_async.errors import ConfigError


@dataclass(frozen=True)
class Claim:
    """``server`` disagrees with the config on ``key``: it said ``said``; ``message``
    tells the operator what to change (it names the server and the key's value)."""

    server: str
    key: str
    said: str
    message: str


def info_claim(config: Config, server: str, info: Mapping[str, object]) -> Claim | None:
    """What a server reports about its shape (its info endpoint), against the config."""
    model = config.model
    hidden, layers = info.get("hidden_size"), info.get("aux_layers")
    if type(hidden) is int and hidden != model.hidden_size:
        return Claim(
            server,
            "model.hidden_size",
            str(hidden),
            f"is {model.hidden_size}, but {server} reports hidden size {hidden} (its info "
            f"endpoint); set [model].hidden_size = {hidden}, or point [server].urls at the "
            "job's model",
        )
    if isinstance(layers, list) and layers != list(model.aux_layers):
        return layers_claim(config, server, layers, "its info endpoint")
    return None


def layers_claim(config: Config, server: str, layers: object, where: str) -> Claim:
    ours = list(config.model.aux_layers)
    shown = list(layers) if isinstance(layers, list | tuple) else layers
    return Claim(
        server,
        "model.aux_layers",
        str(shown),
        f"is {ours}, but {server} captures {shown} ({where}); set [model].aux_layers = "
        f"{shown}, or start the server with HSX_AUX_LAYERS={','.join(map(str, ours))}",
    )


def job_fault(heard: Mapping[str, Claim | None], servers: Sequence[str]) -> ConfigError | None:
    """The config's fault, when there is one: every server of ``servers`` has been heard
    from (``heard``: its latest answer's claim against the config, None when it raised
    none) and every one said the same against the config. The error names which server
    said what."""
    if not servers or any(s not in heard for s in servers):
        return None  # a server not heard from yet does not count
    claims = [heard[s] for s in servers]
    first = claims[0]
    if first is None or any(c is None or (c.key, c.said) != (first.key, first.said)
                            for c in claims):  # fmt: skip
        return None
    if len(claims) == 1:
        return ConfigError(first.key, first.message)
    said = ", ".join(c.server for c in claims if c is not None)
    return ConfigError(first.key, f"{first.message} (every server says {first.said}: {said})")


def server_fault(claim: Claim, heard: Mapping[str, Claim | None]) -> str:
    """Why one server that disagrees with the config is refused while the config stands
    (or is not decided yet): what it said, and what the others said."""
    others = [
        f"{url} {'agrees with the config' if c is None else 'says ' + c.said}"
        for url, c in heard.items()
        if url != claim.server
    ]
    tail = f" ({'; '.join(others)})" if others else ""
    return f"config key {claim.key!r} {claim.message}{tail}"
