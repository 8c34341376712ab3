"""Real SGLang 0.5.23 with the hsx hook, started by ``deploy/sglang/launch.sh`` and driven
by ``hsx run`` from a config file: the dataset equals a direct Hugging Face forward of the
same model (aux layer k == ``hidden_states[k]``, final == the output of ``model.norm``,
same rows and ids), with chunked prefill and several concurrent samples, overlap
scheduling on, under TP=1 and TP=2, while plain requests share the server and get their
normal answers with nothing dumped for them.

One server per configuration (module-scoped, parametrised by TP), started and killed once.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest
from hsx_async.dataset.provenance import dataset_storage, read_provenance
from hsx_async.prepare.template import ChatEncoder, load_tokenizer
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    HIDDEN,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    PER_TOKEN_SLOT_OUTLIERS16,
    SCALES,
    Storage,
    check_response,
    generate_body,
)
from hsx_async.quantize import assemble
from hsx_async.run.dumps.dump import wait_for_meta
from hsx_async.server.reference.model import TINY_HIDDEN, bf16_mismatch, reference_hidden_states
from tests.e2e import config_raw, write_config
from tests.real_sglang.conftest import (
    REPO,
    Server,
    launch_command,
    launch_env,
    new_dump_root,
    running,
    server_port,
    wait_ready,
)
from tests.real_sglang.traffic import (
    Plain,
    check_plain_answers,
    final_norm,
    generate_plain,
    greedy,
    hsx_command,
    run_hsx_beside_plain_traffic,
)
from tests.server.fp8 import check_fp8_dump, read_bf16_rows

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(600)]

AUX = (1, 3, 5)
CHUNK = 16  # --chunked-prefill-size: every prompt longer than this is split into parts
PLAIN_NEW_TOKENS = 6
HSX_TIMEOUT = 300.0


def sample_ids(seed: int) -> dict[str, list[int]]:
    """Prompts of the tiny vocabulary (ids 3..1023): one token, exactly one chunk, one row
    over, and lengths up to ~6 chunks."""
    rng = random.Random(seed)
    lengths = [1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] + [rng.randint(2, 90) for _ in range(6)]
    return {f"s{i}": [rng.randrange(3, 1024) for _ in range(n)] for i, n in enumerate(lengths)}


PLAIN_PROMPTS = [[5 + 7 * i + j for j in range(20 + 9 * i)] for i in range(3)]


@dataclass
class Run:
    tp: int
    server: Server
    out: Path
    samples: dict[str, list[int]]
    plain: list[Plain]
    hsx: subprocess.CompletedProcess[str]
    info: dict[str, Any]
    dump_root_after: list[str]
    regen: subprocess.CompletedProcess[str] | None = None  # hsx regenerate (TP=1 only)
    regen_out: Path | None = None
    fp8: Fp8Run | None = None  # the FP8 run and probe (TP=1 only)


@dataclass
class Fp8Run:
    """``hsx run`` of the same samples with FP8 storage of every slot, and two requests
    sent straight to the server (one bfloat16, one FP8, same prompt) whose dumps were
    copied out of /dev/shm before anything consumed them."""

    hsx: subprocess.CompletedProcess[str]
    out: Path
    probe_ids: list[int]
    probe_bf16: Path
    probe_fp8: Path


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sglang_py: Path,
    model_dir: Path,
    engine_datasets: dict[str, tuple[Path, dict[str, list[int]]]],
) -> Iterator[Run]:
    tp: int = request.param
    tmp = tmp_path_factory.mktemp(f"tp{tp}")
    extra = {"HSX_TP_SIZE": str(tp), "HSX_CHUNKED_PREFILL_SIZE": str(CHUNK)}
    if tp == 2:
        extra["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
    env = launch_env(sglang_py, new_dump_root(), server_port(), **extra)
    samples = sample_ids(seed=tp)
    lines = [orjson.dumps({"id": sid, "input_ids": ids}) for sid, ids in samples.items()]
    (tmp / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with running(launch_command(model_dir), env, tmp / "sglang.log") as server:
        wait_ready(server)
        raw = config_raw(
            tmp, tmp / "in.jsonl", [server.url], server.dump_root,
            hidden_size=TINY_HIDDEN, aux_layers=AUX,
            server={"request_timeout": 120.0, "health_interval": 0.5},
            dump={"timeout": 60.0}, workers={"concurrency": 6},
        )  # fmt: skip
        config = write_config(tmp, raw)
        plain = [Plain(ids) for ids in PLAIN_PROMPTS]
        for p in plain:
            p.alone = generate_plain(server, p.input_ids, PLAIN_NEW_TOKENS)
        hsx = run_hsx_beside_plain_traffic(server, config, plain, PLAIN_NEW_TOKENS, HSX_TIMEOUT)
        regen = run_regenerate(server, tmp, model_dir) if tp == 1 else None
        fp8 = run_fp8(server, tmp, raw) if tp == 1 else None
        info = server.get("/get_server_info")
        left = sorted(p.name for p in server.dump_root.iterdir())
    # The server is gone before the checks: its idle schedulers would take the CPU the
    # Hugging Face forwards need (SGLang binds its threads to the cores under TP=2).
    if tp == 1 and hsx.returncode == 0:
        engine_datasets["sglang"] = (tmp / "out", samples)  # tests/real_vllm compares
    yield Run(
        tp, server, tmp / "out", samples, plain, hsx, info, left, regen, tmp / "regen.jsonl", fp8
    )


def test_server_runs_the_configuration(run: Run, sglang_version: str) -> None:
    info = run.info
    assert info["version"] == sglang_version
    assert info["tp_size"] == run.tp
    assert info["chunked_prefill_size"] == CHUNK
    assert info["disable_overlap_schedule"] is False, "overlap scheduling must be on"
    assert info["disable_radix_cache"] is True
    assert info["dtype"] == "float32"
    log = run.server.log_text()
    assert log.count("hsx hook installed: aux layers [1, 3, 5]") == run.tp
    assert ("non-writing rank" in log) == (run.tp > 1)


def test_hsx_run_writes_every_sample(run: Run) -> None:
    assert run.hsx.returncode == 0, run.hsx.stdout[-3000:]
    entries = {canonical_id(e.id): e for e in read_manifest(run.out)}
    assert set(entries) == set(run.samples)
    assert "samples_retried" in run.hsx.stdout
    assert '"samples_retried":0' in run.hsx.stdout, "a dump was refused and retried"


def test_prompts_were_chunked_and_batched(run: Run) -> None:
    """SGLang's own per-pass log: full chunks of CHUNK rows, and passes that held several
    new requests (concurrent samples and plain requests together)."""
    passes = [
        (int(m[1]), int(m[2]))
        for m in re.finditer(
            r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)", run.server.log_text()
        )
    ]
    assert any(tokens == CHUNK for _, tokens in passes), passes[:20]
    assert max(seqs for seqs, _ in passes) >= 2, "no pass batched two requests"
    assert any(len(ids) > 3 * CHUNK for ids in run.samples.values())


def test_dataset_equals_a_direct_hugging_face_forward(run: Run, hf_model: Any) -> None:
    for entry in read_manifest(run.out):
        ids = run.samples[canonical_id(entry.id)]
        tensors = load_file(run.out / entry.path)
        np.testing.assert_array_equal(tensors["input_ids"].numpy(), np.array(ids))
        got = tensors["hidden_states"]
        truth = reference_hidden_states(hf_model, ids, AUX)
        assert got.dtype == torch.bfloat16 and got.shape == truth.shape == (len(ids), 4, 256)
        problem = bf16_mismatch(got, truth)
        assert problem is None, f"{entry.id} (TP={run.tp}): {problem}"


def test_final_slot_is_the_output_of_model_norm(run: Run, hf_model: Any) -> None:
    """The final slot is post-norm: not the residual entering the norm, and not normed
    twice (the model's norm gains are drawn from U(0.2, 3), so either mix-up shows)."""
    longest = max(run.samples, key=lambda s: len(run.samples[s]))
    ids = run.samples[longest]
    entry = next(e for e in read_manifest(run.out) if canonical_id(e.id) == longest)
    final = load_file(run.out / entry.path)["hidden_states"][:, -1]
    norm = final_norm(hf_model, ids)
    assert bf16_mismatch(final, norm.post.to(torch.bfloat16)) is None
    assert bf16_mismatch(final, norm.pre.to(torch.bfloat16)) is not None
    assert bf16_mismatch(final, norm.twice.to(torch.bfloat16)) is not None


REGEN_CONVERSATIONS = 3
REGEN_NEW_TOKENS = 4


def run_regenerate(server: Server, tmp: Path, model_dir: Path) -> Any:
    """``hsx regenerate`` of a few bundled conversations through this SGLang server."""
    lines = (REPO / "deploy" / "examples" / "tiny-conversations.jsonl").read_bytes().splitlines()
    (tmp / "conversations.jsonl").write_bytes(b"\n".join(lines[:REGEN_CONVERSATIONS]) + b"\n")
    raw = config_raw(
        tmp, tmp / "conversations.jsonl", [server.url], server.dump_root,
        hidden_size=TINY_HIDDEN, aux_layers=AUX,
        server={"request_timeout": 120.0}, output={"dir": str(tmp / "regen-unused")},
        regenerate={"tokenizer": str(model_dir), "max_new_tokens": REGEN_NEW_TOKENS},
    )  # fmt: skip
    config = write_config(tmp, raw, "regen.toml")
    cmd = [*hsx_command(), "regenerate", str(tmp / "conversations.jsonl"),
           "--config", str(config), "--out", str(tmp / "regen.jsonl")]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HSX_TIMEOUT, check=False)


def test_plain_requests_are_served_as_usual_and_dump_nothing(run: Run, hf_model: Any) -> None:
    check_plain_answers(run.plain, hf_model, PLAIN_NEW_TOKENS)
    # hsx removed each of its dumps once written; a plain request would have left one.
    assert run.dump_root_after == []
    assert "hsx: no dump for rid" not in run.server.log_text()


def test_regenerate_answers_are_the_models_own(run: Run, hf_model: Any, model_dir: Path) -> None:
    """``hsx regenerate`` through real SGLang: each assistant turn becomes the model's own
    greedy answer to the history before it (regenerated turns included), as a Hugging Face
    greedy decode of the same prompt ids gives it."""
    if run.regen is None:
        pytest.skip("hsx regenerate runs against the TP=1 server only")
    assert run.regen.returncode == 0, run.regen.stdout + run.regen.stderr
    assert run.regen_out is not None
    tok = load_tokenizer(model_dir)
    enc = ChatEncoder(tok, tok.chat_template)
    records = [orjson.loads(line) for line in run.regen_out.read_bytes().splitlines()]
    assert len(records) == REGEN_CONVERSATIONS
    answered = 0
    for rec in records:
        history: list[dict[str, str]] = []
        for turn in rec["messages"]:
            if turn["role"] == "assistant":
                want = greedy(hf_model, enc.prompt_ids(history), REGEN_NEW_TOKENS)
                assert turn["content"] == tok.decode(want, skip_special_tokens=True)
                answered += 1
            history.append({"role": turn["role"], "content": turn["content"]})
    assert answered >= REGEN_CONVERSATIONS


# --- FP8 storage (TP=1) -----------------------------------------------------------------

FP8_ALL = Storage(FP8, (0, 1, 2, 3), PER_TOKEN_SLOT_OUTLIERS16)  # the default layout
PROBE_NS = "fp8-probe"


def run_fp8(server: Server, tmp: Path, raw: dict[str, Any]) -> Fp8Run:
    """The probe (a prompt of 2 chunks and a bit, as bfloat16 then as FP8, each alone in
    its passes), then ``hsx run`` of the same samples as the bfloat16 run into an FP8
    dataset. The probe's dumps are moved out of the dump root (nothing else reads them)."""
    ids = [3 + (7 * i) % 1000 for i in range(2 * CHUNK + 3)]
    probes = {}
    for rid, storage in (("probe-bf16", BF16_STORAGE), ("probe-fp8", FP8_ALL)):
        body = generate_body(rid, PROBE_NS, ids, storage)
        check_response(server.post("/generate", body), rid=rid, num_tokens=len(ids))
        # The commit follows the response (the hook's writer threads): wait as hsx does.
        asyncio.run(wait_for_meta(server.dump_root / PROBE_NS / rid, 60.0))
        probes[rid] = tmp / rid
        shutil.copytree(server.dump_root / PROBE_NS / rid, probes[rid])
    shutil.rmtree(server.dump_root / PROBE_NS)
    fp8_raw = {**raw, "output": {**raw["output"], "dir": str(tmp / "fp8-out"), "dtype": FP8}}
    config = write_config(tmp, fp8_raw, "fp8.toml")
    cmd = [*hsx_command(), "run", "--config", str(config)]
    hsx = subprocess.run(cmd, capture_output=True, text=True, timeout=HSX_TIMEOUT, check=False)
    return Fp8Run(hsx, tmp / "fp8-out", ids, probes["probe-bf16"], probes["probe-fp8"])


def test_fp8_dumps_are_quantized_by_the_hook(run: Run) -> None:
    """In /dev/shm, before the client saw it: the hook's FP8 dump of a prompt is exactly
    encode_rows of its bfloat16 dump of the same prompt, at the FP8 part sizes; and every
    pass of the FP8 run was quantized on the device, none left to the client."""
    if run.fp8 is None:
        pytest.skip("the FP8 run is against the TP=1 server only")
    fp8 = run.fp8
    bf16 = read_bf16_rows(fp8.probe_bf16)
    parts = check_fp8_dump(fp8.probe_fp8, bf16, FP8_ALL, aux_layers=AUX, rid="probe-fp8")
    assert len(parts) == 3  # chunked: 16 + 16 + 3 rows
    log = run.server.log_text()
    assert f"hsx hook: quantizing passes to {FP8_ALL.describe()} on the cpu" in log
    assert "dumped as bfloat16" not in log and "hsx: no dump for rid" not in log


def test_fp8_run_matches_the_hugging_face_forward_in_half_the_bytes(
    run: Run, hf_model: Any
) -> None:
    if run.fp8 is None:
        pytest.skip("the FP8 run is against the TP=1 server only")
    fp8 = run.fp8
    assert fp8.hsx.returncode == 0, fp8.hsx.stdout[-3000:] + fp8.hsx.stderr[-3000:]
    entries = {canonical_id(e.id): e for e in read_manifest(fp8.out)}
    assert set(entries) == set(run.samples)
    assert dataset_storage(read_provenance(fp8.out)) == FP8_ALL
    hidden_bytes = {"bf16": 0, "fp8": 0}
    for sid, entry in entries.items():
        ids = run.samples[sid]
        with safe_open(str(fp8.out / entry.path), framework="pt") as f:
            assert f.metadata()["dtype"] == FP8 and f.metadata()["quantized"] == "0,1,2,3"
            assert f.metadata()["scales"] == PER_TOKEN_SLOT_OUTLIERS16
            q, scales = f.get_tensor(HIDDEN), f.get_tensor(SCALES)
            index, values = f.get_tensor(OUTLIER_INDEX), f.get_tensor(OUTLIER_VALUES)
            # no slot kept
            assert set(f.keys()) == {"input_ids", HIDDEN, SCALES, OUTLIER_INDEX, OUTLIER_VALUES}
        assert q.dtype == torch.float8_e4m3fn and q.shape == (len(ids), 4, TINY_HIDDEN)
        got = assemble(q, scales, None, FP8_ALL, torch.float32, outlier_index=index,
                       outlier_values=values)  # fmt: skip
        truth = reference_hidden_states(hf_model, ids, AUX).float()
        err = (got - truth).norm(dim=-1) / truth.norm(dim=-1)
        cosine = torch.nn.functional.cosine_similarity(got, truth, dim=-1)
        assert float(err.max()) < 0.08, f"{sid}: relative RMS error {float(err.max()):.4f}"
        assert float(cosine.min()) > 0.995, f"{sid}: cosine {float(cosine.min()):.5f}"
        hidden_bytes["fp8"] += q.numel() + scales.numel() * 4 + index.numel() * 4
        hidden_bytes["bf16"] += truth.numel() * 2
    # Measured from the files: the hidden states take 4 (H + 4 + 16 × 4) / 8H of the
    # bfloat16 run's (0.633 at H 256; 0.505 at 7168: the outliers' 64 bytes a vector are
    # a quarter of H here); the whole files a little more (ids, headers, 4 KiB alignment).
    bf16_files = sum(e.size for e in read_manifest(run.out))
    fp8_files = sum(e.size for e in entries.values())
    assert hidden_bytes["fp8"] / hidden_bytes["bf16"] < 0.64
    assert fp8_files / bf16_files < 0.72, (fp8_files, bf16_files)
