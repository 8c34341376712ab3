"""What an export decides before it writes anything, the same for every format: the facts
of the dataset (aux layers, hidden size, final-state kind, storage), the target model, and
how each sample's final state is turned into the kind the trainer reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hsx_async.dataset import reader as dataset
from hsx_async.dataset.manifest import ManifestEntry
from hsx_async.dataset.provenance import dataset_final_state, dataset_storage, read_provenance
from hsx_async.dataset.target import (
    TargetModel,
    convert_final,
    final_norm_weight,
    norm_gain,
    read_target,
)
from hsx_async.errors import DatasetError, DumpError
from hsx_async.protocol import BF16, BF16_STORAGE, FP8, POST_NORM, Storage, parse_final_state

if TYPE_CHECKING:
    from collections.abc import Sequence

AUTO = "auto"
DTYPE_CHOICES = (AUTO, BF16, FP8)  # --dtype


@dataclass(frozen=True)
class DatasetFacts:
    """What the export must know of the dataset before writing anything."""

    aux_layers: tuple[int, ...] | None
    hidden_size: int | None
    final_state: str  # the kind the samples hold (post-norm for version-1 datasets)
    provenance: dict[str, Any] | None
    storage: Storage = BF16_STORAGE

    @property
    def layers(self) -> int:
        """Layer slots per token (aux layers and the final state); 0 for an empty dataset."""
        return len(self.aux_layers) + 1 if self.aux_layers is not None else 0


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


@dataclass(frozen=True)
class ExportPlan:
    """What every sample of one export is written with."""

    conv: FinalConversion
    dtype: str  # the hidden-state dtype written (bfloat16 or float8_e4m3fn)
    group_size: int  # files per directory, for a format that groups them


def dataset_facts(out_dir: Path, entries: Sequence[ManifestEntry]) -> DatasetFacts:
    """Aux layers, hidden size and final-state kind, from provenance.json or else the first
    sample's header (a dataset merged from parts may have no provenance)."""
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
    fmt: str, want: str, facts: DatasetFacts, target: TargetModel | None, model_given: bool
) -> FinalConversion:
    """The conversion format ``fmt``, whose trainer reads the ``want`` final state, needs;
    refuses when the norm is not known.

    Only an explicit ``--model`` is trusted with the norm: the directory provenance names
    may have changed since the run."""
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


def check_dtype_choice(asked: str) -> None:
    if asked not in DTYPE_CHOICES:
        raise DatasetError(f"--dtype is {asked!r}, expected one of {', '.join(DTYPE_CHOICES)}")
