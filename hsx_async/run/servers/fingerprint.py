"""What a server's rows are: its identity by content, beside what it says (issue 38).

A server *says* which model it serves (its info endpoints, its ``meta.json``); two servers
of one model path with other weights, or a server restarted onto new weights under the
same path (how a model is rolled forward), say the same. The admission's probe — one fixed
prompt — shows what it *is*: the first server admitted pins its probe's rows, and every
admission after (another server, or the same one back after it left rotation) compares
its probe's rows with the pinned ones, within :data:`TOLERANCE`; beyond it the server is
refused, naming both.

What is compared: the sections of the probe's dump that hold values, as float32 — the
bfloat16 rows, and in an FP8 dump the scales (each vector's largest magnitude / 448), the
exact outlier values and the slots kept in bfloat16. The FP8 codes and the outlier channels
are not: a difference in the last bit of an input flips a code or swaps two channels.
The distance is the largest, over those sections, of ``‖a − b‖ / max(‖a‖, ‖b‖)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hsx_async.protocol import HIDDEN, OUTLIER_VALUES, SCALES, UNQUANTIZED, Section
from hsx_async.run.dumps.dump import Dump
from hsx_async.run.dumps.writer import read_sections

# The largest distance between two probes of one server that is still "the same rows".
# An engine's rows for one prompt vary between batches (other kernels, other reduction
# orders for other batch shapes): measured 0 on the fake and reference servers; on real
# engines see docs/notes of issue 38. Other weights differ by ~1 (unrelated rows: ~1.4).
TOLERANCE = 0.05
_VALUED = (HIDDEN, SCALES, OUTLIER_VALUES, UNQUANTIZED)
_TINY = 1e-30

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Fingerprint:
    """The probe's rows of one server, by section (float32)."""

    sections: Mapping[str, F32]

    def distance(self, other: Fingerprint) -> float | None:
        """The largest relative L2 difference of a section both hold; None when they hold
        none in common (one dumps bfloat16, the other FP8 with every slot quantized)."""
        common = sorted(set(self.sections) & set(other.sections))
        found: list[float] = []
        for name in common:
            a, b = self.sections[name], other.sections[name]
            if a.shape != b.shape:
                return float("inf")
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                found.append(0.0 if np.array_equal(a, b, equal_nan=True) else float("inf"))
                continue
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            scale = max(float(np.linalg.norm(a64)), float(np.linalg.norm(b64)), _TINY)
            found.append(float(np.linalg.norm(a64 - b64)) / scale)
        return max(found) if found else None

    def differs(self, other: Fingerprint, tolerance: float = TOLERANCE) -> float | None:
        """The distance when it is beyond ``tolerance`` (other rows), else None."""
        distance = self.distance(other)
        return distance if distance is not None and distance > tolerance else None


def fingerprint(dump: Dump) -> Fingerprint:
    """The valued sections of a (small, validated) dump, as float32."""
    found = read_sections(dump, _VALUED)
    valued = {name: found[name] for name in found if found[name][0].dtype in ("BF16", "F32")}
    return Fingerprint({name: _floats(section, data) for name, (section, data) in valued.items()})


def _floats(section: Section, data: bytes) -> F32:
    if section.dtype == "F32":
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)  # bfloat16
    return bits.view(np.float32)
