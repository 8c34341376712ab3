"""A pass's rows and the bytes of its parts: layouts, checks, float rows rounded to
bfloat16 by the writer (issue 28). Pure: no file is written."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np
import pytest
import torch

from hsx_async.errors import DumpError
from hsx_async.server import rows as rows_module
from hsx_async.server.hook_core import PartWrite
from hsx_async.server.rows import (
    BatchHidden,
    assemble_rows,
    check_hidden,
    encoded_part,
    part_chunks,
    stacked_rows,
)
from tests.server.fp8 import FP8_ALL
from tests.server.passes import LAYERS, H, K, batch_arrays, expected_rows

ROW_BYTES = (K + 1) * H * 2


def rows_of(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    return batch_arrays(n, seed)


# --------------------------------------------------------------------------------------
# Row layout
# --------------------------------------------------------------------------------------


def test_assemble_rows_layout() -> None:
    aux, final = batch_arrays(7)
    hidden = BatchHidden(aux=aux, final=final, aux_layers=LAYERS)
    got = assemble_rows(hidden, 2, 3)
    assert got.shape == (3, K + 1, H)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected_rows(aux, final, 2, 3))


def test_assemble_rows_from_a_full_stack_view() -> None:
    """Servers that hold [T, L, H] pass views; the result is the same stack."""
    rng = np.random.default_rng(3)
    full = rng.integers(0, 2**16, size=(5, K + 1, H), dtype=np.uint16).view(np.int16)
    hidden = BatchHidden(aux=full[:, :K, :], final=full[:, K, :], aux_layers=LAYERS)
    check_hidden(hidden, 5)
    np.testing.assert_array_equal(assemble_rows(hidden, 1, 4).view(np.int16), full[1:5])


@pytest.mark.parametrize(
    ("aux_shape", "final_shape", "dtype", "fragment"),
    [
        ((6, K * H), (5, H), np.uint16, "produced 6 aux and 5 final rows"),
        ((5, K * H), (5, H), np.float64, "expected little-endian bfloat16"),
        ((5, K * H), (5, H), np.int32, "expected little-endian bfloat16"),
        ((5, K * H), (5, H), ">f4", "expected little-endian bfloat16"),
        ((5, K * H), (5, H), ">u2", "expected little-endian bfloat16"),
        ((5, 3 * H), (5, H), np.uint16, "expected 2 layers"),
        ((5, K, H, 1), (5, H), np.uint16, "expected [T, K*H]"),
        ((5, K * H), (5, H, 1), np.uint16, "expected [T, K*H]"),
    ],
)
def test_check_hidden_rejects(
    aux_shape: tuple[int, ...], final_shape: tuple[int, ...], dtype: object, fragment: str
) -> None:
    hidden = BatchHidden(
        aux=np.zeros(aux_shape, dtype=dtype),  # type: ignore[call-overload]
        final=np.zeros(final_shape, dtype=dtype),  # type: ignore[call-overload]
        aux_layers=LAYERS,
    )
    with pytest.raises(DumpError, match=re.escape(fragment)):
        check_hidden(hidden, 5)


def test_bits_and_floats_may_be_mixed() -> None:
    """On a GPU the hook rounds the final rows it copies; SGLang copies the aux rows of a
    float32 model as they are: each array is rounded (or not) on its own."""
    aux, final = float_pass(4, torch.float32)
    bf16_final = final.to(torch.bfloat16).view(torch.int16).numpy()
    mixed = BatchHidden(aux=aux.numpy(), final=bf16_final, aux_layers=LAYERS)
    check_hidden(mixed, 4)
    assert mixed.rounded
    want = expected_rows(
        aux.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
        bf16_final.view(np.uint16),
        0,
        4,
    )
    np.testing.assert_array_equal(assemble_rows(mixed, 0, 4), want)
    assert b"".join(b"".join(c) for c in part_chunks(mixed, 0, 4)) == want.tobytes()


# --------------------------------------------------------------------------------------
# Part layouts without an assembled copy
# --------------------------------------------------------------------------------------


def test_part_chunks_from_separate_contiguous_arrays_are_row_slices() -> None:
    aux, final = rows_of(3, 700)  # more rows than one writev takes
    hidden = BatchHidden(aux, final, LAYERS)
    chunks = list(part_chunks(hidden, 5, 690))
    assert len(chunks) > 1 and all(len(c) <= rows_module.IOV_MAX for c in chunks)
    assert all(np.shares_memory(np.frombuffer(c[0], np.uint8), aux) for c in chunks)
    assert joined(chunks) == assemble_rows(hidden, 5, 690).tobytes()


def test_part_chunks_from_a_stacked_buffer_are_one_slice() -> None:
    full = np.random.default_rng(4).integers(0, 2**16, (9, K + 1, H), dtype=np.uint16)
    for aux in (full[:, :K, :], np.lib.stride_tricks.as_strided(full, (9, K * H), (ROW_BYTES, 2))):
        hidden = BatchHidden(aux, full[:, K, :], LAYERS)
        assert stacked_rows(hidden) is not None
        [[only]] = list(part_chunks(hidden, 2, 5))
        assert np.shares_memory(np.frombuffer(only, np.uint8), full)
        assert bytes(only) == full[2:7].tobytes()


def test_part_chunks_fall_back_to_a_copy_for_other_layouts() -> None:
    aux, final = rows_of(5, 6)
    wide = np.zeros((6, 2 * K * H), np.uint16)
    wide[:, ::2] = aux
    hidden = BatchHidden(wide[:, ::2], final, LAYERS)
    assert stacked_rows(hidden) is None
    assert (
        joined(part_chunks(hidden, 1, 4))
        == assemble_rows(BatchHidden(aux, final, LAYERS), 1, 4).tobytes()
    )
    other = BatchHidden(aux, final[::-1], LAYERS)  # final not next to aux: not a stack
    assert stacked_rows(other) is None


# --------------------------------------------------------------------------------------
# A model served in float32 or float16: its rows are rounded by whoever writes a part
# --------------------------------------------------------------------------------------


def float_pass(total: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of very different magnitudes, with values exactly between two bfloat16s (the
    round-to-nearest-even cases) and the specials: aux [T, K*H], final [T, H]."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn((total, K + 1, H), generator=g) * 10.0 ** torch.randint(
        -3, 4, (total, K + 1, 1), generator=g
    )
    flat = rows.reshape(-1)
    flat[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("inf"), -0.0])
    rows = rows.to(dtype)
    return rows[:, :K].reshape(total, K * H).contiguous(), rows[:, K].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_float_rows_are_rounded_as_a_bfloat16_cast_rounds(dtype: torch.dtype) -> None:
    """The bytes of a part of float rows are exactly those the old scheduler-thread cast
    (``Tensor.to(torch.bfloat16)``) produced, in every layout the writer takes: row
    slices (blocks of 3 rows), the assembled copy, and the FP8 sections."""
    aux, final = float_pass(11, dtype)
    hidden = BatchHidden(aux=aux.numpy(), final=final.numpy(), aux_layers=LAYERS)
    assert hidden.rounded
    check_hidden(hidden, 11)
    bf16_aux = aux.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    bf16_final = final.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    want = expected_rows(bf16_aux, bf16_final, 2, 7)
    np.testing.assert_array_equal(assemble_rows(hidden, 2, 7), want)
    assert b"".join(b"".join(c) for c in part_chunks(hidden, 2, 7)) == want.tobytes()
    bits = BatchHidden(aux=bf16_aux, final=bf16_final, aux_layers=LAYERS)
    write = PartWrite("w0", "r", 2, 0, 7, True, FP8_ALL)
    assert joined(encoded_part(hidden, write)) == joined(encoded_part(bits, write))


def test_float_rows_are_rounded_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer converts a bounded block of rows at once, whatever the part's size."""
    monkeypatch.setattr(rows_module, "_BLOCK_BYTES", 3 * (K + 1) * H * 2)
    aux, final = float_pass(10, torch.float32)
    chunks = list(part_chunks(BatchHidden(aux.numpy(), final.numpy(), LAYERS), 0, 10))
    assert [sum(b.nbytes for b in c) for c in chunks] == [3 * (K + 1) * H * 2] * 3 + [
        (K + 1) * H * 2
    ]


def test_read_only_float_rows_are_rounded_without_a_warning() -> None:
    aux, final = float_pass(3, torch.float32)
    a, f = aux.numpy().copy(), final.numpy().copy()
    a.flags.writeable = f.flags.writeable = False
    got = assemble_rows(BatchHidden(a, f, LAYERS), 0, 3)  # filterwarnings = error
    assert got.shape == (3, K + 1, H)


def joined(chunks: Iterable[Sequence[memoryview]]) -> bytes:
    return b"".join(b"".join(bytes(b) for b in c) for c in chunks)
