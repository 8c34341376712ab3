"""Which servers take ``hsx regenerate``'s turns: the first contact with each, the probe
that brings one back, and the wait while none is in rotation — the decode form of
:mod:`hsx_async.run.admission` (``hsx run`` examines a server through the dump path;
regenerate, which dumps nothing, through the request its turns make).

No server takes a turn before it is *admitted*: ``/health`` answers, and one tiny decode
request in the configured engine's wire form comes back as an answer that passes the
checks every turn's answer passes (:mod:`hsx_async.prepare.regenerate.answer`). The first admitted
server pins the model the job's answers come from (as its info endpoint reports it); a
server serving another model is refused, never mixed in. Causes as in
:mod:`hsx_async.run.faults`:

- the server cannot serve (unreachable, a 404, a broken answer, another model): a
  **server** cause. It stays out of rotation, is examined again every
  ``server.health_interval``, and comes back only when such a probe passes (a ``/health``
  that answers is not enough: a server that answers garbage answers ``/health`` too).
- every server that answers speaks another engine's wire than ``[server].engine`` says
  (a 404 where the engine's endpoint should be, and another engine's info endpoint
  there), and none was admitted yet: a **job** cause — the run stops before any
  conversation is sent (:class:`~hsx_async.errors.ConfigError`, exit 2, naming the key).

While no server is in rotation the run waits as ``hsx run`` does
(:class:`~hsx_async.run.admission.ServerWait`: it says so periodically, and after
``server.unreachable_timeout`` stops with :class:`~hsx_async.errors.NoServerError`, exit 3).
Nothing is charged meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from hsx_async.config import Config
from hsx_async.engines import ENGINES, Decoding, EngineName
from hsx_async.errors import ConfigError, DumpError, RequestError
from hsx_async.prepare.regenerate.answer import Answer, check_answer
from hsx_async.run.admission import ServerWait, info_of, other_engine, settle_eviction
from hsx_async.run.client import Server, ServerPool, SGLangClient
from hsx_async.run.faults import Fault, fault_of
from hsx_async.run.notify import Notifier

log = structlog.get_logger("hsx.serving")

# A server taken out this many times in a row for answers no honest server gives, without
# one good answer between, passes probes but not turns: it stays out for the run.
BAD_ANSWER_STRIKES = 3


async def decode(
    client: SGLangClient,
    server: Server,
    rid: str,
    prompt: Sequence[int],
    decoding: Decoding,
    *,
    vocab_size: int,
    timeout: float,
) -> Answer:
    """One decode request to ``server`` in its engine's wire, and its checked answer;
    RequestError or AnswerError (a DumpError) when it failed."""
    engine = server.engine
    body = await client.post_decode(server, engine.decode_body(rid, prompt, decoding), timeout)
    decoded = engine.parse_decode(body, rid, len(prompt))
    return check_answer(decoded, decoding, rid=rid, vocab_size=vocab_size)


@dataclass(frozen=True)
class _Admitted:
    model: str  # what the info endpoint says it serves ('' when it says nothing)


@dataclass(frozen=True)
class _Refused:
    fault: Fault
    answered: bool  # the server answered (up, but not usable)
    other_engine: EngineName | None = None  # it speaks this engine's wire instead


class DecodeAdmission:
    """The admission task of one ``hsx regenerate`` (a long-lived task of its group)."""

    def __init__(
        self,
        config: Config,
        client: SGLangClient,
        *,
        probe: Sequence[int],
        vocab_size: int,
        nonce: str,
        notifier: Notifier,
        stop_requested: asyncio.Event,
    ) -> None:
        self.config = config
        self.client = client
        self.pool: ServerPool = client.pool
        self.probe = list(probe)  # a prompt in the tokenizer's own ids
        self.vocab_size = vocab_size
        self.nonce = nonce
        self.notifier = notifier
        self.stop_requested = stop_requested
        self.model: str | None = None  # pinned by the first server admitted
        self._strikes: dict[str, tuple[int, int]] = {}  # url → (served then, strikes)
        self._banned: dict[str, str] = {}  # url → why it stays out for the run
        self._probes = 0

    @property
    def ever_admitted(self) -> bool:
        return self.model is not None

    async def run(self) -> None:
        # Nothing is asked of a server before a turn needs one: a rerun with every
        # conversation done never contacts any.
        await self.pool.wanted.wait()
        wait = ServerWait(self.pool, self.notifier, self.stop_requested)
        while True:
            await self.round()
            wait.check(self.config)
            await asyncio.sleep(self.config.server.health_interval)

    async def round(self) -> None:
        """Examine every server out of rotation; admit, refuse, or stop the job."""
        out = self.pool.out_of_rotation()
        if not out:
            return
        results = await asyncio.gather(*(self._examine(s) for s in out))
        wrong_engine: list[tuple[Server, EngineName]] = []
        answered = 0
        for server, result in zip(out, results, strict=True):
            admitted = await self._conclude(server, result)
            settle_eviction(server, admitted)
            if isinstance(result, _Refused):
                answered += result.answered
                if result.other_engine is not None:
                    wrong_engine.append((server, result.other_engine))
            else:
                answered += 1
        if not self.ever_admitted and wrong_engine and len(wrong_engine) == answered:
            server, other = wrong_engine[0]
            raise ConfigError(
                "server.engine",
                f"says {server.engine_name!r} for {server.display}, but it answers 404 at "
                f"{server.engine.decode_path} and serves {other}'s "
                f"{ENGINES[other].model_info_path}: set [server].engine (or engines) to {other!r}",
            )

    async def _conclude(self, server: Server, result: _Admitted | _Refused) -> bool:
        if isinstance(result, _Refused):
            await self.pool.refuse(server, result.fault.reason, result.fault.kind)
            return False
        if self.model and result.model and result.model != self.model:
            reason = (
                f"{server.display} serves {result.model!r}, not {self.model!r} (the first "
                "server admitted): one output holds the answers of one model"
            )
            await self.pool.refuse(server, reason, "identity")
            return False
        if not self.model:  # the first admitted (or the first that names its model)
            self.model = result.model
        await self.pool.restore(server)
        log.info("server_admitted", server=server.display, model=result.model or None)
        return True

    def _struck_out(self, server: Server) -> str:
        """Why ``server`` stays out for the rest of the run ('' if it may be probed):
        taken out for bad answers :data:`BAD_ANSWER_STRIKES` times in a row, with no good
        answer between, it passes the probe but fails the turns."""
        if server.url in self._banned:
            return self._banned[server.url]
        if server.out_kind != "bad_answer":
            return ""
        served, strikes = self._strikes.get(server.url, (server.served, 0))
        strikes = strikes + 1 if served == server.served else 1
        self._strikes[server.url] = (server.served, strikes)
        if strikes < BAD_ANSWER_STRIKES:
            return ""
        why = (
            f"{server.last_error} — {strikes} times in a row, with no good answer between; "
            "it stays out for the rest of this run (fix it, then run hsx regenerate again)"
        )
        self._banned[server.url] = why
        return why

    async def _examine(self, server: Server) -> _Admitted | _Refused:
        banned = self._struck_out(server)
        if banned:
            return _Refused(Fault("server", "bad_answer", banned), True)
        error = await self.client.health(server.url)
        if error:
            return _Refused(Fault("server", "unreachable", f"{server.display}: {error}"), False)
        model = await self._model(server)
        self._probes += 1
        rid = f"{self.nonce}-probe-{self._probes}"
        probe = Decoding(max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0, stop_ids=())
        try:
            await decode(
                self.client, server, rid, self.probe, probe,
                vocab_size=self.vocab_size, timeout=self.config.server.request_timeout,
            )  # fmt: skip
        except (RequestError, DumpError) as exc:
            fault = fault_of(exc)
            other = await other_engine(self.client, server) if fault.kind == "not_found" else None
            return _Refused(fault, True, other)
        return _Admitted(model)

    async def _model(self, server: Server) -> str:
        info = await info_of(self.client, server, server.engine.model_info_path)
        return server.engine.model_of(info) if info is not None else ""
