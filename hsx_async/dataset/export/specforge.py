"""``--format specforge``: sgl-project/SpecForge's offline hidden-states directory.

Matched against SpecForge's own code (commit a6b6b02; read, not copied):
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

SpecForge takes the final state as the LM head's input (post-norm) and applies only the
head. Its 0.2.0 loader has no FP8: an FP8 dataset is dequantized per sample and written as
bfloat16. Its EAGLE-3 drafter needs exactly 3 aux layers (``llama3_eagle.py``), so an
export of any other number is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hsx_async.dataset import reader as dataset
from hsx_async.dataset.export.draft import DRAFT_CONFIG
from hsx_async.dataset.export.format import ExportFormat
from hsx_async.dataset.export.plan import AUTO, DatasetFacts, ExportPlan, FinalConversion
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, POST_NORM

NAME = "specforge"
GROUP_SIZE = 2000  # SpecForge's --file-group-size default
AUX_LAYERS = 3


def specforge_relpath(index: int, group_size: int = GROUP_SIZE) -> str:
    """``rows_{g}-{g+group}/data_{index}.ckpt``, as SpecForge's ``_get_file_path``."""
    group = index // group_size * group_size
    return f"rows_{group}-{group + group_size}/data_{index}.ckpt"


def sample_tensors(
    sample_path: Path, entry: ManifestEntry, plan: ExportPlan
) -> dict[str, torch.Tensor]:
    """The sample as SpecForge's ``OfflineCaptureLayout`` holds it (what is saved)."""
    header, stored = dataset.read_hidden(
        sample_path, (dataset.INPUT_IDS, dataset.LOSS_MASK), num_tokens=entry.num_tokens
    )
    # bf16 [T, L, H]: the mapping itself, or an FP8 sample dequantized (SpecForge has no FP8).
    final, aux = dataset.split_layers(dataset.hidden_bf16(header, stored))
    final = plan.conv.apply(header.metadata, final)
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


def write_sample(sample_path: Path, entry: ManifestEntry, plan: ExportPlan, tmp: Path) -> None:
    record = sample_tensors(sample_path, entry, plan)
    with tmp.open("wb") as fh:
        torch.save(record, fh)


def dtype_rule(asked: str, facts: DatasetFacts, conv: FinalConversion) -> tuple[str, str]:
    if asked in (BF16, AUTO):
        return BF16, ""
    raise DatasetError(
        "--format specforge writes bfloat16 (SpecForge 0.2.0's loader reads no FP8); "
        "drop --dtype or pass --dtype bfloat16"
    )


def check_aux(facts: DatasetFacts) -> None:
    """SpecForge's EAGLE-3 drafter takes exactly 3 aux layers; refuse before writing."""
    if facts.aux_layers is None:
        return
    if len(facts.aux_layers) != AUX_LAYERS:
        raise DatasetError(
            f"SpecForge 0.2.0 trains EAGLE-3 on exactly {AUX_LAYERS} aux layers, "
            f"the dataset has {len(facts.aux_layers)} ({list(facts.aux_layers)}): extract "
            "again with 3 [model].aux_layers, or use --format speculators"
        )


_HINT = """\
specforge: train offline on {dest} (its hidden-states directory) and copy the eagle_config
block of {snippet} into the drafter's config.json"""


def hint(dest: Path, dtype: str, draft: Mapping[str, Any]) -> str:
    return _HINT.format(dest=dest, snippet=dest / DRAFT_CONFIG)


FORMAT = ExportFormat(
    name=NAME,
    final_state=POST_NORM,
    relpath=specforge_relpath,
    write=write_sample,
    tensors=sample_tensors,
    dtype_rule=dtype_rule,
    hint=hint,
    check_aux=check_aux,
)
