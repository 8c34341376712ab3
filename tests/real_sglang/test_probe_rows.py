"""The admission's probe rows on real SGLang (issue 38): one server's probe, alone and in
other batches, stays within :data:`~hsx_async.run.servers.fingerprint.TOLERANCE` of itself, in
bfloat16 and FP8 storage; a server of other weights is far beyond it. The distances are
printed (``-s``): they are the measured batch-to-batch tolerance the note reports."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hsx_async.protocol import BF16_STORAGE, FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage
from hsx_async.run.servers.fingerprint import TOLERANCE
from hsx_async.server.reference.model import TINY_HIDDEN, save_default_model
from tests.probe_rows import Spread, probe_spread
from tests.real_sglang.conftest import (
    launch_command,
    launch_env,
    new_dump_root,
    running,
    server_port,
    wait_ready,
)

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(900)]

AUX = (1, 3, 5)
FP8_STORAGE = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)
STORAGES = {"bf16": BF16_STORAGE, "fp8": FP8_STORAGE}


def _spread(url: str, root: Path, storage: Storage) -> Spread:
    spread = probe_spread(url, "sglang", root, hidden_size=TINY_HIDDEN, aux_layers=AUX,
                          storage=storage)  # fmt: skip
    return asyncio.run(spread)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_probe_rows_stay_within_the_tolerance_and_other_weights_do_not(
    tmp_path: Path, sglang_py: Path, model_dir: Path, dtype: str
) -> None:
    env = launch_env(sglang_py, new_dump_root(), server_port(),
                     HSX_CHUNKED_PREFILL_SIZE="16")  # fmt: skip
    with running(launch_command(model_dir, "--dtype", dtype), env, tmp_path / "a.log") as server:
        wait_ready(server)
        assert server.get("/get_server_info")["dtype"] == dtype  # the flag given last wins
        spreads = {name: _spread(server.url, server.dump_root, storage)
                   for name, storage in STORAGES.items()}  # fmt: skip
    for name, spread in spreads.items():
        print(f"sglang {dtype} {name}: alone {spread.alone} batched {spread.batched}")
        assert spread.worst <= TOLERANCE, (name, spread.alone, spread.batched)
    if dtype != "float32":
        return
    other_dir = save_default_model(tmp_path / "other-llama", seed=1)
    env = launch_env(sglang_py, new_dump_root(), server_port())
    with running(launch_command(other_dir), env, tmp_path / "b.log") as other:
        wait_ready(other)
        far = _spread(other.url, other.dump_root, BF16_STORAGE)
    distance = spreads["bf16"].rows.distance(far.rows)
    print(f"sglang other weights (seed 1 vs 0): {distance}")
    assert distance is not None and distance > 10 * TOLERANCE
