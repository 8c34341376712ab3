"""The worker half of ``hsx regenerate``: conversations read from the input, each
regenerated turn by turn by one of ``[workers].concurrency`` workers, and written or
quarantined through the run's group commit.

Each turn is one decode request and its attempts (:class:`~hsx_async.run.servers.retry.Attempts`):
a failed attempt gets its cause (:func:`~hsx_async.run.servers.faults.fault_of`); the server's
faults take it out of rotation (:meth:`~hsx_async.run.servers.pool.ServerPool.fault`) and cost the
conversation nothing, its own (a 4xx about its content, a suspicion shown to be its doing)
count against ``workers.max_attempts``, and then the conversation is quarantined.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from hsx_async.config import Config
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import AppendLog, QuarantineEntry
from hsx_async.dataset.quarantine import reason_kind
from hsx_async.engines import Decoding
from hsx_async.errors import DumpError, RequestError
from hsx_async.prepare.records import BadRecord, Conversation, Turn, parse_record
from hsx_async.prepare.regenerate.answer import Answer, turn_seed
from hsx_async.prepare.regenerate.serving import decode
from hsx_async.prepare.regenerate.summary import RegenStats
from hsx_async.prepare.template import ChatEncoder, RecordError
from hsx_async.run.dumps.failpoints import failpoint
from hsx_async.run.pipeline.handoff import Conveyor, EndOfInput
from hsx_async.run.pipeline.writers import Committer
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.faults import Fault, fault_of
from hsx_async.run.servers.pool import PoolStopped, Server
from hsx_async.run.servers.retry import Attempts, RetryPolicy
from hsx_async.run.source import TOO_LONG, SampleReader

log = structlog.get_logger("hsx.regenerate")
_READ_BATCH = 256

Intake = Conveyor[Conversation]


class _Abandoned(Exception):
    """The run stopped while a turn waited for a server: the conversation is redone on
    resume."""


@dataclass(frozen=True)
class Done:
    """What a resume skips: ids in the output or the quarantine, lines in the quarantine."""

    ids: set[str]
    lines: set[int]


@dataclass(frozen=True)
class _Failure:
    """A failed attempt: its error, and the server (and lease number) that it went to."""

    error: RequestError | DumpError
    server: Server
    lease: int


@dataclass(frozen=True)
class Logs:
    """Where conversations go, made durable by ``committer``."""

    out: AppendLog
    quarantine: AppendLog
    committer: Committer


class Turns:
    """The reader and the workers of one regenerate (its task group runs them)."""

    def __init__(
        self,
        config: Config,
        encoder: ChatEncoder,
        client: EngineClient,
        logs: Logs,
        *,
        input_path: Path,
        done: Done,
        stop_ids: tuple[int, ...],
        nonce: str,
        stats: RegenStats,
    ) -> None:
        self.config = config
        self.settings = config.regenerate
        self.encoder = encoder
        self.vocab_size = len(encoder.tokenizer)
        self.client = client
        self.pool = client.pool
        self.logs = logs
        self.input_path = input_path
        self.done = done
        self.stop_ids = stop_ids
        self.nonce = nonce  # rids stay unique across runs
        self.stats = stats
        w = config.workers
        self.retry = RetryPolicy(w.max_attempts, w.backoff_base, w.backoff_max)
        self.stopping = False
        self.input_done = False  # the reader reached the end of the input
        self.workers_done = asyncio.Event()
        self._running = 0
        # Settles a server's refusal of a turn (its lease number): True, the conversation's
        # (Admission.arbitrate: a storm of refusals is arbitrated by the probe).
        self.arbiter: Callable[[Server, int], Awaitable[bool]] | None = None

    def start(self, tg: asyncio.TaskGroup) -> None:
        concurrency = self.config.workers.start_concurrency
        intake: Intake = Conveyor(2 * concurrency)  # backpressure on the reader
        tg.create_task(self._read(intake), name="hsx-reader")
        self._running = concurrency
        for index in range(concurrency):
            tg.create_task(self._worker(intake), name=f"hsx-worker-{index}")

    # -- intake ---------------------------------------------------------------------------

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        return SampleReader(self.input_path, self.config.input.max_tokens).raw_lines()

    async def _read(self, intake: Intake) -> None:
        lines = self._lines()
        try:
            while not self.stopping:
                batch = await asyncio.to_thread(list, itertools.islice(lines, _READ_BATCH))
                if not batch:
                    self.input_done = True
                    break
                for line, raw in batch:
                    conv = await self._admit(line, raw)
                    if conv is not None:
                        await intake.put(conv)  # blocks while the workers are busy
        finally:
            intake.close()  # never waits: a reader cut off on a full queue ends too

    async def _admit(self, line: int, raw: bytes) -> Conversation | None:
        """The conversation to regenerate, or None (done before, or quarantined now)."""
        self.stats.read += 1
        if line in self.done.lines:
            self.stats.skipped += 1
            return None
        record = (
            BadRecord(line, None, "line too long") if raw is TOO_LONG else parse_record(raw, line)
        )
        key = None if record.id is None else canonical_id(record.id)
        if key is not None and key in self.done.ids:
            self.stats.skipped += 1
            return None
        first = None if key is None else self.stats.seen.setdefault(key, line)
        if first is not None and first != line:
            reason = f"duplicate id {key!r} (first on input line {first + 1})"
            await self.quarantine(line, record.id, reason, duplicate_of=first)
            return None
        if isinstance(record, BadRecord):
            await self.quarantine(record.line, record.id, record.reason)
            return None
        return record

    # -- workers --------------------------------------------------------------------------

    async def _worker(self, intake: Intake) -> None:
        try:
            while not isinstance(conv := await intake.get(), EndOfInput):
                if self.stopping:
                    continue  # a stop: what is queued stays for the next run
                try:
                    await self._one(conv)
                except _Abandoned:
                    self.stats.abandoned += 1
                    log.info("conversation_abandoned", id=conv.id, input_line=conv.line + 1)
        finally:
            self._running -= 1
            if self._running == 0:
                self.workers_done.set()

    async def _one(self, conv: Conversation) -> None:
        try:
            line = await self._conversation(conv)
        except RecordError as exc:
            await self.quarantine(conv.line, conv.id, str(exc))
            return
        if line is None:
            return
        failpoint("regenerate.before_append")
        # Shielded: a line being committed when a stop arrives is written whole.
        await asyncio.shield(self.logs.committer.commit(self.logs.out, line))
        failpoint("regenerate.after_append")
        self.stats.done += 1
        self.stats.bytes += len(line)

    async def quarantine(
        self, line: int, sample_id: str | int | None, reason: str, duplicate_of: int | None = None
    ) -> None:
        entry = QuarantineEntry(sample_id, line, reason, duplicate_of)
        await asyncio.shield(self.logs.committer.commit(self.logs.quarantine, entry.to_line()))
        self.stats.quarantined += 1
        self.stats.reasons[reason_kind(reason)] += 1
        # input_line: the number editors and grep -n show (the record keeps 0-based line)
        log.warning("sample_quarantined", id=sample_id, input_line=line + 1, reason=reason)

    # -- one conversation -----------------------------------------------------------------

    async def _conversation(self, conv: Conversation) -> bytes | None:
        """The conversation's output line; None once it is quarantined."""
        history: list[Turn] = []
        messages: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        for index, turn in enumerate(conv.turns):
            if turn.role != "assistant":
                history.append(turn)
                messages.append({"role": turn.role, "content": turn.content})
                continue
            prompt = [{"role": t.role, "content": t.content} for t in history]
            ids = await asyncio.to_thread(self.encoder.prompt_ids, prompt)
            answer = await self._answer(conv, index, ids)
            if answer is None:
                return None
            text = self.encoder.tokenizer.decode(answer.output_ids, skip_special_tokens=True)
            if not text.strip():
                await self.quarantine(
                    conv.line, conv.id, f"turn {index}: the model answered with no text"
                )
                return None
            history.append(Turn("assistant", text))
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if answer.length_capped:
                message["hsx_length_capped"] = True
            messages.append(message)
            finish = "length" if answer.length_capped else "stop"
            turns.append(
                {"index": index, "completion_tokens": len(answer.output_ids), "finish": finish}
            )
        self._count(turns)
        meta = {"turns": turns, "length_capped": any(t["finish"] == "length" for t in turns)}
        record = {"id": conv.id, "messages": messages, "hsx_regenerate": meta}
        return orjson.dumps(record) + b"\n"

    def _count(self, turns: list[dict[str, Any]]) -> None:
        self.stats.turns += len(turns)
        self.stats.length_capped += sum(t["finish"] == "length" for t in turns)
        self.stats.tokens += sum(t["completion_tokens"] for t in turns)

    async def _answer(self, conv: Conversation, index: int, prompt: list[int]) -> Answer | None:
        """One turn's answer: attempts until one passes; None once the conversation is
        quarantined. Only the conversation's own faults charge it."""
        s = self.settings
        seed = turn_seed(s.seed, conv.id, index)
        decoding = Decoding(s.max_new_tokens, s.temperature, s.top_p, seed, self.stop_ids)
        attempts = Attempts()
        while True:
            attempts.settle(self.retry)  # a suspicion may have been settled while it waited
            if attempts.exhausted(self.retry):
                await self._exhausted(conv, index, attempts)
                return None
            attempts.rids += 1
            rid = f"{self.nonce}-{conv.line}-{index}-{attempts.rids}"
            with structlog.contextvars.bound_contextvars(
                id=conv.id, rid=rid, turn=index, attempt=attempts.rids
            ):
                got = await self._attempt(rid, prompt, decoding)
                if isinstance(got, Answer):
                    return got
                if await self._failed(conv, index, attempts, got):
                    return None

    async def _attempt(self, rid: str, prompt: list[int], decoding: Decoding) -> Answer | _Failure:
        try:
            # No deadline here: the admission task owns the wait for a server (exit 3).
            async with self.pool.lease(timeout=None) as server:
                lease = server.requests
                try:
                    answer = await decode(
                        self.client, server, rid, prompt, decoding,
                        vocab_size=self.vocab_size, timeout=self.config.server.request_timeout,
                    )  # fmt: skip
                except (RequestError, DumpError) as exc:
                    return _Failure(exc, server, lease)
        except PoolStopped:
            raise _Abandoned from None
        self.pool.served(server, lease)
        return answer

    async def _failed(
        self,
        conv: Conversation,
        index: int,
        attempts: Attempts,
        failure: _Failure,
    ) -> bool:
        """Attribute a failed attempt and back off; True once the conversation is
        quarantined for it."""
        server = failure.server
        fault = await self._arbitrated(fault_of(failure.error), server, failure.lease)
        log.info("attempt_failed", cause=fault.cause, kind=fault.kind, error=fault.reason)
        self.stats.failed[fault.kind] += 1
        attempts.record(fault, server)  # before the server's record changes for it
        await self.pool.fault(server, fault)
        attempts.settle(self.retry)
        if attempts.exhausted(self.retry):
            await self._exhausted(conv, index, attempts)
            return True
        if fault.cause == "server" and not fault.reached:
            return False  # the server is out of rotation: the next lease waits for one
        await asyncio.sleep(self.retry.delay(attempts.failed))
        return False

    async def _arbitrated(self, fault: Fault, server: Server, lease: int) -> Fault:
        """A refusal of the conversation's content (a 4xx) is the conversation's only once
        its server is shown to work for a request sent at or after it; refused by a server
        that fails its probe too, it is that server's, and the conversation goes on
        uncharged (as ``hsx run``'s workers do)."""
        if fault.cause != "sample" or self.arbiter is None or await self.arbiter(server, lease):
            return fault
        return Fault("server", fault.kind, f"{fault.reason} (its probe was refused too)")

    async def _exhausted(self, conv: Conversation, index: int, attempts: Attempts) -> None:
        why = attempts.quarantine_reason()
        await self.quarantine(conv.line, conv.id, f"turn {index}: {why.text}")
