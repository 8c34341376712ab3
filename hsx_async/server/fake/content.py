"""Deterministic hidden states for the fake server: what it writes, and what tests expect.

A row (one token, one layer) is ``H`` bf16 bit patterns. Its body is a row of a small
precomputed table picked by a hash of (token id, position), so producing a pass is one
numpy gather at memcpy speed; its first few elements (the header) spell out the layer,
the position and the token id, so distinct layers and positions always differ even where
the hash picks the same table row. Every pattern has an exponent below 0xFF: finite.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

U16 = npt.NDArray[np.uint16]
I64 = npt.NDArray[np.int64]

# Token classes in the table; prime so that the class hash mixes every input bit.
_CLASSES = 61
_MIX_TOKEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_POS = np.uint64(0xC2B2AE3D27D4EB4F)
# Header: element 0 = layer code, 1..4 = position bytes, 5..8 = token id bytes.
_HEADER = 9
_ONE = 0x3F80  # bf16 1.0: byte codes are ±[1, 2), finite by construction
_TWO = 0x4000  # bf16 2.0: layer codes live in another binade than byte codes


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # Integer hash (no RNG): the table is the same for every numpy version and platform.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def content_table(hidden_size: int, num_layers: int, weights: int = 0) -> U16:
    """``[K, L, H]`` bf16 patterns: random sign and mantissa, exponent 119..126 (finite).
    ``weights``: another checkpoint of one shape (other numbers, the same headers)."""
    start = np.uint64(weights) * np.uint64(_CLASSES * num_layers * hidden_size)
    h = _splitmix64(start + np.arange(_CLASSES * num_layers * hidden_size, dtype=np.uint64))
    sign = (h & np.uint64(1)) << np.uint64(15)
    exponent = (np.uint64(119) + ((h >> np.uint64(8)) & np.uint64(7))) << np.uint64(7)
    mantissa = (h >> np.uint64(16)) & np.uint64(0x7F)
    table: U16 = (
        (sign | exponent | mantissa).astype("<u2").reshape(_CLASSES, num_layers, hidden_size)
    )
    table.flags.writeable = False
    return table


def _byte_codes(values: I64) -> U16:
    """``[n, 4]``: the low 4 bytes of each value, each as a finite bf16 in ±[1, 2)."""
    shifts = np.arange(0, 32, 8, dtype=np.int64)
    b = (values[:, None] >> shifts) & 0xFF
    return (_ONE | (b & 0x7F) | ((b & 0x80) << 8)).astype("<u2")


def fill_rows(out: U16, input_ids: I64, positions: I64, weights: int = 0) -> None:
    """Write the rows of ``input_ids`` at ``positions`` into ``out`` (``[n, L, H]``)."""
    _, num_layers, hidden = out.shape
    mixed = input_ids.astype(np.uint64) * _MIX_TOKEN + positions.astype(np.uint64) * _MIX_POS
    classes = ((mixed ^ (mixed >> np.uint64(31))) % np.uint64(_CLASSES)).astype(np.intp)
    # mode="clip": with the default "raise", numpy buffers `out` (an extra copy).
    np.take(content_table(hidden, num_layers, weights), classes, axis=0, out=out, mode="clip")
    layer = np.arange(num_layers, dtype=np.int64)
    out[:, :, 0] = (_TWO | (layer & 0x7F) | ((layer & 0x80) << 8)).astype("<u2")
    header = np.concatenate((_byte_codes(positions), _byte_codes(input_ids)), axis=1)
    width = min(hidden, _HEADER) - 1
    if width > 0:
        out[:, :, 1 : 1 + width] = header[:, None, :width]


def expected_hidden_states(
    input_ids: npt.ArrayLike, hidden_size: int, num_layers: int, weights: int = 0
) -> U16:
    """``uint16 [T, L, H]``: the bf16 bit patterns the fake server dumps for this prompt.

    Depends only on token id, position (0-based in the prompt) and layer; never NaN or Inf.
    """
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    out = np.empty((ids.shape[0], num_layers, hidden_size), dtype="<u2")
    fill_rows(out, ids, np.arange(ids.shape[0], dtype=np.int64), weights)
    return out
