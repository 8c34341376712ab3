"""``--format speculators``: vllm-project/speculators' offline data directory.

Matched against speculators' own code (commit c05b95b; read, not copied):
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

speculators 0.9.0 takes the final state as the *pre*-norm state and applies
``lm_head(norm(x))`` with the verifier's own norm (``models/eagle3/core.py``).

FP8: speculators reads FP8 through hs-connectors 0.9.0's ``FP8Transfer``
(``--hidden-states-backend fp8``; ``hs_connectors/transfer.py``, ``fp8_utils.py``): a file
with ``hidden_states`` float8_e4m3fn ``[T, L, H]`` and ``hidden_states_scales`` float32
broadcastable against it (its own writer makes ``[T, 1, 1]``), dequantized as
``fp8.to(bf16) * scale.to(bf16)``. hsx's ``per_token_slot`` scales ``[T, L, 1]`` broadcast
the same way, so when every slot is stored as FP8 in that layout and the final state needs
no conversion (a pre-norm dataset), ``--dtype auto`` (the default) writes the dataset's own
bytes, nothing requantized: half the disk, and exactly the values hsx's reader yields, but
for the bf16 rounding of the scale in their formula. Otherwise (the
``per_token_slot_outliers16`` layout, whose outliers FP8Transfer cannot read; slots kept in
bf16; a final state to convert) it writes bfloat16, and says why; ``--dtype bfloat16``
forces bfloat16 (a trainer started without the fp8 backend reads these files unscaled, so
FP8 would be garbage to it); ``--dtype float8_e4m3fn`` writes FP8 whatever the dataset: the
slots it holds no such FP8 bytes for (every slot of the outliers layout — requantized with
one scale per vector from the dequantized values, so an attention-sink token's massive
channels starve the rest of its vector again, as speculators' own FP8 writer would —,
kept bf16 slots, a converted final state — a second rounding —, every slot of a bf16
dataset) are quantized by the export, with the one quantizer, from the values the bf16
export would write; the others are copied (:mod:`.fp8`).
"""

from __future__ import annotations

import collections
import importlib.util
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from safetensors.torch import save_file

from hsx_async.dataset import reader as dataset
from hsx_async.dataset.durable import fsync_dir, fsync_file
from hsx_async.dataset.export.format import TMP_PREFIX, ExportFormat, write_output
from hsx_async.dataset.export.fp8 import fp8_dtype_rule, requantized_slots
from hsx_async.dataset.export.plan import ExportPlan, FinalConversion
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.dataset.reader import SampleHeader
from hsx_async.errors import DatasetError
from hsx_async.protocol import FP8, PER_TOKEN_SLOT, PRE_NORM
from hsx_async.quantize import quantize

NAME = "speculators"
SPECULATORS_ROWS = "samples.jsonl"
TOKEN_FREQ = "token_freq.pt"


def speculators_relpath(index: int, group_size: int = 0) -> str:
    """``hidden_states/hs_{index}.safetensors``, as speculators' ``FileTransfer`` (no
    groups: ``group_size`` is ignored)."""
    return f"hidden_states/hs_{index}.safetensors"


def write_sample(sample_path: Path, entry: ManifestEntry, plan: ExportPlan, tmp: Path) -> None:
    header, stored = dataset.read_hidden(
        sample_path, (dataset.INPUT_IDS,), num_tokens=entry.num_tokens
    )
    meta = {
        "hsx_id": canonical_id(entry.id),
        "aux_layers": header.metadata.get("aux_layers", ""),
        "final_state": plan.conv.want,
        "dtype": plan.dtype,
    }
    tensors = {"token_ids": stored[dataset.INPUT_IDS].clone()}
    if plan.dtype == FP8:
        tensors |= _fp8_tensors(header, stored, plan.conv)
    else:
        tensors["hidden_states"] = _bf16_hidden(header, stored, plan.conv)
    save_file(tensors, str(tmp), metadata=meta)


def sample_tensors(
    sample_path: Path, entry: ManifestEntry, plan: ExportPlan
) -> dict[str, torch.Tensor]:
    """The sample as hs-connectors' ``FileTransfer`` hands it to speculators (bf16
    ``hidden_states`` [T, L, H], final state converted, and ``token_ids``), plus the
    ``loss_mask`` (int64) its dataset row holds."""
    header, stored = dataset.read_hidden(
        sample_path, (dataset.INPUT_IDS, dataset.LOSS_MASK), num_tokens=entry.num_tokens
    )
    mask = stored.get(dataset.LOSS_MASK)
    return {
        "hidden_states": _bf16_hidden(header, stored, plan.conv),
        "token_ids": stored[dataset.INPUT_IDS],
        "loss_mask": (
            torch.ones(entry.num_tokens, dtype=torch.int64)
            if mask is None
            else mask.to(torch.int64)
        ),
    }


def _bf16_hidden(
    header: SampleHeader, stored: dict[str, torch.Tensor], conv: FinalConversion
) -> torch.Tensor:
    """``[T, L, H]`` bf16: as stored (no copy) or dequantized, the final state converted."""
    hidden = dataset.hidden_bf16(header, stored)
    final = conv.apply(header.metadata, hidden[:, -1])
    if final.data_ptr() != hidden[:, -1].data_ptr():  # converted: a new tensor
        if not header.storage.is_fp8:  # hidden is the file's (private) mapping
            hidden = hidden.clone()
        hidden[:, -1] = final
    return hidden


def _fp8_tensors(
    header: SampleHeader, stored: dict[str, torch.Tensor], conv: FinalConversion
) -> dict[str, torch.Tensor]:
    """The sample as hs-connectors' ``FP8Transfer`` reads it: values ``[T, L, H]`` and
    scales ``[T, L, 1]``. The dataset's FP8 bytes unchanged where they hold what speculators
    reads; the slots with new values (:func:`requantized_slots`) quantized here by the one
    quantizer, from the values the bf16 export would write."""
    storage, layers = header.storage, header.num_layers
    redo = requantized_slots(storage, layers, conv)
    if not redo:
        return {
            "hidden_states": stored[dataset.HIDDEN_STATES],
            "hidden_states_scales": stored[dataset.HIDDEN_STATES_SCALES],
        }
    hidden = _bf16_hidden(header, stored, conv)  # [T, L, H]: what bf16 would write
    t, _, h = hidden.shape
    values = torch.empty((t, layers, h), dtype=torch.float8_e4m3fn)
    scales = torch.empty((t, layers, 1), dtype=torch.float32)
    if storage.is_fp8 and storage.scales == PER_TOKEN_SLOT:
        slots = list(storage.quantized)
        values[:, slots] = stored[dataset.HIDDEN_STATES]
        scales[:, slots] = stored[dataset.HIDDEN_STATES_SCALES]
    for slot in redo:
        values[:, slot], scales[:, slot, 0] = quantize(hidden[:, slot])
    return {"hidden_states": values, "hidden_states_scales": scales}


def finish(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: Mapping[str, int]
) -> None:
    """The columns speculators reads beside the files: rows, token frequencies, and the
    ``datasets`` directory built from the rows."""
    write_speculators_rows(out_dir, dest, entries, indices)
    write_hf_dataset(dest)


def write_speculators_rows(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: Mapping[str, int]
) -> None:
    """``samples.jsonl`` (row ``i`` = input_ids, loss_mask, seq_len of ``hs_i``) and
    ``token_freq.pt`` (counts of the tokens under ``loss_mask == 1``), in one pass."""
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

    write_output(dest / SPECULATORS_ROWS, rows)
    freq = dict(counts)

    def save_freq(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            torch.save(freq, fh)

    write_output(dest / TOKEN_FREQ, save_freq)


_NEEDS_DATASETS = (
    "--format speculators writes a Hugging Face datasets directory, and the datasets package "
    "is not installed: pip install -e '.[speculators]' in the hsx clone (the speculators extra)"
)


def require_datasets() -> None:
    """Refuse the export before its first file when ``datasets`` cannot be imported (found
    without importing it: that import takes seconds)."""
    try:
        missing = importlib.util.find_spec("datasets") is None
    except ValueError:  # sys.modules holds None for it: importing it would fail
        missing = True
    if missing:
        raise DatasetError(_NEEDS_DATASETS)


def write_hf_dataset(dest: Path) -> None:
    """The Hugging Face ``datasets`` directory speculators loads with ``load_from_disk``:
    built from ``samples.jsonl`` (streamed by Arrow, not held in memory) in a temporary
    directory, then its files moved into ``dest`` (fsynced, renamed, directory synced)."""
    try:
        import datasets  # noqa: PLC0415 - an optional, slow import
    except ImportError:
        raise DatasetError(_NEEDS_DATASETS) from None
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


def draft_keys(aux_layers: Sequence[int]) -> dict[str, Any]:
    # speculators' --target-layer-ids (and vLLM's ids) count like hsx: hidden_states[k].
    return {"speculators_target_layer_ids": list(aux_layers)}


_HINT = """\
speculators: train with --data-path {dest} (the datasets directory, hidden_states/ and
token_freq.pt, so --draft-vocab-size takes effect), --verifier-name-or-path the target model
and --target-layer-ids {aux} (speculators and vLLM count layers as hsx does){backend}"""
_FP8_BACKEND = """,
and --hidden-states-backend fp8 (the files are FP8 with per-token, per-layer scales)"""


def hint(dest: Path, dtype: str, draft: Mapping[str, Any]) -> str:
    aux = ",".join(map(str, draft["hsx"]["speculators_target_layer_ids"]))
    backend = _FP8_BACKEND if dtype == FP8 else ""
    return _HINT.format(dest=dest, aux=aux, backend=backend)


FORMAT = ExportFormat(
    name=NAME,
    final_state=PRE_NORM,
    relpath=speculators_relpath,
    write=write_sample,
    tensors=sample_tensors,
    dtype_rule=fp8_dtype_rule,
    hint=hint,
    finish=finish,
    draft_keys=draft_keys,
    check_ready=require_datasets,
)
