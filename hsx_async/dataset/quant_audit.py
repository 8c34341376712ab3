"""What ``hsx verify --deep`` checks in the FP8 sections of a sample file (PROTOCOL §4).

hsx's one quantizer (:mod:`hsx_async.quantize`) gives every (token, layer slot) vector the
scale ``max(m / 448, 2⁻¹²⁶)`` — ``m`` the vector's largest ``|value|`` (``per_token_slot``),
or the largest after its 16 outliers (``per_token_slot_outliers16``, whose outliers then
saturate to ±448) — so that each stored vector's largest ``|q|`` is exactly 448 (the
division rounds to within a hair of 448, and e4m3fn's neighbours are 416 and 448): a vector
whose largest value is anything else was not made by it — other scales, a shifted section,
bytes from elsewhere. The exceptions are the vectors whose scale hit the floor (all-zero or
denormal-small ones; their ``|q|`` stays below 448). A scale must be finite and positive: a
non-finite one is what a non-finite input gives, and dequantizes to NaN. The outliers of a
vector are its channels, ascending, below the hidden size, the unused entries last
(``0xFFFF``, value +0); each used one is finite (a non-finite input value is kept there, as
it was) and its own ``q`` saturated to ±448 with its sign.

It also estimates the quantization error of each stored vector from the values alone
(:func:`hsx_async.quantize.rounding_error`, the expected relative RMS error) and sums it
per layer slot, and counts the values stored as e4m3fn subnormals or zero (outliers
excluded): where a few massive channels set a vector's scale (attention sinks, in the
``per_token_slot`` layout) that share climbs from ~0.02 % to a fifth or half of the vector
(``bench/fp8.py``), so the report says what FP8 cost this dataset without the originals.

Pure numpy/torch over arrays; reading the file is the audit's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hsx_async.protocol import (
    OUTLIER_INDEX,
    OUTLIER_NONE,
    OUTLIER_VALUES,
    SCALES,
    saturated_codes,
)
from hsx_async.quantize import FP8_MAX, FP8_MIN_NORMAL, SCALE_MIN, rounding_error

SCALE_FLOOR = np.float32(SCALE_MIN)
# A vector "starves" when more than this share of its FP8 values are subnormal or zero:
# an ordinary one has ~0.02 %; one scaled by a massive channel 10,000x its median, ~20 %.
STARVED = 0.05


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
    values: np.ndarray  # FP8 values (outliers excluded)
    subnormal: np.ndarray  # of them stored as e4m3fn subnormals or zero
    bad_outliers: np.ndarray  # vectors whose outlier sections break the layout's rule
    starved: np.ndarray  # vectors with more than STARVED of their values subnormal or zero
    first_bad_scale: tuple[int, int] | None = None  # (token, slot)
    first_off_scale: tuple[int, int] | None = None
    first_bad_outliers: tuple[int, int] | None = None

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
            values=zeros(),
            subnormal=zeros(),
            bad_outliers=zeros(),
            starved=zeros(),
        )

    def add(self, other: QuantStats) -> None:
        self.vectors += other.vectors
        self.bad_scales += other.bad_scales
        self.off_scale += other.off_scale
        self.err_vectors += other.err_vectors
        self.err_sum += other.err_sum
        self.err_max = np.maximum(self.err_max, other.err_max)
        self.values += other.values
        self.subnormal += other.subnormal
        self.bad_outliers += other.bad_outliers
        self.starved += other.starved

    @property
    def err_mean(self) -> np.ndarray:
        mean: np.ndarray = self.err_sum / np.maximum(self.err_vectors, 1)
        return mean

    @property
    def subnormal_share(self) -> np.ndarray:
        """Per slot, the share of FP8 values (outliers excluded) stored as subnormal or 0."""
        share: np.ndarray = self.subnormal / np.maximum(self.values, 1)
        return share

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
        if self.bad_outliers.any():
            token, slot = self.first_bad_outliers or (0, 0)
            found.append(
                f"{where}: {int(self.bad_outliers.sum())} stored FP8 vectors have outliers "
                f"that break the layout ({_per_slot(self.bad_outliers, names)}); first at "
                f"token {token}, {names[slot]}: channels not ascending or past the hidden "
                "size, a non-finite value (the rows were not finite), or one whose own "
                f"value is not saturated to ±{FP8_MAX:g}: not written by hsx's quantizer"
            )
        return found


def fp8_warnings(stats: QuantStats, names: Sequence[str], scales: str) -> list[str]:
    """What the audited FP8 vectors say about the layout's fit: vectors whose scale a few
    massive channels set, so that many of their other values starve."""
    if not stats.starved.any():
        return []
    fix = (
        "the per_token_slot_outliers16 layout ([output].scales, the default) keeps 16 of "
        "them exact and scales the rest by the others"
        if scales == "per_token_slot"
        else "they hold more massive channels than the 16 outliers the layout keeps"
    )
    return [
        f"{int(stats.starved.sum())} FP8 vectors store more than {STARVED:.0%} of their values "
        f"as e4m3fn subnormals or zero ({_per_slot(stats.starved, names)}; of "
        f"{int(stats.vectors.max())} per slot): a few massive channels (attention sinks) set "
        f"their scale; {fix}"
    ]


def _per_slot(counts: np.ndarray, names: Sequence[str]) -> str:
    return ", ".join(f"{names[i]}: {int(c)}" for i, c in enumerate(counts) if c)


def _first(flags: np.ndarray, offset: int, slots: Sequence[int]) -> tuple[int, int]:
    token, j = np.argwhere(flags)[0]
    return offset + int(token), slots[int(j)]


def scan_fp8(sections: Mapping[str, torch.Tensor], stats: QuantStats, offset: int) -> None:
    """Check one chunk of a file's FP8 sections (by name, as the file holds them):
    ``hidden_states`` e4m3fn ``[t, Lq, H]``, ``hidden_states_scales`` float32 ``[t, Lq, 1]``
    and, in the outliers layout, the two outlier sections ``[t, Lq, K]``; rows ``offset …``
    of the sample."""
    q, scales = sections["hidden_states"], sections[SCALES]
    index, values = sections.get(OUTLIER_INDEX), sections.get(OUTLIER_VALUES)
    t, lq = q.shape[0], q.shape[1]
    s = scales.reshape(t, lq).numpy()
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(s) | (s <= 0)
    magnitude = _without_outliers(q.float().abs(), index)
    amax = magnitude.amax(dim=-1).numpy()  # NaN where a value is NaN
    off = (amax != FP8_MAX) & (s != SCALE_FLOOR) & ~bad
    err = rounding_error(q, scales, index, values).numpy()
    counted = (amax > 0) & np.isfinite(err)  # an all-zero vector has no relative error
    small = (magnitude < FP8_MIN_NORMAL).sum(dim=-1).numpy()
    count = np.full((t, lq), q.shape[-1])
    slots = list(stats.slots)
    if index is not None and values is not None:
        wrong, used, zeroed = _outlier_problems(q, s, index, values)
        # the outliers' own q are ±448 (set to 0 above): not values of the FP8 section
        count -= used
        small = np.maximum(small - zeroed, 0)
        stats.bad_outliers[slots] += wrong.sum(axis=0)
        if stats.first_bad_outliers is None and wrong.any():
            stats.first_bad_outliers = _first(wrong, offset, slots)
    stats.vectors[slots] += t
    stats.bad_scales[slots] += bad.sum(axis=0)
    stats.off_scale[slots] += off.sum(axis=0)
    stats.err_vectors[slots] += counted.sum(axis=0)
    stats.err_sum[slots] += np.where(counted, err, 0.0).sum(axis=0, dtype=np.float64)
    chunk_max = np.where(counted, err, 0.0).max(axis=0, initial=0.0)
    stats.err_max[slots] = np.maximum(stats.err_max[slots], chunk_max)
    stats.values[slots] += count.sum(axis=0)
    stats.subnormal[slots] += small.sum(axis=0)
    stats.starved[slots] += (small > STARVED * np.maximum(count, 1)).sum(axis=0)
    if stats.first_bad_scale is None and bad.any():
        stats.first_bad_scale = _first(bad, offset, slots)
    if stats.first_off_scale is None and off.any():
        stats.first_off_scale = _first(off, offset, slots)


def _without_outliers(magnitude: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``|q|`` with the outliers' own entries (±448 by the rule) set to 0: the largest of
    the rest is the (K+1)-th largest value, which the scale maps to 448."""
    if index is None:
        return magnitude
    h = magnitude.shape[-1]
    padded = torch.cat([magnitude, magnitude.new_zeros((*magnitude.shape[:-1], 1))], dim=-1)
    padded.scatter_(-1, index.to(torch.int64).clamp_max(h), 0.0)  # unused: the pad column
    return padded[..., :h]


def _outlier_problems(
    q: torch.Tensor, scales: np.ndarray, index: torch.Tensor, values: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per vector ``[t, Lq]``: whether its outliers break the rule, how many entries it
    uses, and how many of them name a channel (below H)."""
    h = q.shape[-1]
    idx = index.to(torch.int64)
    used = idx != OUTLIER_NONE
    # used entries first, ascending and distinct, each below H; then only unused, value +0
    ascending = (idx[..., 1:] > idx[..., :-1]) | ~used[..., 1:]
    order = ascending.all(dim=-1) & ~(~used[..., :-1] & used[..., 1:]).any(dim=-1)
    below = (idx < h) | ~used
    v = values.float()
    unused_zero = torch.where(used, True, values.view(torch.int16) == 0)
    finite = torch.where(used, torch.isfinite(v), True)
    # each outlier's own code ±448 with its value's sign: the rule the copy checks too
    checked, codes = saturated_codes(
        idx.numpy(), values.view(torch.int16).numpy().view(np.uint16), scales.view(np.uint32), h
    )
    at = q.view(torch.uint8).gather(-1, idx.clamp_max(h - 1)).numpy()
    saturated = torch.from_numpy(~checked | (at == codes))
    ok = order & (below & unused_zero & finite & saturated).all(dim=-1)
    return (~ok).numpy(), used.sum(dim=-1).numpy(), (idx < h).sum(dim=-1).numpy()
