"""One trainer's prompt through hsx's extraction path, to tensors in speculators' layout.

The request and the dump are ``hsx run``'s own (:meth:`EngineClient.generate`,
:func:`collect_dump`: the same body, answer checks and dump validation), read back with the
copy's own section reader (:func:`read_sections`); the final state is converted to the
pre-norm one speculators reads with the export's conversion (:class:`FinalConversion`).
What goes wrong is attributed as ``hsx run`` attributes it (:func:`fault_of`): the
sample's fault or the server's, in the reason the trainer reads.

This round handles bfloat16 storage only ([output].dtype = "bfloat16"). The servers are
taken in turn; a server's fault moves the prompt on to the next one (each server once, no
eviction from rotation yet); the sample's fault is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import structlog
import torch

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.dataset.provenance import FinalStateGuard
from hsx_async.errors import ConfigError, DatasetError, DumpError, HsxError, RequestError
from hsx_async.protocol import BF16, HIDDEN, num_layers
from hsx_async.run.dumps.dump import Dump, namespace_lock, on_tmpfs, prepare_namespace, remove_tree
from hsx_async.run.dumps.writer import read_sections
from hsx_async.run.pipeline.workers import collect_dump
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import fault_of
from hsx_async.run.servers.pool import Server, ServerPool
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
    hidden_states: torch.Tensor  # [T, n_aux + 1, H] bfloat16, the last slot pre-norm
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
        self.ns = f"{config.dump.namespace_prefix}-{FRONT_NAMESPACE}"
        self.ns_dir = config.dump.root / self.ns
        self.on_tmpfs = False
        self._held = contextlib.ExitStack()
        self.nonce = secrets.token_hex(4)
        self._count = itertools.count()
        urls = config.server.urls
        self.pool = ServerPool(
            urls,
            health_interval=config.server.health_interval,
            unreachable_timeout=config.server.unreachable_timeout,
            engines=[config.server.engine_of(u) for u in urls],
        )
        self._turn = itertools.cycle(self.pool.servers)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Extractor:
        """Holds the front's dump namespace (:class:`ConfigError` when another front with
        the same ``dump.namespace_prefix`` holds it), cleared."""
        root = self.config.dump.root
        root.mkdir(parents=True, exist_ok=True)
        self._held.enter_context(namespace_lock(root, self.ns))
        try:
            prepare_namespace(root, self.ns)
            self.on_tmpfs = on_tmpfs(self.ns_dir)
        except BaseException:
            self._held.close()
            raise
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._session is not None:
                await self._session.close()
            await asyncio.to_thread(remove_tree, self.ns_dir)
        finally:
            self._held.close()

    def next_rid(self) -> str:
        return f"{self.nonce}-{next(self._count)}"

    async def extract(self, rid: str, input_ids: list[int]) -> Extracted:
        """The prompt's rows, from the servers in turn: a server's fault moves on to the
        next one (each server tried once); :class:`ExtractionFailed` naming whose fault it
        was once the sample's fault stops it or every server failed it."""
        failed: list[ExtractionFailed] = []
        for attempt in range(len(self.pool.servers)):
            try:
                return await self._attempt(f"{rid}-{attempt}", input_ids)
            except ExtractionFailed as exc:
                if exc.cause != "server":
                    raise
                log.info("server_failed", rid=rid, reason=str(exc))
                failed.append(exc)
        if len(failed) == 1:
            raise failed[0]
        reasons = "; ".join(str(f) for f in failed)
        raise ExtractionFailed("server", failed[-1].kind, f"every server failed it: {reasons}")

    async def _attempt(self, rid: str, input_ids: list[int]) -> Extracted:
        assert self._session is not None, "use the extractor as an async context manager"
        server: Server = next(self._turn)
        ids = np.asarray(input_ids, dtype=np.int64)
        sample = Sample(id=rid, line=0, input_ids=ids, loss_mask=None)
        rid_dir = self.ns_dir / rid
        cfg = self.config
        try:
            await EngineClient(self._session, self.pool).generate(
                server,
                rid=rid,
                ns=self.ns,
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
            hidden = await asyncio.to_thread(self._hidden, dump, len(input_ids))
        except (RequestError, DumpError) as exc:
            fault = fault_of(exc)
            raise ExtractionFailed(fault.cause, fault.kind, fault.reason) from None
        except DatasetError as exc:  # a post-norm server and no --model to convert with
            raise ExtractionFailed("server", "final_state", f"{exc}: give --model") from None
        finally:
            await asyncio.to_thread(remove_tree, rid_dir)
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
