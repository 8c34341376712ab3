"""One trainer's prompt through hsx's extraction path, to tensors in speculators' layout.

The request and the dump are ``hsx run``'s own (:meth:`EngineClient.generate`,
:func:`collect_dump`: the same body, answer checks and dump validation), read back with the
copy's own section reader (:func:`read_sections`); the final state is converted to the
pre-norm one speculators reads with the export's conversion (:class:`FinalConversion`).
What goes wrong is attributed as ``hsx run`` attributes it (:func:`fault_of`): the
sample's fault or the server's, in the reason the trainer reads.

The servers are ``hsx run``'s too: none takes a prompt before ``hsx run``'s admission
(:class:`~hsx_async.run.servers.admission.Admission`) examined it (its info, one probe through the
dump path, its identity against the config and against the first server admitted); a
server's fault takes it out of rotation as in ``hsx run`` (:meth:`ServerPool.fault`) and
moves the prompt on to the next server in rotation (each server once); a refusal (a 4xx)
is the sample's, and final, only once the server is shown to work (hsx run's arbitration:
a later request served, or its probe passing now), else the server's; every dump is
checked against its server's identity. While no server is in
rotation a prompt waits at most ``server.unreachable_timeout``, then fails as the server's
fault; the front keeps examining the servers (it does not stop as ``hsx run`` does).

This round handles bfloat16 storage only ([output].dtype = "bfloat16").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import structlog
import torch

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.dataset.provenance import FinalStateGuard
from hsx_async.dataset.target import final_norm_weight, norm_gain, read_target
from hsx_async.errors import (
    ConfigError,
    DatasetError,
    DumpError,
    HsxError,
    NoServerError,
    RequestError,
    first_error,
)
from hsx_async.protocol import BF16, HIDDEN, num_layers
from hsx_async.run.dumps.dump import Dump, namespace_lock, on_tmpfs, prepare_namespace, remove_tree
from hsx_async.run.dumps.writer import read_sections
from hsx_async.run.notify import Notifier
from hsx_async.run.pipeline.workers import collect_dump
from hsx_async.run.servers.admission import Admission
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault, fault_of
from hsx_async.run.servers.identity import JobRecord, check_dump
from hsx_async.run.servers.pool import Server, server_pool
from hsx_async.run.servers.probe import DumpProbe
from hsx_async.run.source import Sample

FRONT_NAMESPACE = "front"

log = structlog.get_logger("hsx.front")


class ExtractionFailed(HsxError):
    """One prompt could not be extracted; ``cause`` is ``"sample"`` or ``"server"``."""

    def __init__(self, cause: str, kind: str, reason: str) -> None:
        super().__init__(f"{cause} fault ({kind}): {reason}")
        self.cause = cause
        self.kind = kind


@dataclass(frozen=True)
class Extracted:
    hidden_states: torch.Tensor  # [T, n_aux + 1, H] bfloat16, the last slot as converted
    token_ids: torch.Tensor  # [T] int64


def check_config(config: Config) -> None:
    if config.output.dtype != BF16:
        raise ConfigError(
            "output.dtype",
            f"{config.output.dtype!r}: the speculators front publishes bfloat16 only for "
            'now; set [output].dtype = "bfloat16" in its config',
        )


class Extractor:
    """Holds the HTTP session, the servers and the front's dump namespace."""

    def __init__(self, config: Config, conversion: FinalConversion, state_dir: Path) -> None:
        check_config(config)
        self.config = config
        self.conversion = conversion
        state_dir.mkdir(parents=True, exist_ok=True)
        self.final_states = FinalStateGuard(state_dir)  # one final-state kind per front
        # The front's namespaces: <ns>-<n> for requests, one in flight in each (the copy
        # sweeps every other rid of an attempt's namespace as debris, as in hsx run's
        # workers), and <ns>-probe for the admission; all under one namespace lock.
        self.ns = f"{config.dump.namespace_prefix}-{FRONT_NAMESPACE}"
        self.namespaces: list[str] = []  # made so far
        self._free: list[str] = []  # made and not in use
        self.on_tmpfs = False
        self._held = contextlib.ExitStack()
        self.nonce = secrets.token_hex(4)
        self._count = itertools.count()
        self.pool = server_pool(config)  # no server takes a prompt before it is admitted
        self._session: aiohttp.ClientSession | None = None
        self._client: EngineClient | None = None
        self._admission: Admission | None = None

    async def __aenter__(self) -> Extractor:
        """Holds the front's dump namespace (:class:`ConfigError` when another front with
        the same ``dump.namespace_prefix`` holds it), cleared."""
        root = self.config.dump.root
        root.mkdir(parents=True, exist_ok=True)
        self._held.enter_context(namespace_lock(root, self.ns))
        try:
            self.on_tmpfs = on_tmpfs(root)
        except BaseException:
            self._held.close()
            raise
        self._session = aiohttp.ClientSession()
        self._client = EngineClient(self._session, self.pool)
        self._admission = Admission(
            self.config,
            self._client,
            probe=DumpProbe(self.config, self._client, nonce=self.nonce, namespace=self.probe_ns),
            record=None,
            job=JobRecord(),
            final_states=self.final_states,
            notifier=Notifier(None),
            stop_requested=asyncio.Event(),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._session is not None:
                await self._session.close()
            for ns in [*self.namespaces, self.probe_ns]:
                await asyncio.to_thread(remove_tree, self.config.dump.root / ns)
        finally:
            self._held.close()

    @contextlib.asynccontextmanager
    async def _namespace(self) -> AsyncIterator[str]:
        """A namespace of the front's for one request, no other request in it meanwhile."""
        if self._free:
            ns = self._free.pop()
        else:
            ns = f"{self.ns}-{len(self.namespaces)}"
            self.namespaces.append(ns)
            await asyncio.to_thread(prepare_namespace, self.config.dump.root, ns)
        try:
            yield ns
        finally:
            self._free.append(ns)

    @property
    def probe_ns(self) -> str:
        """The admission's probes' namespace (under the front's namespace lock)."""
        return f"{self.ns}-probe"

    async def admit(self) -> None:
        """``hsx run``'s admission of the servers, for as long as the front serves (a
        long-lived task of its group). It stops ``hsx run`` when no server is in rotation
        for ``server.unreachable_timeout``; the front says so and keeps examining them."""
        assert self._admission is not None, "use the extractor as an async context manager"
        while True:
            try:
                await self._admission.run()
            except NoServerError as exc:
                log.warning("no_server_in_rotation", reason=str(exc))

    def next_rid(self) -> str:
        return f"{self.nonce}-{next(self._count)}"

    async def extract(self, rid: str, input_ids: list[int]) -> Extracted:
        """The prompt's rows, from the servers in rotation: a server's fault takes it out
        and moves on to the next one (each server tried once); :class:`ExtractionFailed`
        naming whose fault it was once the sample's fault stops it, every server in
        rotation failed it, or none came into rotation within ``server.unreachable_timeout``."""
        failed: list[ExtractionFailed] = []
        for attempt in range(len(self.pool.servers)):
            if failed and not self.pool.healthy():
                break  # no other server in rotation now: the trainer is not kept waiting
            try:
                async with self._namespace() as ns, self.pool.lease() as server:
                    lease = server.requests  # what a refusal is arbitrated against
                    return await self._attempt(server, lease, ns, f"{rid}-{attempt}", input_ids)
            except NoServerError as exc:
                failed.append(ExtractionFailed("server", "unreachable", str(exc)))
                break
            except ExtractionFailed as exc:
                if exc.cause != "server":
                    raise
                log.info("server_failed", rid=rid, reason=str(exc))
                failed.append(exc)
        if len(failed) == 1:
            raise failed[0]
        reasons = "; ".join(str(f) for f in failed)
        raise ExtractionFailed("server", failed[-1].kind, f"every server failed it: {reasons}")

    async def _attempt(
        self, server: Server, lease: int, ns: str, rid: str, input_ids: list[int]
    ) -> Extracted:
        assert self._client is not None and self._admission is not None, "use it in `async with`"
        ids = np.asarray(input_ids, dtype=np.int64)
        sample = Sample(id=rid, line=0, input_ids=ids, loss_mask=None)
        cfg = self.config
        rid_dir = cfg.dump.root / ns / rid
        try:
            await self._client.generate(
                server,
                rid=rid,
                ns=ns,
                input_ids=ids,
                timeout=cfg.server.request_timeout,
                storage=cfg.storage,
            )
            dump = await collect_dump(
                cfg,
                sample,
                rid_dir,
                {rid},
                on_tmpfs=self.on_tmpfs,
                to_thread=asyncio.to_thread,
                final_states=self.final_states,
            )
            if server.identity is not None:  # every meta.json against its server's identity
                check_dump(server.identity, dump.meta, server.display)
            hidden = await asyncio.to_thread(self._hidden, dump, len(input_ids))
        except (RequestError, DumpError) as exc:
            fault = fault_of(exc)
            # As in hsx run: a refusal is the sample's only once the server is shown to
            # work (a later request served, or its probe now); else it is the server's.
            if fault.cause == "sample" and not await self._admission.arbitrate(server, lease):
                fault = Fault("server", fault.kind, f"{fault.reason} (its probe was refused too)")
            await self.pool.fault(server, fault)
            raise ExtractionFailed(fault.cause, fault.kind, fault.reason) from None
        except DatasetError as exc:  # a post-norm server and no --model to convert with
            raise ExtractionFailed("server", "final_state", f"{exc}: give --model") from None
        finally:
            await asyncio.to_thread(remove_tree, rid_dir)
        self.pool.served(server, lease)
        return Extracted(hidden, torch.from_numpy(ids.copy()))

    def _hidden(self, dump: Dump, num_tokens: int) -> torch.Tensor:
        [(section, data)] = read_sections(dump, {HIDDEN}).values()
        layers = num_layers(self.config.model.aux_layers)
        hidden_size = self.config.model.hidden_size
        expected = num_tokens * layers * hidden_size * 2
        if section.dtype != "BF16" or len(data) != expected:
            raise DumpError(
                f"{dump.path.name}: hidden_states is {section.dtype}, {len(data)} bytes; "
                f"expected BF16, {expected} bytes"
            )
        hidden = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
        hidden = hidden.view(num_tokens, layers, hidden_size)
        final = self.conversion.apply({"final_state": dump.meta.final_state}, hidden[:, -1])
        if final.data_ptr() != hidden[:, -1].data_ptr():
            hidden[:, -1] = final
        return hidden


def final_conversion(want: str, model: Path | None) -> FinalConversion:
    """To the final state of kind ``want`` the trainer reads; the norm from ``--model`` when
    given (needed when the servers dump the other kind)."""
    if model is None:
        return FinalConversion(want)
    target = read_target(model)
    weight = final_norm_weight(target)
    return FinalConversion(want, norm_gain(weight, target.norm_kind), target.norm_eps)


@contextlib.asynccontextmanager
async def extracting(
    config: Config, conversion: FinalConversion, state_dir: Path
) -> AsyncIterator[Extractor]:
    """An :class:`Extractor` with its servers' admission running beside the caller's
    work, in one task group; a job fault of the admission (the servers and the config
    disagree) or the caller's own :class:`HsxError` comes out as itself."""
    async with Extractor(config, conversion, state_dir) as extractor:
        try:
            async with asyncio.TaskGroup() as tg:
                admission = tg.create_task(extractor.admit(), name="hsx-front-admission")
                try:
                    yield extractor
                finally:
                    admission.cancel()
        except* HsxError as group:
            raise first_error(group) from None
