"""FP8 storage of hidden states (PROTOCOL §3, §4, version 3): one quantizer for every place.

``float8_e4m3fn`` with one float32 scale per (token, layer slot) vector: the aux layers of
a model differ in magnitude by orders (and so do tokens: the first token's residual is
often 100× the rest), so a scale shared across either leaves the quieter vectors with few
significant bits.

    scale = max(amax(|x|) / 448, 2⁻¹²⁶)       (float32; 448 is e4m3fn's largest value)
    q     = e4m3fn(clamp(x / scale, ±448))    (round to nearest even)
    x̂     = float32(q) × scale

Every step is exact or IEEE-rounded (the division, the cast), so the server hook on a GPU,
the hook on a CPU and the client's fallback produce the same bytes for the same rows; the
clamp makes that hold also where an implementation would turn an overflow into NaN rather
than saturate. A non-finite input gives a non-finite scale, which ``hsx verify --deep``
reports. Used by the hook (the rows are quantized where they are produced), by the client's
writer when a server dumped bfloat16, and by the dataset reader to dequantize.
"""

from __future__ import annotations

import torch

from hsx_async.protocol import Storage

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_MIN = 2.0**-126  # float32's smallest normal: all-zero vectors get a finite, positive scale
# e4m3fn: 3 mantissa bits. The spacing of representable values at |q| in [2^e, 2^(e+1)) is
# 2^(e-3); below 2^-6 (subnormals) it is 2^-9.
_MANTISSA_BITS = 3
_MIN_NORMAL_EXP = -6


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[..., H]`` (any float dtype, any device) → (e4m3fn ``[..., H]``,
    float32 scales ``[...]``), one scale per vector of the last dimension."""
    # One float32 copy, then in place: the temporaries of the plain expression cost the
    # client's fallback twice the CPU (bench/README.md, FP8). amax as max(max, -min) is
    # exact, and NaN propagates through both.
    x = rows.to(torch.float32, copy=True)
    lo, hi = torch.aminmax(x, dim=-1)
    scale = torch.maximum(hi, lo.neg()).div_(FP8_MAX).clamp_min_(SCALE_MIN)
    x.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return x.to(FP8_DTYPE), scale


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """e4m3fn ``[..., H]`` and scales ``[...]`` (or ``[..., 1]``) → ``dtype``, computed in
    float32 and rounded once."""
    s = scales.float()
    if s.dim() == q.dim():
        s = s.squeeze(-1)
    return (q.float() * s.unsqueeze(-1)).to(dtype)


def encode_rows(rows: torch.Tensor, storage: Storage) -> list[torch.Tensor]:
    """One block of rows ``[n, L, H]`` bfloat16 as the tensors of ``storage``'s sections, in
    order (each C-contiguous, on the rows' device): the bytes a dump part holds for them."""
    if not storage.is_fp8:
        return [rows.contiguous()]
    layers = rows.shape[1]
    slots = list(storage.quantized)
    q, scale = quantize(rows[:, slots, :] if len(slots) != layers else rows)
    out = [q.contiguous(), scale.contiguous()]
    kept = list(storage.kept(layers))
    if kept:
        out.append(rows[:, kept, :].to(torch.bfloat16).contiguous())
    return out


def assemble(
    q: torch.Tensor,
    scales: torch.Tensor,
    unquantized: torch.Tensor | None,
    storage: Storage,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """A file's tensors back to ``[T, L, H]`` in ``dtype``: the quantized slots dequantized,
    the others as stored."""
    t, lq, h = q.shape
    lk = 0 if unquantized is None else unquantized.shape[1]
    out = torch.empty((t, lq + lk, h), dtype=dtype)
    out[:, list(storage.quantized), :] = dequantize(q, scales, dtype)
    if unquantized is not None and lk:
        out[:, list(storage.kept(lq + lk)), :] = unquantized.to(dtype)
    return out


def rounding_error(q: torch.Tensor) -> torch.Tensor:
    """The expected relative RMS error of each stored vector ``[..., H]`` → ``[...]``, from
    the quantized values alone: rounding to nearest leaves an error uniform in ±half the
    spacing at each value, of variance spacing² / 12 (none at the ±448 the vector's amax
    becomes). Needs no original; ``bench/fp8.py`` checks it against the measured error."""
    v = q.float().abs()
    exp = torch.floor(torch.log2(v.clamp_min(2.0**_MIN_NORMAL_EXP)))
    # The vector's largest element is stored as exactly ±448: no rounding error there.
    spacing = torch.where(v == FP8_MAX, 0.0, torch.exp2(exp - _MANTISSA_BITS))
    noise = (spacing * spacing / 12.0).sum(dim=-1)
    power = (v * v).sum(dim=-1).clamp_min(1e-30)
    return torch.sqrt(noise / power)
