"""The training side: a ``torch.utils.data.Dataset`` over an hsx output directory (PROTOCOL §4).

Each sample file is a standard safetensors file. It is opened with ``safetensors.safe_open``,
which maps the file copy-on-write (``MAP_PRIVATE``) and hands out tensors that *are* the
mapping: nothing is read until a tensor's pages are touched, so asking for ``input_ids``
alone never reads ``hidden_states``, and an in-place edit by a trainer can never reach the
file. From the stored ``hidden_states`` ``[T, L, H]`` (aux layers in capture order, then the
final post-norm state) a sample yields, as views of the mapping:

- ``hidden_states`` ``[T, H]``: the final layer, ``hs[:, L-1, :]`` (rows strided by ``L·H``);
- ``aux_hidden_states`` ``[T, k·H]``: the ``k = L-1`` aux layers concatenated in capture
  order, ``hs[:, :k, :].reshape(T, k·H)`` (each row is ``k·H`` contiguous values);
- ``input_ids`` ``[T]`` int64 and ``loss_mask`` ``[T]`` uint8 (all ones when the input had
  none; that one tensor is built, not mapped).

The only copy on the way to the trainer is :class:`PadCollator` writing each sample into the
padded batch. With ``DataLoader(num_workers > 0)`` the batch then travels to the main
process through shared memory, as torch does for every dataset.

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

from hsx_async.dataset.layout import SampleId, canonical_id
from hsx_async.dataset.manifest import ManifestEntry, read_manifest
from hsx_async.errors import DatasetError

Sample = dict[str, torch.Tensor]
Split = Literal["all", "train", "val"]

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_STATES = "hidden_states"
AUX_HIDDEN_STATES = "aux_hidden_states"
FIELDS: tuple[str, ...] = (INPUT_IDS, LOSS_MASK, HIDDEN_STATES, AUX_HIDDEN_STATES)

# What the writer stores (PROTOCOL §4): tensor name -> (safetensors dtype, rank).
_STORED: dict[str, tuple[str, int]] = {
    INPUT_IDS: ("I64", 1),
    HIDDEN_STATES: ("BF16", 3),
    LOSS_MASK: ("U8", 1),
}


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


def _parse_aux_layers(text: str | None, path: Path) -> tuple[int, ...]:
    if text is None:
        raise DatasetError(f"{path}: metadata has no 'aux_layers'; not an hsx sample file")
    try:
        return tuple(int(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise DatasetError(
            f"{path}: metadata aux_layers {text!r} is not a list of integers"
        ) from None


def _check_stored(handle: Any, path: Path) -> dict[str, list[int]]:
    """Shapes of the stored tensors, after checking names and dtypes against PROTOCOL §4."""
    names = set(handle.keys())
    missing = {INPUT_IDS, HIDDEN_STATES} - names
    extra = names - set(_STORED)
    if missing or extra:
        raise DatasetError(
            f"{path}: tensors {sorted(names)}; expected input_ids, hidden_states and "
            "optionally loss_mask. Not an hsx sample file, or written by another version"
        )
    shapes = {}
    for name in names:
        view = handle.get_slice(name)
        dtype, rank = _STORED[name]
        shape = list(view.get_shape())
        if view.get_dtype() != dtype or len(shape) != rank:
            raise DatasetError(
                f"{path}: tensor {name} is {view.get_dtype()} {shape}, expected {dtype} of rank "
                f"{rank}"
            )
        shapes[name] = shape
    return shapes


def _header(handle: Any, path: Path, num_tokens: int | None) -> SampleHeader:
    shapes = _check_stored(handle, path)
    t, layers, hidden = shapes[HIDDEN_STATES]
    meta = dict(handle.metadata() or {})
    aux = _parse_aux_layers(meta.get("aux_layers"), path)
    for name in (INPUT_IDS, LOSS_MASK):
        if name in shapes and shapes[name] != [t]:
            raise DatasetError(
                f"{path}: {name} has shape {shapes[name]}, hidden_states has {t} rows"
            )
    if layers != len(aux) + 1:
        raise DatasetError(
            f"{path}: hidden_states has {layers} layers but aux_layers {list(aux)} means "
            f"{len(aux) + 1}"
        )
    if num_tokens is not None and t != num_tokens:
        raise DatasetError(f"{path}: {t} tokens, the manifest says {num_tokens}; run hsx verify")
    return SampleHeader(
        path=path,
        sample_id=meta.get("id", ""),
        num_tokens=t,
        num_layers=layers,
        hidden_size=hidden,
        aux_layers=aux,
        has_loss_mask=LOSS_MASK in shapes,
        metadata=meta,
    )


def read_tensors(
    path: Path, names: Sequence[str] = (), *, num_tokens: int | None = None
) -> tuple[SampleHeader, dict[str, torch.Tensor]]:
    """The header and the named *stored* tensors (``input_ids``, ``hidden_states`` [T, L, H],
    ``loss_mask`` when present), zero-copy views of a private mapping of the file.

    ``num_tokens``, when given (from the manifest), must match the file.
    """
    unknown = set(names) - set(_STORED)
    if unknown:
        raise ValueError(f"unknown stored tensor(s) {sorted(unknown)}; known: {sorted(_STORED)}")
    _check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = _header(handle, path, num_tokens)
            tensors = {
                n: handle.get_tensor(n) for n in names if n != LOSS_MASK or header.has_loss_mask
            }
    except FileNotFoundError:
        raise DatasetError(f"{path}: listed in the manifest but missing; run hsx verify") from None
    except (SafetensorError, OSError) as exc:
        raise DatasetError(
            f"{path}: not a readable safetensors file ({exc}); run hsx verify"
        ) from None
    return header, tensors


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
    path: Path, fields: Sequence[str] = FIELDS, *, num_tokens: int | None = None
) -> Sample:
    """One sample as an EAGLE-3 trainer consumes it; see the module docstring."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {list(FIELDS)}")
    wanted = [n for n in (INPUT_IDS, LOSS_MASK) if n in fields]
    if HIDDEN_STATES in fields or AUX_HIDDEN_STATES in fields:
        wanted.append(HIDDEN_STATES)
    header, stored = read_tensors(path, wanted, num_tokens=num_tokens)
    sample: Sample = {}
    if INPUT_IDS in fields:
        sample[INPUT_IDS] = stored[INPUT_IDS]
    if LOSS_MASK in fields:
        mask = stored.get(LOSS_MASK)
        sample[LOSS_MASK] = (
            torch.ones(header.num_tokens, dtype=torch.uint8) if mask is None else mask
        )
    if HIDDEN_STATES in stored:
        final, aux = split_layers(stored[HIDDEN_STATES])
        if HIDDEN_STATES in fields:
            sample[HIDDEN_STATES] = final
        if AUX_HIDDEN_STATES in fields:
            sample[AUX_HIDDEN_STATES] = aux
    return sample


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

    Only the manifest is read up front; each item opens its file on demand. The object holds
    no open file, so it pickles cheaply into DataLoader workers.
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
    ) -> None:
        self.out_dir = Path(out_dir)
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {list(FIELDS)}")
        self.fields = tuple(fields)
        entries = read_manifest(self.out_dir)
        if not entries and not self.out_dir.is_dir():
            raise DatasetError(f"{self.out_dir} is not a directory; expected an hsx output dir")
        self.entries: tuple[ManifestEntry, ...] = tuple(
            select_entries(
                entries, max_tokens=max_tokens, split=split, val_fraction=val_fraction, seed=seed
            )
        )

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> Sample:
        entry = self.entries[index]
        return read_sample(self.path(index), self.fields, num_tokens=entry.num_tokens)

    def path(self, index: int) -> Path:
        return self.out_dir / self.entries[index].path

    @property
    def lengths(self) -> list[int]:
        """Token counts from the manifest (no file is opened)."""
        return [e.num_tokens for e in self.entries]

    @property
    def ids(self) -> list[SampleId]:
        return [e.id for e in self.entries]


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
    """A numpy view (no copy); bfloat16, which numpy lacks, as its int16 bit patterns."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
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
    "HIDDEN_STATES",
    "INPUT_IDS",
    "LOSS_MASK",
    "HiddenStateDataset",
    "LengthGroupedBatchSampler",
    "PadCollator",
    "Sample",
    "SampleHeader",
    "padded_fraction",
    "read_header",
    "read_sample",
    "read_tensors",
    "select_entries",
    "split_layers",
    "split_of",
]
