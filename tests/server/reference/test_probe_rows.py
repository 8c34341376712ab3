"""The admission's probe rows on the reference server (issue 38): a torch model batching
requests as an engine does. One probe, alone and in other batches, stays within
:data:`~hsx_async.run.servers.fingerprint.TOLERANCE` of itself (printed with ``-s``: the measured
batch-to-batch spread the note reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx_async.protocol import BF16_STORAGE, FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage
from hsx_async.run.servers.fingerprint import TOLERANCE
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server
from tests.probe_rows import probe_spread


@pytest.mark.parametrize(
    "storage", [BF16_STORAGE, Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)],
    ids=["bf16", "fp8"],
)  # fmt: skip
async def test_probe_rows_stay_within_the_tolerance(shm_root: Path, storage: Storage) -> None:
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        spread = await probe_spread(
            server.url, "sglang", shm_root, hidden_size=server.hidden_size,
            aux_layers=server.aux_layers, storage=storage,
        )  # fmt: skip
    print(f"reference {storage.dtype}: alone {spread.alone} batched {spread.batched}")
    assert spread.worst <= TOLERANCE
