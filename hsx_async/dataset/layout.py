"""Where a sample goes in the dataset and how its safetensors file is laid out (PROTOCOL §4).

Pure: the writer does the I/O. The file is a standard safetensors file, ordered so that the
bulk tensor starts on a 4 KiB boundary (the header is padded with spaces, which the format
allows), which lets the writer copy dump parts with O_DIRECT:

    [u64 header length][JSON header, space padded][input_ids i64][hidden sections][loss_mask u8]

The hidden sections are those of the dataset's storage (protocol ``Storage.sections``):
``hidden_states`` bf16 ``[T, L, H]``; or, stored as FP8, ``hidden_states`` e4m3fn
``[T, Lq, H]``, ``hidden_states_scales`` f32 ``[T, Lq, 1]`` and, where some slots stay
bf16, ``hidden_states_unquantized`` bf16 ``[T, L - Lq, H]``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import xxhash

from hsx_async.protocol import (
    BF16_STORAGE,
    POST_NORM,
    PROTOCOL_VERSION,
    Storage,
    num_layers,
    storage_metadata,
)

ALIGN = 4096
SampleId = str | int

_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
DATA_DIR = "data"
FILE_SUFFIX = ".safetensors"
# What data_relpath(sample_key(id)) can produce, and nothing else (a safe key, or a
# sanitised stem of at most 81 characters with ``~`` and a hash).
_MANIFEST_PATH = re.compile(
    rf"{DATA_DIR}/[0-9a-f]{{2}}/[A-Za-z0-9_][A-Za-z0-9._-]{{0,99}}(?:~[0-9a-f]{{16}})?"
    + re.escape(FILE_SUFFIX)
)


def canonical_id(sample_id: SampleId) -> str:
    """Ids are compared by their text: ``5`` and ``"5"`` are the same sample."""
    return str(sample_id)


def shard_of_id(sample_id: SampleId, count: int) -> int:
    """The shard that owns a sample: stable across runs, machines and Python versions."""
    return xxhash.xxh3_64_intdigest(canonical_id(sample_id).encode()) % count


def sample_key(sample_id: SampleId) -> str:
    """The file-name-safe key of an id, unique per canonical id.

    An id that is already safe is its own key. Any other id is sanitised, cut, and given
    ``~`` plus a hash of the full id: ``~`` never occurs in a safe id, so the two kinds of
    key cannot collide, and the hash keeps distinct unsafe ids apart.
    """
    text = canonical_id(sample_id)
    if _SAFE_KEY.fullmatch(text) and text not in (".", ".."):
        return text
    stem = _UNSAFE_CHARS.sub("_", text)[:80]
    if stem[:1] in (".", "-", ""):
        stem = "_" + stem  # never a hidden file or something that reads as an option
    return f"{stem}~{xxhash.xxh3_64_hexdigest(text.encode('utf-8', 'surrogatepass'))}"


def data_relpath(key: str) -> str:
    """``data/<2 hex>/<key>.safetensors``: 256 fan-out directories keep each one small."""
    bucket = xxhash.xxh3_64_hexdigest(key.encode())[:2]
    return f"{DATA_DIR}/{bucket}/{key}{FILE_SUFFIX}"


def manifest_path_problem(path: object) -> str:
    """Why ``path`` is not of the form hsx writes, ``data/<2 hex>/<key>.safetensors``
    ('' if it is). A manifest line may come from another node (shard outputs are merged),
    so readers accept only that form: no ``..``, no absolute path, no link-free escape,
    no NUL byte, nothing over-long. Every reader of a manifest (merge, verify and its
    repair, resume, the Dataset reader) gets its entries through the manifest parser,
    which checks this."""
    if not isinstance(path, str):
        return f"path {path!r} is not a string"
    if _MANIFEST_PATH.fullmatch(path) is None:
        shown = repr(path if len(path) <= 120 else path[:120] + "…")
        return f"path {shown} is not of the dataset's form {DATA_DIR}/<2 hex>/<key>{FILE_SUFFIX}"
    return ""


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Byte offsets of one sample file; ``prefix`` holds the header and ``input_ids``."""

    header: bytes  # u64 length + padded JSON
    num_tokens: int
    hidden_offset: int  # where hidden_states starts (a multiple of ALIGN)
    hidden_bytes: int  # all hidden sections
    mask_bytes: int
    storage: Storage = BF16_STORAGE
    section_row_bytes: tuple[int, ...] = ()  # per token, of each hidden section in order

    @property
    def total_bytes(self) -> int:
        return self.hidden_offset + self.hidden_bytes + self.mask_bytes


def build_layout(
    *,
    sample_id: SampleId,
    num_tokens: int,
    hidden_size: int,
    aux_layers: Sequence[int],
    has_loss_mask: bool,
    final_state: str = POST_NORM,
    storage: Storage = BF16_STORAGE,
) -> FileLayout:
    """The safetensors header for a sample, padded so ``hidden_states`` is 4 KiB aligned."""
    t, layers = num_tokens, num_layers(aux_layers)
    ids_bytes = 8 * t
    sections = storage.sections(layers, hidden_size)
    mask_bytes = t if has_loss_mask else 0
    metadata = {
        "id": canonical_id(sample_id),
        "aux_layers": ",".join(str(x) for x in aux_layers),
        "protocol": str(PROTOCOL_VERSION),
        "final_state": final_state,
    }
    if storage.is_fp8:  # a bf16 file reads as every earlier version's
        metadata |= storage_metadata(storage)
    tensors: dict[str, object] = {
        "__metadata__": metadata,
        "input_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, ids_bytes]},
    }
    end = ids_bytes
    for section in sections:
        size = t * section.row_bytes
        tensors[section.name] = {
            "dtype": section.dtype,
            "shape": [t, *section.row_shape],
            "data_offsets": [end, end + size],
        }
        end += size
    hidden_bytes = end - ids_bytes
    if has_loss_mask:
        tensors["loss_mask"] = {"dtype": "U8", "shape": [t], "data_offsets": [end, end + t]}
    body = orjson.dumps(tensors)
    # 8 + len(header) + ids_bytes must land on ALIGN; ids_bytes is a multiple of 8, so the
    # padded header length stays a multiple of 8 as safetensors recommends.
    unpadded = 8 + len(body) + ids_bytes
    pad = -unpadded % ALIGN
    header_len = len(body) + pad
    header = header_len.to_bytes(8, "little") + body + b" " * pad
    return FileLayout(
        header=header,
        num_tokens=t,
        hidden_offset=len(header) + ids_bytes,
        hidden_bytes=hidden_bytes,
        mask_bytes=mask_bytes,
        storage=storage,
        section_row_bytes=tuple(s.row_bytes for s in sections),
    )


def expected_tensors(
    storage: Storage, t: int, layers: int, hidden: int
) -> dict[str, tuple[str, list[int]]]:
    """Name → (safetensors dtype, shape) of every tensor a file of ``storage`` holds
    (``loss_mask`` included: it is the one optional tensor)."""
    want = {"input_ids": ("I64", [t])}
    for section in storage.sections(layers, hidden):
        want[section.name] = (section.dtype, [t, *section.row_shape])
    want["loss_mask"] = ("U8", [t])
    return want


# The safetensors library's own bound (MAX_HEADER_SIZE): a longer header no trainer loads.
HEADER_MAX = 100_000_000


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and where its data starts (8 + header length),
    without torch. ValueError when the length is not plausible or the header is not a
    JSON object; OSError when the file cannot be read (links are not followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= HEADER_MAX:
            raise ValueError(f"header length {n} is not plausible")
        body = fh.read(n)
    if len(body) != n:
        raise ValueError(f"header cut short: {len(body)} of {n} bytes")
    header = orjson.loads(body)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")  # noqa: TRY004 - a content error
    return header, 8 + n
