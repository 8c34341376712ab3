"""What a server's rows are (issue 38): the probe's dump read back, compared within the
engines' batch-to-batch tolerance. Against the fake server's own dump writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hsx_async.protocol import BF16_STORAGE, DumpMeta, Storage, part_name
from hsx_async.run.dumps.dump import Dump
from hsx_async.run.servers.fingerprint import TOLERANCE, Fingerprint, fingerprint
from hsx_async.server.fake.content import expected_hidden_states

H, L = 64, 4
IDS = np.array([1, 2, 3, 4], dtype=np.int64)


def _dump(tmp: Path, rows: np.ndarray, storage: Storage = BF16_STORAGE) -> Dump:
    """A bf16 dump of ``rows`` ([T, L, H] bf16 bits) in two parts."""
    tmp.mkdir(parents=True, exist_ok=True)
    parts = ((0, 1), (1, len(rows)))
    for start, end in parts:
        (tmp / part_name(start, end)).write_bytes(rows[start:end].tobytes())
    meta = DumpMeta(
        rid="r", num_tokens=len(rows), hidden_size=H, aux_layers=(1, 2, 3), parts=parts,
        model="m", server="s", protocol=4, final_state="post_norm", storage=storage,
    )  # fmt: skip
    return Dump(tmp, meta)


def test_the_same_rows_are_at_distance_zero_and_other_weights_far(tmp_path: Path) -> None:
    mine = fingerprint(_dump(tmp_path / "a", expected_hidden_states(IDS, H, L)))
    again = fingerprint(_dump(tmp_path / "b", expected_hidden_states(IDS, H, L)))
    other = fingerprint(_dump(tmp_path / "c", expected_hidden_states(IDS, H, L, weights=1)))
    assert mine.distance(again) == 0.0 and mine.differs(again) is None
    far = mine.differs(other)
    assert far is not None and far > 10 * TOLERANCE


def test_a_difference_within_the_tolerance_is_the_same_rows(tmp_path: Path) -> None:
    """A batch-to-batch difference (the last bits of some values) stays within it."""
    rows = expected_hidden_states(IDS, H, L)
    noisy = rows.copy()
    noisy[:, :, 20:40] ^= np.uint16(1)  # one ulp of bfloat16 on a third of the values
    a, b = fingerprint(_dump(tmp_path / "a", rows)), fingerprint(_dump(tmp_path / "b", noisy))
    distance = a.distance(b)
    assert distance is not None and 0 < distance < TOLERANCE


def test_nothing_in_common_is_not_compared() -> None:
    a = Fingerprint({"x": np.ones(3, dtype=np.float32)})
    b = Fingerprint({"y": np.ones(3, dtype=np.float32)})
    assert a.distance(b) is None and a.differs(b) is None


@pytest.mark.parametrize("other", [np.ones(4, dtype=np.float32), np.full(3, np.inf, np.float32)])
def test_another_shape_or_non_finite_rows_differ(other: np.ndarray) -> None:
    a = Fingerprint({"x": np.ones(3, dtype=np.float32)})
    assert a.differs(Fingerprint({"x": other})) == float("inf")
