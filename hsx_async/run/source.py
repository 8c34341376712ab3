"""Reading samples (PROTOCOL §1): a streaming JSONL reader that never loads the file whole.

:func:`parse_line` is pure. :class:`SampleReader` reads the file in a thread, a batch of
lines at a time, and adds what needs the whole stream: duplicate ids (the first line with
an id wins, later ones go to quarantine) and over-long lines (skipped without being held in
memory). Line numbers are 0-based, like the default id.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import orjson

from hsx_async.dataset.layout import SampleId, canonical_id, shard_of_id
from hsx_async.dataset.provenance import fingerprint
from hsx_async.errors import InputError

_BATCH_BYTES = 4 << 20
TOO_LONG = b"<too long>"  # identity-compared marker for an over-long line
_BATCH_LINES = 512
# A JSON token id takes at most ~21 bytes ("18446744073709551615,"); a loss mask 2 more.
_BYTES_PER_TOKEN_MAX = 32
_LINE_OVERHEAD = 1 << 20


@dataclass(frozen=True, slots=True)
class Sample:
    id: SampleId
    line: int
    input_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.uint8] | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that goes to quarantine. ``id`` is None when the line has no usable id.

    ``duplicate_of``: for a repeated id, the (0-based) line that holds it first; the
    duplicate keeps its id so a person can find it, but only its line marks it done."""

    line: int
    id: SampleId | None
    reason: str
    duplicate_of: int | None = None

    @property
    def own_id(self) -> SampleId | None:
        """The id this line settles (None for a duplicate: the first line owns it)."""
        return None if self.duplicate_of is not None else self.id


Item = Sample | BadLine


def _sample_id(obj: dict[str, Any], line: int) -> tuple[SampleId | None, str]:
    """The id (the line number by default), or None and why it is unusable."""
    if "id" not in obj:
        return line, ""
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None, f"id {value!r} is not a string or integer"
    if isinstance(value, str) and not value:
        return None, "id is an empty string"
    if isinstance(value, int) and value < 0:
        return None, f"id {value} is negative"
    return value, ""


def _token_ids(raw: object, max_tokens: int) -> npt.NDArray[np.int64] | str:
    if not isinstance(raw, list):
        return "input_ids is missing or not a list"
    if not raw:
        return "input_ids is empty"
    if len(raw) > max_tokens:
        return f"input_ids has {len(raw)} tokens, more than input.max_tokens ({max_tokens})"
    if not all(type(x) is int for x in raw):
        bad = next(x for x in raw if type(x) is not int)
        return f"input_ids holds {bad!r}, not an integer"
    try:
        ids = np.array(raw, dtype=np.int64)
    except OverflowError:
        return "input_ids holds an integer beyond int64"
    if int(ids.min()) < 0:
        return f"input_ids holds a negative id {int(ids.min())}"
    return ids


def _loss_mask(raw: object, n: int) -> npt.NDArray[np.uint8] | str | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        return "loss_mask is not a list"
    if len(raw) != n:
        return f"loss_mask has {len(raw)} entries, input_ids has {n}"
    if not all(type(x) is int and x in (0, 1) for x in raw):
        return "loss_mask holds a value other than 0 or 1"
    return np.array(raw, dtype=np.uint8)


def parse_line(raw: bytes, line: int, max_tokens: int) -> Item:
    """Validate one JSONL line (without duplicate detection, which needs the stream)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        reason = "blank line" if not raw.strip() else f"not valid JSON: {exc}"
        return BadLine(line, None, reason)
    if not isinstance(obj, dict):
        return BadLine(line, None, f"not a JSON object but {type(obj).__name__}")
    sid, why = _sample_id(obj, line)
    if sid is None:
        return BadLine(line, None, why)
    ids = _token_ids(obj.get("input_ids"), max_tokens)
    if isinstance(ids, str):
        return BadLine(line, sid, ids)
    mask = _loss_mask(obj.get("loss_mask"), len(ids))
    if isinstance(mask, str):
        return BadLine(line, sid, mask)
    return Sample(sid, line, ids, mask)


def open_input(path: Path) -> io.BufferedReader:
    """The input file, opened for reading; :class:`InputError` (one line naming
    ``input.path``) unless it is a readable regular file. Opened non-blocking, so a FIFO
    is refused instead of waiting for a writer; a device such as ``/dev/zero`` (endless)
    or a directory is refused too: resuming needs a file that can be read again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"cannot read input.path {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise InputError(
        f"cannot read input.path {path}: it is {_kind(mode)}, not a regular file; point "
        "input.path at the JSONL file"
    )


def require_samples(path: Path) -> None:
    """:func:`open_input`'s refusals, and :class:`InputError` when the file holds nothing but
    whitespace: a job with no sample is an operator's mistake (the wrong file, a failed
    ``hsx prepare``), refused by ``hsx check`` and ``hsx run`` in the same words. Reads up
    to the first byte that is not whitespace (the first chunk of any real input)."""
    with open_input(path) as fh:
        while chunk := fh.read(1 << 20):
            if chunk.strip():
                return
    raise InputError(
        f"input.path {path} holds no sample (the file is empty or blank): point input.path "
        "at the job's JSONL file, one sample per line"
    )


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "not a file"


def fingerprint_input(path: Path, prefix: int | None = None) -> dict[str, Any]:
    """:func:`hsx_async.dataset.provenance.fingerprint` of the input, opened as
    :func:`open_input` opens it (blocking: call from a thread)."""
    with open_input(path) as fh:
        return fingerprint(fh, path, prefix=prefix)


def shard_of(item: Item, count: int) -> int:
    """Stable shard of an item: by id for samples, by line for quarantined lines."""
    if isinstance(item, Sample):
        return shard_of_id(item.id, count)
    return item.line % count


class SampleReader:
    """Streams :data:`Item` s from a JSONL file, one thread-read batch at a time."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        self.path = path
        self.max_tokens = max_tokens
        self.max_line_bytes = max_tokens * _BYTES_PER_TOKEN_MAX + _LINE_OVERHEAD
        self._first_line: dict[str, int] = {}

    def _open(self) -> IO[bytes]:
        return open_input(self.path)

    def _read_line(self, fh: IO[bytes]) -> bytes | None:
        """One line without its newline; None at EOF; :data:`TOO_LONG` for an over-long
        line, which is skipped without being held in memory."""
        raw = fh.readline(self.max_line_bytes + 1)
        if not raw:
            return None
        if len(raw) > self.max_line_bytes and not raw.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # drop the rest of the line without holding it
            return TOO_LONG
        return raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw

    def _batch(self, fh: IO[bytes], start: int, lines: int = _BATCH_LINES) -> list[Item]:
        items: list[Item] = []
        size, line = 0, start
        while len(items) < lines and size < _BATCH_BYTES:
            raw = self._read_line(fh)
            if raw is None:
                break
            if raw is TOO_LONG:
                item: Item = BadLine(line, None, f"line longer than {self.max_line_bytes} bytes")
            else:
                item = self._dedup(parse_line(raw, line, self.max_tokens))
            items.append(item)
            size += len(raw) + 1
            line += 1
        return items

    def _dedup(self, item: Item) -> Item:
        if item.id is None:
            return item
        key = canonical_id(item.id)
        first = self._first_line.setdefault(key, item.line)
        if first != item.line:
            # Messages use the line numbers of editors and grep -n (1-based).
            reason = f"duplicate id {key!r} (first on line {first + 1})"
            return BadLine(item.line, item.id, reason, duplicate_of=first)
        return item

    async def items(self) -> AsyncIterator[Item]:
        fh = await asyncio.to_thread(self._open)
        try:
            # The first batches are small, so the first samples reach the workers after
            # one line's parse, not 512 lines' (the start of every run waited for it).
            line, lines = 0, 1
            while batch := await asyncio.to_thread(self._batch, fh, line, lines):
                line += len(batch)
                lines = min(2 * lines, _BATCH_LINES)
                for item in batch:
                    yield item
        finally:
            fh.close()

    def raw_lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, raw line) without validation; over-long lines are :data:`TOO_LONG`."""
        with self._open() as fh:
            line = 0
            while (raw := self._read_line(fh)) is not None:
                yield line, raw
                line += 1

    def iter_sync(self) -> Iterator[Item]:
        """The same stream, blocking (for ``hsx check`` estimates and tests)."""
        with self._open() as fh:
            line = 0
            while batch := self._batch(fh, line):
                line += len(batch)
                yield from batch


def count_pending(
    reader: SampleReader,
    shard_index: int,
    shard_count: int,
    is_done: Callable[[SampleId, int], bool],
) -> tuple[int, int]:
    """(samples, tokens) of this shard not yet done: a fast pass for progress, ETA and the
    disk estimate. It parses but does not validate, so it may count a bad line or two."""
    samples = tokens = 0
    for line, raw in reader.raw_lines():
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(ids := obj.get("input_ids"), list):
            continue
        sid = obj.get("id", line)
        if isinstance(sid, bool) or not isinstance(sid, str | int):
            continue
        if shard_count > 1 and shard_of_id(sid, shard_count) != shard_index:
            continue
        if not is_done(sid, line):
            samples += 1
            tokens += len(ids)
    return samples, tokens
