"""One ``hsx regenerate`` from start to end: the output lock and resume, the servers and
their admission, one task group for the reader, the workers, the group commit, the events
log and the signals, and the summary at the end (the CLI's handler is
:mod:`hsx_async.cli.handlers.regenerate`)."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import structlog
import xxhash

from hsx_async.config import Config
from hsx_async.dataset.durable import write_atomic
from hsx_async.dataset.manifest import AppendLog
from hsx_async.errors import ConfigError
from hsx_async.prepare.regenerate.files import (
    RegenPaths,
    check_meta,
    output_lock,
    quarantined,
    written_ids,
)
from hsx_async.prepare.regenerate.serving import DecodeProbe
from hsx_async.prepare.regenerate.summary import RegenStats, RegenSummary
from hsx_async.prepare.regenerate.turns import Done, Logs, Turns
from hsx_async.prepare.template import ChatEncoder, load_tokenizer, read_template
from hsx_async.run.daemon.job import JobRunner
from hsx_async.run.daemon.signals import Stopper
from hsx_async.run.notify import Notifier
from hsx_async.run.pipeline.writers import Committer
from hsx_async.run.report.numbers import RunRecorder, Tick
from hsx_async.run.servers.admission import Admission
from hsx_async.run.servers.client import connected
from hsx_async.run.servers.identity import Identity, JobRecord
from hsx_async.run.servers.pool import ServerPool, server_pool
from hsx_async.run.servers.probe import PROBE_IDS

log = structlog.get_logger("hsx.regenerate")


class Regenerator:
    def __init__(
        self,
        config: Config,
        encoder: ChatEncoder,
        paths: RegenPaths,
        input_path: Path,
        model: str,
        *,
        tokenizer_dir: Path | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.paths = paths
        self.input_path = input_path
        self.tokenizer_dir = tokenizer_dir or Path(model)
        tok, settings = encoder.tokenizer, config.regenerate
        stops = set(settings.stop_token_ids)
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        self.stop_ids = tuple(sorted(stops))
        self.meta = {
            "model": model,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "max_new_tokens": settings.max_new_tokens,
            "seed": settings.seed,
            "stop_token_ids": list(self.stop_ids),
            "chat_template_xxh3_64": xxhash.xxh3_64_hexdigest(encoder.template.encode()),
        }
        self.nonce = f"hsx-regen-{secrets.token_hex(4)}"
        self.notifier = notifier or Notifier.from_env()
        self.stopper = Stopper(self.notifier, lambda: self.config.daemon.drain_timeout)
        self.stats = RegenStats()
        self.recorder = RunRecorder.at(paths.events, self._tick)  # <stem>.events.jsonl
        self.pool: ServerPool | None = None
        self.turns: Turns | None = None
        self.admission: Admission | None = None
        self._started = time.monotonic()

    @property
    def stop_requested(self) -> asyncio.Event:
        return self.stopper.stop_requested

    def request_stop(self) -> None:
        """Programmatic SIGTERM (tests, embedding)."""
        self.stopper.on_signal(signal.SIGTERM)

    async def stop(self) -> None:
        """Stop intake (what is queued stays for the next run) and stop waiting for a
        server; the conversations in flight finish (:class:`Stopper`)."""
        if self.turns is not None:
            self.turns.stopping = True
        if self.pool is not None:
            await self.pool.stop_waiting()

    async def run(self, *, handle_signals: bool = False) -> RegenSummary:
        paths = self.paths
        self._started = time.monotonic()
        with output_lock(paths):
            await asyncio.to_thread(check_meta, paths.meta, self.meta)
            out_ids = await asyncio.to_thread(written_ids, paths.out)
            q_ids, q_lines = await asyncio.to_thread(quarantined, paths.quarantine)
            done = Done(out_ids | q_ids, q_lines)
            out = await asyncio.to_thread(AppendLog, paths.out)
            quarantine = await asyncio.to_thread(AppendLog, paths.quarantine)
            recorder = self.recorder
            try:
                await recorder.start()
                await self._connect_and_serve(done, out, quarantine, recorder, handle_signals)
            finally:
                out.close()
                quarantine.close()
                summary = await self._finish(recorder)
        return summary

    async def _finish(self, recorder: RunRecorder) -> RegenSummary:
        stopped = self.stop_requested.is_set()
        await asyncio.to_thread(recorder.finish, stopped=stopped, unfinished=self.unfinished())
        summary = self.summary()
        data = orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2) + b"\n"
        await asyncio.to_thread(write_atomic, self.paths.summary, data)
        return summary

    def summary(self) -> RegenSummary:
        s, p = self.stats, self.paths
        return RegenSummary(
            done=s.done,
            skipped=s.skipped,
            quarantined=s.quarantined,
            turns=s.turns,
            length_capped=s.length_capped,
            tokens=s.tokens,
            seconds=time.monotonic() - self._started,
            stopped=self.stop_requested.is_set(),
            unfinished=self.unfinished(),
            input_done=self.turns is not None and self.turns.input_done,
            quarantine_reasons=dict(s.reasons.most_common()),
            failed_attempts=dict(s.failed.most_common()),
            servers=self._requests(),
            servers_out=list(self.recorder.spells.spells),
            files={
                "output": str(p.out),
                "quarantine": str(p.quarantine),
                "meta": str(p.meta),
                "events": str(p.events),
                "summary": str(p.summary),
            },
            next_step=f"hsx prepare {p.out} --tokenizer {self.tokenizer_dir} --out samples.jsonl",
            identity=self.identity.to_record() if self.identity is not None else None,
        )

    @property
    def identity(self) -> Identity | None:
        """The job's server identity (engine, model, revision, version): pinned by the
        first server admitted, and every other server must match it."""
        return None if self.admission is None else self.admission.job

    def unfinished(self) -> int:
        s = self.stats
        return s.read - s.done - s.quarantined - s.skipped

    def _requests(self) -> dict[str, int]:
        return {x.display: x.requests for x in self.pool.servers} if self.pool else {}

    def _tick(self) -> Tick:
        s = self.stats
        return Tick(s.done, s.tokens, s.bytes, s.quarantined, dict(s.failed), self._requests())

    # -- the servers and the task group ---------------------------------------------------

    async def _connect_and_serve(
        self,
        done: Done,
        out: AppendLog,
        quarantine: AppendLog,
        recorder: RunRecorder,
        signals: bool,
    ) -> None:
        self.pool = server_pool(self.config)  # no server takes a turn before admission
        self.pool.on_change.append(recorder.server_changed)  # the summary's spells too
        executor = ThreadPoolExecutor(2, thread_name_prefix="hsx-regen-io")
        try:
            async with connected(self.pool) as client:
                logs = Logs(out, quarantine, Committer(out, quarantine, executor, _no_files))
                self.turns = Turns(
                    self.config, self.encoder, client, logs,
                    input_path=self.input_path, done=done, stop_ids=self.stop_ids,
                    nonce=self.nonce, stats=self.stats,
                )  # fmt: skip
                vocab = len(self.encoder.tokenizer)
                probe = DecodeProbe(
                    self.config, client,
                    prompt=[int(t) for t in PROBE_IDS if t < vocab], vocab_size=vocab,
                    nonce=self.nonce,
                )  # fmt: skip
                # The one examination of a server (run's): a new output pins nothing yet.
                admission = self.admission = Admission(
                    self.config, client, probe=probe, record=None, job=JobRecord(),
                    final_states=None, notifier=self.notifier,
                    stop_requested=self.stop_requested,
                )  # fmt: skip
                self.turns.arbiter = admission.arbitrate
                runner = JobRunner(
                    lambda: self.config,
                    stopper=self.stopper,
                    notifier=self.notifier,
                    recorder=recorder,
                )
                work = _Regeneration(self, self.turns, logs.committer)
                await runner.serve(work, admission, on_reload=_no_reload if signals else None)
        finally:
            executor.shutdown(wait=True)  # no commit thread writes once the logs close
            self.notifier.close()


class _Regeneration:
    """``hsx regenerate``'s kind of job for the runner: the reader, the workers and the
    group commit."""

    name = "regenerate"

    def __init__(self, regen: Regenerator, turns: Turns, committer: Committer) -> None:
        self.regen = regen
        self.turns = turns
        self.committer = committer

    def start(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.committer.run(), name="hsx-committer")
        self.turns.start(tg)

    async def drained(self) -> None:
        await self.turns.workers_done.wait()

    async def stop(self) -> None:
        await self.regen.stop()

    @property
    def in_flight(self) -> int:
        return self.regen.unfinished()

    def started(self) -> dict[str, Any]:
        cfg = self.regen.config
        return {"workers": cfg.workers.start_concurrency, "servers": len(cfg.server.urls)}

    def finished(self) -> dict[str, Any]:
        return self.regen.summary().to_json()


def _no_files(staged: object) -> None:
    """The group commit's publish step: regenerate stages no sample files."""


def _no_reload() -> None:
    log.warning("reload_ignored", why="hsx regenerate reads its config once; restart it")


# --- entry points ------------------------------------------------------------------------
def _tokenizer_dir(config: Config, tokenizer: Path | None) -> Path:
    base = config.path.parent if config.path is not None else Path.cwd()
    settings = config.regenerate
    tok_dir = tokenizer or (base / settings.tokenizer if settings.tokenizer else None)
    if tok_dir is None:
        raise ConfigError("regenerate.tokenizer", "is not set; add it or pass --tokenizer DIR")
    return tok_dir


def _encoder(config: Config, tok_dir: Path, template: Path | None) -> ChatEncoder:
    base = config.path.parent if config.path is not None else Path.cwd()
    chat = config.regenerate.chat_template
    tmpl = template or (base / chat if chat else None)
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
) -> RegenSummary:
    tok_dir = _tokenizer_dir(config, tokenizer)
    encoder = await asyncio.to_thread(_encoder, config, tok_dir, chat_template)
    model = str(tokenizer or config.regenerate.tokenizer)  # as recorded since version 1
    regen = Regenerator(
        config, encoder, RegenPaths.beside(out), input_path, model, tokenizer_dir=tok_dir
    )
    return await regen.run(handle_signals=handle_signals)
