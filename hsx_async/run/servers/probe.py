"""How the admission asks a server to show what it is: a :class:`Probe`, one known-good
request, pluggable (issue 38). :class:`DumpProbe` (``hsx run``, ``hsx check``) sends one
tiny prompt through the whole dump path and runs the checks the copy runs on its own
dump; ``hsx regenerate``'s probe (:class:`~hsx_async.prepare.regenerate.serving.DecodeProbe`)
asks one greedy decode. The rest of the examination — ``/health``, the info endpoints,
the identity, the claims against the config, the arbitration of a storm — is
:class:`~hsx_async.run.servers.admission.Admission`'s, the same for both.

A probe either shows the server (:class:`Shown`: its dump's ``meta.json`` when it has
one, and what its rows are, compared with the pinned rows by :meth:`Probe.compare`) or
raises :class:`Verdict` with why it is refused (:class:`Refused`) or what it says against
the config (a :class:`~hsx_async.run.servers.claims.Claim`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import numpy as np

from hsx_async.config import Config
from hsx_async.engines import ENGINES, EngineName
from hsx_async.errors import DumpError, DumpMissingError, HsxError, IdentityError, RequestError
from hsx_async.protocol import DumpMeta, parse_meta
from hsx_async.run.dumps.dump import (
    Dump,
    prepare_namespace,
    remove_stray_dump,
    remove_tree,
    validate_dump,
    wait_for_meta,
)
from hsx_async.run.dumps.writer import check_sections
from hsx_async.run.servers.claims import Claim, info_claim
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault, fault_of
from hsx_async.run.servers.fingerprint import TOLERANCE, Fingerprint, fingerprint
from hsx_async.run.servers.pool import Server

PROBE_IDS = np.array([1, 2, 3, 4], dtype=np.int64)  # in every vocabulary
PROBE_SETTLE_S = 10.0  # how long the end of a run waits for a probe still at a server

RowsT = TypeVar("RowsT")


@dataclass(frozen=True)
class Shown(Generic[RowsT]):
    """What a probe that passed shows: its dump's ``meta.json`` (None: a probe that dumps
    nothing) and what its rows are."""

    meta: DumpMeta | None
    rows: RowsT


@dataclass(frozen=True)
class Refused:
    fault: Fault
    answered: bool  # the server answered (it is up, but not usable)


class InFlight:
    """Requests and clean-ups left running on their own (a probe at a server, the removal
    of its dump, an arbitration), which the end of the job lets finish, bounded."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    def track(self, request: asyncio.Future[Any]) -> None:
        self._running.add(request)
        request.add_done_callback(self._forget)

    def _forget(self, request: asyncio.Future[Any]) -> None:
        self._running.discard(request)
        if not request.cancelled():
            request.exception()  # retrieved: a probe abandoned at the run's end may fail

    async def settle(self, timeout: float = PROBE_SETTLE_S) -> None:
        if self._running:
            await asyncio.wait(self._running, timeout=timeout)


class Verdict(Exception):
    """A probe that ended in a verdict other than a server shown."""

    def __init__(self, result: Refused | Claim) -> None:
        self.result = result
        super().__init__(repr(result))


class Probe(Protocol[RowsT]):
    """One kind of admission probe."""

    config: Config  # replaced by a reload

    async def open(self) -> None:
        """Before the first probe (its scratch space)."""

    def claims(self, server: Server, info: Mapping[str, Any]) -> Claim | None:
        """What the server's info endpoints say against the config, for this probe."""

    async def show(self, server: Server, info: Awaitable[dict[str, Any]]) -> Shown[RowsT]:
        """Probe ``server`` (``info``: what :func:`server_info` finds, side by side);
        raises :class:`Verdict` when it does not pass."""

    def compare(self, pinned: RowsT, rows: RowsT) -> str | None:
        """How ``rows`` differ from the pinned rows beyond the tolerance (a phrase), or
        None when they are the same rows."""

    async def settle(self) -> None:
        """At the end of the job: let a probe still at a server finish (bounded)."""


class DumpProbe:
    """One tiny request through the dump path, its ``meta.json`` checked against the
    config, the copy's checks run on its bytes, its rows fingerprinted."""

    def __init__(self, config: Config, client: EngineClient, *, nonce: str, namespace: str):
        self.config = config
        self.client = client
        self.nonce = nonce
        self.namespace = namespace
        self._probes = 0
        self._ns_dir: Path | None = None
        self.in_flight = InFlight()  # probe requests at a server, removals of their dumps

    async def open(self) -> None:
        # The probes' own directory is ready before the first sample needs a server (local,
        # and off the first sample's path).
        self._ns_dir = await asyncio.to_thread(
            prepare_namespace, self.config.dump.root, self.namespace
        )

    def claims(self, server: Server, info: Mapping[str, Any]) -> Claim | None:
        """What the server reports about its shape, against the config (conclusive: it
        is the server's own word)."""
        return info_claim(self.config, server.display, info)

    def compare(self, pinned: Fingerprint, rows: Fingerprint) -> str | None:
        distance = pinned.differs(rows, TOLERANCE)
        if distance is None:
            return None
        return f"by {distance:.3g} (relative L2; tolerance {TOLERANCE:g})"

    async def settle(self) -> None:
        """Let a probe still at a server finish (bounded), so its dump is written before
        the namespace goes, not after it (a server writes a dump before it answers). What
        a hung server writes later is debris for the next run."""
        await self.in_flight.settle()

    async def show(self, server: Server, info: Awaitable[dict[str, Any]]) -> Shown[Fingerprint]:
        """One tiny request through the dump path (twice after a prefix-cache hit: the
        second must not hit the cache either)."""
        shown = await self._probe_once(server, info)
        if server.out_kind == "cache_hit":
            shown = await self._probe_once(server, info)
        return shown

    async def _probe_once(
        self, server: Server, info: Awaitable[dict[str, Any]], again: bool = True
    ) -> Shown[Fingerprint]:
        """``info``: what :func:`server_info` found, read only when the probe fails (it runs
        side by side with the probe)."""
        assert self._ns_dir is not None, "open() first"
        cfg = self.config
        self._probes += 1
        rid = f"{self.nonce}-probe-{self._probes}"
        rid_dir = self._ns_dir / rid
        request = asyncio.ensure_future(
            self.client.generate(
                server,
                rid=rid,
                ns=self.namespace,
                input_ids=PROBE_IDS,
                timeout=cfg.server.request_timeout,
                storage=cfg.storage,
            )
        )
        self.in_flight.track(request)
        try:
            # Shielded: a run that ends meanwhile waits for the answer (settle).
            await asyncio.shield(request)
            raw = await wait_for_meta(rid_dir, cfg.dump.timeout)
            meta = parse_meta(raw)
            dump = validate_dump(
                rid_dir, raw, rid=rid, num_tokens=len(PROBE_IDS),
                hidden_size=cfg.model.hidden_size, aux_layers=cfg.model.aux_layers,
                storage=cfg.storage,
            )  # fmt: skip
            # The checks the copy runs on every dump, and what the rows are (issue 38).
            rows = await asyncio.to_thread(examine_rows, dump)
        except IdentityError as exc:
            raise Verdict(await self._shape_mismatch(server, info, exc, again)) from None
        except (RequestError, DumpError) as exc:
            said = await info
            if isinstance(exc, DumpMissingError):  # dumped where the server says, maybe
                stray = (said.get("dump_root"), cfg.dump.root, self.namespace, rid)
                self.in_flight.track(
                    asyncio.ensure_future(asyncio.to_thread(remove_stray_dump, *stray))
                )
            raise Verdict(await self._failed_probe(server, said, exc)) from None
        else:
            return Shown(meta, rows)
        finally:
            # Not awaited: the next probe has a rid of its own, and the end of the run
            # waits for this (settle) before the namespace goes.
            self.in_flight.track(asyncio.ensure_future(asyncio.to_thread(remove_tree, rid_dir)))

    async def _shape_mismatch(
        self, server: Server, info: Awaitable[dict[str, Any]], exc: IdentityError, again: bool
    ) -> Refused | Claim:
        """The probe's dump has another shape than the config: the server's own report
        decides whether that is the server (a broken dump) or the config; without one,
        a second probe must agree."""
        said = await info
        claimed = (
            said.get("aux_layers") if exc.key == "model.aux_layers" else said.get("hidden_size")
        )
        if claimed is not None:
            return Refused(fault_of(DumpError(f"{server.display}: {exc}")), True)
        if again:
            try:
                await self._probe_once(server, info, again=False)
            except Verdict as verdict:
                return verdict.result
            return Refused(fault_of(DumpError(f"{server.display}: {exc} (once)")), True)
        return Claim(server.display, exc.key, str(exc), f"{server.display}'s dump says: {exc}")

    async def _failed_probe(
        self, server: Server, info: dict[str, Any], exc: RequestError | DumpError
    ) -> Refused | Claim:
        fault = fault_of(exc)
        # A 404 at the engine's path, or an answer no hsx hook took (an SGLang server also
        # serves /v1/completions): if the other engine's info endpoint answers, the config
        # names the wrong engine.
        if fault.kind in ("not_found", "no_hook"):
            what = "answers 404 at" if fault.kind == "not_found" else "takes no hsx mark at"
            claim = await wrong_engine(self.client, server, what, server.engine.generate_path)
            if claim is not None:
                return claim
        if isinstance(exc, DumpMissingError):
            return self._dump_missing(server, info)
        reason = str(exc) if str(exc).startswith(server.display) else f"{server.display}: {exc}"
        # The probe is a known-good request: whatever refuses it is the server's fault.
        return Refused(Fault("server", fault.kind, reason, fault.evict, fault.reached), True)

    def _dump_missing(self, server: Server, info: dict[str, Any]) -> Refused | Claim:
        root = self.config.dump.root
        theirs = info.get("dump_root")
        if theirs and Path(str(theirs)) != root:
            return Claim(
                server.display,
                "dump.root",
                str(theirs),
                f"is {root}, but {server.display} dumps under {theirs} (HSX_DUMP_ROOT, "
                "its info endpoint) and nothing appeared here: set dump.root to the "
                "servers' HSX_DUMP_ROOT",
            )
        if server.engine.acks_mark:
            return Claim(
                server.display,
                "dump.root",
                "(none here)",
                f"is {root}, but no dump of {server.display} appeared there although its "
                "hsx connector took the request: set dump.root to the server's "
                "HSX_DUMP_ROOT",
            )
        # The error's rid and path change with every probe: the reason says it plainly.
        reason = (
            f"{server.display} took the request but no meta.json appeared under dump.root "
            f"({root}) within dump.timeout ({self.config.dump.timeout:g} s): is the hsx hook "
            f"loaded ({server.engine.deploy}), and HSX_DUMP_ROOT the same path?"
        )
        return Refused(Fault("server", "dump_missing", reason, reached=True), True)


def examine_rows(dump: Dump) -> Fingerprint:
    """The checks the copy runs on a dump's bytes (a probe that the copy would refuse does
    not pass), then what its rows are."""
    check_sections(dump)
    return fingerprint(dump)


async def server_info(client: EngineClient, server: Server) -> dict[str, Any]:
    """What the server says about itself; whatever it does not say stays out."""
    found: dict[str, Any] = {}
    engine = server.engine
    raw = await info_of(client, server, engine.model_info_path)
    if isinstance(raw, Mapping):
        found["model"] = engine.model_of(raw)
        for key, ours in (("hidden_size", "hidden_size"), ("hsx_aux_layers", "aux_layers"),
                          ("hsx_final_norm", "final_norm"), ("weight_version", "revision"),
                          ("hsx_dump_root", "dump_root")):  # fmt: skip
            if key in raw:
                found[ours] = raw[key]
    raw = await info_of(client, server, engine.version_path)
    if isinstance(raw, Mapping):
        found["version"] = str(raw.get("version", ""))
        for key, ours in (("revision", "revision"), ("hsx_dump_root", "dump_root")):
            if raw.get(key):
                found[ours] = raw[key]
    found = {k: v for k, v in found.items() if v not in ("", None)}
    if "revision" in found:
        found["revision"] = str(found["revision"])
    return found


async def info_of(client: EngineClient, server: Server, path: str) -> object:
    """One of the server's info endpoints as JSON; None when it does not answer one."""
    with contextlib.suppress(HsxError, aiohttp.ClientError, TimeoutError, ValueError):
        return await client.get_json(server.url, path)
    return None


async def other_engine(client: EngineClient, server: Server) -> EngineName | None:
    """The engine whose info endpoint ``server`` answers, when it is not its configured
    one (a 404 at the configured engine's endpoint: ``[server].engine`` is wrong)."""
    for name, engine in ENGINES.items():
        if name != server.engine_name and await info_of(client, server, engine.model_info_path):
            return name
    return None


async def wrong_engine(client: EngineClient, server: Server, what: str, path: str) -> Claim | None:
    """The claim that ``[server].engine`` is wrong for ``server`` (it ``what`` ``path``,
    and answers another engine's info endpoint), or None when no other engine's does."""
    other = await other_engine(client, server)
    if other is None:
        return None
    return Claim(
        server.display,
        "server.engine",
        other,
        f"says {server.engine_name!r} for {server.display}, but it {what} {path} and serves "
        f"{other}'s {ENGINES[other].model_info_path}: set [server].engine (or engines) to "
        f"{other!r}",
    )
