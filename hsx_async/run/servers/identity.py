"""What a server is, and whether it is the job's. Pure.

A server's :class:`Identity` is what it says about itself at first contact (its info
endpoints: model path, revision, version) and in its first dump's ``meta.json`` (hidden
size, layers, final state, hook protocol, the model it names). A job is made of one
identity: the first server admitted pins it (or the dataset's ``provenance.json``, once
samples were made under it), and every other server — and every later ``meta.json`` of
every server — must match it in the pinned fields, or it is refused and never mixed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from hsx_async.errors import IdentityError
from hsx_async.protocol import DumpMeta

# Fields compared between servers (and with the dataset's record); the others are kept as
# a record of what served the job (an engine upgrade between resumes is not refused).
PINNED = ("engine", "model", "revision", "served_as", "hidden_size", "aux_layers",
          "final_state", "hook")  # fmt: skip
# Compared only when both sides know them: not every server reports them.
_WHEN_KNOWN = frozenset({"model", "revision"})
_WHAT = {
    "engine": "engine",
    "model": "model",
    "revision": "model revision",
    "served_as": "model (meta.json)",
    "hidden_size": "hidden size",
    "aux_layers": "aux layers",
    "final_state": "final state",
    "hook": "hook protocol",
}


@dataclass(frozen=True)
class Identity:
    engine: str
    model: str  # the model path its info endpoint reports ('' when it reports none)
    served_as: str  # the model its dumps name (meta.json "model")
    hidden_size: int
    aux_layers: tuple[int, ...]
    final_state: str
    hook: int  # the hook's protocol version (meta.json "protocol")
    revision: str = ""  # the model revision, when the server reports one
    server: str = ""  # the hook's "server" string: engine and version (recorded)
    version: str = ""  # the server's version endpoint (recorded)

    @classmethod
    def of(cls, engine: str, meta: DumpMeta, info: Mapping[str, str]) -> Identity:
        """From a dump's meta.json and what the info endpoints said (``model``,
        ``revision``, ``version``; any may be missing)."""
        return cls(
            engine=engine,
            model=info.get("model", ""),
            served_as=meta.model,
            hidden_size=meta.hidden_size,
            aux_layers=tuple(meta.aux_layers),
            final_state=meta.final_state,
            hook=meta.protocol,
            revision=info.get("revision", ""),
            server=meta.server,
            version=info.get("version", ""),
        )

    @classmethod
    def said(cls, engine: str, info: Mapping[str, str]) -> Identity:
        """From what the info endpoints said alone (a probe that dumps nothing: ``hsx
        regenerate``'s decode); the dump's fields stay empty and compare equal."""
        return cls(
            engine=engine,
            model=info.get("model", ""),
            served_as="",
            hidden_size=0,
            aux_layers=(),
            final_state="",
            hook=0,
            revision=info.get("revision", ""),
            version=info.get("version", ""),
        )

    def to_record(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["aux_layers"] = list(self.aux_layers)
        return raw

    @classmethod
    def from_record(cls, raw: object) -> Identity | None:
        """An identity as ``provenance.json`` holds it; None for anything else."""
        if not isinstance(raw, Mapping):
            return None
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        layers = values.get("aux_layers")
        if not isinstance(layers, list) or not all(type(x) is int for x in layers):
            return None
        if type(values.get("hidden_size")) is not int or type(values.get("hook")) is not int:
            return None
        values["aux_layers"] = tuple(layers)
        try:
            return cls(**values)
        except TypeError:  # a field missing
            return None

    def differences(self, other: Identity) -> list[str]:
        """The pinned fields in which ``other`` is not this identity, said as
        "<what> is <theirs>, not <mine>"."""
        found = []
        for name in PINNED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name in _WHEN_KNOWN and not (mine and theirs):
                continue
            if mine != theirs:
                shown = list(theirs) if isinstance(theirs, tuple) else theirs
                expected = list(mine) if isinstance(mine, tuple) else mine
                found.append(f"{_WHAT[name]} is {shown!r}, not {expected!r}")
        return found


@dataclass(frozen=True)
class JobRecord:
    """What the dataset already says about the job's servers (``provenance.json``)."""

    identity: Identity | None = None  # pinned by the samples made under it
    model: str = ""  # an older dataset's record: the model path only
    has_samples: bool = False  # the dataset holds samples made with this config's shape


def check_dump(identity: Identity, meta: DumpMeta, where: str) -> None:
    """A dump's ``meta.json`` against the identity its server was admitted with: a server
    restarted with another checkpoint or hook between two requests is caught at its first
    dump (:class:`IdentityError`: the server leaves rotation, the sample is not charged)."""
    changed = []
    if meta.model != identity.served_as:
        changed.append(f"model {meta.model!r} (was {identity.served_as!r})")
    if meta.final_state != identity.final_state:
        changed.append(f"final state {meta.final_state} (was {identity.final_state})")
    if meta.protocol != identity.hook:
        changed.append(f"hook protocol {meta.protocol} (was {identity.hook})")
    if changed:
        raise IdentityError(
            f"{where}: its dump names " + ", ".join(changed) + ": the server changed since "
            "it was admitted; it stays out of rotation until it serves the job's model again",
            field="identity",
        )
