"""One record in, one sample line or one quarantine reason out: the work a process does.

:class:`EncodeOptions` is what every worker process is started with; :func:`encode_chunk`
turns a chunk of ``(line, raw)`` input lines into :class:`Outcome` s in the same order, so
the parent can write them in input order whatever process did the work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from hsx_async.prepare.records import BadRecord, SystemPolicy, parse_record
from hsx_async.prepare.template import (
    ChatEncoder,
    Encoded,
    RecordError,
    load_tokenizer,
    read_template,
)

LengthPolicy = Literal["skip", "truncate"]


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    tokenizer: Path
    chat_template: Path | None = None
    system: SystemPolicy = "keep"
    system_prompt: str | None = None
    max_tokens: int = 32768
    length_policy: LengthPolicy = "skip"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A sample (``line_json`` set) or a quarantined record (``reason`` set)."""

    line: int
    id: str | int | None
    line_json: bytes = b""
    reason: str = ""
    tokens: int = 0
    trainable: int = 0
    truncated_from: int = 0  # the length before truncation; 0: not truncated


def sample_line(sample_id: str | int, enc: Encoded) -> bytes:
    """A PROTOCOL §1 line: ``id``, ``input_ids``, ``loss_mask``."""
    obj = {"id": sample_id, "input_ids": enc.input_ids, "loss_mask": enc.loss_mask}
    return orjson.dumps(obj) + b"\n"


def apply_length(enc: Encoded, max_tokens: int, policy: LengthPolicy) -> Encoded | str:
    """The sample within ``max_tokens``, or why it is refused."""
    n = len(enc.input_ids)
    if n <= max_tokens:
        return enc
    if policy == "skip":
        return f"{n} tokens > --max-tokens {max_tokens} (policy skip)"
    cut = Encoded(enc.input_ids[:max_tokens], enc.loss_mask[:max_tokens])
    if not cut.trainable:
        return f"{n} tokens, and no assistant token in the first {max_tokens} (policy truncate)"
    return cut


class RecordEncoder:
    """Records → outcomes with one tokenizer and template (one per process)."""

    def __init__(self, options: EncodeOptions) -> None:
        self.options = options
        tokenizer = load_tokenizer(options.tokenizer)
        self.chat = ChatEncoder(tokenizer, read_template(options.chat_template, tokenizer))

    def outcome(self, line: int, raw: bytes | None) -> Outcome:
        """``raw`` None: a line too long to read (already refused by the reader)."""
        opts = self.options
        if raw is None:
            return Outcome(line, None, reason="line too long to be one conversation")
        record = parse_record(raw, line, system=opts.system, system_prompt=opts.system_prompt)
        if isinstance(record, BadRecord):
            return Outcome(line, record.id, reason=record.reason)
        try:
            full = self.chat.encode(record)
        except RecordError as exc:
            return Outcome(line, record.id, reason=str(exc))
        enc = apply_length(full, opts.max_tokens, opts.length_policy)
        if isinstance(enc, str):
            return Outcome(line, record.id, reason=enc)
        n_full = len(full.input_ids)
        return Outcome(
            line,
            record.id,
            line_json=sample_line(record.id, enc),
            tokens=len(enc.input_ids),
            trainable=enc.trainable,
            truncated_from=n_full if n_full > len(enc.input_ids) else 0,
        )

    def chunk(self, lines: Sequence[tuple[int, bytes | None]]) -> ChunkResult:
        started = time.process_time()
        outcomes = [self.outcome(line, raw) for line, raw in lines]
        return ChunkResult(outcomes, time.process_time() - started)


@dataclass(frozen=True, slots=True)
class ChunkResult:
    outcomes: list[Outcome]
    cpu_s: float  # CPU seconds the chunk took in its process (the summary adds them up)


# One encoder per worker process, built by the pool's initializer.
_WORKER: RecordEncoder | None = None


def init_worker(options: EncodeOptions) -> None:
    global _WORKER  # noqa: PLW0603 - a process pool hands state to workers this way
    _WORKER = RecordEncoder(options)


def encode_chunk(lines: Sequence[tuple[int, bytes | None]]) -> ChunkResult:
    if _WORKER is None:
        raise RuntimeError("encode_chunk runs in a worker started with init_worker")
    return _WORKER.chunk(lines)
