"""How ``hsx regenerate`` examines a server: the decode :class:`DecodeProbe` plugged into
the one examination of a server, :class:`~hsx_async.run.servers.admission.Admission` (``hsx run``
plugs in the dump probe; regenerate dumps nothing, so it asks what its turns ask).

No server takes a turn before it is *admitted*: ``/health`` answers, and one tiny greedy
decode request in the configured engine's wire form comes back as an answer that passes
the checks every turn's answer passes (:mod:`hsx_async.prepare.regenerate.answer`). The
rest is the admission's, as for ``hsx run``: the first admitted server pins the job's
:class:`~hsx_async.run.servers.identity.Identity` (what its info endpoints say: engine, model,
revision) and its probe's answer (its identity by content: a greedy answer is the
weights'); a server of another identity, or whose greedy answer to the probe differs
(other weights under the same name), is refused, never mixed in. A storm of refusals from
one server is arbitrated by this probe before the conversations pay
(:meth:`~hsx_async.run.servers.admission.Admission.arbitrate`). Every server that answers 404 at
the engine's decode path and serves another engine's info endpoint: a **job** cause, the
run stops before any conversation is sent (:class:`~hsx_async.errors.ConfigError`, exit
2, naming ``[server].engine``). The wait while no server is in rotation is the job
runner's (:mod:`hsx_async.run.daemon.job`: exit 3 after ``server.unreachable_timeout``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import structlog

from hsx_async.config import Config
from hsx_async.engines import Decoding
from hsx_async.errors import DumpError, RequestError
from hsx_async.prepare.regenerate.answer import Answer, check_answer
from hsx_async.run.servers.claims import Claim
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault, fault_of
from hsx_async.run.servers.pool import Server
from hsx_async.run.servers.probe import Refused, Shown, Verdict, wrong_engine

log = structlog.get_logger("hsx.serving")

# A server taken out this many times in a row for answers no honest server gives, without
# one good answer between, passes probes but not turns: it stays out for the run.
BAD_ANSWER_STRIKES = 3
# The probe's decoding: one greedy token (what the weights answer, the same every time).
PROBE_DECODING = Decoding(max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0, stop_ids=())

Tokens = tuple[int, ...]  # a decode probe's rows: its greedy answer


async def decode(
    client: EngineClient,
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


class DecodeProbe:
    """``hsx regenerate``'s admission probe (a :class:`~hsx_async.run.servers.probe.Probe`)."""

    def __init__(
        self,
        config: Config,
        client: EngineClient,
        *,
        prompt: Sequence[int],
        vocab_size: int,
        nonce: str,
    ) -> None:
        self.config = config
        self.client = client
        self.prompt = list(prompt)  # in the tokenizer's own ids
        self.vocab_size = vocab_size
        self.nonce = nonce
        self._strikes: dict[str, tuple[int, int]] = {}  # url → (served then, strikes)
        self._banned: dict[str, str] = {}  # url → why it stays out for the run
        self._probes = 0

    async def open(self) -> None:
        """Nothing to prepare: a decode dumps nothing."""

    def claims(self, server: Server, info: Mapping[str, Any]) -> Claim | None:
        """A decode asks nothing of the dump shape the config describes."""
        return None

    async def show(self, server: Server, info: Awaitable[dict[str, Any]]) -> Shown[Tokens]:
        banned = self._struck_out(server)
        if banned:
            raise Verdict(Refused(Fault("server", "bad_answer", banned), True))
        self._probes += 1
        rid = f"{self.nonce}-probe-{self._probes}"
        try:
            answer = await decode(
                self.client, server, rid, self.prompt, PROBE_DECODING,
                vocab_size=self.vocab_size, timeout=self.config.server.request_timeout,
            )  # fmt: skip
        except (RequestError, DumpError) as exc:
            fault = fault_of(exc)
            claim = None
            if fault.kind == "not_found":
                path = server.engine.decode_path
                claim = await wrong_engine(self.client, server, "answers 404 at", path)
            # The probe is a known-good request: whatever refuses it is the server's fault.
            refused = Refused(Fault("server", fault.kind, fault.reason, fault.evict), True)
            raise Verdict(claim or refused) from None
        return Shown(None, tuple(int(t) for t in answer.output_ids))

    def compare(self, pinned: Tokens, rows: Tokens) -> str | None:
        if pinned == rows:
            return None
        return f"(its greedy answer to the probe is {list(rows)}, not {list(pinned)})"

    async def settle(self) -> None:
        """Nothing to clean up: a decode leaves nothing behind."""

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
