"""Small synthetic hsx datasets, written byte for byte as the pipeline writes them.

Per sample: the header from :func:`hsx_async.dataset.layout.build_layout`, then ``input_ids``
(little-endian int64), the hidden sections of the storage (bf16 ``hidden_states [T, L, H]``;
or, with ``storage=`` FP8, the bytes of :func:`hsx_async.quantize.encode_rows`: e4m3fn
values, float32 scales, kept bf16 slots, as the writer stores them), ``loss_mask`` (uint8),
at ``out/data_relpath(sample_key(id))``; then a :class:`ManifestEntry` line with the XXH3-64
of the file appended to ``manifest.jsonl`` (or to the shard's manifest). An FP8 dataset also
gets the ``provenance.json`` fields that name its storage.

Hidden values look like a model's: aux layers are residual streams whose row norms grow
with depth, the final layer is post-norm (rows of norm ~ sqrt(H)). Tests plant faults with
the ``mutate`` hook and the ``plant_*`` helpers.

:func:`pipeline_dataset` instead runs the real pipeline (daemon + in-process fake server)
and knows what every sample must hold.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
import xxhash

from hsx_async.dataset.layout import SampleId, build_layout, data_relpath, sample_key
from hsx_async.dataset.manifest import MANIFEST, ManifestEntry, log_name
from hsx_async.dataset.provenance import PROVENANCE
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    PER_TOKEN_SLOT,
    POST_NORM,
    PROTOCOL_VERSION,
    Storage,
)
from hsx_async.quantize import encode_rows
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, expected_hidden_states, running_fake_server
from tests.e2e import SampleSet, make_config, write_samples

AUX_LAYERS = (2, 30, 58)
Mutate = Callable[[int, torch.Tensor], None]  # (sample index, hidden [T, L, H] bf16) in place
# (sample index, the encoded hidden sections) in place: faults only a file can hold (FP8
# values or scales the quantizer never makes).
MutateSections = Callable[[int, list[torch.Tensor]], None]


@dataclass(frozen=True, slots=True)
class WrittenSample:
    """A sample as written, to compare what readers return against."""

    id: SampleId
    path: Path
    entry: ManifestEntry
    input_ids: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, L, H] bf16: the stored values (FP8: before quantizing)
    loss_mask: torch.Tensor | None  # [T] uint8, None when the sample has none
    aux_layers: tuple[int, ...]
    storage: Storage = BF16_STORAGE
    sections: tuple[torch.Tensor, ...] = ()  # the stored hidden sections, in file order


def fp8_storage(num_layers: int, quantize: str = "all", scales: str = PER_TOKEN_SLOT) -> Storage:
    """The FP8 storage ``[output].quantize`` names: every slot, or the aux ones only, in the
    layout ``scales`` names (PROTOCOL §3)."""
    slots = range(num_layers) if quantize == "all" else range(num_layers - 1)
    return Storage(FP8, tuple(slots), scales)


def section_bytes(tensor: torch.Tensor) -> bytes:
    """A section's bytes as a file holds them (little-endian, C order)."""
    return bytes(tensor.contiguous().view(torch.uint8).numpy())


def synthetic_hidden(
    num_tokens: int, hidden_size: int, num_layers: int, *, seed: int
) -> torch.Tensor:
    """``[T, L, H]`` bf16: aux layer ``i`` has row norms ~ 4·(i+1)·sqrt(H), final ~ sqrt(H)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((num_tokens, num_layers, hidden_size), dtype=np.float32)
    scales = np.array([4.0 * (i + 1) for i in range(num_layers - 1)] + [1.0], dtype=np.float32)
    values *= scales[None, :, None]
    return torch.from_numpy(values).to(torch.bfloat16)


def synthetic_ids(num_tokens: int, *, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed + 1_000_003)
    return torch.from_numpy(rng.integers(0, 128_000, num_tokens, dtype=np.int64))


def plant_nan(hidden: torch.Tensor, token: int, layer: int, *, value: float = float("nan")) -> None:
    hidden[token, layer, hidden.shape[2] // 2] = value


def plant_zero_row(hidden: torch.Tensor, token: int, layer: int) -> None:
    hidden[token, layer, :] = 0


def plant_duplicate_layer(hidden: torch.Tensor, source: int, target: int) -> None:
    """What a wrong layer id looks like: two layers with identical rows."""
    hidden[:, target, :] = hidden[:, source, :]


def write_sample(
    out_dir: Path,
    sample_id: SampleId,
    *,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    loss_mask: torch.Tensor | None,
    aux_layers: Sequence[int] = AUX_LAYERS,
    manifest: str = f"{MANIFEST}.jsonl",
    sparse_hidden: bool = False,
    storage: Storage = BF16_STORAGE,
    final_state: str = POST_NORM,
    mutate_sections: Callable[[list[torch.Tensor]], None] | None = None,
) -> WrittenSample:
    """Write one sample file and append its manifest line.

    ``sparse_hidden`` leaves ``hidden_states`` a hole (zeros, no data blocks): on tmpfs a
    reader that touches those pages allocates them, which ``SEEK_DATA`` then shows.
    """
    t, _, size = hidden.shape
    layout = build_layout(
        sample_id=sample_id,
        num_tokens=t,
        hidden_size=size,
        aux_layers=aux_layers,
        has_loss_mask=loss_mask is not None,
        storage=storage,
        final_state=final_state,
    )
    relpath = data_relpath(sample_key(sample_id))
    path = out_dir / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    ids_bytes = input_ids.to(torch.int64).numpy().astype("<i8").tobytes()
    encoded = encode_rows(hidden, storage)
    if mutate_sections is not None:
        mutate_sections(encoded)
    sections = tuple(encoded)
    hidden_bytes = b"".join(section_bytes(x) for x in sections)
    mask_bytes = b"" if loss_mask is None else loss_mask.to(torch.uint8).numpy().tobytes()
    hasher = xxhash.xxh3_64()
    for chunk in (layout.header, ids_bytes, hidden_bytes, mask_bytes):
        hasher.update(chunk)
    with path.open("wb") as fh:
        fh.write(layout.header + ids_bytes)
        if sparse_hidden:
            fh.seek(len(hidden_bytes), os.SEEK_CUR)
        else:
            fh.write(hidden_bytes)
        fh.write(mask_bytes)
        fh.truncate(layout.total_bytes)
    if sparse_hidden and any(hidden_bytes):
        raise ValueError("sparse_hidden needs an all-zero hidden tensor")
    entry = ManifestEntry(
        id=sample_id,
        path=relpath,
        num_tokens=t,
        size=layout.total_bytes,
        xxh3_64=hasher.hexdigest(),
    )
    with (out_dir / manifest).open("ab") as fh:
        fh.write(entry.to_line())
    return WrittenSample(
        id=sample_id,
        path=path,
        entry=entry,
        input_ids=input_ids,
        hidden=hidden,
        loss_mask=loss_mask,
        aux_layers=tuple(aux_layers),
        storage=storage,
        sections=sections,
    )


def write_storage_provenance(
    out_dir: Path,
    storage: Storage,
    *,
    hidden_size: int,
    aux_layers: Sequence[int],
    final_state: str = POST_NORM,
) -> None:
    """The ``provenance.json`` fields that say how the dataset stores hidden states."""
    record: dict[str, object] = {
        "protocol": PROTOCOL_VERSION,
        "hidden_size": hidden_size,
        "aux_layers": list(aux_layers),
        "dtype": storage.dtype,
        "quantized": list(storage.quantized),
        "final_state": final_state,
    }
    if storage.is_fp8:
        record["scales"] = storage.scales
    (out_dir / PROVENANCE).write_bytes(orjson.dumps(record))


def write_dataset(
    out_dir: Path,
    *,
    num_samples: int = 6,
    hidden_size: int = 64,
    aux_layers: Sequence[int] = AUX_LAYERS,
    lengths: Sequence[int] | None = None,
    ids: Sequence[SampleId] | None = None,
    loss_mask: str = "alternate",
    shards: int = 1,
    seed: int = 0,
    mutate: Mutate | None = None,
    storage: Storage = BF16_STORAGE,
    final_state: str = POST_NORM,
    mutate_sections: MutateSections | None = None,
) -> list[WrittenSample]:
    """Write ``num_samples`` samples; ``loss_mask`` is ``"all"``, ``"none"`` or
    ``"alternate"`` (every other sample has one). With ``shards > 1`` sample ``i`` goes to
    shard ``i % shards``'s manifest, as a sharded run writes them. An FP8 ``storage`` (see
    :func:`fp8_storage`) quantizes each sample and records the storage in provenance.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if storage.is_fp8:
        write_storage_provenance(
            out_dir, storage, hidden_size=hidden_size, aux_layers=aux_layers,
            final_state=final_state,
        )  # fmt: skip
    lengths = list(lengths) if lengths is not None else [5 + 7 * i for i in range(num_samples)]
    ids = list(ids) if ids is not None else [f"s{i:04d}" for i in range(num_samples)]
    if len(lengths) != num_samples or len(ids) != num_samples:
        raise ValueError("lengths and ids must have num_samples items")
    written = []
    for i, (sample_id, t) in enumerate(zip(ids, lengths, strict=True)):
        hidden = synthetic_hidden(t, hidden_size, len(aux_layers) + 1, seed=seed + i)
        if mutate is not None:
            mutate(i, hidden)
        has_mask = loss_mask == "all" or (loss_mask == "alternate" and i % 2 == 0)
        mask = (torch.arange(t) % 3 != 0).to(torch.uint8) if has_mask else None
        written.append(
            write_sample(
                out_dir,
                sample_id,
                input_ids=synthetic_ids(t, seed=seed + i),
                hidden=hidden,
                loss_mask=mask,
                aux_layers=aux_layers,
                manifest=log_name(MANIFEST, i % shards, shards),
                storage=storage,
                final_state=final_state,
                mutate_sections=(
                    None if mutate_sections is None else functools.partial(mutate_sections, i)
                ),
            )
        )
    return written


@dataclass(frozen=True, slots=True)
class PipelineDataset:
    """A dataset written by the real pipeline (daemon + fake server), with its inputs."""

    out_dir: Path
    samples: SampleSet
    hidden_size: int
    aux_layers: tuple[int, ...]

    def expected(
        self, sample_id: SampleId
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``input_ids`` int64, ``hidden`` bf16 [T, L, H] and ``loss_mask`` uint8 (or None)
        that the fake server and the writer must have produced for ``sample_id``."""
        obj = self.samples.good[str(sample_id)]
        ids = torch.tensor(obj["input_ids"], dtype=torch.int64)
        bits = expected_hidden_states(ids.numpy(), self.hidden_size, len(self.aux_layers) + 1)
        hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        mask = obj.get("loss_mask")
        return ids, hidden, None if mask is None else torch.tensor(mask, dtype=torch.uint8)


async def pipeline_dataset(
    tmp_path: Path,
    shm_root: Path,
    *,
    num_samples: int = 10,
    hidden_size: int = 64,
    aux_layers: tuple[int, ...] = (1, 3, 5),
    max_len: int = 40,
    seed: int = 0,
) -> PipelineDataset:
    """Run the daemon against the in-process fake server (random chunking) to the end."""
    samples = write_samples(tmp_path / "in.jsonl", num_samples, max_len=max_len, seed=seed)
    options = FakeOptions(
        hidden_size=hidden_size, aux_layers=aux_layers, dump_root=shm_root, random_chunks=True
    )
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, hidden_size=hidden_size,
            aux_layers=aux_layers,
        )  # fmt: skip
        summary = await Daemon(config).run()
    if summary.done != num_samples:
        raise RuntimeError(f"the pipeline wrote {summary.done} of {num_samples} samples")
    return PipelineDataset(config.output.dir, samples, hidden_size, aux_layers)
