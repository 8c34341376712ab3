"""The admission's probe rows on real vLLM (issue 38): one server's probe, alone and in
other batches, stays within :data:`~hsx_async.run.servers.fingerprint.TOLERANCE` of itself, in
bfloat16 and FP8 storage. The distances are printed (``-s``): the measured batch-to-batch
tolerance the note reports."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

import pytest

from hsx_async.protocol import BF16_STORAGE, FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage
from hsx_async.run.servers.fingerprint import TOLERANCE
from hsx_async.server.reference.model import TINY_AUX_LAYERS, TINY_HIDDEN
from tests.e2e import free_port
from tests.probe_rows import Spread, probe_spread
from tests.real_vllm.conftest import CHUNK, LAUNCH, serving, vllm_python

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

FP8_STORAGE = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)
STORAGES = {"bf16": BF16_STORAGE, "fp8": FP8_STORAGE}


def _spread(url: str, root: Path, storage: Storage) -> Spread:
    spread = probe_spread(url, "vllm", root, hidden_size=TINY_HIDDEN,
                          aux_layers=tuple(TINY_AUX_LAYERS), storage=storage)  # fmt: skip
    return asyncio.run(spread)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_probe_rows_stay_within_the_tolerance(tmp_path: Path, tiny_model: Path, dtype: str) -> None:
    python = vllm_python()
    root = Path("/dev/shm") / f"hsx-vllm-tol-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    port = free_port()
    env = {
        **os.environ,
        "HSX_PYTHON": str(python),
        "HSX_PORT": str(port),
        "HSX_DUMP_ROOT": str(root),
        "HSX_AUX_LAYERS": ",".join(map(str, TINY_AUX_LAYERS)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    args = ["bash", str(LAUNCH), str(tiny_model), "--max-model-len", "512",
            "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8",
            "--dtype", dtype]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with serving(args, env, url, tmp_path / "server.log"):
            spreads = {name: _spread(url, root, storage) for name, storage in STORAGES.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, spread in spreads.items():
        print(f"vllm {dtype} {name}: alone {spread.alone} batched {spread.batched}")
        assert spread.worst <= TOLERANCE, (name, spread.alone, spread.batched)
