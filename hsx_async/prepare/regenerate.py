"""``hsx regenerate``: every assistant turn replaced by the target model's own answer.

Turn by turn: the prompt of assistant turn *k* is the conversation up to it, with turns
before it already regenerated, rendered with the chat template's generation prompt, sent to
the servers of ``[server]`` as ``input_ids``. The requests go through what ``hsx run``
uses: :class:`~hsx_async.run.client.ServerPool` (least loaded healthy server, eviction and
probing), :class:`~hsx_async.run.retry.RetryPolicy` (``[workers]`` attempts and backoff),
``[workers].concurrency`` workers on a bounded queue (backpressure on the reader), and
:class:`~hsx_async.dataset.manifest.AppendLog` for the output: one fsynced line per
finished conversation, so a run killed at any instant and started again skips the
conversations already written and ends with each exactly once.

Output (OpenAI ``messages`` form, the record's id kept or derived as ``hsx prepare`` does):
``{"id", "messages", "hsx_regenerate": {"turns": [...], "length_capped": bool}}``; an
answer cut by ``max_new_tokens`` carries ``"hsx_length_capped": true`` in its message.
Beside it: ``<stem>.quarantine.jsonl`` and ``<stem>.meta.json`` (the sampling settings;
a resume with other settings is refused).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog
import uvloop
import xxhash

from hsx_async.config import Config, RegenerateConfig, load_config
from hsx_async.dataset.durable import write_atomic
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import AppendLog
from hsx_async.errors import ConfigError, DatasetError, RequestError
from hsx_async.logs import configure_logging
from hsx_async.prepare.records import BadRecord, Conversation, Turn, parse_record
from hsx_async.prepare.template import ChatEncoder, RecordError, load_tokenizer, read_template
from hsx_async.run.client import ServerPool, SGLangClient
from hsx_async.run.failpoints import failpoint
from hsx_async.run.retry import RetryPolicy
from hsx_async.run.source import TOO_LONG, SampleReader

log = structlog.get_logger("hsx.regenerate")
_READ_BATCH = 256


# --- pure: the request, the answer, the seed --------------------------------------------
@dataclass(frozen=True, slots=True)
class Answer:
    output_ids: list[int]
    length_capped: bool


def turn_seed(seed: int, sample_id: str | int, turn: int) -> int:
    """The sampling seed of one turn: the same in every run, so a resumed run samples the
    same answers, and different for every conversation and turn."""
    key = f"{seed}:{canonical_id(sample_id)}:{turn}".encode()
    return xxhash.xxh3_64_intdigest(key) & ((1 << 63) - 1)


def generation_body(
    rid: str, input_ids: list[int], settings: RegenerateConfig, stop_ids: list[int], seed: int
) -> dict[str, Any]:
    """A decoding ``POST /generate`` (SGLang's sampling parameters; no hsx namespace)."""
    return {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": {
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "sampling_seed": seed,
            "stop_token_ids": stop_ids,
        },
        "stream": False,
    }


def parse_answer(body: object, rid: str, prompt_tokens: int, stop_ids: set[int]) -> Answer:
    """The generated tokens (without the stop token) and whether the length cap cut them."""

    def bad(why: str) -> RequestError:
        return RequestError(f"answer to {rid}: {why}", server_fault=False)

    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise bad("no meta_info")
    meta = body["meta_info"]
    if meta.get("id") != rid:
        raise bad(f"meta_info.id is {meta.get('id')!r}")
    if meta.get("prompt_tokens") != prompt_tokens:
        raise bad(f"meta_info.prompt_tokens is {meta.get('prompt_tokens')!r}, sent {prompt_tokens}")
    ids = body.get("output_ids")
    if not isinstance(ids, list) or any(type(t) is not int for t in ids):
        raise bad("output_ids is not a list of token ids")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length"):
        raise bad(f"finish_reason is {finish!r}")
    while ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return Answer(ids, kind == "length")


# --- output files ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RegenPaths:
    out: Path
    quarantine: Path
    meta: Path

    @classmethod
    def beside(cls, out: Path) -> RegenPaths:
        stem = out.name.removesuffix(".jsonl")
        return cls(
            out, out.with_name(f"{stem}.quarantine.jsonl"), out.with_name(f"{stem}.meta.json")
        )


def _logged(path: Path) -> tuple[set[str], set[int]]:
    """Ids and lines already in an output or quarantine file (complete lines only)."""
    ids: set[str] = set()
    lines: set[int] = set()
    if not path.exists():
        return ids, lines
    with path.open("rb") as fh:
        for raw in fh:
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise DatasetError(f"{path}: a line is not JSON; this is not hsx output") from None
            if rec.get("id") is not None:
                ids.add(canonical_id(rec["id"]))
            if isinstance(rec.get("line"), int):
                lines.add(rec["line"])
    return ids, lines


def _check_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write the settings once; a resume must use the same ones."""
    if path.exists():
        old = orjson.loads(path.read_bytes())
        if old != meta:
            changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            raise ConfigError(
                "regenerate",
                f"{path} was written with other settings ({', '.join(changed)}); "
                "use them again to resume, or write to a new --out",
            )
        return
    write_atomic(path, orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


# --- the run -----------------------------------------------------------------------------
@dataclass
class RegenStats:
    done: int = 0
    skipped: int = 0  # already in the output or quarantine (resume)
    quarantined: int = 0
    turns: int = 0
    length_capped: int = 0
    seen: dict[str, int] = field(default_factory=dict)


class TurnFailed(Exception):
    """Every attempt at one turn failed; the conversation goes to quarantine."""


class Regenerator:
    def __init__(
        self,
        config: Config,
        encoder: ChatEncoder,
        paths: RegenPaths,
        input_path: Path,
        model: str,
    ) -> None:
        self.config = config
        self.settings = config.regenerate
        self.encoder = encoder
        self.paths = paths
        self.input_path = input_path
        tok = encoder.tokenizer
        stops = set(self.settings.stop_token_ids)
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        self.stop_ids = sorted(stops)
        workers = config.workers
        self.retry = RetryPolicy(workers.max_attempts, workers.backoff_base, workers.backoff_max)
        self.meta = {
            "model": model,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "max_new_tokens": self.settings.max_new_tokens,
            "seed": self.settings.seed,
            "stop_token_ids": self.stop_ids,
            "chat_template_xxh3_64": xxhash.xxh3_64_hexdigest(encoder.template.encode()),
        }
        self.nonce = f"hsx-regen-{secrets.token_hex(4)}"
        self._rids = itertools.count()
        self.stats = RegenStats()
        self.stop = asyncio.Event()
        self._append_lock = asyncio.Lock()

    async def run(self) -> RegenStats:
        self.paths.out.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(_check_meta, self.paths.meta, self.meta)
        self.out = await asyncio.to_thread(AppendLog, self.paths.out)
        self.quarantine = await asyncio.to_thread(AppendLog, self.paths.quarantine)
        try:
            done_ids, _ = await asyncio.to_thread(_logged, self.paths.out)
            q_ids, q_lines = await asyncio.to_thread(_logged, self.paths.quarantine)
            self.done_ids, self.done_lines = done_ids | q_ids, q_lines
            await self._serve()
        finally:
            self.out.close()
            self.quarantine.close()
        return self.stats

    async def _serve(self) -> None:
        cfg = self.config.server
        self.pool = ServerPool(
            cfg.urls,
            health_interval=cfg.health_interval,
            unreachable_timeout=cfg.unreachable_timeout,
        )
        queue: asyncio.Queue[Conversation | None] = asyncio.Queue(
            2 * self.config.workers.start_concurrency
        )
        async with aiohttp.ClientSession() as session:
            self.client = SGLangClient(session, self.pool)
            await self.client.probe_all()
            probe = asyncio.create_task(self.client.probe_forever())
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._read(queue))
                    for _ in range(self.config.workers.start_concurrency):
                        tg.create_task(self._worker(queue))
            finally:
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        return SampleReader(self.input_path, self.config.input.max_tokens).raw_lines()

    async def _read(self, queue: asyncio.Queue[Conversation | None]) -> None:
        lines = self._lines()
        try:
            while not self.stop.is_set():
                batch = await asyncio.to_thread(list, itertools.islice(lines, _READ_BATCH))
                if not batch:
                    break
                for line, raw in batch:
                    conv = await self._admit(line, raw)
                    if conv is not None:
                        await queue.put(conv)  # blocks while the workers are busy
        finally:
            for _ in range(self.config.workers.start_concurrency):
                await queue.put(None)

    async def _admit(self, line: int, raw: bytes) -> Conversation | None:
        """The conversation to regenerate, or None (done before, or quarantined now)."""
        if line in self.done_lines:
            self.stats.skipped += 1
            return None
        record = (
            BadRecord(line, None, "line too long") if raw is TOO_LONG else parse_record(raw, line)
        )
        key = None if record.id is None else canonical_id(record.id)
        if key is not None and key in self.done_ids:
            self.stats.skipped += 1
            return None
        if key is not None:
            first = self.stats.seen.setdefault(key, line)
            if first != line:
                record = BadRecord(line, None, f"duplicate id {key!r} (first on line {first})")
        if isinstance(record, BadRecord):
            await self._quarantine(record.line, record.id, record.reason)
            return None
        return record

    async def _worker(self, queue: asyncio.Queue[Conversation | None]) -> None:
        while (conv := await queue.get()) is not None:
            if self.stop.is_set():
                continue  # a stop: what is queued stays for the next run
            try:
                line = await self._regenerate(conv)
            except (TurnFailed, RecordError) as exc:
                await self._quarantine(conv.line, conv.id, str(exc))
                continue
            failpoint("regenerate.before_append")
            await self._append(self.out, line)
            failpoint("regenerate.after_append")
            self.stats.done += 1

    async def _append(self, target: AppendLog, line: bytes) -> None:
        # Shielded: a line being written when a stop arrives is written whole.
        async with self._append_lock:
            await asyncio.shield(asyncio.to_thread(target.append, [line]))

    async def _quarantine(self, line: int, sample_id: str | int | None, reason: str) -> None:
        entry = {"id": sample_id, "line": line, "reason": reason}
        await self._append(self.quarantine, orjson.dumps(entry) + b"\n")
        self.stats.quarantined += 1
        log.info("regenerate.quarantined", line=line, id=sample_id, reason=reason)

    async def _regenerate(self, conv: Conversation) -> bytes:
        history: list[Turn] = []
        turns: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = []
        for index, turn in enumerate(conv.turns):
            if turn.role != "assistant":
                history.append(turn)
                messages.append({"role": turn.role, "content": turn.content})
                continue
            prompt = [{"role": t.role, "content": t.content} for t in history]
            ids = await asyncio.to_thread(self.encoder.prompt_ids, prompt)
            answer = await self._generate(ids, turn_seed(self.settings.seed, conv.id, index))
            text = self.encoder.tokenizer.decode(answer.output_ids, skip_special_tokens=True)
            if not text.strip():
                raise TurnFailed(f"turn {index}: the model answered with no text")
            history.append(Turn("assistant", text))
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if answer.length_capped:
                message["hsx_length_capped"] = True
                self.stats.length_capped += 1
            messages.append(message)
            turns.append(
                {
                    "index": index,
                    "completion_tokens": len(answer.output_ids),
                    "finish": "length" if answer.length_capped else "stop",
                }
            )
            self.stats.turns += 1
        meta = {"turns": turns, "length_capped": any(t["finish"] == "length" for t in turns)}
        record = {"id": conv.id, "messages": messages, "hsx_regenerate": meta}
        return orjson.dumps(record) + b"\n"

    async def _generate(self, ids: list[int], seed: int) -> Answer:
        attempt = 0
        stops = set(self.stop_ids)
        while True:
            attempt += 1
            rid = f"{self.nonce}-{next(self._rids)}"
            body = generation_body(rid, ids, self.settings, self.stop_ids, seed)
            try:
                async with self.pool.lease() as server:
                    try:
                        answer = await self.client.post_generate(
                            server, body, self.config.server.request_timeout
                        )
                    except RequestError as exc:
                        await self.pool.failed(server, exc)
                        raise
                    self.pool.succeeded(server)
                return parse_answer(answer, rid, len(ids), stops)
            except RequestError as exc:
                log.info("regenerate.attempt_failed", rid=rid, attempt=attempt, error=str(exc))
                if self.retry.exhausted(attempt):
                    raise TurnFailed(f"{attempt} attempts failed; last: {exc}") from None
                await asyncio.sleep(self.retry.delay(attempt))


# --- command line ------------------------------------------------------------------------
def _encoder(config: Config, tokenizer: Path | None, template: Path | None) -> ChatEncoder:
    base = config.path.parent if config.path is not None else Path.cwd()
    settings = config.regenerate
    tok_dir = tokenizer or (base / settings.tokenizer if settings.tokenizer else None)
    if tok_dir is None:
        raise ConfigError("regenerate.tokenizer", "is not set; add it or pass --tokenizer DIR")
    tmpl = template or (base / settings.chat_template if settings.chat_template else None)
    tok = load_tokenizer(tok_dir)
    return ChatEncoder(tok, read_template(tmpl, tok))


async def regenerate(
    config: Config,
    input_path: Path,
    out: Path,
    *,
    tokenizer: Path | None = None,
    chat_template: Path | None = None,
    handle_signals: bool = False,
) -> RegenStats:
    encoder = await asyncio.to_thread(_encoder, config, tokenizer, chat_template)
    model = str(tokenizer or config.regenerate.tokenizer)
    regen = Regenerator(config, encoder, RegenPaths.beside(out), input_path, model)
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, regen.stop.set)
    stats = await regen.run()
    log.info(
        "regenerate.finished",
        done=stats.done,
        skipped=stats.skipped,
        quarantined=stats.quarantined,
        turns=stats.turns,
        length_capped=stats.length_capped,
        stopped_early=regen.stop.is_set(),
    )
    return stats


def regenerate_command(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    if not args.input.is_file():
        raise ConfigError("input", f"{args.input} is not a file")
    stats = uvloop.run(
        regenerate(
            config,
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            handle_signals=True,
        )
    )
    print(
        orjson.dumps(
            {
                "done": stats.done,
                "skipped": stats.skipped,
                "quarantined": stats.quarantined,
                "turns": stats.turns,
                "length_capped": stats.length_capped,
            }
        ).decode()
    )
    return 0
