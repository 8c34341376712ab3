"""``hsx prepare``: conversations → PROTOCOL §1 samples with the assistant loss mask.

Streams the input, encodes chunks of lines in worker processes (``--workers``; results are
taken back in input order, so the output is the same for any number of workers), and
writes three files that appear only once complete (temp → fsync → rename): the samples,
the quarantine (``{"id", "line", "reason"}`` per refused record) and a summary, which the
command prints (:mod:`hsx_async.cli.handlers.prepare`). At most ``2 × workers`` chunks
are in flight: memory stays bounded.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async.config import load_config
from hsx_async.dataset.durable import open_atomic
from hsx_async.dataset.layout import canonical_id
from hsx_async.parallel import ordered_map
from hsx_async.prepare.encode import (
    ChunkResult,
    EncodeOptions,
    Outcome,
    RecordEncoder,
    encode_chunk,
    init_worker,
)
from hsx_async.prepare.summary import PrepareStats, disk_free, size_estimate
from hsx_async.run.source import TOO_LONG, SampleReader

CHUNK_LINES = 64
Chunk = list[tuple[int, bytes | None]]


@dataclass(frozen=True, slots=True)
class PreparePaths:
    input: Path
    out: Path
    quarantine: Path
    summary: Path

    @classmethod
    def beside(cls, input_path: Path, out: Path, quarantine: Path | None = None) -> PreparePaths:
        stem = out.name.removesuffix(".jsonl")
        return cls(
            input_path,
            out,
            quarantine or out.with_name(f"{stem}.quarantine.jsonl"),
            out.with_name(f"{stem}.summary.json"),
        )


# What the fork server imports before it forks the workers: never torch (a process that
# has loaded torch must not fork; tests/prepare/test_pipeline.py).
FORK_SERVER_PRELOAD = ("hsx_async.prepare.encode", "transformers")


def _chunks(reader: SampleReader) -> Iterator[Chunk]:
    chunk: Chunk = []
    for line, raw in reader.raw_lines():
        chunk.append((line, None if raw is TOO_LONG else raw))
        if len(chunk) == CHUNK_LINES:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _in_process(options: EncodeOptions, chunks: Iterable[Chunk]) -> Iterator[ChunkResult]:
    encoder = RecordEncoder(options)
    for chunk in chunks:
        yield encoder.chunk(chunk)


def _pool_context() -> multiprocessing.context.BaseContext:
    """forkserver: a child forked from this process would inherit its tokenizer threads and
    locks; the fork server is a clean process that imports transformers once for all
    workers. Started early, it imports while this process checks the tokenizer."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    multiprocessing.forkserver.ensure_running()
    return context


def _in_pool(
    options: EncodeOptions, chunks: Iterable[Chunk], workers: int
) -> Iterator[ChunkResult]:
    """Chunk results in input order, at most 2 × workers chunks in flight."""
    context = _pool_context()
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=init_worker, initargs=(options,)
    ) as pool:
        yield from ordered_map(pool, encode_chunk, chunks, 2 * workers)


def outcomes(
    options: EncodeOptions, input_path: Path, workers: int, stats: PrepareStats | None = None
) -> Iterator[Outcome]:
    """Every input line's outcome, in input order; duplicate ids go to quarantine. The
    encoding CPU time of every chunk, wherever it ran, is added to ``stats``."""
    reader = SampleReader(input_path, options.max_tokens)
    chunks = _chunks(reader)
    results = _in_process(options, chunks) if workers <= 1 else _in_pool(options, chunks, workers)
    first_line: dict[str, int] = {}
    for batch in results:
        if stats is not None:
            stats.encode_cpu_s += batch.cpu_s
        for outcome in batch.outcomes:
            yield _dedup(outcome, first_line)


def _dedup(outcome: Outcome, first_line: dict[str, int]) -> Outcome:
    """The first sample with an id wins; a later one goes to quarantine."""
    if outcome.id is None or outcome.reason:
        return outcome
    key = canonical_id(outcome.id)
    first = first_line.setdefault(key, outcome.line)
    if first == outcome.line:
        return outcome
    return Outcome(outcome.line, None, reason=f"duplicate id {key!r} (first on line {first})")


def _quarantine_line(outcome: Outcome) -> bytes:
    return orjson.dumps({"id": outcome.id, "line": outcome.line, "reason": outcome.reason}) + b"\n"


def run_prepare(
    options: EncodeOptions,
    paths: PreparePaths,
    *,
    workers: int = 1,
    estimate: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write samples, quarantine and summary; return the summary."""
    if workers > 1:
        _pool_context()
    RecordEncoder(options)  # a bad tokenizer or template fails here, once, as a ConfigError
    stats = PrepareStats()
    paths.out.parent.mkdir(parents=True, exist_ok=True)
    with open_atomic(paths.out) as out, open_atomic(paths.quarantine) as quarantine:
        for outcome in outcomes(options, paths.input, workers, stats):
            stats.add(outcome)
            if outcome.reason:
                quarantine.write(_quarantine_line(outcome))
            else:
                out.write(outcome.line_json)
    summary = stats.to_json()
    summary["max_tokens"] = options.max_tokens
    summary["length_policy"] = options.length_policy
    summary["files"] = {
        "samples": str(paths.out),
        "quarantine": str(paths.quarantine),
        "summary": str(paths.summary),
    }
    if estimate is not None:
        free_at, free = disk_free(Path(estimate["output_dir"]))
        summary["extraction_estimate"] = {
            **size_estimate(
                stats.tokens, estimate["hidden_size"], estimate["aux"], free, estimate["reserve"]
            ),
            "output_dir": str(free_at),
        }
    with open_atomic(paths.summary) as fh:
        fh.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    return summary


def estimate_from_config(path: Path | None) -> dict[str, Any] | None:
    """What the extraction estimate needs from a job's config (``--config``), if any."""
    if path is None:
        return None
    config = load_config(path)
    return {
        "hidden_size": config.model.hidden_size,
        "aux": len(config.model.aux_layers),
        "output_dir": str(config.output.dir),
        "reserve": config.output.disk_reserve,
        "max_tokens": config.input.max_tokens,
    }
