"""Which servers serve this job: the first contact with each, the probe that brings one
back into rotation, and the wait while none is in rotation (issue 24).

No server takes a sample before it is *admitted*: its info endpoints are read (model
path, revision, version, and the shape and dump root where it reports them) and one tiny
request goes through the whole dump path, its ``meta.json`` checked against the config.
What it showed is its :class:`~hsx_async.run.servers.identity.Identity`; the first server
admitted pins the job's (unless the dataset's ``provenance.json`` already does), and a
server whose identity differs is refused — with the reason, in the log, ``/status``,
the metrics and the job report — and never mixed in. Each admitted server's identity is
recorded in ``provenance.json`` (``servers``).

What a contact can show, and what it means:

- the server cannot serve (unreachable, no hook, a 404, broken dumps, another model):
  a **server** cause. It stays out of rotation and is examined again every
  ``server.health_interval``; it comes back only when such a probe passes. The first
  probe after it left rotation also settles the failures that led there
  (:mod:`hsx_async.run.servers.retry`).
- the server and the *config* disagree (layers, hidden size, dump root, engine): a
  **job** cause when nothing stands with the config — no server of this run was admitted
  and the dataset holds no sample made with it — and every server has been heard from
  and all say the same (:mod:`hsx_async.run.servers.claims`, the rule ``hsx check`` applies
  too). The run stops before any sample is sent (:class:`~hsx_async.errors.ConfigError`,
  exit 2, naming the key and which server said what). Otherwise it is the fault of the
  servers that disagree: refused, naming what each said.
- the server says it is the job's but its probe's rows are not the pinned ones (other
  weights under the same model path: :mod:`hsx_async.run.servers.fingerprint`): refused, naming
  both servers.

The probe runs the checks the copy runs on its own dump (the FP8 scales and outliers):
a server whose every dump the copy refuses does not pass it. And it arbitrates refusals:
a 4xx is the sample's only once its server is shown to work for a request sent at or
after it (:meth:`Admission.arbitrate`); a server that refuses its probe too leaves
rotation, and its refusals cost no sample.
- the servers serve another model than the dataset was made with: a job cause too
  (:class:`~hsx_async.errors.DatasetError`), unless ``--allow-provenance-change``.

While no server is in rotation the run waits, saying every ``WAIT_NOTICE_S`` seconds
what it waits for (each server's reason) and how long it has left; after
``server.unreachable_timeout`` it stops with :class:`~hsx_async.errors.NoServerError`
(exit 3). Nothing is charged meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from hsx_async.config import Config
from hsx_async.dataset.provenance import FinalStateGuard, parse_final_norm
from hsx_async.errors import ConfigError, DatasetError, NoServerError
from hsx_async.protocol import DumpMeta
from hsx_async.run.notify import Notifier
from hsx_async.run.servers.claims import Claim, job_fault, server_fault
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault
from hsx_async.run.servers.identity import Identity, JobRecord
from hsx_async.run.servers.pool import Server, ServerPool
from hsx_async.run.servers.probe import InFlight, Probe, Refused, Shown, Verdict, server_info

log = structlog.get_logger("hsx.admission")

WAIT_NOTICE_S = 30.0  # at most this long between two "waiting_for_server" lines

# (server, its identity, its final norm, a new dataset's final-state kind): provenance.json.
# The write is under way when it returns, and no sample is committed before it is done.
Record = Callable[[Server, Identity, dict[str, Any] | None, str | None], asyncio.Future[None]]


@dataclass(frozen=True)
class _Examined:
    identity: Identity
    final_norm: dict[str, Any] | None
    rows: Any  # what its probe's rows are (the probe's kind: Probe.compare)
    meta: DumpMeta | None = None  # its probe's dump's meta.json (a dump probe)


@dataclass(frozen=True)
class Examination:
    """What one examination of a server found, acting on nothing (``hsx check``):
    admitted as ``identity``, refused for ``fault`` (its cause and kind), or saying
    ``claim`` against the config (judged with every server's: :meth:`Admission.config_fault`)."""

    server: Server
    identity: Identity | None = None
    meta: DumpMeta | None = None  # the probe's dump's meta.json, when it passed
    fault: Fault | None = None
    claim: Claim | None = None


_Result = _Examined | Refused | Claim  # a claim: it disagrees with the config


class Admission:
    """The admission task of one run (a long-lived task of the daemon's task group)."""

    def __init__(
        self,
        config: Config,
        client: EngineClient,
        *,
        probe: Probe[Any],
        record: Record | None,
        job: JobRecord,
        final_states: FinalStateGuard | None,
        notifier: Notifier,
        stop_requested: asyncio.Event,
        allow_provenance_change: bool = False,
    ) -> None:
        self.config = config
        self.client = client
        self.pool: ServerPool = client.pool
        self.probe = probe
        self._record = record
        self.dataset = job
        self.job: Identity | None = None if allow_provenance_change else job.identity
        self._dataset_model = "" if allow_provenance_change else job.model
        self.final_states = final_states
        self.notifier = notifier
        self.stop_requested = stop_requested
        self.ever_admitted = False
        self._in_flight = InFlight()  # arbitrations
        self._contacted: set[str] = set()  # the servers examined before (their URLs)
        # Each server heard from: its latest answer's claim against the config (None: none).
        self._heard: dict[str, Claim | None] = {}
        # The rows of the first admitted server's probe, and that server (issue 38).
        self._pinned: tuple[Any, str] | None = None
        # A refusal's arbitration by probe, per server: (requests sent before it, verdict).
        self._arbitrations: dict[str, tuple[int, asyncio.Future[bool]]] = {}

    def apply(self, config: Config) -> None:
        """A reloaded config (timeouts, intervals; the shape cannot change live)."""
        self.config = self.probe.config = config

    # -- the task ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            # Nothing is asked of a server before a sample needs one: a run with nothing
            # left to send (a finished dataset) never contacts any.
            await self.probe.open()
            await self.pool.wanted.wait()
            wait = ServerWait(self.pool, self.notifier, self.stop_requested)
            while True:
                await self.round()
                wait.check(self.config)
                await self._pause()
        finally:
            # The namespace itself goes with the workers' when the pipeline closes (also
            # what a killed run left, when this one asked no server anything).
            await self._settle_probes()

    async def _settle_probes(self) -> None:
        """At the end of the run, let a probe still at a server finish (bounded)."""
        await self._in_flight.settle()
        await self.probe.settle()

    async def _pause(self) -> None:
        await asyncio.sleep(self.config.server.health_interval)

    async def round(self) -> None:
        """Examine every server out of rotation; admit, refuse, or stop the job."""
        out = self.pool.out_of_rotation()
        if not out:
            return
        results = await asyncio.gather(*(self._examine(s) for s in out))
        for server, result in zip(out, results, strict=True):
            if not (isinstance(result, Refused) and not result.answered):
                self._heard[server.display] = result if isinstance(result, Claim) else None
        with_dataset: list[str] = []  # serve another model than the dataset's
        answered = 0
        for server, result in zip(out, results, strict=True):
            admitted, other_model = await self._conclude(server, result)
            settle_eviction(server, admitted)
            if other_model:
                with_dataset.append(other_model)
            answered += not (isinstance(result, Refused) and not result.answered)
        if self.ever_admitted or not answered:
            return
        if not self.dataset.has_samples:
            # Every server heard from, and all of them say the same against the config,
            # with nothing on the config's side (no server admitted, no sample made with
            # it): the job is wrong, not the servers (hsx_async.run.servers.claims).
            servers = [s.display for s in self.pool.servers if not s.retired]
            if (error := job_fault(self._heard, servers)) is not None:
                raise error
        if with_dataset and len(with_dataset) == answered:
            # Its samples were made by servers of another identity than every server that
            # answered: the output.dir is not this job's (or the servers are not).
            raise DatasetError(
                f"{self.config.output.dir} holds samples of another server identity: "
                f"{with_dataset[0]}. Serve the dataset's model as it was made, use a new "
                "output.dir, or (for another model) pass --allow-provenance-change if "
                "this is intended"
            )

    # -- hsx check ---------------------------------------------------------------------

    async def check(self, server: Server) -> Examination:
        """Examine ``server`` as a run would, acting on nothing but what is pinned: the
        first server that passes pins the identity and the rows the others must match."""
        result = await self._examine(server)
        if not (isinstance(result, Refused) and not result.answered):
            self._heard[server.display] = result if isinstance(result, Claim) else None
        if isinstance(result, Claim):
            return Examination(server, claim=result)
        if isinstance(result, Refused):
            return Examination(server, fault=result.fault)
        differences, _ = self._differences(result.identity)
        why = self._other_rows(server, result)
        if differences:
            why = f"{server.display} is not this job's server: " + "; ".join(differences)
        if why is not None:
            fault = Fault("server", "identity", why)
            return Examination(server, identity=result.identity, fault=fault)
        self._pinned = self._pinned or (result.rows, server.display)
        self.job = self.job or result.identity
        return Examination(server, identity=result.identity, meta=result.meta)

    def config_fault(self) -> tuple[ConfigError | None, list[str]]:
        """Once every server was checked: the config's fault, when every server heard
        from says the same against it (the rule of a run), else each disagreeing
        server's fault, in words (:mod:`hsx_async.run.servers.claims`)."""
        servers = [s.display for s in self.pool.servers if not s.retired]
        error = job_fault(self._heard, servers)
        if error is not None:
            return error, []
        return None, [server_fault(c, self._heard) for c in self._heard.values() if c is not None]

    async def _conclude(self, server: Server, result: _Result) -> tuple[bool, str]:
        """Act on one examination: (now in rotation, why it is refused when that is
        because it is not the dataset's model)."""
        if not isinstance(result, _Examined):
            reason, kind = self._refusal(result)
            await self.pool.refuse(server, reason, kind)
            return False, ""
        differences, of_dataset = self._differences(result.identity)
        if differences:
            reason = f"{server.display} is not this job's server: " + "; ".join(differences)
            await self.pool.refuse(server, reason, "identity")
            return False, reason if of_dataset else ""
        if (other := self._other_rows(server, result)) is not None:
            await self.pool.refuse(server, other, "identity")
            return False, ""
        await self._admit(server, result)
        return True, ""

    def _refusal(self, result: Refused | Claim) -> tuple[str, str]:
        """Why a server is refused, and the fault kind, when it did not pass."""
        if isinstance(result, Refused):
            return result.fault.reason, result.fault.kind
        return server_fault(result, self._heard), "identity"

    def _other_rows(self, server: Server, examined: _Examined) -> str | None:
        """Why the server is not the job's although it says so: its probe's rows are not
        the pinned ones (other weights under the same name); None when they are."""
        if self._pinned is None:
            return None
        pinned, by = self._pinned
        how = self.probe.compare(pinned, examined.rows)
        if how is None:
            return None
        model = examined.identity.model or examined.identity.served_as
        return (
            f"{server.display} serves {model!r} with other weights than {by} (the job's): "
            f"its probe's rows differ from the pinned ones {how}; it stays out until it "
            "serves the job's weights"
        )

    # -- arbitration -----------------------------------------------------------------

    async def arbitrate(self, server: Server, sent: int) -> bool:
        """A sample's request to ``server`` (lease number ``sent``) was refused (a 4xx):
        is the refusal the sample's? Only if the server is shown to work for a request
        sent at or after it: a later request whose dump became a sample, or else the
        probe — a known-good request — sent now (one for every refusal before it). When
        the probe fails too, the server leaves rotation with the probe's reason, the
        eviction is settled as "broken", and the refusals are not the samples' (False)."""
        if server.worked > sent:
            return True
        held = self._arbitrations.get(server.url)
        if held is None or held[0] < sent:  # none yet, or sent before this request was
            verdict = asyncio.ensure_future(self._arbitration(server))
            self._in_flight.track(verdict)
            held = self._arbitrations[server.url] = (server.requests, verdict)
        return await asyncio.shield(held[1])

    async def _arbitration(self, server: Server) -> bool:
        result = await self._examine(server)
        if isinstance(result, _Examined):
            other = self._differences(result.identity)[0] or self._other_rows(server, result)
            if not other:
                return True
            reason, kind = (other if isinstance(other, str) else "; ".join(other)), "identity"
        else:
            reason, kind = self._refusal(result)
        log.warning("server_refusals_not_the_samples", server=server.display, reason=reason)
        if server.healthy:
            server.last_error = reason
            await self.pool.evict(server, reason, kind)
        else:  # out already (another fault): it stays out, for this reason
            await self.pool.refuse(server, reason, kind)
        settle_eviction(server, False)
        return False

    def _differences(self, identity: Identity) -> tuple[list[str], bool]:
        """How ``identity`` differs from the job's, and whether the job's is the dataset's
        (no server admitted in this run yet)."""
        of_dataset = not self.ever_admitted and self.dataset.has_samples
        if self.job is not None:
            source = "the dataset's (provenance.json)" if of_dataset else "the job's"
            return [f"{d} ({source})" for d in self.job.differences(identity)], of_dataset
        found = []
        if self._dataset_model and identity.model and identity.model != self._dataset_model:
            found.append(
                f"model is {identity.model!r}, not {self._dataset_model!r} (provenance.json)"
            )
        kind = None if self.final_states is None else self.final_states.kind
        if kind is not None and identity.final_state != kind and self.dataset.has_samples:
            found.append(
                f"final state is {identity.final_state}, not {kind} (provenance.json): "
                "one dataset holds one kind"
            )
        return found, of_dataset

    async def _admit(self, server: Server, examined: _Examined) -> None:
        identity = examined.identity
        # A new dataset's kind is recorded with the server (one durable write); a known
        # one is checked now.
        guard = self.final_states
        new_kind = identity.final_state if guard is not None and guard.kind is None else None
        if guard is not None and new_kind is None:
            guard.accept(identity.final_state)
        server.identity = identity
        if self._pinned is None:
            self._pinned = (examined.rows, server.display)
        if self.job is None:
            self.job = identity
            log.info("job_identity_pinned", by=server.display, identity=identity.to_record())
        self.ever_admitted = True
        # Recorded while the server takes its first samples: none is committed before the
        # record is durable (Record), and a new dataset's kind counts as recorded from now
        # on (one durable write, not two). Before, the write stood between the probe and
        # the first sample (bench/README.md, issue 27, sixth round).
        record = None
        if self._record is not None:
            record = self._record(server, identity, examined.final_norm, new_kind)
        if guard is not None and new_kind is not None:
            guard.accept(new_kind, recorded=True)
        await self.pool.restore(server)
        log.info(
            "server_admitted",
            server=server.display,
            model=identity.model or identity.served_as,
            engine=identity.engine,
        )
        if record is not None:
            await record

    # -- the wait ----------------------------------------------------------------------

    # -- one examination ---------------------------------------------------------------

    async def _examine(self, server: Server) -> _Result:
        """What one contact shows: /health, the info endpoints, then the probe — the
        verdict reads them in that order. At a server's first contact, on the run's
        critical path, they go side by side (one after another they were half of a
        short run's fixed time: bench/README.md, issue 27, sixth round); a server
        examined again (out of rotation) answers /health before it is sent a probe, so a
        sick one is not sent a probe every ``server.health_interval``."""
        health = asyncio.ensure_future(self.client.health(server.url))
        tasks: list[asyncio.Future[Any]] = [health]
        try:
            if server.url in self._contacted and (error := await health):
                return _unreachable(server, error)
            self._contacted.add(server.url)
            info = asyncio.ensure_future(server_info(self.client, server))
            probe = asyncio.ensure_future(self.probe.show(server, info))
            tasks += [info, probe]
            if error := await health:
                return _unreachable(server, error)
            claim = self.probe.claims(server, await info)
            if claim is not None:
                return claim  # the probe is not waited for (its own cleanup follows it)
            try:
                shown = await probe
            except Verdict as verdict:
                return verdict.result
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # retrieved: a verdict was reached without it
        return self._shown(server, shown, info.result())

    def _shown(self, server: Server, shown: Shown[Any], info: dict[str, Any]) -> _Result:
        """A probe that passed: the server's identity, unless it is another model than
        ``[model].name`` says."""
        engine = server.engine_name
        meta = shown.meta
        identity = Identity.said(engine, info) if meta is None else Identity.of(engine, meta, info)
        name, said = self.config.model.name, identity.model or identity.served_as
        # A server that names no model (a decode probe of a server without an info
        # endpoint) is not held against [model].name: it said nothing to disagree with.
        if name and said and name not in (identity.model, identity.served_as):
            return Claim(
                server.display,
                "model.name",
                identity.model or identity.served_as,
                f"is {name!r}, but {server.display} serves "
                f"{identity.model or identity.served_as!r}; set [model].name to the model "
                "this job is for, or point [server].urls at servers of it",
            )
        return _Examined(identity, parse_final_norm(info.get("final_norm")), shown.rows, meta)


def _unreachable(server: Server, error: str) -> Refused:
    return Refused(Fault("server", "unreachable", f"{server.display}: {error}"), False)


def settle_eviction(server: Server, admitted: bool) -> None:
    """The first examination after a server left rotation settles the failures that led
    there (:class:`~hsx_async.run.servers.retry.Suspicion`): admitted, it worked, and they were the
    samples'; refused, it was broken, and they are forgiven."""
    if server.evictions and server.evictions[-1].verdict is None:
        server.evictions[-1].verdict = admitted


class ServerWait:
    """The wait while no server is in rotation, for an admission task (``hsx run``'s and
    ``hsx regenerate``'s): a line every ``WAIT_NOTICE_S`` (or ``daemon.progress_interval``)
    saying what it waits for and how long it has left, and :class:`NoServerError` after
    ``server.unreachable_timeout``. Nothing is charged meanwhile."""

    def __init__(self, pool: ServerPool, notifier: Notifier, stop_requested: asyncio.Event) -> None:
        self.pool = pool
        self.notifier = notifier
        self.stop_requested = stop_requested
        self._up_since = time.monotonic()
        self._said_at = -WAIT_NOTICE_S

    def check(self, config: Config) -> None:
        """After each round of examinations."""
        now = time.monotonic()
        if self.pool.healthy():
            self._up_since = now
            return
        self._waiting(now - self._up_since, config)

    def _waiting(self, waited: float, config: Config) -> None:
        timeout = config.server.unreachable_timeout
        reasons = {
            s.display: s.last_error or "no answer" for s in self.pool.servers if not s.retired
        }
        if self.stop_requested.is_set():
            return  # the pool said so (ServerPool.stop_waiting); the run is ending
        said = [why if why.startswith(url) else f"{url}: {why}" for url, why in reasons.items()]
        if waited >= timeout:
            detail = "; ".join(said)
            raise NoServerError(
                f"no server in rotation for {timeout:g} s (server.unreachable_timeout) — "
                f"{detail}. Start or fix the servers, or check [server].urls"
            )
        now = time.monotonic()
        every = min(WAIT_NOTICE_S, max(1.0, config.daemon.progress_interval))
        if now - self._said_at < every:
            return
        self._said_at = now
        left = timeout - waited
        log.warning(
            "waiting_for_server", waited_s=round(waited), exit_in_s=round(left), servers=reasons
        )
        self.notifier.status(
            f"waiting for a server ({waited:.0f} s; exit 3 in {left:.0f} s): " + "; ".join(said)
        )
