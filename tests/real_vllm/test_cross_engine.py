"""The same samples through SGLang and through vLLM: two datasets that agree with each
other. The real-SGLang tier (run earlier in the same session) leaves its TP=1 dataset and
samples in ``engine_datasets``; this runs those samples through vLLM and compares, file by
file: the aux layers directly, the final state through the model's own final norm (SGLang
stores its output, vLLM its input; each file says which)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.server.reference.model import TINY_AUX_LAYERS, TINY_HIDDEN, load_model
from tests.e2e import config_raw, write_config
from tests.real_vllm.conftest import VllmServer

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

# Both engines compute in float32 here and round to bf16 once; each is within bf16 rounding
# of the Hugging Face forward, so they are within two of each other: 4 bf16 ulps relative,
# an absolute floor for values near 0, and the rows' cosine as a second, scale-free check.
CROSS_RTOL = 4 * 2.0**-7
CROSS_ATOL = 1e-4
MIN_ROW_COSINE = 0.9999


def _tensors(path: Path) -> tuple[dict[str, str], torch.Tensor, list[int]]:
    with safe_open(path, "pt") as f:
        return f.metadata(), f.get_tensor("hidden_states"), f.get_tensor("input_ids").tolist()


def _dataset(out: Path) -> dict[str, Path]:
    return {canonical_id(e.id): out / e.path for e in read_manifest(out)}


def _rms_norm(x: torch.Tensor, model: Any) -> torch.Tensor:
    """The model's own final norm (weight and epsilon from the checkpoint)."""
    norm = model.model.norm
    x32 = x.float()
    eps = float(getattr(norm, "variance_epsilon", model.config.rms_norm_eps))
    weight: torch.Tensor = norm.weight.detach().float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.float(), b.float()
    bad = ~torch.isclose(a, b, rtol=CROSS_RTOL, atol=CROSS_ATOL)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} values differ"
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) >= MIN_ROW_COSINE, f"{what}: worst row cosine {float(cos.min())}"


def test_sglang_and_vllm_datasets_agree(
    vllm_server: VllmServer,
    tmp_path: Path,
    engine_datasets: dict[str, tuple[Path, dict[str, list[int]]]],
) -> None:
    if "sglang" not in engine_datasets:
        message = (
            "no SGLang dataset in this session: run tests/real_sglang and tests/real_vllm together"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    sglang_out, samples = engine_datasets["sglang"]
    lines = [json.dumps({"id": sid, "input_ids": ids}) for sid, ids in samples.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    raw = config_raw(tmp_path, tmp_path / "in.jsonl", [vllm_server.url], vllm_server.dump_root,
                     hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS,
                     server={"engine": "vllm", "request_timeout": 120.0},
                     dump={"timeout": 60.0}, workers={"concurrency": 4})  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "hsx_async",
        "run",
        "--no-report",
        "--config",
        str(write_config(tmp_path, raw)),
    ]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_out = tmp_path / "out"
    assert read_quarantine(vllm_out) == []
    from_sglang, from_vllm = _dataset(sglang_out), _dataset(vllm_out)
    assert sorted(from_sglang) == sorted(from_vllm) == sorted(samples)
    model = load_model(str(vllm_server.model_dir))
    for sid in sorted(samples):
        meta_s, hidden_s, ids_s = _tensors(from_sglang[sid])
        meta_v, hidden_v, ids_v = _tensors(from_vllm[sid])
        assert ids_s == ids_v == samples[sid]
        assert (meta_s["final_state"], meta_v["final_state"]) == ("post_norm", "pre_norm")
        assert hidden_s.shape == hidden_v.shape
        _close(hidden_s[:, :-1], hidden_v[:, :-1], f"{sid}: aux layers")
        _close(hidden_s[:, -1], _rms_norm(hidden_v[:, -1], model), f"{sid}: final state")
        # The trap the recorded kind guards against: vLLM's slot is not SGLang's.
        cos = torch.nn.functional.cosine_similarity(
            hidden_s[:, -1].float(), hidden_v[:, -1].float(), dim=-1
        )
        assert float(cos.min()) < 0.95
