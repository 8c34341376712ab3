"""An independent implementation of PROTOCOL §3's ``per_token_slot_outliers16`` rule, for
tests: numpy only, written from the protocol's text, sharing no code with
:mod:`hsx_async.quantize` (its own bfloat16 decoding, sort and e4m3fn encoder), so that a
byte-for-byte match says the one quantizer does what the protocol says.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

K = 16  # outliers per vector
UNUSED = 0xFFFF
E4M3_MAX = 448.0
SCALE_FLOOR = np.float32(2.0**-126)


class Encoded(NamedTuple):
    q: npt.NDArray[np.uint8]  # e4m3fn codes [..., H]
    scales: npt.NDArray[np.float32]  # [...]
    channels: npt.NDArray[np.uint16]  # [..., K]
    values: npt.NDArray[np.uint16]  # bfloat16 bits [..., K]


def bf16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """bfloat16 is the high half of a float32: exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3fn_codes(y: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """Round finite float32 values with |y| ≤ 448 to e4m3fn, to nearest even: sign, 4
    exponent bits (bias 7), 3 mantissa bits; below 2^-6 the subnormals, steps of 2^-9."""
    if not np.isfinite(y).all() or (np.abs(y) > E4M3_MAX).any():
        raise ValueError("the reference encodes finite values within ±448 only")
    a = np.abs(y).astype(np.float64)  # exact
    sign = np.signbit(y).astype(np.uint8) << 7
    _, e2 = np.frexp(a)  # a = f · 2^e2 with f in [0.5, 1) (0 for a = 0)
    normal = a >= 2.0**-6
    exp = np.where(normal, e2 - 1, -6)  # the binade; subnormals (and 0) step like the lowest
    step = np.exp2(exp - 3)  # 3 mantissa bits
    units = np.rint(a / step)  # exact division by a power of two; rint: half to even
    # units counts steps of 2^(exp-3): in a normal binade 8..16 (16 is the next binade's 8)
    code = np.where(
        normal,
        ((exp + 7) << 3) + (units - 8),  # exp field exp+7, mantissa units-8 (a carry to 16
        units,  # is exp field +1, mantissa 0: the same sum); subnormal: the units themselves
    )
    code = np.where(normal & (units >= 16), ((exp + 8) << 3), code)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def reference_outliers16(bits: npt.NDArray[np.uint16], k: int = K) -> Encoded:
    """``bits``: bfloat16 rows ``[..., H]`` as uint16 (finite). The rule: m = |x|; r = the
    (k+1)-th largest m (0 when H ≤ k); scale = max(r / 448, 2^-126) in float32; q = e4m3fn
    of clamp(x / scale, ±448); outliers: the channels with m > r, ascending, padded with
    (0xFFFF, +0). ``k = 0`` is version 3's ``per_token_slot`` (r = the largest m)."""
    x = bf16_to_f32(bits)
    shape, h = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, h)
    qs = np.empty(flat.shape, dtype=np.uint8)
    scales = np.empty(flat.shape[0], dtype=np.float32)
    index = np.full((flat.shape[0], k), UNUSED, dtype=np.uint16)
    values = np.zeros((flat.shape[0], k), dtype=np.uint16)
    raw = bits.reshape(-1, h)
    for i, row in enumerate(flat):
        m = np.abs(row)
        r = np.float32(np.sort(m)[::-1][k]) if h > k else np.float32(0.0)
        scale = np.float32(max(np.float32(r) / np.float32(E4M3_MAX), SCALE_FLOOR))
        with np.errstate(over="ignore"):  # x / 2^-126 may overflow to ±inf: clamped
            y = np.clip(row / scale, np.float32(-E4M3_MAX), np.float32(E4M3_MAX))
        qs[i] = e4m3fn_codes(y.astype(np.float32))
        scales[i] = scale
        chosen = np.nonzero(m > r)[0]  # ascending
        index[i, : len(chosen)] = chosen
        values[i, : len(chosen)] = raw[i, chosen]
    return Encoded(
        qs.reshape(*shape, h),
        scales.reshape(shape),
        index.reshape(*shape, k),
        values.reshape(*shape, k),
    )
