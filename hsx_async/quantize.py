"""FP8 storage of hidden states (PROTOCOL §3, §4, version 4): one quantizer for every place.

``float8_e4m3fn`` with one float32 scale per (token, layer slot) vector: the aux layers of
a model differ in magnitude by orders (and so do tokens: the first token's residual is
often 100× the rest), so a scale shared across either leaves the quieter vectors with few
significant bits. Two layouts (``Storage.scales``):

``per_token_slot`` (version 3)::

    scale = max(amax(|x|) / 448, 2⁻¹²⁶)       (float32; 448 is e4m3fn's largest value)
    q     = e4m3fn(clamp(x / scale, ±448))    (round to nearest even)
    x̂     = float32(q) × scale

``per_token_slot_outliers16`` (version 4, the default): attention-sink tokens carry a few
massive channels, 1,000–30,000× the row's median; scaled by them, a fifth to a half of the
row's other values fall to e4m3fn's subnormals or zero (``bench/fp8.py``). So the K = 16
largest magnitudes of each bfloat16 vector are kept exactly beside it, and the scale
comes from the largest of the rest::

    m     = |x|, NaN counted as +inf                          (bfloat16, exact)
    r     = the (K+1)-th largest m (0 when H ≤ K)
    scale = max(r / 448, 2⁻¹²⁶)                               (float32)
    q     = e4m3fn(clamp(x / scale, ±448))                    (every channel)
    outliers: the channels with m > r (at most K), ascending: index uint16, x bfloat16;
              the unused entries index 0xFFFF, value +0
    x̂     = x for an outlier channel, float32(q) × scale for the others

r is one value whatever the ties, and "m > r" picks the same channels everywhere, so no
step depends on how an implementation breaks ties; the outliers' own q saturate to ±448.

Every step is exact or IEEE-rounded (the division, the cast), so the server hook on a GPU,
the hook on a CPU and the client's fallback produce the same bytes for the same rows; the
clamp makes that hold also where an implementation would turn an overflow into NaN rather
than saturate. A non-finite input gives a non-finite scale (``per_token_slot``; the
outliers layout: a non-finite outlier, or a non-finite scale when more than K values are),
which ``hsx verify --deep`` reports. Used by the hook (the rows are quantized where they
are produced), by the client's writer when a server dumped bfloat16, and by the dataset
reader to dequantize.
"""

from __future__ import annotations

import torch

from hsx_async.protocol import OUTLIER_NONE, Storage

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_MIN = 2.0**-126  # float32's smallest normal: all-zero vectors get a finite, positive scale
# e4m3fn: 3 mantissa bits. The spacing of representable values at |q| in [2^e, 2^(e+1)) is
# 2^(e-3); below 2^-6 (subnormals) it is 2^-9.
_MANTISSA_BITS = 3
_MIN_NORMAL_EXP = -6
FP8_MIN_NORMAL = 2.0**_MIN_NORMAL_EXP


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_slot``: ``rows`` ``[..., H]`` (any float dtype, any device) → (e4m3fn
    ``[..., H]``, float32 scales ``[...]``), one scale per vector of the last dimension."""
    # One float32 copy, then in place: the temporaries of the plain expression cost the
    # client's fallback twice the CPU (bench/README.md, FP8). amax as max(max, -min) is
    # exact, and NaN propagates through both.
    x = rows.to(torch.float32, copy=True)
    lo, hi = torch.aminmax(x, dim=-1)
    scale = torch.maximum(hi, lo.neg()).div_(FP8_MAX).clamp_min_(SCALE_MIN)
    x.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return x.to(FP8_DTYPE), scale


def quantize_outliers(
    rows: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``per_token_slot_outliers16`` (``k`` = 16): bfloat16 ``rows`` ``[..., H]`` (other
    float dtypes are rounded to bfloat16 first), any device → (e4m3fn ``[..., H]``, float32
    scales ``[...]``, outlier channels uint16 ``[..., k]``, their values bfloat16
    ``[..., k]``); the rule is the module docstring's."""
    x = rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)
    h = x.shape[-1]
    if h >= OUTLIER_NONE:
        raise ValueError(f"hidden size {h} is too large for uint16 outlier indices")
    # bfloat16: exact; NaN ranks as the largest. posinf too: nan_to_num's default would turn
    # ±inf into bfloat16's largest finite value, and more than k of them a finite scale.
    mag = x.abs().nan_to_num_(nan=float("inf"), posinf=float("inf"))
    if h <= k:  # fewer channels than outliers: r = 0, every nonzero value is an outlier
        mag = torch.cat([mag, mag.new_zeros((*mag.shape[:-1], k + 1 - h))], dim=-1)
    top, at = torch.topk(mag, k + 1, dim=-1)  # values exact; which of tied channels: moot
    del mag
    r = top[..., k]
    index = torch.where(top[..., :k] > r.unsqueeze(-1), at[..., :k], OUTLIER_NONE)
    index = index.sort(dim=-1).values  # ascending, the unused (0xFFFF) last
    used = index < h
    values = torch.where(used, x.gather(-1, index.clamp_max(h - 1)), 0.0).to(torch.bfloat16)
    scale = r.to(torch.float32).div_(FP8_MAX).clamp_min_(SCALE_MIN)
    q = x.to(torch.float32, copy=True)
    q.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale, index.to(torch.uint16), values


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    outlier_index: torch.Tensor | None = None,
    outlier_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """e4m3fn ``[..., H]`` and scales ``[...]`` (or ``[..., 1]``), and for the outliers
    layout its outlier sections ``[..., K]`` → ``dtype``, computed in float32 and rounded
    once. An outlier index past the vector (a damaged file: ``hsx verify --deep`` names
    it) is ignored."""
    s = scales.float()
    if s.dim() == q.dim():
        s = s.squeeze(-1)
    out = q.float() * s.unsqueeze(-1)
    if outlier_index is not None and outlier_values is not None and outlier_index.numel():
        h = out.shape[-1]
        flat = out.view(-1, h)
        index = outlier_index.reshape(flat.shape[0], -1).to(torch.int64)
        used = index < h
        row = torch.arange(flat.shape[0]).unsqueeze(-1).expand_as(index)
        flat[row[used], index[used]] = outlier_values.reshape(index.shape)[used].float()
    return out.to(dtype)


def quantized_sections(rows: torch.Tensor, storage: Storage) -> list[torch.Tensor]:
    """The quantized slots' rows ``[n, Lq, H]`` as ``storage``'s FP8 sections, in order:
    values, scales and, in the outliers layout, the outliers' channels and values."""
    if storage.outliers:
        return list(quantize_outliers(rows, storage.outliers))
    return list(quantize(rows))


def encode_rows(rows: torch.Tensor, storage: Storage) -> list[torch.Tensor]:
    """One block of rows ``[n, L, H]`` bfloat16 as the tensors of ``storage``'s sections, in
    order (each C-contiguous, on the rows' device): the bytes a dump part holds for them."""
    if not storage.is_fp8:
        return [rows.contiguous()]
    layers = rows.shape[1]
    slots = list(storage.quantized)
    out = quantized_sections(rows[:, slots, :] if len(slots) != layers else rows, storage)
    kept = list(storage.kept(layers))
    if kept:
        out.append(rows[:, kept, :].to(torch.bfloat16))
    return [t.contiguous() for t in out]


def assemble(
    q: torch.Tensor,
    scales: torch.Tensor,
    unquantized: torch.Tensor | None,
    storage: Storage,
    dtype: torch.dtype = torch.bfloat16,
    *,
    outlier_index: torch.Tensor | None = None,
    outlier_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """A file's tensors back to ``[T, L, H]`` in ``dtype``: the quantized slots dequantized
    (with their outliers, in the outliers layout), the others as stored."""
    if storage.outliers and (outlier_index is None or outlier_values is None):
        raise ValueError(f"a {storage.scales} storage needs its outlier sections to dequantize")
    t, lq, h = q.shape
    lk = 0 if unquantized is None else unquantized.shape[1]
    out = torch.empty((t, lq + lk, h), dtype=dtype)
    out[:, list(storage.quantized), :] = dequantize(q, scales, dtype, outlier_index, outlier_values)
    if unquantized is not None and lk:
        out[:, list(storage.kept(lq + lk)), :] = unquantized.to(dtype)
    return out


def rounding_error(
    q: torch.Tensor,
    scales: torch.Tensor | None = None,
    outlier_index: torch.Tensor | None = None,
    outlier_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expected relative RMS error of each stored vector ``[..., H]`` → ``[...]``, from
    the stored values alone: rounding to nearest leaves an error uniform in ±half the
    spacing at each value, of variance spacing² / 12 (none at the ±448 the vector's amax
    becomes, nor at the outliers, which are exact and saturate their q to ±448). The
    outliers layout adds its outliers' power, in the units of q (value / scale): ``scales``
    and both outlier sections. Needs no original; ``bench/fp8.py`` checks it against the
    measured error."""
    v = q.float().abs()
    exp = torch.floor(torch.log2(v.clamp_min(FP8_MIN_NORMAL)))
    # The vector's largest element is stored as exactly ±448: no rounding error there.
    spacing = torch.where(v == FP8_MAX, 0.0, torch.exp2(exp - _MANTISSA_BITS))
    noise = (spacing * spacing / 12.0).sum(dim=-1)
    power = (v * v).sum(dim=-1)
    if scales is not None and outlier_index is not None and outlier_values is not None:
        h = v.shape[-1]
        index = outlier_index.to(torch.int64)
        used = index < h
        at = v.gather(-1, index.clamp_max(h - 1))
        s = scales.float().reshape(power.shape).unsqueeze(-1)
        exact = outlier_values.float() / s
        power = power + torch.where(used, exact * exact - at * at, 0.0).sum(dim=-1)
    return torch.sqrt(noise / power.clamp_min(1e-30))
