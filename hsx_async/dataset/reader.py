"""The training side: a ``torch.utils.data.Dataset`` over an hsx output directory (PROTOCOL §4).

Each sample file is a standard safetensors file. It is opened with ``safetensors.safe_open``,
which maps the file copy-on-write (``MAP_PRIVATE``) and hands out tensors that *are* the
mapping: nothing is read until a tensor's pages are touched, so asking for ``input_ids``
alone never reads ``hidden_states``, and an in-place edit by a trainer can never reach the
file. From the stored ``hidden_states`` ``[T, L, H]`` (aux layers in capture order, then the
final state: post-norm from SGLang, pre-norm from vLLM, as ``provenance.json`` and each file's
``final_state`` say; :attr:`HiddenStateDataset.final_state`, and ``final_state=`` to convert)
a sample yields, as views of the mapping:

- ``hidden_states`` ``[T, H]``: the final layer, ``hs[:, L-1, :]`` (rows strided by ``L·H``);
- ``aux_hidden_states`` ``[T, k·H]``: the ``k = L-1`` aux layers concatenated in capture
  order, ``hs[:, :k, :].reshape(T, k·H)`` (each row is ``k·H`` contiguous values);
- ``input_ids`` ``[T]`` int64 and ``loss_mask`` ``[T]`` uint8 (all ones when the input had
  none; that one tensor is built, not mapped).

The only copy on the way to the trainer is :class:`PadCollator` writing each sample into the
padded batch. With ``DataLoader(num_workers > 0)`` the batch then travels to the main
process through shared memory, as torch does for every dataset.

FP8 datasets (PROTOCOL §4, versions 3 and 4: ``[output].dtype = "float8_e4m3fn"``) store
the quantized layer slots as ``hidden_states`` e4m3fn ``[T, Lq, H]`` with
``hidden_states_scales`` float32 ``[T, Lq, 1]`` (one scale per token and slot), in the
``per_token_slot_outliers16`` layout (version 4's default) each vector's 16 largest values
exactly beside them (``hidden_states_outlier_index`` uint16 ``[T, Lq, 16]``, the channels,
and ``hidden_states_outlier_values`` bf16 ``[T, Lq, 16]``), and the slots kept in bfloat16
as ``hidden_states_unquantized`` ``[T, L - Lq, H]``. Which slots and layout are which is in
each file's ``__metadata__`` (``dtype``, ``quantized``, ``scales``) and in
``provenance.json``. By default
(``storage="bf16"``) such a sample yields exactly what a bfloat16 sample yields: each item is
dequantized on its own, when it is read (:func:`hsx_async.quantize.assemble`; a bfloat16
``[T, L, H]`` per sample, then the same two views), so only the sample in hand is ever
widened. With ``storage="raw"`` the hidden fields are replaced by the file's sections as
stored (zero-copy views, for trainers that take FP8 themselves): ``hidden_states`` e4m3fn
``[T, Lq, H]``, ``hidden_states_scales`` ``[T, Lq, 1]``, the two outlier sections in that
layout and, when some slots are kept, ``hidden_states_unquantized`` bf16 ``[T, Lk, H]``;
``HiddenStateDataset.storage`` (and each :class:`SampleHeader`) says which slots and layout
(``storage.quantized``, ``storage.kept(L)``, ``storage.scales``;
:func:`hsx_async.quantize.dequantize` takes the sections). Raw on a
bfloat16 dataset yields its one section, ``hidden_states`` bf16 ``[T, L, H]``.

Also here: :class:`LengthGroupedBatchSampler` (batches of similar lengths, less padding),
a ``max_tokens`` filter and a train/validation split by a hash of the sample id, so a
sample's side never depends on the manifest order, on sharding, or on samples added later.
"""

from __future__ import annotations

import math
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError, safe_open
from torch.utils.data import Dataset, Sampler

from hsx_async.dataset.layout import SampleId, canonical_id, expected_tensors
from hsx_async.dataset.manifest import ManifestEntry, read_manifest
from hsx_async.dataset.provenance import dataset_final_state, dataset_storage, read_provenance
from hsx_async.dataset.target import convert_final, final_norm_weight, norm_gain, read_target
from hsx_async.errors import DatasetError, DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    HIDDEN,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    POST_NORM,
    PRE_NORM,
    SCALES,
    UNQUANTIZED,
    Storage,
    parse_final_state,
    storage_from_metadata,
)
from hsx_async.quantize import FP8_DTYPE, assemble

Sample = dict[str, torch.Tensor]
Split = Literal["all", "train", "val"]
HiddenMode = Literal["bf16", "raw"]
FinalState = Literal["as_stored", "post_norm", "pre_norm"]
FINAL_STATES: tuple[str, ...] = ("as_stored", POST_NORM, PRE_NORM)
HIDDEN_MODES: tuple[str, ...] = ("bf16", "raw")

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_STATES = HIDDEN  # bf16 [T, L, H], or the FP8 values [T, Lq, H] of an FP8 file
HIDDEN_STATES_SCALES = SCALES  # FP8 files: float32 [T, Lq, 1]
# FP8 files of the per_token_slot_outliers16 layout: uint16 channels, bf16 values [T, Lq, 16]
HIDDEN_STATES_OUTLIER_INDEX = OUTLIER_INDEX
HIDDEN_STATES_OUTLIER_VALUES = OUTLIER_VALUES
HIDDEN_STATES_UNQUANTIZED = UNQUANTIZED  # FP8 files keeping some slots: bf16 [T, Lk, H]
AUX_HIDDEN_STATES = "aux_hidden_states"
FIELDS: tuple[str, ...] = (INPUT_IDS, LOSS_MASK, HIDDEN_STATES, AUX_HIDDEN_STATES)
SECTIONS: tuple[str, ...] = (  # in file order (protocol.Storage.sections)
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    HIDDEN_STATES_OUTLIER_INDEX,
    HIDDEN_STATES_OUTLIER_VALUES,
    HIDDEN_STATES_UNQUANTIZED,
)
# Every tensor name PROTOCOL §4 allows in a sample file, in file order.
STORED: tuple[str, ...] = (INPUT_IDS, *SECTIONS, LOSS_MASK)


@dataclass(frozen=True, slots=True)
class SampleHeader:
    """What a sample file's header says; reading it touches no tensor data."""

    path: Path
    sample_id: str
    num_tokens: int
    num_layers: int  # L: aux layers + the final state
    hidden_size: int
    aux_layers: tuple[int, ...]
    has_loss_mask: bool
    metadata: dict[str, str]
    storage: Storage = BF16_STORAGE


def _parse_aux_layers(text: str | None, path: Path) -> tuple[int, ...]:
    if text is None:
        raise DatasetError(f"{path}: metadata has no 'aux_layers'; not an hsx sample file")
    try:
        return tuple(int(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise DatasetError(
            f"{path}: metadata aux_layers {text!r} is not a list of integers"
        ) from None


def file_storage(meta: dict[str, str], path: Path, layers: int) -> Storage:
    """A file's storage from its ``__metadata__`` (none named: bfloat16), its slots checked
    against the file's ``layers``."""
    try:
        storage = storage_from_metadata(meta, f"{path}: metadata")
        storage.check_slots(layers)
    except DumpError as exc:
        raise DatasetError(str(exc)) from None
    except ValueError as exc:
        raise DatasetError(
            f"{path}: metadata {exc} (aux_layers {meta.get('aux_layers')!r})"
        ) from None
    return storage


def _check_names(
    names: set[str], want: dict[str, tuple[str, list[int]]], storage: Storage, path: Path
) -> None:
    missing = set(want) - {LOSS_MASK} - names
    extra = names - set(want)
    if not (missing or extra):
        return
    raise DatasetError(
        f"{path}: metadata says {storage.describe()}, which stores "
        f"{', '.join(n for n in want if n != LOSS_MASK)} (and optionally loss_mask), but the "
        f"file holds {', '.join(sorted(names))}: "
        + "; ".join(
            [
                *(f"{n} is missing" for n in sorted(missing)),
                *(f"{n} is unexpected" for n in sorted(extra)),
            ]
        )
        + ". The file was not written by hsx, or was edited; run hsx verify"
    )


def _check_stored(handle: Any, path: Path) -> tuple[dict[str, list[int]], Storage, tuple[int, ...]]:
    """Shapes of the stored tensors, the file's storage and aux layers, after checking names,
    dtypes and shapes against PROTOCOL §4 and the file's own metadata."""
    names = set(handle.keys())
    if not {INPUT_IDS, HIDDEN_STATES} <= names or not names <= set(STORED):
        raise DatasetError(
            f"{path}: tensors {sorted(names)}; expected input_ids, hidden_states and "
            "optionally loss_mask. Not an hsx sample file, or written by another version"
        )
    meta = dict(handle.metadata() or {})
    aux = _parse_aux_layers(meta.get("aux_layers"), path)
    layers = len(aux) + 1
    storage = file_storage(meta, path, layers)
    views = {name: handle.get_slice(name) for name in names}
    first = list(views[HIDDEN_STATES].get_shape())
    t = first[0] if first else 0
    hidden = first[-1] if len(first) == 3 else 0
    want = expected_tensors(storage, t, layers, hidden)
    _check_names(names, want, storage, path)
    shapes = {}
    for name in (n for n in STORED if n in names):  # file order: the first wrong one is named
        dtype, shape = views[name].get_dtype(), list(views[name].get_shape())
        want_dtype, want_shape = want[name]
        if dtype != want_dtype or len(shape) != len(want_shape):
            raise DatasetError(
                f"{path}: tensor {name} is {dtype} {shape}, expected {want_dtype} of rank "
                f"{len(want_shape)} ({_what(storage, aux)})"
            )
        shapes[name] = shape
    _check_shapes(shapes, want, storage, aux, path)
    return shapes, storage, aux


def _what(storage: Storage, aux: Sequence[int]) -> str:
    return f"the file's metadata: {storage.describe()}, aux_layers {list(aux)}"


def _check_shapes(
    shapes: dict[str, list[int]],
    want: dict[str, tuple[str, list[int]]],
    storage: Storage,
    aux: tuple[int, ...],
    path: Path,
) -> None:
    t = shapes[HIDDEN_STATES][0]
    for name in (INPUT_IDS, LOSS_MASK):
        if name in shapes and shapes[name] != [t]:
            raise DatasetError(
                f"{path}: {name} has shape {shapes[name]}, hidden_states has {t} rows"
            )
    layers = len(aux) + 1
    if not storage.is_fp8 and shapes[HIDDEN_STATES][1] != layers:
        raise DatasetError(
            f"{path}: hidden_states has {shapes[HIDDEN_STATES][1]} layers but aux_layers "
            f"{list(aux)} means {layers}"
        )
    for name in SECTIONS:
        if name in shapes and shapes[name] != want[name][1]:
            raise DatasetError(
                f"{path}: {name} has shape {shapes[name]}, expected {want[name][1]} "
                f"({_what(storage, aux)})"
            )


def _header(handle: Any, path: Path, num_tokens: int | None) -> SampleHeader:
    shapes, storage, aux = _check_stored(handle, path)
    t, _, hidden = shapes[HIDDEN_STATES]
    meta = dict(handle.metadata() or {})
    if num_tokens is not None and t != num_tokens:
        raise DatasetError(f"{path}: {t} tokens, the manifest says {num_tokens}; run hsx verify")
    return SampleHeader(
        path=path,
        sample_id=meta.get("id", ""),
        num_tokens=t,
        num_layers=len(aux) + 1,
        hidden_size=hidden,
        aux_layers=aux,
        has_loss_mask=LOSS_MASK in shapes,
        metadata=meta,
        storage=storage,
    )


def read_tensors(
    path: Path, names: Sequence[str] = (), *, num_tokens: int | None = None
) -> tuple[SampleHeader, dict[str, torch.Tensor]]:
    """The header and the named *stored* tensors, zero-copy views of a private mapping of
    the file: ``input_ids``, ``loss_mask`` and the storage's sections (bfloat16:
    ``hidden_states`` [T, L, H]; FP8: ``hidden_states`` e4m3fn [T, Lq, H],
    ``hidden_states_scales``, the outlier sections and ``hidden_states_unquantized``). A
    named tensor the file
    does not hold (no loss_mask, a section of another storage) is left out: see
    :func:`hidden_bf16` for ``[T, L, H]`` whatever the storage.

    ``num_tokens``, when given (from the manifest), must match the file.
    """
    unknown = set(names) - set(STORED)
    if unknown:
        raise ValueError(f"unknown stored tensor(s) {sorted(unknown)}; known: {list(STORED)}")
    _check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = _header(handle, path, num_tokens)
            present = set(handle.keys())
            tensors = {n: handle.get_tensor(n) for n in names if n in present}
    except FileNotFoundError:
        raise DatasetError(f"{path}: listed in the manifest but missing; run hsx verify") from None
    except (SafetensorError, OSError) as exc:
        raise DatasetError(
            f"{path}: not a readable safetensors file ({exc}); run hsx verify"
        ) from None
    return header, tensors


def read_hidden(
    path: Path, names: Sequence[str] = (), *, num_tokens: int | None = None
) -> tuple[SampleHeader, dict[str, torch.Tensor]]:
    """:func:`read_tensors` of ``names`` plus every hidden section of the file."""
    wanted = list(dict.fromkeys([*names, *SECTIONS]))
    return read_tensors(path, wanted, num_tokens=num_tokens)


def hidden_bf16(header: SampleHeader, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sample's hidden states as bfloat16 ``[T, L, H]`` from what :func:`read_hidden`
    returned: the stored tensor itself (a view of the mapping) for a bfloat16 file; for an
    FP8 file, a new tensor with the quantized slots dequantized (float32 product, rounded
    once; the outliers as stored) and the kept slots as stored."""
    if not header.storage.is_fp8:
        return stored[HIDDEN_STATES]
    return assemble(
        stored[HIDDEN_STATES],
        stored[HIDDEN_STATES_SCALES],
        stored.get(HIDDEN_STATES_UNQUANTIZED),
        header.storage,
        torch.bfloat16,
        outlier_index=stored.get(HIDDEN_STATES_OUTLIER_INDEX),
        outlier_values=stored.get(HIDDEN_STATES_OUTLIER_VALUES),
    )


def _check_regular(path: Path) -> None:
    """A sample file must be a regular file: a directory fails with a raw OSError deep in
    safetensors, and opening a FIFO would block for good."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DatasetError(f"{path}: listed in the manifest but missing; run hsx verify") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror}); run hsx verify") from None
    if not stat.S_ISREG(mode):
        raise DatasetError(f"{path}: listed in the manifest but not a regular file; run hsx verify")


def read_header(path: Path, *, num_tokens: int | None = None) -> SampleHeader:
    return read_tensors(path, (), num_tokens=num_tokens)[0]


def split_layers(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, L, H]`` -> (final ``[T, H]``, aux concatenated ``[T, (L-1)·H]``), both views."""
    t, layers, size = hidden.shape
    k = layers - 1
    # Rows of the first k layers are adjacent in C order, so this reshape never copies.
    return hidden[:, k, :], hidden[:, :k, :].reshape(t, k * size)


def read_sample(
    path: Path,
    fields: Sequence[str] = FIELDS,
    *,
    num_tokens: int | None = None,
    storage: HiddenMode = "bf16",
    expect: Storage | None = None,
) -> Sample:
    """One sample as an EAGLE-3 trainer consumes it; see the module docstring.

    ``storage="bf16"`` (default): ``hidden_states`` / ``aux_hidden_states`` in bfloat16,
    whatever the file stores (FP8 files are dequantized here, for this sample only).
    ``storage="raw"``: if either hidden field is asked for, the file's hidden sections as
    stored (``hidden_states``, and for FP8 ``hidden_states_scales`` and, when slots are
    kept, ``hidden_states_unquantized``) instead of the two views. ``expect``: the
    dataset's storage; a file of another one is refused.
    """
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {list(FIELDS)}")
    _check_mode(storage)
    wanted = [n for n in (INPUT_IDS, LOSS_MASK) if n in fields]
    hidden = HIDDEN_STATES in fields or AUX_HIDDEN_STATES in fields
    if hidden:
        wanted.extend(SECTIONS)
    header, stored = read_tensors(path, wanted, num_tokens=num_tokens)
    if expect is not None and header.storage != expect:
        raise DatasetError(
            f"{path}: stores hidden states as {header.storage.describe()}, but the dataset "
            f"is {expect.describe()} (provenance.json): a file from another run; run hsx "
            "verify, and extract it again"
        )
    sample: Sample = {}
    if INPUT_IDS in fields:
        sample[INPUT_IDS] = stored[INPUT_IDS]
    if LOSS_MASK in fields:
        mask = stored.get(LOSS_MASK)
        sample[LOSS_MASK] = (
            torch.ones(header.num_tokens, dtype=torch.uint8) if mask is None else mask
        )
    if hidden and storage == "raw":
        sample.update({n: stored[n] for n in SECTIONS if n in stored})
    elif hidden:
        final, aux = split_layers(hidden_bf16(header, stored))
        if HIDDEN_STATES in fields:
            sample[HIDDEN_STATES] = final
        if AUX_HIDDEN_STATES in fields:
            sample[AUX_HIDDEN_STATES] = aux
    return sample


def _check_mode(storage: str) -> None:
    if storage not in HIDDEN_MODES:
        raise ValueError(f"storage is {storage!r}, expected one of {', '.join(HIDDEN_MODES)}")


def split_of(sample_id: SampleId, *, val_fraction: float, seed: int = 0) -> Literal["train", "val"]:
    """The stable side of a sample: a hash of its canonical id against ``val_fraction``."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction is {val_fraction}, expected a number in [0, 1]")
    digest = xxhash.xxh3_64_intdigest(f"{seed}\0{canonical_id(sample_id)}".encode())
    return "val" if digest < val_fraction * 2.0**64 else "train"


def select_entries(
    entries: Sequence[ManifestEntry],
    *,
    max_tokens: int | None = None,
    split: Split = "all",
    val_fraction: float = 0.0,
    seed: int = 0,
) -> list[ManifestEntry]:
    """Filter (``max_tokens``, split) and order manifest entries by canonical id.

    The order is the same for the same set of samples whatever the shard or completion
    order, so a sampler seeded alike sees the same sequence across runs.
    """
    if split not in ("all", "train", "val"):
        raise ValueError(f"split is {split!r}, expected 'all', 'train' or 'val'")
    seen: dict[str, ManifestEntry] = {}
    for entry in entries:
        key = canonical_id(entry.id)
        if key in seen:
            raise DatasetError(
                f"sample id {key!r} is in the manifest twice ({seen[key].path}, {entry.path})"
            )
        seen[key] = entry
    chosen = [
        e
        for e in seen.values()
        if (max_tokens is None or e.num_tokens <= max_tokens)
        and (split == "all" or split_of(e.id, val_fraction=val_fraction, seed=seed) == split)
    ]
    return sorted(chosen, key=lambda e: canonical_id(e.id))


class HiddenStateDataset(Dataset[Sample]):
    """Samples of an output directory (sharded or not), as :func:`read_sample` yields them.

    Only the manifest (and ``provenance.json``) is read up front; each item opens its file
    on demand. The object holds no open file, so it pickles cheaply into DataLoader workers.

    ``storage``: ``"bf16"`` (default) yields bfloat16 hidden states whatever the dataset
    stores (an FP8 dataset is dequantized per item, in ``__getitem__``); ``"raw"`` yields the
    stored sections (e4m3fn values, float32 scales, outliers, kept bf16 slots) for trainers
    that take FP8; :attr:`storage` (a :class:`~hsx_async.protocol.Storage`) names the
    quantized and kept slots and the layout. Every file must hold the dataset's storage
    (``provenance.json``).

    ``final_state``: what ``hidden_states`` (the last slot) holds. ``"as_stored"``
    (default): the dataset's own kind, :attr:`final_state` — post-norm from SGLang (the LM
    head's input), pre-norm from vLLM (the last decoder layer's output). ``"post_norm"`` or
    ``"pre_norm"``: converted to that kind when the dataset holds the other, with the final
    norm of ``model`` (the target's local Hugging Face directory) — the conversion
    ``hsx export`` makes (:func:`hsx_async.dataset.target.convert_final`). Needs
    ``storage="bf16"``.
    """

    def __init__(
        self,
        out_dir: Path | str,
        *,
        fields: Sequence[str] = FIELDS,
        max_tokens: int | None = None,
        split: Split = "all",
        val_fraction: float = 0.0,
        seed: int = 0,
        storage: HiddenMode = "bf16",
        final_state: FinalState = "as_stored",
        model: Path | str | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {list(FIELDS)}")
        _check_mode(storage)
        self.fields = tuple(fields)
        self.mode: HiddenMode = storage
        entries = read_manifest(self.out_dir)
        if not entries and not self.out_dir.is_dir():
            raise DatasetError(f"{self.out_dir} is not a directory; expected an hsx output dir")
        self.entries: tuple[ManifestEntry, ...] = tuple(
            select_entries(
                entries, max_tokens=max_tokens, split=split, val_fraction=val_fraction, seed=seed
            )
        )
        self._expect = _recorded_storage(self.out_dir)
        # From provenance.json; a dataset without one: its first file, when first needed.
        self._stored_final = dataset_final_state(read_provenance(self.out_dir))
        self._convert = None
        if final_state != "as_stored":
            self._convert = _final_conversion(self.stored_final_state, final_state, model, storage)
        if self._convert is not None and self.entries:
            size = read_header(self.path(0), num_tokens=self.entries[0].num_tokens).hidden_size
            if self._convert[1].shape[0] != size:
                raise DatasetError(
                    f"model {model} has hidden size {self._convert[1].shape[0]}, the dataset "
                    f"{size}: give the model the dataset was made from"
                )

    @property
    def stored_final_state(self) -> str:
        """What the dataset's last slot holds: ``"post_norm"`` or ``"pre_norm"``."""
        if self._stored_final is None:
            self._stored_final = _first_file_final_state(self.out_dir, self.entries)
        return self._stored_final

    @property
    def final_state(self) -> str:
        """What ``hidden_states`` yields: ``"post_norm"`` or ``"pre_norm"``."""
        return self._convert[0] if self._convert is not None else self.stored_final_state

    @property
    def storage(self) -> Storage:
        """How the dataset stores hidden states: ``provenance.json``'s record, or (a dataset
        without one) the first sample file's; bfloat16 for an empty one."""
        if self._expect is not None:
            return self._expect
        if not self.entries:
            return BF16_STORAGE
        return read_header(self.path(0), num_tokens=self.entries[0].num_tokens).storage

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> Sample:
        entry = self.entries[index]
        sample = read_sample(
            self.path(index),
            self.fields,
            num_tokens=entry.num_tokens,
            storage=self.mode,
            expect=self._expect,
        )
        if self._convert is not None and HIDDEN_STATES in sample:
            want, gain, eps = self._convert
            sample[HIDDEN_STATES] = convert_final(
                sample[HIDDEN_STATES], self.stored_final_state, want, gain, eps
            )
        return sample

    def path(self, index: int) -> Path:
        return self.out_dir / self.entries[index].path

    @property
    def lengths(self) -> list[int]:
        """Token counts from the manifest (no file is opened)."""
        return [e.num_tokens for e in self.entries]

    @property
    def ids(self) -> list[SampleId]:
        return [e.id for e in self.entries]


def _first_file_final_state(out_dir: Path, entries: Sequence[ManifestEntry]) -> str:
    """The kind the first file's last slot holds (a dataset without provenance.json, e.g.
    merged from parts); post-norm for an empty one."""
    kind = None
    if entries:
        meta = read_header(out_dir / entries[0].path, num_tokens=entries[0].num_tokens).metadata
        try:
            kind = parse_final_state(meta.get("final_state"), "final_state")
        except DumpError as exc:
            raise DatasetError(f"{out_dir / entries[0].path}: {exc}") from None
    return kind or POST_NORM


def _final_conversion(
    stored: str, want: FinalState, model: Path | str | None, mode: HiddenMode
) -> tuple[str, torch.Tensor, float] | None:
    """(kind, the final norm's gain, eps) to convert each sample's final state with, or
    None when it is yielded as stored."""
    if want not in FINAL_STATES:
        raise ValueError(f"final_state={want!r}; expected one of {list(FINAL_STATES)}")
    if want in ("as_stored", stored):
        return None
    if mode != "bf16":
        raise ValueError(f'final_state={want!r} converts bfloat16 values: use storage="bf16"')
    if model is None:
        raise DatasetError(
            f"the dataset holds the {stored} final state; converting it to {want} needs the "
            "target's final norm: give model=PATH (its local Hugging Face directory)"
        )
    target = read_target(Path(model))
    weight = final_norm_weight(target)
    return want, norm_gain(weight, target.norm_kind), target.norm_eps


def _recorded_storage(out_dir: Path) -> Storage | None:
    prov = read_provenance(out_dir)
    return None if prov is None else dataset_storage(prov)


@dataclass(frozen=True, slots=True)
class PadCollator:
    """Pads a list of samples into a batch: ``[B, T_max, ...]`` plus ``attention_mask``
    (int64, 1 on real tokens) and ``lengths`` ``[B]``. Padding is ``pad_token_id`` for
    ``input_ids`` and zero elsewhere (so padded positions never count in the loss).

    Each sample is copied exactly once, from its mapping into the batch. A module-level
    class, so it pickles into DataLoader workers under any start method.
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int = 1

    def __call__(self, batch: Sequence[Sample]) -> Sample:
        if not batch:
            raise ValueError("cannot collate an empty batch")
        lengths = [_num_tokens(s) for s in batch]
        width = -(-max(lengths) // self.pad_to_multiple_of) * self.pad_to_multiple_of
        out: Sample = {}
        for key, first in batch[0].items():
            fill = self.pad_token_id if key == INPUT_IDS else 0
            target = _batch_tensor((len(batch), width, *first.shape[1:]), first.dtype)
            rows = _as_numpy(target)
            for row, (sample, n) in enumerate(zip(batch, lengths, strict=True)):
                # numpy copies on one thread; torch's intra-op threads spin and contend on a
                # busy host (measured: 3× the CPU per GB). Each batch byte is written once:
                # fresh memory is costly to touch.
                np.copyto(rows[row, :n], _as_numpy(sample[key]))
                rows[row, n:] = fill
            out[key] = target
        size = torch.tensor(lengths, dtype=torch.int64)
        out["attention_mask"] = (torch.arange(width)[None, :] < size[:, None]).to(torch.int64)
        out["lengths"] = size
        return out


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy); bfloat16 and float8, which numpy lacks, as their bit
    patterns (int16, uint8)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype == FP8_DTYPE:
        tensor = tensor.view(torch.uint8)
    return tensor.numpy()


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; in a DataLoader worker, in shared memory from the start
    (as torch's default_collate does), which saves the copy into shared memory that sending
    the batch to the main process would make."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = math.prod(shape)
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(  # type: ignore[no-untyped-call]
        numel * dtype.itemsize
    )
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def _num_tokens(sample: Sample) -> int:
    return int(next(iter(sample.values())).shape[0])


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of indices with similar lengths, in a random but reproducible order.

    Per epoch: shuffle all indices (seeded by ``seed`` and :meth:`set_epoch`), cut them into
    groups of ``group_size``, sort each group by length (longest first) and cut it into
    batches of at most ``batch_size`` samples and at most ``max_batch_tokens`` padded tokens
    (``len(batch) × longest``); then shuffle the batches. A sample longer than
    ``max_batch_tokens`` gets a batch of its own: drop such samples with the dataset's
    ``max_tokens``. With ``num_replicas > 1`` each rank takes every ``num_replicas``-th batch
    of the same sequence, the tail cut so that all ranks run the same number of steps.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group_size: int | None = None,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_size is None and max_batch_tokens is None:
            raise ValueError("give batch_size, max_batch_tokens or both")
        if (batch_size is not None and batch_size < 1) or (
            max_batch_tokens is not None and max_batch_tokens < 1
        ):
            raise ValueError("batch_size and max_batch_tokens must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.group_size = group_size or 64 * (batch_size or 8)
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _cut(self, group: np.ndarray) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for index in group.tolist():
            n = int(self.lengths[index])
            full = self.batch_size is not None and len(current) >= self.batch_size
            over = (
                self.max_batch_tokens is not None
                and (len(current) + 1) * max(longest, n) > self.max_batch_tokens
            )
            if current and (full or over):
                batches.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    def batches(self) -> list[list[int]]:
        """This rank's batches for the current epoch."""
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        batches: list[list[int]] = []
        for start in range(0, n, self.group_size):
            group = order[start : start + self.group_size]
            # Stable sort on the negated lengths: longest first, ties keep the shuffled order.
            batches.extend(self._cut(group[np.argsort(-self.lengths[group], kind="stable")]))
        if self.drop_last and self.batch_size is not None:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        usable = len(batches) - len(batches) % self.num_replicas
        return batches[self.rank : usable : self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())


def padded_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of padding in the batches (0 = none): how well a sampler groups lengths."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return 0.0 if padded == 0 else 1.0 - real / padded


__all__ = [
    "AUX_HIDDEN_STATES",
    "FIELDS",
    "FINAL_STATES",
    "HIDDEN_MODES",
    "HIDDEN_STATES",
    "HIDDEN_STATES_OUTLIER_INDEX",
    "HIDDEN_STATES_OUTLIER_VALUES",
    "HIDDEN_STATES_SCALES",
    "HIDDEN_STATES_UNQUANTIZED",
    "INPUT_IDS",
    "LOSS_MASK",
    "SECTIONS",
    "STORED",
    "FinalState",
    "HiddenMode",
    "HiddenStateDataset",
    "LengthGroupedBatchSampler",
    "PadCollator",
    "Sample",
    "SampleHeader",
    "expected_tensors",
    "file_storage",
    "hidden_bf16",
    "padded_fraction",
    "read_header",
    "read_hidden",
    "read_sample",
    "read_tensors",
    "select_entries",
    "split_layers",
    "split_of",
]
