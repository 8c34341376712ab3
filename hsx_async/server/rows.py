"""A pass's hidden rows as the hook receives them, and the bytes of a part cut from them
(PROTOCOL §3). Pure: no file is touched here; :mod:`hsx_async.server.dumpwrite` writes
what these functions lay out.

A pass arrives either as :class:`BatchHidden` (the rows as the model left them: bfloat16
bit patterns, or the float32/float16 values of a model served in another dtype) or as an
:class:`EncodedPass` (the rows already in the sections of one storage, made where they were
produced, e.g. quantized on the GPU before the copy to the host). Parts are written from
the pass's rows as they lie (row slices with ``writev``) where the layout allows it, never
assembled first. Rows of a model that is not served in bfloat16 are rounded to bfloat16
here, a block of rows at a time, by whoever asks for a part's bytes: a writer thread, never
the engine's scheduler thread (issue 28).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hsx_async.errors import DumpError
from hsx_async.protocol import Storage
from hsx_async.server.hook_core import PartWrite

# Buffers one writev takes (Linux UIO_MAXIOV).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
# Rows converted (rounded to bfloat16, or quantized) at once: the temporaries stay a few
# MiB per writer thread, whatever the part.
_BLOCK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class BatchHidden:
    """A pass's hidden rows and their layers: ``aux`` ``[T, K*H]`` or ``[T, K, H]`` and
    ``final`` ``[T, H]``, each little-endian bfloat16 bit patterns (2-byte integers) or
    floating point (float32/float16: rounded to bfloat16 when a part is written). They
    may differ: on a GPU the hook rounds the final rows it copies itself, while SGLang
    copies the aux rows in the model's dtype."""

    aux: np.ndarray
    final: np.ndarray
    aux_layers: tuple[int, ...]

    @property
    def hidden_size(self) -> int:
        return int(self.final.shape[-1])

    @property
    def rounded(self) -> bool:
        """Some rows are floats that become bfloat16 only when a part is written."""
        return bool(self.aux.dtype.kind == "f" or self.final.dtype.kind == "f")


def _bits_or_floats(a: np.ndarray) -> str | None:
    """'bits' (bfloat16 patterns), 'floats' (float16/32) or None, for one array."""
    if a.dtype.byteorder == ">":
        return None
    if a.dtype.kind in "iu" and a.dtype.itemsize == 2:
        return "bits"
    if a.dtype.kind == "f" and a.dtype.itemsize in (2, 4):
        return "floats"
    return None


def check_hidden(hidden: BatchHidden, total_rows: int) -> None:
    """The arrays hold exactly the pass's rows, K aux slices and one final slice each."""
    aux, final = hidden.aux, hidden.final
    if final.ndim != 2 or aux.ndim not in (2, 3):
        raise DumpError(
            f"hidden arrays have shapes {aux.shape} (aux) and {final.shape} (final); "
            "expected [T, K*H] or [T, K, H] and [T, H]"
        )
    if _bits_or_floats(aux) is None or _bits_or_floats(final) is None:
        raise DumpError(
            f"hidden arrays are {aux.dtype}/{final.dtype}, expected little-endian bfloat16 "
            "bits or float32/float16 values"
        )
    if aux.shape[0] != total_rows or final.shape[0] != total_rows:
        raise DumpError(
            f"the pass produced {aux.shape[0]} aux and {final.shape[0]} final rows, its "
            f"requests account for {total_rows}"
        )
    per_row = int(np.prod(aux.shape[1:]))
    expected = len(hidden.aux_layers) * hidden.hidden_size
    if per_row != expected:
        raise DumpError(
            f"aux rows hold {per_row} values, expected {len(hidden.aux_layers)} layers × "
            f"{hidden.hidden_size} (the model captured a different number of layers)"
        )


@dataclass(frozen=True, slots=True)
class EncodedPass:
    """A pass's rows already in the sections of one storage, made where they were produced
    (quantized on the device before the copy to the host, so the host buffer carries the
    smaller bytes; or a finished request's rows as vLLM's connector copies them).
    ``sections[i]`` is a C-contiguous ``uint8`` array ``[T, row bytes]`` of
    ``storage.sections(L, H)[i]``: a part is the row slice of each, back to back."""

    storage: Storage
    sections: tuple[np.ndarray, ...]
    aux_layers: tuple[int, ...]
    hidden_size: int

    @property
    def nbytes(self) -> int:
        return sum(int(s.nbytes) for s in self.sections)


# What a pass hands the dumper: its rows (any storage is written from them; FP8 parts are
# quantized on the host) or rows encoded where they were produced, for one storage.
PassRows = BatchHidden | EncodedPass


def pass_nbytes(hidden: PassRows) -> int:
    """Host bytes a pass's rows hold (what a background writer's budget counts)."""
    if isinstance(hidden, EncodedPass):
        return hidden.nbytes
    return int(hidden.aux.nbytes + hidden.final.nbytes)


def check_encoded(hidden: EncodedPass, total_rows: int, writes: Sequence[PartWrite]) -> None:
    """Every section holds the pass's rows at its row size, and every part of the pass
    wants exactly this storage."""
    layers = len(hidden.aux_layers) + 1
    wanted = hidden.storage.sections(layers, hidden.hidden_size)
    if len(hidden.sections) != len(wanted):
        raise DumpError(
            f"the pass was encoded into {len(hidden.sections)} sections, its storage "
            f"{hidden.storage.describe()} has {len(wanted)}"
        )
    for got, section in zip(hidden.sections, wanted, strict=True):
        shape = (total_rows, section.row_bytes)
        if got.dtype != np.uint8 or got.shape != shape or not got.flags.c_contiguous:
            raise DumpError(
                f"encoded section {section.name} is {got.dtype} {got.shape}, expected "
                f"uint8 {shape} (C order)"
            )
    for write in writes:
        if write.storage != hidden.storage:
            raise DumpError(
                f"rid {write.rid} asked for {write.storage.describe()} but the pass was "
                f"encoded as {hidden.storage.describe()}"
            )


def part_bytes(hidden: PassRows, write: PartWrite) -> Iterator[list[memoryview]]:
    """The bytes of ``write``'s part in file order, as lists of at most :data:`IOV_MAX`
    buffers for ``writev``: row slices of an :class:`EncodedPass`; the sections of an FP8
    storage quantized here; else the bfloat16 rows (:func:`part_chunks`)."""
    if isinstance(hidden, EncodedPass) or write.storage.is_fp8:
        yield from encoded_part(hidden, write)
    else:
        yield from part_chunks(hidden, write.batch_row, write.rows)


def encoded_part(hidden: PassRows, write: PartWrite) -> list[list[memoryview]]:
    """The bytes of an encoded part in file order (PROTOCOL §3), as ``writev`` lists: for
    FP8 ``[fp8][f32 scales][bf16 kept]`` of its rows, exactly
    :func:`hsx_async.quantize.encode_rows` of its bfloat16 rows. Row slices of an
    :class:`EncodedPass`; from :class:`BatchHidden` rows, quantized here a block of rows at
    a time (the same quantizer, per (row, slot) vector, so the same bytes)."""
    row, count = write.batch_row, write.rows
    if isinstance(hidden, EncodedPass):
        return [[s[row : row + count].reshape(-1).data for s in hidden.sections]]
    sections: list[list[memoryview]] = []
    for first, n in _blocks(hidden, row, count):
        encoded = encode_bits(assemble_rows(hidden, first, n), write.storage)
        sections = sections or [[] for _ in encoded]
        for out, data in zip(sections, encoded, strict=True):
            out.append(data)
    flat = [data for section in sections for data in section]
    return [flat[i : i + IOV_MAX] for i in range(0, len(flat), IOV_MAX)]


def _blocks(hidden: BatchHidden, row: int, count: int) -> Iterator[tuple[int, int]]:
    """``(first row, rows)`` of blocks of about :data:`_BLOCK_BYTES` of bfloat16 rows."""
    layers = len(hidden.aux_layers) + 1
    block = max(1, _BLOCK_BYTES // (layers * hidden.hidden_size * 2))
    for first in range(row, row + count, block):
        yield first, min(block, row + count - first)


def encode_bits(rows: np.ndarray, storage: Storage) -> list[memoryview]:
    """Host rows ``[n, L, H]`` of bfloat16 bit patterns (2-byte elements) as the bytes of
    ``storage``'s sections, in order (:func:`hsx_async.quantize.encode_rows`)."""
    import torch  # noqa: PLC0415 (a bfloat16-only server never loads torch for this)

    from hsx_async.quantize import encode_rows  # noqa: PLC0415 (it imports torch)

    bf16 = torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return [t.view(torch.uint8).numpy().reshape(-1).data for t in encode_rows(bf16, storage)]


def assemble_rows(hidden: BatchHidden, row: int, count: int) -> np.ndarray:
    """Rows ``[row, row+count)`` of the pass as one part: ``[count, K+1, H]`` bfloat16 bit
    patterns, C order, the aux layers in order, then the final hidden state (float rows
    rounded to bfloat16 on the way)."""
    k, h = len(hidden.aux_layers), hidden.hidden_size
    out = np.empty((count, k + 1, h), dtype=np.dtype("<u2"))
    _put_bits(out[:, :k, :], hidden.aux[row : row + count].reshape(count, k, h))
    _put_bits(out[:, k, :], hidden.final[row : row + count])
    return out


def _put_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """bfloat16 bit patterns into ``dst`` (2-byte, any strides): ``src``'s own, or its
    float32/float16 values rounded by torch as ``Tensor.to(torch.bfloat16)`` rounds (to
    nearest even): the bytes a bfloat16 cast on the scheduler thread made before issue 28."""
    if src.dtype.kind != "f":
        dst[...] = src.view("<u2")
        return
    import torch  # noqa: PLC0415 (float rows come from torch: it is loaded already)

    target = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
    target.copy_(torch.from_numpy(_writable(src)))


def _writable(a: np.ndarray) -> np.ndarray:
    # torch.from_numpy warns on a read-only array (it could not stop a write through it).
    return a if a.flags.writeable else a.copy()


def stacked_rows(hidden: BatchHidden) -> memoryview | None:
    """The pass's rows as one ``[T, K+1, H]`` byte buffer, when ``aux`` and ``final`` are
    bfloat16 views of such a buffer (a device-side stack, the reference server); else None.

    Then every part is one contiguous slice of it: written without any host copy.
    """
    aux, final = hidden.aux, hidden.final
    t, h, k = final.shape[0], hidden.hidden_size, len(hidden.aux_layers)
    row = (k + 1) * h * 2
    if hidden.rounded:
        return None
    aux2 = aux
    if aux.ndim == 3 and aux.strides == (row, h * 2, 2):
        aux2 = np.lib.stride_tricks.as_strided(aux, (t, k * h), (row, 2), writeable=False)
    if t == 0 or aux2.ndim != 2 or aux2.strides != (row, 2) or final.strides != (row, 2):
        return None
    aux_at = aux2.__array_interface__["data"][0]
    if final.__array_interface__["data"][0] != aux_at + k * h * 2:
        return None
    # Bytes [aux_at, aux_at + t*row) are each an element of aux or of final: no byte
    # outside the arrays is read.
    flat = np.lib.stride_tricks.as_strided(aux2, (t * row // 2,), (2,), writeable=False)
    return flat.view(np.uint8).data


def part_chunks(hidden: BatchHidden, row: int, count: int) -> Iterator[list[memoryview]]:
    """The bfloat16 bytes of part rows ``[row, row+count)`` in file order, as lists of at
    most :data:`IOV_MAX` buffers for ``writev``, without assembling the part where the
    layout allows it:

    - one slice of the pass's ``[T, K+1, H]`` buffer (see :func:`stacked_rows`);
    - else, with C-contiguous bfloat16 ``aux`` and ``final`` (SGLang's own layout), two
      slices per row: its K aux slices, then its final slice;
    - else (float rows to round, other layouts) assembled copies, a block of rows at a time
      (:func:`assemble_rows`).
    """
    k, h = len(hidden.aux_layers), hidden.hidden_size
    stacked = stacked_rows(hidden)
    if stacked is not None:
        size = (k + 1) * h * 2
        yield [stacked[row * size : (row + count) * size]]
        return
    aux, final = hidden.aux, hidden.final
    if hidden.rounded or not (aux.flags.c_contiguous and final.flags.c_contiguous):
        for first, n in _blocks(hidden, row, count):
            yield [assemble_rows(hidden, first, n).view(np.uint8).data]
        return
    aux_bytes = aux.reshape(-1).view(np.uint8).data
    final_bytes = final.reshape(-1).view(np.uint8).data
    a, f = k * h * 2, h * 2
    per_call = max(1, IOV_MAX // 2)
    for first in range(row, row + count, per_call):
        last = min(first + per_call, row + count)
        buffers: list[memoryview] = []
        for r in range(first, last):
            buffers.append(aux_bytes[r * a : (r + 1) * a])
            buffers.append(final_bytes[r * f : (r + 1) * f])
        yield buffers
