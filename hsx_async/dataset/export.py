"""``hsx export``: the dataset in the on-disk format of an existing EAGLE-3 trainer.

Streaming and resumable: one sample at a time (memory bounded by one sample), each output
written under a temporary name, fsynced and renamed into place, then recorded in
``hsx-export.jsonl`` in the destination. A rerun skips every output whose record, size and
source hash still match, and redoes the rest; a crash leaves at most a temporary file,
removed on the next run. Output indices are assigned once per sample id (in id order) and
kept across runs, so a resumed or extended export never renumbers a file.

Formats, matched against the trainers' own code (read, not copied):

``specforge`` — sgl-project/SpecForge (commit a6b6b02):
    ``scripts/prepare_hidden_states.py`` (``HiddenStatesGenerator._get_file_path``,
    ``_save_tensor_sync``) writes ``rows_{g}-{g + 2000}/data_{idx}.ckpt`` (``g`` = ``idx``
    rounded down to the group size, 2000 by default) with ``torch.save`` of a dict built by
    ``OfflineCaptureLayout.materialize`` (``specforge/algorithms/common/providers.py``):
    ``input_ids`` int64 ``[T]``, ``loss_mask`` int64 ``[T]``, ``aux_hidden_state``
    ``[1, T, 3H]`` and ``hidden_state`` ``[1, T, H]`` in the model dtype (bf16). The reader
    (``specforge/runtime/data_plane/offline_reader.py``: ``list_feature_files`` walks the
    tree for ``*.ckpt``; ``feature_store.load_feature_file``: ``torch.load(path,
    weights_only=False, mmap=True)``) and the EAGLE-3 normalizer
    (``specforge/algorithms/eagle3/data.py``) use exactly these keys and shapes. The trainer
    zeroes the last ``loss_mask`` position itself, so the mask is exported as stored (all
    ones when the input had none).

``speculators`` — vllm-project/speculators (commit c05b95b):
    ``hs_connectors/src/hs_connectors/transfer.py`` (``FileTransfer.get_cached``) loads
    ``<data>/hidden_states/hs_{idx}.safetensors`` with ``safetensors.torch.load_file``;
    ``src/speculators/train/data.py`` (``ArrowDataset._get_raw_data``) takes
    ``hidden_states`` ``[T, n_layers, H]`` (aux layers in order, then the last layer: it
    uses ``[:, :-1].flatten(1)`` and ``[:, -1]``) and ``token_ids`` ``[T]``, which it
    compares with ``torch.equal`` to the int64 ``input_ids`` of its preprocessed dataset
    (``src/speculators/data_generation/preprocessing.py``: columns ``input_ids``,
    ``loss_mask`` (int64) and ``seq_len``). hsx's ``hidden_states`` is that tensor
    unchanged. Row ``idx`` of ``samples.jsonl`` holds those three columns (plus ``hsx_id``)
    for ``hs_{idx}``; speculators reads them from a HuggingFace ``datasets`` directory
    (``load_from_disk(<data>)``), which the export writes into the destination itself
    (``datasets`` is the ``speculators`` extra), plus ``token_freq.pt`` (``train/cli.py``,
    ``vocab_mapping.save_token_frequency_distribution``: ``torch.save`` of ``{token id:
    count}`` over the tokens whose ``loss_mask`` is 1) that ``--draft-vocab-size`` needs.

The final state (the last layer slot). SpecForge takes it as the LM head's input (post-norm)
and applies only the head; speculators 0.9.0 takes it as the *pre*-norm state and applies
``lm_head(norm(x))`` with the verifier's own norm (``models/eagle3/core.py``). A dataset
records which kind it holds (PROTOCOL §4); where it differs from the trainer's, the export
converts it with the final norm read from ``--model`` (:mod:`.target`), and refuses without
one rather than hand a trainer a wrong target. ``hsx-export.json`` records the kind written,
so an old, unconverted speculators export is never silently extended.

FP8 datasets (PROTOCOL §4). SpecForge 0.2.0's loader has no FP8: it always gets bfloat16,
dequantized per sample. speculators reads FP8 through hs-connectors 0.9.0's ``FP8Transfer``
(``--hidden-states-backend fp8``; ``hs_connectors/transfer.py``, ``fp8_utils.py``): a file
with ``hidden_states`` float8_e4m3fn ``[T, L, H]`` and ``hidden_states_scales`` float32
broadcastable against it (its own writer makes ``[T, 1, 1]``), dequantized as
``fp8.to(bf16) * scale.to(bf16)``. hsx's per-(token, slot) scales ``[T, L, 1]`` broadcast
the same way, so when every slot is stored as FP8 and the final state needs no conversion
(a pre-norm dataset), ``--dtype auto`` (the default) writes the dataset's own bytes in that
layout, nothing requantized: half the disk, and exactly the values hsx's reader yields,
but for the bf16 rounding of the scale in their formula. Otherwise (slots kept in bf16, or a
final state to convert) it writes bfloat16; ``--dtype bfloat16`` forces bfloat16 (a
trainer started without the fp8 backend reads these files unscaled, so FP8 would be
garbage to it); ``--dtype float8_e4m3fn`` writes FP8 whatever the dataset: the slots
it holds no FP8 bytes for (kept bf16 slots, a converted final state — a second rounding —,
every slot of a bf16 dataset) are quantized by the export, with the one quantizer, from the
values the bf16 export would write; the others are copied. ``hsx-export.json`` records the
dtype written: a resumed export never mixes.

Both formats get ``draft-config.json``: the ``eagle_config`` block of the drafter's config
with ``eagle_aux_hidden_state_layer_ids`` in SGLang's (and SpecForge's) numbering for the
target's family (:mod:`hsx_async.layer_ids`), so serving captures exactly the dataset's
layers; SpecForge additionally needs exactly 3 aux layers (``llama3_eagle.py``), so a
SpecForge export of any other number is refused.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from hsx_async.dataset.durable import exclusive_lock, fsync_dir, fsync_file, write_durably
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import AppendLog, ManifestEntry, read_log, read_manifest
from hsx_async.dataset.provenance import dataset_final_state, dataset_storage, read_provenance
from hsx_async.dataset.target import (
    TargetModel,
    convert_final,
    final_norm_weight,
    norm_gain,
    read_target,
)
from hsx_async.errors import DatasetError, DumpError
from hsx_async.layer_ids import DraftIds, draft_ids
from hsx_async.protocol import (
    BF16,
    BF16_STORAGE,
    FP8,
    POST_NORM,
    PRE_NORM,
    Storage,
    parse_final_state,
)

if TYPE_CHECKING:
    import torch

    from hsx_async.dataset.reader import SampleHeader

SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMATS = (SPECFORGE, SPECULATORS)
SPECFORGE_GROUP_SIZE = 2000  # SpecForge's --file-group-size default
EXPORT_LOG = "hsx-export.jsonl"
EXPORT_INFO = "hsx-export.json"
SPECULATORS_ROWS = "samples.jsonl"
TOKEN_FREQ = "token_freq.pt"
DRAFT_CONFIG = "draft-config.json"
# The final-state kind each trainer reads from the last layer slot (module docstring).
WANTED_FINAL_STATE = {SPECFORGE: POST_NORM, SPECULATORS: PRE_NORM}
SPECFORGE_AUX_LAYERS = 3
AUTO = "auto"
DTYPE_CHOICES = (AUTO, BF16, FP8)  # --dtype
TMP_PREFIX = ".hsx-tmp-"
LOCK_NAME = ".hsx-export.lock"

Progress = Callable[[int, int], None]  # (samples handled, total)


def specforge_relpath(index: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """``rows_{g}-{g+group}/data_{index}.ckpt``, as SpecForge's ``_get_file_path``."""
    group = index // group_size * group_size
    return f"rows_{group}-{group + group_size}/data_{index}.ckpt"


def speculators_relpath(index: int) -> str:
    """``hidden_states/hs_{index}.safetensors``, as speculators' ``FileTransfer``."""
    return f"hidden_states/hs_{index}.safetensors"


def relpath_for(fmt: str, index: int, group_size: int) -> str:
    return specforge_relpath(index, group_size) if fmt == SPECFORGE else speculators_relpath(index)


@dataclass(frozen=True, slots=True)
class ExportRecord:
    """One line of ``hsx-export.jsonl``: an output that is complete and durable."""

    index: int
    id: str
    path: str
    size: int
    source_xxh3_64: str

    def to_line(self) -> bytes:
        return (
            orjson.dumps(
                {
                    "index": self.index,
                    "id": self.id,
                    "path": self.path,
                    "bytes": self.size,
                    "source_xxh3_64": self.source_xxh3_64,
                }
            )
            + b"\n"
        )


@dataclass(frozen=True, slots=True)
class ExportResult:
    fmt: str
    dest: Path
    total: int
    written: int
    skipped: int
    bytes_written: int
    seconds: float
    ids_line: str = ""  # the draft-config ids for the target's family (DraftIds.describe)
    converted: bool = False  # the final state was converted with the model's final norm
    dtype: str = BF16  # what the hidden states were written as
    dtype_why: str = ""  # why, when --dtype auto chose bfloat16 for an FP8 dataset
    requantized: tuple[int, ...] = ()  # FP8 written: the slots quantized by the export


def _record(raw: Any, where: str) -> ExportRecord:
    try:
        return ExportRecord(
            index=int(raw["index"]),
            id=str(raw["id"]),
            path=str(raw["path"]),
            size=int(raw["bytes"]),
            source_xxh3_64=str(raw["source_xxh3_64"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: export log line is missing or mistypes {exc}") from None


def read_export_log(dest: Path) -> dict[str, ExportRecord]:
    """The latest record per sample id (a redone sample appends a newer line)."""
    path = dest / EXPORT_LOG
    records, _torn = read_log(path)
    return {rec.id: rec for rec in (_record(raw, f"{path}:{n}") for n, raw in records)}


def assign_indices(ids: Sequence[str], done: dict[str, ExportRecord]) -> dict[str, int]:
    """Keep every recorded index; number new ids after the highest one, in the given order."""
    indices = {i: done[i].index for i in ids if i in done}
    following = max((r.index for r in done.values()), default=-1) + 1
    for sample_id in ids:
        if sample_id not in indices:
            indices[sample_id] = following
            following += 1
    return indices


def _claim(dest: Path, fmt: str, group_size: int, out_dir: Path, dtype: str) -> None:
    """Record what this directory is an export of; refuse to mix formats, final-state
    kinds or hidden-state dtypes in one directory."""
    want = WANTED_FINAL_STATE[fmt]
    info = {
        "format": fmt,
        "file_group_size": group_size,
        "source": str(out_dir.resolve()),
        "final_state": want,
        "hidden_states_dtype": dtype,
    }
    path = dest / EXPORT_INFO
    if path.exists():
        try:
            old = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            raise DatasetError(f"{path} is not valid JSON; export into another directory") from None
        if (old.get("format"), old.get("file_group_size")) != (fmt, group_size):
            raise DatasetError(
                f"{dest} holds a {old.get('format')} export (file_group_size "
                f"{old.get('file_group_size')}); export to another --to directory"
            )
        # Exports before hsx recorded the kind wrote the stored (post-norm) state as is.
        if old.get("final_state", POST_NORM) != want:
            raise DatasetError(
                f"{dest} holds a {fmt} export with the {old.get('final_state', POST_NORM)} "
                f"final state, but {fmt} reads the {want} one (an export made before hsx "
                "converted it trains on wrong teacher logits); export into a new --to directory"
            )
        # Exports before hsx knew FP8 wrote bfloat16.
        if old.get("hidden_states_dtype", BF16) != dtype:
            raise DatasetError(
                f"{dest} holds a {fmt} export written as {old.get('hidden_states_dtype', BF16)}"
                f", this one would write {dtype}: one directory holds one dtype (its trainer "
                f"is started with one hidden-states backend). Pass --dtype "
                f"{old.get('hidden_states_dtype', BF16)} to extend it, or export into a new "
                "--to directory"
            )
        return
    _write_durably(path, lambda tmp: tmp.write_bytes(orjson.dumps(info) + b"\n"))


def _write_durably(final: Path, write: Callable[[Path], object]) -> int:
    """``write(tmp)`` made durable under ``final`` (:func:`write_durably`); the size."""
    final.parent.mkdir(parents=True, exist_ok=True)
    write_durably(final, write, tmp=final.with_name(TMP_PREFIX + final.name))
    return final.stat().st_size


@dataclass(frozen=True)
class FinalConversion:
    """How to turn each sample's final state into the kind the trainer reads."""

    want: str
    gain: torch.Tensor | None = None  # the final norm's per-channel factor, when known
    eps: float = 0.0

    def apply(self, header_meta: dict[str, str], final: torch.Tensor) -> torch.Tensor:
        try:
            have = parse_final_state(header_meta.get("final_state"), "sample final_state")
        except DumpError as exc:
            raise DatasetError(str(exc)) from None
        return convert_final(final, have, self.want, self.gain, self.eps)


def _specforge_record(
    sample_path: Path, entry: ManifestEntry, conv: FinalConversion
) -> dict[str, torch.Tensor]:
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    header, stored = dataset.read_hidden(
        sample_path, (dataset.INPUT_IDS, dataset.LOSS_MASK), num_tokens=entry.num_tokens
    )
    # bf16 [T, L, H]: the mapping itself, or an FP8 sample dequantized (SpecForge has no FP8).
    final, aux = dataset.split_layers(dataset.hidden_bf16(header, stored))
    final = conv.apply(header.metadata, final)
    mask = stored.get(dataset.LOSS_MASK)
    # clone(): torch.save writes a tensor's whole storage, and these views share the
    # mapping of the entire sample file.
    compact = torch.contiguous_format
    return {  # key order of SpecForge's OfflineCaptureLayout: passthrough, aux, last
        "input_ids": stored[dataset.INPUT_IDS].clone(),
        "loss_mask": (
            torch.ones(entry.num_tokens, dtype=torch.int64)
            if mask is None
            else mask.to(torch.int64)
        ),
        "aux_hidden_state": aux.clone(memory_format=compact).unsqueeze(0),
        "hidden_state": final.clone(memory_format=compact).unsqueeze(0),
    }


def _write_specforge(
    sample_path: Path, entry: ManifestEntry, conv: FinalConversion, tmp: Path
) -> None:
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    record = _specforge_record(sample_path, entry, conv)
    with tmp.open("wb") as fh:
        torch.save(record, fh)


def _write_speculators(
    sample_path: Path, entry: ManifestEntry, conv: FinalConversion, dtype: str, tmp: Path
) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    header, stored = dataset.read_hidden(
        sample_path, (dataset.INPUT_IDS,), num_tokens=entry.num_tokens
    )
    meta = {
        "hsx_id": canonical_id(entry.id),
        "aux_layers": header.metadata.get("aux_layers", ""),
        "final_state": conv.want,
        "dtype": dtype,
    }
    tensors = {"token_ids": stored[dataset.INPUT_IDS].clone()}
    if dtype == FP8:
        tensors |= _speculators_fp8(header, stored, conv)
    else:
        tensors["hidden_states"] = _speculators_bf16(header, stored, conv)
    save_file(tensors, str(tmp), metadata=meta)


def _speculators_bf16(
    header: SampleHeader, stored: dict[str, torch.Tensor], conv: FinalConversion
) -> torch.Tensor:
    """``[T, L, H]`` bf16: as stored (no copy) or dequantized, the final state converted."""
    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    hidden = dataset.hidden_bf16(header, stored)
    final = conv.apply(header.metadata, hidden[:, -1])
    if final.data_ptr() != hidden[:, -1].data_ptr():  # converted: a new tensor
        if not header.storage.is_fp8:  # hidden is the file's (private) mapping
            hidden = hidden.clone()
        hidden[:, -1] = final
    return hidden


def _speculators_fp8(
    header: SampleHeader, stored: dict[str, torch.Tensor], conv: FinalConversion
) -> dict[str, torch.Tensor]:
    """The sample as hs-connectors' ``FP8Transfer`` reads it: values ``[T, L, H]`` and
    scales ``[T, L, 1]``. The dataset's FP8 bytes unchanged where they hold what speculators
    reads; the slots with new values (:func:`requantized_slots`) quantized here by the one
    quantizer, from the values the bf16 export would write."""
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help
    from hsx_async.quantize import quantize  # noqa: PLC0415 - torch stays out of hsx --help

    storage, layers = header.storage, header.num_layers
    redo = requantized_slots(storage, layers, conv)
    if not redo:
        return {
            "hidden_states": stored[dataset.HIDDEN_STATES],
            "hidden_states_scales": stored[dataset.HIDDEN_STATES_SCALES],
        }
    hidden = _speculators_bf16(header, stored, conv)  # [T, L, H]: what bf16 would write
    t, _, h = hidden.shape
    values = torch.empty((t, layers, h), dtype=torch.float8_e4m3fn)
    scales = torch.empty((t, layers, 1), dtype=torch.float32)
    if storage.is_fp8:
        slots = list(storage.quantized)
        values[:, slots] = stored[dataset.HIDDEN_STATES]
        scales[:, slots] = stored[dataset.HIDDEN_STATES_SCALES]
    for slot in redo:
        values[:, slot], scales[:, slot, 0] = quantize(hidden[:, slot])
    return {"hidden_states": values, "hidden_states_scales": scales}


def requantized_slots(storage: Storage, layers: int, conv: FinalConversion) -> tuple[int, ...]:
    """The slots a speculators FP8 export quantizes itself, having no FP8 bytes for what
    speculators reads: every slot of a bfloat16 dataset, the slots an FP8 dataset keeps in
    bfloat16, and the final slot when it is converted (new values: a second FP8 rounding).
    Empty: the dataset's FP8 bytes are the export's."""
    if not storage.is_fp8:
        return tuple(range(layers))
    redo = set(storage.kept(layers))
    if conv.gain is not None:
        redo.add(layers - 1)
    return tuple(sorted(redo))


def fp8_export_problem(storage: Storage, layers: int, conv: FinalConversion) -> str:
    """Why ``--dtype auto`` writes a speculators export of this dataset in bfloat16 ('' if
    the dataset's FP8 bytes are the export's)."""
    if not storage.is_fp8:
        return "the dataset stores bfloat16"
    why = []
    if storage.kept(layers):
        kept = ",".join(map(str, storage.kept(layers)))
        why.append(
            f'the dataset keeps slot(s) {kept} in bfloat16 ([output].quantize = "aux"), '
            "and speculators' FP8 file holds every slot as FP8"
        )
    if conv.gain is not None:
        why.append(
            f"the dataset holds the {POST_NORM} final state and speculators reads the "
            f"{PRE_NORM} one: converting it gives new values, which FP8 would quantize again"
        )
    if not why:
        return ""
    redo = ",".join(map(str, requantized_slots(storage, layers, conv)))
    return "; ".join(why) + f" (--dtype {FP8} writes FP8 anyway, quantizing slot(s) {redo} here)"


def _remove_stale_temps(dest: Path) -> None:
    """Temporary files left by a crash: never a complete output, always safe to drop."""
    for path in dest.rglob(TMP_PREFIX + "*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _is_complete(dest: Path, record: ExportRecord | None, entry: ManifestEntry, rel: str) -> bool:
    if record is None or record.path != rel or record.source_xxh3_64 != entry.xxh3_64:
        return False
    try:
        return (dest / rel).stat().st_size == record.size
    except FileNotFoundError:
        return False


def _check_stale(done: dict[str, ExportRecord], ids: set[str], dest: Path) -> None:
    stale = sorted(set(done) - ids)
    if stale:
        raise DatasetError(
            f"{dest} holds exports of {len(stale)} sample(s) no longer in the dataset (e.g. "
            f"{stale[0]!r}); export into an empty directory"
        )


@contextlib.contextmanager
def _exclusive(dest: Path) -> Iterator[None]:
    """One export at a time per destination: two would race on indices and the log."""
    with exclusive_lock(dest / LOCK_NAME, f"another hsx export is writing to {dest}; wait for it"):
        yield


def _check_args(out_dir: Path, dest: Path, fmt: str, file_group_size: int) -> None:
    if fmt not in FORMATS:
        raise DatasetError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if file_group_size < 1:
        raise DatasetError(f"file_group_size is {file_group_size}, expected at least 1")
    if dest.resolve() == out_dir.resolve():
        raise DatasetError("--to must not be the dataset directory itself")


@dataclass
class _Run:
    """One export pass: where from, where to, and what is already there."""

    out_dir: Path
    dest: Path
    fmt: str
    group_size: int
    done: dict[str, ExportRecord]
    indices: dict[str, int]
    conv: FinalConversion
    dtype: str = BF16
    written: int = 0
    skipped: int = 0
    nbytes: int = 0

    def sample(self, entry: ManifestEntry, sample_id: str, log: AppendLog) -> None:
        rel = relpath_for(self.fmt, self.indices[sample_id], self.group_size)
        if _is_complete(self.dest, self.done.get(sample_id), entry, rel):
            self.skipped += 1
            return
        source = self.out_dir / entry.path
        if self.fmt == SPECFORGE:
            write = functools.partial(_write_specforge, source, entry, self.conv)
        else:
            write = functools.partial(_write_speculators, source, entry, self.conv, self.dtype)
        size = _write_durably(self.dest / rel, write)
        log.append(
            [ExportRecord(self.indices[sample_id], sample_id, rel, size, entry.xxh3_64).to_line()]
        )
        self.written += 1
        self.nbytes += size


@dataclass(frozen=True)
class DatasetFacts:
    """What the export must know of the dataset before writing anything."""

    aux_layers: tuple[int, ...] | None
    hidden_size: int | None
    final_state: str  # the kind the samples hold (post-norm for version-1 datasets)
    provenance: dict[str, Any] | None
    storage: Storage = BF16_STORAGE


def dataset_facts(out_dir: Path, entries: Sequence[ManifestEntry]) -> DatasetFacts:
    """Aux layers, hidden size and final-state kind, from provenance.json or else the first
    sample's header (a dataset merged from parts may have no provenance)."""
    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    prov = read_provenance(out_dir)
    kind = dataset_final_state(prov)
    aux = prov.get("aux_layers") if prov else None
    hidden = prov.get("hidden_size") if prov else None
    storage = dataset_storage(prov) if prov is not None else None
    if entries and (kind is None or aux is None or hidden is None or storage is None):
        header = dataset.read_header(out_dir / entries[0].path, num_tokens=entries[0].num_tokens)
        storage = storage if storage is not None else header.storage
        aux = aux if aux is not None else list(header.aux_layers)
        hidden = hidden if hidden is not None else header.hidden_size
        if kind is None:
            try:
                kind = parse_final_state(header.metadata.get("final_state"), "final_state")
            except DumpError as exc:
                raise DatasetError(f"{header.path}: {exc}") from None
    return DatasetFacts(
        aux_layers=tuple(aux) if isinstance(aux, list) else None,
        hidden_size=hidden if isinstance(hidden, int) else None,
        final_state=kind or POST_NORM,
        provenance=prov,
        storage=storage or BF16_STORAGE,
    )


def find_target(model: Path | None, facts: DatasetFacts) -> TargetModel | None:
    """``--model``, else the model directory provenance.json names, when it is one here."""
    if model is not None:
        return read_target(model)
    served = (facts.provenance or {}).get("model")
    if isinstance(served, str) and served and (Path(served) / "config.json").is_file():
        try:
            return read_target(Path(served))
        except DatasetError:
            return None
    return None


def plan_conversion(
    fmt: str, facts: DatasetFacts, target: TargetModel | None, model_given: bool
) -> FinalConversion:
    """The final-state conversion ``fmt`` needs; refuses when the norm is not known.

    Only an explicit ``--model`` is trusted with the norm: the directory provenance names
    may have changed since the run."""
    want = WANTED_FINAL_STATE[fmt]
    if facts.final_state == want or facts.aux_layers is None:  # nothing to convert
        return FinalConversion(want)
    if target is None or not model_given:
        raise DatasetError(
            f"--format {fmt} reads the {want} final state but the dataset holds the "
            f"{facts.final_state} one: give --model PATH (the target model's local Hugging "
            "Face directory) so hsx can convert it with the model's final norm"
        )
    weight = final_norm_weight(target)
    if facts.hidden_size is not None and weight.shape[0] != facts.hidden_size:
        raise DatasetError(
            f"--model {target.path} has hidden size {weight.shape[0]}, the dataset "
            f"{facts.hidden_size}: give the model the dataset was made from"
        )
    return FinalConversion(want, norm_gain(weight, target.norm_kind), target.norm_eps)


def plan_dtype(fmt: str, asked: str, facts: DatasetFacts, conv: FinalConversion) -> tuple[str, str]:
    """The dtype to write (and, when ``auto`` fell back to bfloat16 for an FP8 dataset,
    why); refuses an FP8 request that cannot be met."""
    if asked not in DTYPE_CHOICES:
        raise DatasetError(f"--dtype is {asked!r}, expected one of {', '.join(DTYPE_CHOICES)}")
    if asked == BF16 or (fmt == SPECFORGE and asked == AUTO):
        return BF16, ""
    if fmt == SPECFORGE:
        raise DatasetError(
            "--format specforge writes bfloat16 (SpecForge 0.2.0's loader reads no FP8); "
            "drop --dtype or pass --dtype bfloat16"
        )
    layers = len(facts.aux_layers) + 1 if facts.aux_layers is not None else 0
    if not layers:
        if asked == FP8:
            raise DatasetError(f"--dtype {FP8}: the dataset is empty; export with --dtype auto")
        return BF16, ""
    problem = fp8_export_problem(facts.storage, layers, conv)
    if not problem or asked == FP8:  # FP8: the slots with new values quantized here
        return FP8, ""
    return BF16, problem if facts.storage.is_fp8 else ""


def check_aux_count(fmt: str, facts: DatasetFacts) -> None:
    """SpecForge's EAGLE-3 drafter takes exactly 3 aux layers; refuse before writing."""
    if fmt != SPECFORGE or facts.aux_layers is None:
        return
    if len(facts.aux_layers) != SPECFORGE_AUX_LAYERS:
        raise DatasetError(
            f"SpecForge 0.2.0 trains EAGLE-3 on exactly {SPECFORGE_AUX_LAYERS} aux layers, "
            f"the dataset has {len(facts.aux_layers)} ({list(facts.aux_layers)}): extract "
            "again with 3 [model].aux_layers, or use --format speculators"
        )


def draft_ids_for(target: TargetModel | None, facts: DatasetFacts) -> DraftIds | None:
    if facts.aux_layers is None:
        return None
    if target is None or target.architecture is None or target.num_layers is None:
        return None
    return draft_ids(target.architecture, facts.aux_layers, target.num_layers)


def describe_ids(ids: DraftIds | None, facts: DatasetFacts) -> str:
    """The ids line ``hsx export`` prints (and ``draft-config.json`` keeps)."""
    if facts.aux_layers is None:
        return "the dataset is empty: no aux layers to name"
    if ids is None:
        return (
            "draft-config ids unknown: give --model PATH (the target's Hugging Face "
            "directory) so hsx knows the model family"
        )
    return ids.describe(facts.aux_layers)


def draft_config(fmt: str, ids: DraftIds | None, facts: DatasetFacts) -> dict[str, Any]:
    """``draft-config.json``: the drafter config's ``eagle_config`` block (SGLang and
    SpecForge read ``eagle_config.eagle_aux_hidden_state_layer_ids``) and what it means."""
    aux = list(facts.aux_layers or ())
    expressible = ids is not None and ids.ids is not None
    about: dict[str, Any] = {
        "aux_layers": aux,
        "numbering": "hsx aux layer k is the residual stream entering decoder layer k "
        "(Hugging Face hidden_states[k]); eagle_aux_hidden_state_layer_ids are in SGLang "
        "0.5.23's draft-config numbering for the target's family, which SpecForge uses too",
        "architecture": None if ids is None else ids.architecture,
        "rule": None if ids is None else ids.rule,
        "ids_line": describe_ids(ids, facts),
        "final_state": WANTED_FINAL_STATE[fmt],
    }
    if fmt == SPECULATORS:
        # speculators' --target-layer-ids (and vLLM's ids) count like hsx: hidden_states[k].
        about["speculators_target_layer_ids"] = aux
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(ids.ids) if expressible else None,  # type: ignore[union-attr, arg-type]
            "use_aux_hidden_state": True,
        },
        "hsx": about,
    }


def export_dataset(
    out_dir: Path,
    dest: Path,
    *,
    fmt: str,
    file_group_size: int = SPECFORGE_GROUP_SIZE,
    model: Path | None = None,
    dtype: str = AUTO,
    progress: Progress | None = None,
) -> ExportResult:
    """Export every sample of ``out_dir`` (all shards) into ``dest`` in format ``fmt``;
    ``dtype`` (``auto``, ``bfloat16``, ``float8_e4m3fn``): see the module docstring."""
    from hsx_async.dataset.reader import select_entries  # noqa: PLC0415 - torch stays out of hsx --help

    _check_args(out_dir, dest, fmt, file_group_size)
    started = time.monotonic()
    entries = select_entries(read_manifest(out_dir))
    facts = dataset_facts(out_dir, entries)
    check_aux_count(fmt, facts)
    target = find_target(model, facts)
    conv = plan_conversion(fmt, facts, target, model is not None)
    written_dtype, dtype_why = plan_dtype(fmt, dtype, facts, conv)
    ids_answer = draft_ids_for(target, facts)
    sample_ids = [canonical_id(e.id) for e in entries]
    dest.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest):
        _claim(dest, fmt, file_group_size, out_dir, written_dtype)
        _remove_stale_temps(dest)
        done = read_export_log(dest)
        _check_stale(done, set(sample_ids), dest)
        indices = assign_indices(sample_ids, done)
        run = _Run(out_dir, dest, fmt, file_group_size, done, indices, conv, written_dtype)
        log = AppendLog(dest / EXPORT_LOG)
        try:
            for count, (entry, sample_id) in enumerate(
                zip(entries, sample_ids, strict=True), start=1
            ):
                run.sample(entry, sample_id, log)
                if progress is not None:
                    progress(count, len(entries))
        finally:
            log.close()
        if fmt == SPECULATORS:
            write_speculators_rows(out_dir, dest, entries, run.indices)
            write_hf_dataset(dest)
        snippet = orjson.dumps(draft_config(fmt, ids_answer, facts), option=orjson.OPT_INDENT_2)
        _write_durably(dest / DRAFT_CONFIG, lambda tmp: tmp.write_bytes(snippet + b"\n"))
    return ExportResult(
        fmt,
        dest,
        len(entries),
        run.written,
        run.skipped,
        run.nbytes,
        time.monotonic() - started,
        ids_line=describe_ids(ids_answer, facts),
        converted=conv.gain is not None,
        dtype=written_dtype,
        dtype_why=dtype_why,
        requantized=(
            requantized_slots(facts.storage, len(facts.aux_layers) + 1, conv)
            if written_dtype == FP8 and facts.aux_layers is not None
            else ()
        ),
    )


def write_speculators_rows(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: dict[str, int]
) -> None:
    """``samples.jsonl`` (row ``i`` = input_ids, loss_mask, seq_len of ``hs_i``) and
    ``token_freq.pt`` (counts of the tokens under ``loss_mask == 1``), in one pass."""
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    order = sorted(entries, key=lambda e: indices[canonical_id(e.id)])
    if [indices[canonical_id(e.id)] for e in order] != list(range(len(order))):
        raise DatasetError(f"{dest}: export indices have gaps; export into an empty directory")
    counts: collections.Counter[int] = collections.Counter()

    def rows(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            for entry in order:
                sample = dataset.read_sample(
                    out_dir / entry.path,
                    (dataset.INPUT_IDS, dataset.LOSS_MASK),
                    num_tokens=entry.num_tokens,
                )
                ids, mask = sample[dataset.INPUT_IDS], sample[dataset.LOSS_MASK]
                tokens, n = np.unique(ids[mask.to(torch.bool)].numpy(), return_counts=True)
                counts.update(dict(zip(tokens.tolist(), n.tolist(), strict=True)))
                row = {
                    "input_ids": ids.tolist(),
                    "loss_mask": mask.tolist(),
                    "seq_len": entry.num_tokens,
                    "hsx_id": canonical_id(entry.id),
                }
                fh.write(orjson.dumps(row) + b"\n")

    _write_durably(dest / SPECULATORS_ROWS, rows)
    freq = dict(counts)

    def save_freq(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            torch.save(freq, fh)

    _write_durably(dest / TOKEN_FREQ, save_freq)


def write_hf_dataset(dest: Path) -> None:
    """The Hugging Face ``datasets`` directory speculators loads with ``load_from_disk``:
    built from ``samples.jsonl`` (streamed by Arrow, not held in memory) in a temporary
    directory, then its files moved into ``dest`` (fsynced, renamed, directory synced)."""
    try:
        import datasets  # noqa: PLC0415 - an optional, slow import
    except ImportError:
        raise DatasetError(
            "--format speculators writes a Hugging Face datasets directory: install the "
            "extra with pip install 'hsx_async[speculators]'"
        ) from None
    datasets.disable_progress_bars()  # hsx export reports its own progress
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
            "hsx_id": datasets.Value("string"),
        }
    )
    work = dest / f"{TMP_PREFIX}datasets"
    shutil.rmtree(work, ignore_errors=True)
    try:
        rows = dest / SPECULATORS_ROWS
        if rows.stat().st_size == 0:  # Arrow's JSON reader refuses an empty file
            built = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
        else:
            built = datasets.Dataset.from_json(
                str(rows), features=features, cache_dir=str(work / "cache")
            )
        built.set_format("torch")
        built.save_to_disk(str(work / "saved"))
        del built
        _move_into(work / "saved", dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _move_into(saved: Path, dest: Path) -> None:
    """Each file of a saved ``datasets`` directory renamed into ``dest``, durably; Arrow
    shards of an earlier, larger export removed."""
    names = sorted(p.name for p in saved.iterdir())
    for old in dest.glob("data-*.arrow"):
        if old.name not in names:
            old.unlink()
    for name in names:
        fsync_file(saved / name)
        (saved / name).replace(dest / name)
    fsync_dir(dest)


_SPECULATORS_HINT = """\
speculators: train with --data-path {dest} (the datasets directory, hidden_states/ and
token_freq.pt, so --draft-vocab-size takes effect), --verifier-name-or-path the target model
and --target-layer-ids {aux} (speculators and vLLM count layers as hsx does){backend}"""
_FP8_BACKEND = """,
and --hidden-states-backend fp8 (the files are FP8 with per-token, per-layer scales)"""
_SPECFORGE_HINT = """\
specforge: train offline on {dest} (its hidden-states directory) and copy the eagle_config
block of {snippet} into the drafter's config.json"""


def _run(args: argparse.Namespace) -> int:
    def report(done: int, total: int) -> None:
        if done % 1000 == 0 or done == total:
            print(f"hsx export: {done}/{total} samples", file=sys.stderr)

    result = export_dataset(
        args.out_dir,
        args.dest,
        fmt=args.format,
        file_group_size=args.file_group_size,
        model=args.model,
        dtype=args.dtype,
        progress=report,
    )
    print(
        f"exported {result.total} samples to {result.dest} ({result.fmt}): {result.written} "
        f"written ({result.bytes_written / 1e9:.2f} GB), {result.skipped} already there, "
        f"{result.seconds:.1f} s"
    )
    if result.converted:
        want = WANTED_FINAL_STATE[result.fmt]
        print(f"final state converted to {want} with the final norm of --model")
    print(f"hidden states written as {result.dtype}")
    if result.dtype_why:
        print(f"  (not FP8: {result.dtype_why})")
    if result.requantized:
        slots = ",".join(map(str, result.requantized))
        print(f"  (slot(s) {slots} quantized by the export: values the dataset holds no FP8 of)")
    print(f"{result.ids_line}\n  (written to {result.dest / DRAFT_CONFIG})")
    if result.fmt == SPECULATORS:
        snippet = orjson.loads((result.dest / DRAFT_CONFIG).read_bytes())
        aux = ",".join(map(str, snippet["hsx"]["speculators_target_layer_ids"]))
        backend = _FP8_BACKEND if result.dtype == FP8 else ""
        print(_SPECULATORS_HINT.format(dest=result.dest, aux=aux, backend=backend))
    else:
        print(_SPECFORGE_HINT.format(dest=result.dest, snippet=result.dest / DRAFT_CONFIG))
    return 0


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the dataset in SpecForge's or speculators' offline format",
        description=(
            "Export every sample of an hsx output directory (all shards) for an existing "
            "trainer. Streaming and resumable: run it again to finish an interrupted export "
            "or to add samples extracted since."
        ),
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT", help="hsx output directory")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target format")
    parser.add_argument(
        "--to", required=True, type=Path, dest="dest", metavar="DIR", help="directory to write"
    )
    parser.add_argument(
        "--file-group-size",
        type=int,
        default=SPECFORGE_GROUP_SIZE,
        metavar="N",
        help="specforge: files per rows_* directory (default: %(default)s, as SpecForge)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="the target model's local Hugging Face directory: its family gives the "
        "draft-config ids, its final norm converts the final state where the trainer "
        "reads the other kind (speculators: pre-norm)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=AUTO,
        help="hidden-state dtype of the files. auto: speculators gets the dataset's FP8 "
        "bytes unchanged when every slot is FP8 and the final state needs no conversion "
        "(train with --hidden-states-backend fp8), else bfloat16; SpecForge always gets "
        "bfloat16. bfloat16: always (a trainer without the fp8 backend). float8_e4m3fn: "
        "speculators gets FP8 always, the slots without FP8 bytes (kept bf16 slots, a "
        "converted final state, a bf16 dataset) quantized by the export",
    )
    parser.set_defaults(handler=_run)
