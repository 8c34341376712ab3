"""Checks every server's FP8 tests share: a committed FP8 dump holds, part by part, exactly
:func:`hsx_async.quantize.encode_rows` of the bfloat16 rows the same server dumps for the
same input, and the client's own :func:`~hsx_async.run.dumps.dump.validate_dump` accepts it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson
import torch

from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    META_NAME,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
    PROTOCOL_VERSION,
    Storage,
    num_layers,
    parse_meta,
)
from hsx_async.quantize import encode_rows
from hsx_async.run.dumps.dump import validate_dump

# Every slot quantized, and the aux layers only (the final state kept), for L = 3, in the
# default layout (version 4: the outliers one); and every slot in version 3's layout.
FP8_ALL = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT_OUTLIERS16)
FP8_AUX = Storage(FP8, (0, 1), PER_TOKEN_SLOT_OUTLIERS16)
FP8_ALL_V3 = Storage(FP8, (0, 1, 2), PER_TOKEN_SLOT)


def encoded_bytes(rows: np.ndarray, storage: Storage) -> bytes:
    """``rows`` ``[n, L, H]`` bfloat16 bit patterns → the part bytes of ``storage``."""
    bf16 = torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes() for t in encode_rows(bf16, storage)
    )


def read_bf16_rows(rid_dir: Path) -> np.ndarray:
    """A committed bfloat16 dump's rows ``[T, L, H]`` (uint16 bit patterns)."""
    meta = parse_meta((rid_dir / META_NAME).read_bytes())
    assert meta.storage == BF16_STORAGE
    shape = (num_layers(meta.aux_layers), meta.hidden_size)
    parts = [
        np.fromfile(rid_dir / f"part-{s:010d}-{e:010d}.bin", dtype="<u2").reshape(e - s, *shape)
        for s, e in meta.parts
    ]
    return np.concatenate(parts)


def check_fp8_dump(
    rid_dir: Path,
    bf16_rows: np.ndarray,
    storage: Storage,
    *,
    aux_layers: Sequence[int],
    rid: str | None = None,
) -> list[tuple[int, int]]:
    """``rid_dir`` is a committed dump stored as ``storage`` whose every part is the
    encoding of ``bf16_rows`` (``[T, L, H]`` bits) over its rows; returns its parts."""
    rid = rid or rid_dir.name
    t, layers, h = bf16_rows.shape
    meta_bytes = (rid_dir / META_NAME).read_bytes()
    raw = orjson.loads(meta_bytes)
    assert raw["dtype"] == FP8 and raw["quantized"] == list(storage.quantized)
    assert raw["scales"] == storage.scales and raw["protocol"] == PROTOCOL_VERSION
    dump = validate_dump(
        rid_dir, meta_bytes, rid=rid, num_tokens=t, hidden_size=h,
        aux_layers=tuple(aux_layers), storage=storage,
    )  # fmt: skip
    assert dump.meta.storage == storage and layers == num_layers(aux_layers)
    per_row = storage.row_bytes(layers, h)
    for (start, end), path in zip(dump.meta.parts, dump.part_paths(), strict=True):
        data = path.read_bytes()
        assert len(data) == (end - start) * per_row
        assert data == encoded_bytes(bf16_rows[start:end], storage), f"part [{start}, {end})"
    return list(dump.meta.parts)
