"""``hsx samples``: a synthetic input file (PROTOCOL §1) of a given size, to try hsx out.

Deterministic for a seed: the same command writes the same bytes, so a tryout that is run
twice resumes instead of being refused for a changed input. Token ids are drawn from
``[3, vocab)`` (0–2 are the special tokens of the reference model's tokenizer); lengths are
uniform in ``[min_len, max_len]``. The file is written under a temporary name, fsynced and
renamed, so an interrupted command never leaves half a file for ``hsx run`` to fingerprint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from hsx_async.errors import ConfigError

_FIRST_TOKEN = 3  # <s>, </s>, <unk> of the reference tokenizer come first


def synthetic_lines(
    count: int, *, max_len: int, min_len: int = 1, vocab: int = 1024, seed: int = 0
) -> Iterator[bytes]:
    """``count`` JSONL lines, ids ``sample-000000``…; one sample in memory at a time.
    Arguments are checked here, before the first line is asked for."""
    if count < 1:
        raise ConfigError("", "--count must be at least 1")
    if not 1 <= min_len <= max_len:
        raise ConfigError("", f"need 1 ≤ --min-len ({min_len}) ≤ --max-len ({max_len})")
    if vocab <= _FIRST_TOKEN:
        raise ConfigError("", f"--vocab must be larger than {_FIRST_TOKEN}")
    return _lines(count, max_len, min_len, vocab, seed)


def _lines(count: int, max_len: int, min_len: int, vocab: int, seed: int) -> Iterator[bytes]:
    rng = np.random.default_rng(seed)
    width = max(6, len(str(count - 1)))
    for i in range(count):
        n = int(rng.integers(min_len, max_len, endpoint=True))
        ids = rng.integers(_FIRST_TOKEN, vocab, size=n, dtype=np.int64)
        record = {"id": f"sample-{i:0{width}d}", "input_ids": ids}
        yield orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def write_samples(path: Path, lines: Iterator[bytes]) -> tuple[int, int]:
    """Write atomically (temp, fsync, rename); returns (samples, bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    samples = size = 0
    with tmp.open("wb") as fh:
        for line in lines:
            fh.write(line)
            samples += 1
            size += len(line)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    return samples, size


def write_synthetic(
    out: Path, *, count: int, max_len: int, min_len: int | None, vocab: int, seed: int
) -> tuple[int, int]:
    """``count`` synthetic samples written to the file ``out`` (:func:`write_samples`);
    returns (samples, bytes). ``min_len`` None: 16, or ``max_len`` when that is shorter."""
    if out.is_dir():
        raise ConfigError(
            "", f"--out {out} is a directory; name a file such as {out}/samples.jsonl"
        )
    min_len = min(16, max_len) if min_len is None else min_len
    lines = synthetic_lines(count, max_len=max_len, min_len=min_len, vocab=vocab, seed=seed)
    try:
        return write_samples(out, lines)
    except OSError as exc:
        raise ConfigError("", f"--out: cannot write {out}: {exc.strerror}") from None
