"""What ``hsx verify --deep`` checks in the FP8 sections of a sample file (PROTOCOL §4).

hsx's one quantizer (:mod:`hsx_async.quantize`) gives every (token, layer slot) vector the
scale ``max(amax / 448, 2⁻¹²⁶)``, so that each stored vector's largest ``|q|`` is exactly 448
(the division rounds to within a hair of 448, and e4m3fn's neighbours are 416 and 448): a
vector whose largest value is anything else was not made by it — other scales, a shifted
section, bytes from elsewhere. The exceptions are the vectors whose scale hit the floor
(all-zero or denormal-small ones; their ``|q|`` stays below 448). A scale must be finite
and positive: a non-finite one is what a non-finite input gives, and dequantizes to NaN.

It also estimates the quantization error of each stored vector from the values alone
(:func:`hsx_async.quantize.rounding_error`, the expected relative RMS error) and sums it
per layer slot, so the report says what FP8 cost this dataset without the originals.

Pure numpy/torch over arrays; reading the file is the audit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hsx_async.quantize import FP8_MAX, SCALE_MIN, rounding_error

SCALE_FLOOR = np.float32(SCALE_MIN)


@dataclass
class QuantStats:
    """Per layer slot (indexed like the L axis; kept bf16 slots stay zero)."""

    slots: tuple[int, ...]  # the quantized slots
    vectors: np.ndarray  # stored FP8 vectors
    bad_scales: np.ndarray  # scales that are non-finite or ≤ 0
    off_scale: np.ndarray  # vectors whose largest |q| is not 448 (scale above the floor)
    err_vectors: np.ndarray  # nonzero vectors in the error estimate
    err_sum: np.ndarray  # sum of their estimated relative RMS errors
    err_max: np.ndarray
    first_bad_scale: tuple[int, int] | None = None  # (token, slot)
    first_off_scale: tuple[int, int] | None = None

    @classmethod
    def empty(cls, slots: Sequence[int], layers: int) -> QuantStats:
        def zeros() -> np.ndarray:
            return np.zeros(layers, dtype=np.int64)

        return cls(
            slots=tuple(slots),
            vectors=zeros(),
            bad_scales=zeros(),
            off_scale=zeros(),
            err_vectors=zeros(),
            err_sum=np.zeros(layers),
            err_max=np.zeros(layers),
        )

    def add(self, other: QuantStats) -> None:
        self.vectors += other.vectors
        self.bad_scales += other.bad_scales
        self.off_scale += other.off_scale
        self.err_vectors += other.err_vectors
        self.err_sum += other.err_sum
        self.err_max = np.maximum(self.err_max, other.err_max)

    @property
    def err_mean(self) -> np.ndarray:
        mean: np.ndarray = self.err_sum / np.maximum(self.err_vectors, 1)
        return mean

    def problems(self, where: str, names: Sequence[str], num_tokens: int) -> list[str]:
        found = []
        if self.bad_scales.any():
            token, slot = self.first_bad_scale or (0, 0)
            found.append(
                f"{where}: {int(self.bad_scales.sum())} FP8 scales are non-finite or ≤ 0 "
                f"({_per_slot(self.bad_scales, names)} of {num_tokens} tokens); first at "
                f"token {token}, {names[slot]}: the rows it was quantized from were not "
                "finite, or the scales were overwritten"
            )
        if self.off_scale.any():
            token, slot = self.first_off_scale or (0, 0)
            found.append(
                f"{where}: {int(self.off_scale.sum())} stored FP8 vectors have a largest "
                f"|value| other than {FP8_MAX:g} ({_per_slot(self.off_scale, names)}); first "
                f"at token {token}, {names[slot]}: hsx's quantizer scales every vector to "
                f"±{FP8_MAX:g}, so these were not written by it (other scales, or bytes from "
                "elsewhere)"
            )
        return found


def _per_slot(counts: np.ndarray, names: Sequence[str]) -> str:
    return ", ".join(f"{names[i]}: {int(c)}" for i, c in enumerate(counts) if c)


def scan_fp8(q: torch.Tensor, scales: torch.Tensor, stats: QuantStats, offset: int) -> None:
    """Check one chunk of a file's FP8 section: ``q`` e4m3fn ``[t, Lq, H]``, ``scales``
    float32 ``[t, Lq, 1]``; rows ``offset …`` of the sample."""
    t, lq = q.shape[0], q.shape[1]
    s = scales.reshape(t, lq).numpy()
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(s) | (s <= 0)
    amax = q.float().abs().amax(dim=-1).numpy()  # NaN where a value is NaN
    off = (amax != FP8_MAX) & (s != SCALE_FLOOR) & ~bad
    err = rounding_error(q).numpy()
    counted = (amax > 0) & np.isfinite(err)  # an all-zero vector has no relative error
    slots = list(stats.slots)
    stats.vectors[slots] += t
    stats.bad_scales[slots] += bad.sum(axis=0)
    stats.off_scale[slots] += off.sum(axis=0)
    stats.err_vectors[slots] += counted.sum(axis=0)
    stats.err_sum[slots] += np.where(counted, err, 0.0).sum(axis=0, dtype=np.float64)
    chunk_max = np.where(counted, err, 0.0).max(axis=0, initial=0.0)
    stats.err_max[slots] = np.maximum(stats.err_max[slots], chunk_max)
    if stats.first_bad_scale is None and bad.any():
        token, j = np.argwhere(bad)[0]
        stats.first_bad_scale = (offset + int(token), slots[int(j)])
    if stats.first_off_scale is None and off.any():
        token, j = np.argwhere(off)[0]
        stats.first_off_scale = (offset + int(token), slots[int(j)])
