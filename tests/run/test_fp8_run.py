"""End to end, in process: ``hsx run`` with ``[output].dtype = "float8_e4m3fn"`` against the
fake server, which quantizes where it produces the rows (PROTOCOL §2–4, versions 3, 4).

The same samples are run three times (bfloat16, FP8 of every slot, FP8 of the aux slots),
in each FP8 layout:
the FP8 files are exactly the fake server's bfloat16 rows through ``encode_rows``, were
quantized by the server (its counters; the client's fallback is never needed), and take the
bytes the storage predicts, measured from the files themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hsx_async.config import Config
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest
from hsx_async.dataset.provenance import dataset_storage, read_provenance
from hsx_async.protocol import (
    BF16,
    FP8,
    HIDDEN,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
    SCALES,
    UNQUANTIZED,
    Storage,
)
from hsx_async.quantize import assemble, encode_rows
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, expected_hidden_states, running_fake_server
from tests.e2e import SampleSet, check_dataset, make_config, shm_leftovers, write_samples

# A hidden size where the rows, not the file's header and 4 KiB alignment, dominate.
H, AUX = 1024, (1, 3, 5)
L = len(AUX) + 1
ID_BYTES = 8  # input_ids: int64 per token


async def run_once(
    tmp: Path,
    shm_root: Path,
    samples: SampleSet,
    name: str,
    output: dict[str, Any],
    *,
    honour_storage: bool = True,
) -> tuple[Config, tuple[int, int]]:
    """One run into ``tmp/name``; returns its config and the server's (FP8 requests,
    storage fallbacks). ``honour_storage=False``: a hook older than version 3."""
    base = tmp / name
    base.mkdir()
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root, chunk_size=64,
                          honour_storage=honour_storage)  # fmt: skip
    async with running_fake_server(options) as fake:
        config = make_config(base, samples.path, [fake.url], shm_root, hidden_size=H,
                             output=output)  # fmt: skip
        summary = await Daemon(config).run()
        counts = (fake.stats.fp8_requests, fake.stats.storage_fallbacks)
    assert (summary.done, summary.quarantined, summary.unfinished) == (len(samples.good), 0, 0)
    assert shm_leftovers(shm_root) == []
    return config, counts


def dataset_bytes(config: Config) -> int:
    return sum(entry.size for entry in read_manifest(config.output.dir))


def check_fp8_files(config: Config, samples: SampleSet, storage: Storage) -> None:
    """Every file names its storage and holds encode_rows of the fake server's rows."""
    assert dataset_storage(read_provenance(config.output.dir)) == storage
    sections = storage.sections(L, H)
    for entry in read_manifest(config.output.dir):
        ids = np.array(samples.good[canonical_id(entry.id)]["input_ids"], dtype=np.int64)
        want_bits = expected_hidden_states(ids, H, L)
        rows = torch.from_numpy(want_bits.view(np.int16)).view(torch.bfloat16)
        want = encode_rows(rows, storage)
        with safe_open(str(config.output.dir / entry.path), framework="pt") as f:
            meta = f.metadata()
            assert (meta["dtype"], meta["scales"]) == (FP8, storage.scales)
            assert meta["quantized"] == ",".join(map(str, storage.quantized))
            assert set(f.keys()) - {"input_ids", "loss_mask"} == {s.name for s in sections}
            got = {s.name: f.get_tensor(s.name) for s in sections}
        for section, tensor in zip(sections, want, strict=True):
            stored = got[section.name]
            assert tuple(stored.shape) == (len(ids), *section.row_shape), section.name
            assert stored.element_size() * stored[0].numel() == section.row_bytes
            assert torch.equal(stored.reshape(-1).view(torch.uint8),
                               tensor.reshape(-1).view(torch.uint8)), section.name  # fmt: skip
        assert got[HIDDEN].dtype == torch.float8_e4m3fn and got[SCALES].dtype == torch.float32
        # Dequantized: the fake rows within FP8's rounding (3 mantissa bits: < 2^-4 relative).
        back = assemble(got[HIDDEN], got[SCALES], got.get(UNQUANTIZED), storage, torch.float32,
                        outlier_index=got.get(OUTLIER_INDEX),
                        outlier_values=got.get(OUTLIER_VALUES))  # fmt: skip
        err = (back - rows.float()).norm(dim=-1) / rows.float().norm(dim=-1).clamp_min(1e-30)
        assert float(err.max()) < 0.08, entry.id
        if storage.kept(L):  # the kept slot is the very bytes
            assert torch.equal(back[:, -1], rows[:, -1].float())


SCALE_LAYOUTS = [PER_TOKEN_SLOT_OUTLIERS16, PER_TOKEN_SLOT]


@pytest.mark.parametrize("scales", SCALE_LAYOUTS)
@pytest.mark.parametrize("quantize", ["all", "aux"])
async def test_fp8_run_writes_the_servers_fp8_at_the_predicted_bytes(
    tmp_path: Path, shm_root: Path, quantize: str, scales: str
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 16, max_len=200, seed=19)
    bf16_config, bf16_counts = await run_once(tmp_path, shm_root, samples, "bf16", {"dtype": BF16})
    assert bf16_counts == (0, 0)
    check_dataset(bf16_config.output.dir, samples, hidden_size=H, num_layers=L)

    output = {"dtype": FP8, "quantize": quantize, "scales": scales}
    config, counts = await run_once(tmp_path, shm_root, samples, f"fp8-{quantize}", output)
    storage = config.storage
    assert storage.quantized == (tuple(range(L)) if quantize == "all" else tuple(range(L - 1)))
    assert storage.scales == scales
    # The server quantized every request (each was sent once: no faults, no retries),
    # and the probe that admitted it.
    assert counts == (len(samples.good) + 1, 0)
    check_fp8_files(config, samples, storage)

    # Bytes: measured from the files, against what the storage predicts per token.
    ratio = dataset_bytes(config) / dataset_bytes(bf16_config)
    per_token = (storage.row_bytes(L, H) + ID_BYTES) / (L * H * 2 + ID_BYTES)
    assert abs(ratio - per_token) < 0.01, (ratio, per_token)
    # The outliers layout adds 68 bytes per vector: 6.6 % of H here, 0.9 % at H 7168.
    if quantize == "all":
        assert ratio < 0.56, ratio
    else:
        assert 0.55 < ratio < 0.66, ratio  # the final slot's bf16 stays


@pytest.mark.parametrize("scales", SCALE_LAYOUTS)
async def test_a_server_that_dumps_bf16_gets_the_same_dataset_from_the_clients_writer(
    tmp_path: Path, shm_root: Path, scales: str
) -> None:
    """A hook older than version 3 ignores hsx_dtype and dumps bfloat16 (and so does a
    version-3 hook asked for the outliers layout, in hsx_storage, a key it does not know);
    the client's writer quantizes with the same quantizer, so the dataset is the one a
    quantizing hook makes: every file byte for byte (the manifests' hashes are equal)."""
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=200, seed=23)
    output = {"dtype": FP8, "quantize": "aux", "scales": scales}
    hook, counts = await run_once(tmp_path, shm_root, samples, "hook", output)
    assert counts == (len(samples.good) + 1, 0)  # and the admission's probe
    client, counts = await run_once(
        tmp_path, shm_root, samples, "client", output, honour_storage=False
    )
    assert counts == (0, 0)  # nothing quantized by the server
    check_fp8_files(client, samples, client.storage)
    assert {(e.id, e.xxh3_64) for e in read_manifest(client.output.dir)} == {
        (e.id, e.xxh3_64) for e in read_manifest(hook.output.dir)
    }
