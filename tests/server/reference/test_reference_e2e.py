"""The dataset hsx writes through the reference server equals a direct forward pass of the
same model: same layers, same rows, same order — with prompts chunked and batched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import torch
from safetensors.torch import load_file

from hsx_async.dataset.inspection import verify_dataset
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest
from hsx_async.demo import demo_samples, run_demo
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.reference.model import bf16_mismatch
from hsx_async.server.reference.server import (
    ReferenceOptions,
    reference_hidden_states,
    running_reference_server,
)
from tests.e2e import make_config


async def test_pipeline_dataset_equals_direct_forward(tmp_path: Path, shm_root: Path) -> None:
    lines = demo_samples().read_bytes().splitlines()[:16]
    samples = tmp_path / "in.jsonl"
    samples.write_bytes(b"\n".join(lines) + b"\n")
    by_id = {str(o["id"]): o for o in map(orjson.loads, lines)}
    options = ReferenceOptions(dump_root=shm_root, chunk_size=64, max_batch_tokens=256)
    async with running_reference_server(options) as srv:
        config = make_config(tmp_path, samples, [srv.url], shm_root, hidden_size=srv.hidden_size,
                             aux_layers=srv.aux_layers, workers={"concurrency": 6},
                             server={"request_timeout": 60.0}, dump={"timeout": 30.0})  # fmt: skip
        summary = await Daemon(config).run()
        assert srv.stats.batched_passes > 0, "requests should have shared forward passes"
        model = srv.model
        aux = srv.aux_layers
    assert summary.done == len(lines)
    chunked = 0
    for entry in read_manifest(config.output.dir):
        tensors = load_file(config.output.dir / entry.path)
        ids = by_id[canonical_id(entry.id)]["input_ids"]
        chunked += len(ids) > 64
        np.testing.assert_array_equal(tensors["input_ids"].numpy(), np.array(ids))
        truth = reference_hidden_states(model, ids, aux)
        got = tensors["hidden_states"]
        assert got.dtype == torch.bfloat16 and got.shape == truth.shape
        problem = bf16_mismatch(got, truth)
        assert problem is None, f"{entry.id}: {problem}"
    assert chunked >= 3, "some prompts must have been chunked"


async def test_demo_writes_a_verified_dataset(tmp_path: Path) -> None:
    summary, config = await run_demo(tmp_path / "demo", demo_samples())
    assert summary.done == len(demo_samples().read_bytes().splitlines())
    assert verify_dataset(config.output.dir).ok
