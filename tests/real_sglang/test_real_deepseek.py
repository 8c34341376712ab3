"""Kimi-K2.5's own architecture in real SGLang 0.5.23 with the hsx hook: a tiny DeepSeek-V3
(MLA, MoE with a shared expert, YaRN; ``tiny_deepseek.py``) served on the CPU by
``deploy/sglang/launch.sh`` and driven by ``hsx check`` and ``hsx run``, in the two layouts
Kimi is served in: tensor parallel (TP 2, chunked prefill of 64 rows) and DP attention
(``--tp 2 --dp-size 2 --enable-dp-attention``: attention-TP size 1, each rank its own
requests, a chunk of 128 tokens split into 64 per rank).

In each: every dumped row equals a float32 Hugging Face forward (aux layer k ==
``hidden_states[k]``, final == the output of ``model.norm``; bf16-rounding close, and not
the neighbouring layer nor the norm's input), a lone prompt is tiled into chunk-sized
parts, concurrent marked requests share prefill batches with plain requests, which get
Hugging Face's greedy answer and leave no dump, every rank that should write does (both
DP leaders under DP attention, their own requests), and the draft-config ids ``hsx check``
prints make SGLang's own ``set_eagle3_layers_to_capture`` of ``DeepseekV3ForCausalLM`` and
``KimiK25ForConditionalGeneration`` capture the dataset's layers.

One server per layout (module-scoped), started and killed once; two CPU-only gaps of
SGLang's DeepSeek path are filled by the test-only stand-in ``standins/sglang_cpu_gaps``.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import load_file

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import read_manifest
from hsx_async.dataset.provenance import read_provenance
from hsx_async.layer_ids import draft_ids
from hsx_async.protocol import BF16_STORAGE, META_NAME, check_response, generate_body, parse_meta
from hsx_async.run.dumps.dump import wait_for_meta
from hsx_async.server.reference.model import TINY_VOCAB, bf16_mismatch, reference_hidden_states
from tests.e2e import config_raw, write_config
from tests.real_sglang.conftest import (
    CPU_GAPS,
    Server,
    launch_command,
    launch_env,
    new_dump_root,
    running,
    server_port,
    wait_ready,
)
from tests.real_sglang.layer_probe import captured_by
from tests.real_sglang.tiny_deepseek import (
    ARCHITECTURE,
    AUX_LAYERS,
    BOS,
    DELIMITER,
    HIDDEN,
    KIMI_ARCHITECTURE,
    LAYERS,
    MASSIVE_CHANNELS,
)
from tests.real_sglang.traffic import (
    Plain,
    check_plain_answers,
    final_norm,
    generate_plain,
    hsx_command,
    run_hsx_beside_plain_traffic,
)
from tests.server.fp8 import read_bf16_rows

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(900)]

ROWS_PER_PASS = 64  # each rank's prefill chunk, so the most rows one part holds
PLAIN_NEW_TOKENS = 6
HSX_TIMEOUT = 400.0
PROBE_NS = "tiling-probe"
# Every row against the float32 forward, beyond bf16_mismatch (within two bf16 ulps of the
# rounded forward, 99 % bit-identical): the cosine of each [H] vector, and its relative
# error without the massive channels (which would otherwise dominate both norms). Storing
# bf16 alone costs a value at most 2^-8 of itself, a vector 0.0016 on average (this
# model's forward of a 300-token prompt, rounded). Measured over every row of the tier's
# samples: cosine >= 0.9999974, relative error <= 0.0024 (TP) and 0.0023 (DP attention),
# the same in each of three runs.
MIN_COSINE = 0.999995
MAX_RELATIVE_ERROR = 0.003
# A neighbouring layer or a wrongly normed final state is far off (measured >= 0.24).
MIN_WRONG_ERROR = 0.1


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int  # attention-DP size (1: plain tensor parallelism)
    chunked_prefill_size: int  # SGLang's, over all DP ranks
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


# Under DP attention the hook writes on the scheduler thread (HSX_WRITER_THREADS=0), where
# it logs each commit at debug level: SGLang's log then names the rank that committed
# every dump. The TP layout keeps the default background writers.
LAYOUTS = [
    Layout("tp2", 1, ROWS_PER_PASS),
    Layout(
        "tp2-dp2-attention",
        2,
        2 * ROWS_PER_PASS,
        ("--dp-size", "2", "--enable-dp-attention", "--log-level", "debug"),
        (("HSX_WRITER_THREADS", "0"),),
    ),
]


def sample_ids(seed: int) -> dict[str, list[int]]:
    """Prompts like chat data: most start with <s> (an attention sink, massive activations)
    and carry delimiters (sinks too, ~5 %); one starts mid-document. Lengths: one token,
    exactly one chunk, one row over, several chunks, and up to 300."""
    rng = random.Random(seed)
    c = ROWS_PER_PASS
    lengths = [1, c, c + 1, 3 * c + 5, 300] + [rng.randint(2, 300) for _ in range(7)]
    samples = {}
    for i, n in enumerate(lengths):
        ids = [DELIMITER if rng.random() < 0.05 else rng.randrange(4, TINY_VOCAB) for _ in range(n)]
        if i != len(lengths) - 1:
            ids[0] = BOS
        samples[f"s{i}"] = ids
    return samples


PLAIN_PROMPTS = [[BOS] + [5 + 7 * i + j for j in range(20 + 9 * i)] for i in range(3)]
TILING_PROMPT = [BOS] + [4 + (11 * i) % 1000 for i in range(2 * ROWS_PER_PASS + 6)]


@dataclass
class Tiling:
    """A prompt of two chunks and a bit, sent alone: its dump's parts and rows, as the hook
    wrote them (read before anything else saw them)."""

    parts: list[tuple[int, int]]
    rows: torch.Tensor
    aux_layers: tuple[int, ...]


@dataclass
class DsRun:
    layout: Layout
    server: Server
    out: Path
    samples: dict[str, list[int]]
    plain: list[Plain]
    check: subprocess.CompletedProcess[str]
    tiling: Tiling
    hsx: subprocess.CompletedProcess[str]
    info: dict[str, Any]
    dump_root_after: list[str]


class Clock:
    """Wall time of each phase of a layout's run (printed: where the tier's time goes)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.laps)


def probe_tiling(server: Server) -> Tiling:
    rid = "tiling-0"
    body = generate_body(rid, PROBE_NS, TILING_PROMPT, BF16_STORAGE)
    check_response(server.post("/generate", body), rid=rid, num_tokens=len(TILING_PROMPT))
    rid_dir = server.dump_root / PROBE_NS / rid
    asyncio.run(wait_for_meta(rid_dir, 60.0))
    meta = parse_meta((rid_dir / META_NAME).read_bytes())
    rows = torch.from_numpy(read_bf16_rows(rid_dir).view(np.int16)).view(torch.bfloat16)
    shutil.rmtree(server.dump_root / PROBE_NS)
    return Tiling([(int(s), int(e)) for s, e in meta.parts], rows, tuple(meta.aux_layers))


@pytest.fixture(scope="module", params=LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def ds_run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sglang_py: Path,
    deepseek_dir: Path,
) -> Iterator[DsRun]:
    layout: Layout = request.param
    tmp = tmp_path_factory.mktemp(layout.name)
    extra = {
        "HSX_AUX_LAYERS": ",".join(map(str, AUX_LAYERS)),
        "HSX_TP_SIZE": "2",
        "HSX_CHUNKED_PREFILL_SIZE": str(layout.chunked_prefill_size),
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank
        "PYTHONPATH": str(CPU_GAPS),  # the stand-ins for SGLang's CPU-only gaps
        **dict(layout.env),
    }
    env = launch_env(sglang_py, new_dump_root(), server_port(), **extra)
    samples = sample_ids(seed=len(layout.name))
    lines = [orjson.dumps({"id": sid, "input_ids": ids}) for sid, ids in samples.items()]
    (tmp / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    command = launch_command(deepseek_dir, *layout.flags)
    clock = Clock()
    with running(command, env, tmp / "sglang.log") as server:
        wait_ready(server)
        clock.lap("start")
        raw = config_raw(
            tmp, tmp / "in.jsonl", [server.url], server.dump_root,
            hidden_size=HIDDEN, aux_layers=AUX_LAYERS,
            server={"request_timeout": 180.0, "health_interval": 0.5},
            dump={"timeout": 60.0}, workers={"concurrency": 6},
        )  # fmt: skip
        config = write_config(tmp, raw)
        check = subprocess.run(
            [*hsx_command(), "check", "--config", str(config)],
            capture_output=True, text=True, timeout=HSX_TIMEOUT, check=False,
        )  # fmt: skip
        clock.lap("hsx check")
        tiling = probe_tiling(server)
        plain = [Plain(ids) for ids in PLAIN_PROMPTS]
        for p in plain:
            p.alone = generate_plain(server, p.input_ids, PLAIN_NEW_TOKENS)
        clock.lap("probe and plain")
        hsx = run_hsx_beside_plain_traffic(server, config, plain, PLAIN_NEW_TOKENS, HSX_TIMEOUT)
        clock.lap("hsx run")
        info = server.get("/get_server_info")
        left = sorted(p.name for p in server.dump_root.iterdir())
    clock.lap("stop")
    print(f"{layout.name}: {clock}")
    # The server is gone before the checks: the Hugging Face forwards need the CPU.
    yield DsRun(layout, server, tmp / "out", samples, plain, check, tiling, hsx, info, left)


RANK = r"\[[\d\- :]+?( DP\d+)? TP(\d+)\] "  # SGLang's log prefix of a scheduler's line


def rank_of(match: re.Match[str]) -> str:
    return f"{match[1] or ''} TP{match[2]}".strip()


def test_server_runs_the_layout(ds_run: DsRun, sglang_version: str) -> None:
    info, layout = ds_run.info, ds_run.layout
    assert info["version"] == sglang_version
    # (0.5.14's server info names no attn_dp_size: its dp_size under DP attention)
    attn_dp = info.get("attn_dp_size", info["dp_size"] if info["enable_dp_attention"] else 1)
    assert (info["tp_size"], attn_dp) == (2, layout.dp)
    assert info["enable_dp_attention"] is (layout.dp > 1)
    # Under DP attention SGLang itself divides the chunk among the DP ranks.
    assert info["chunked_prefill_size"] == ROWS_PER_PASS
    assert info["disable_radix_cache"] is True
    assert info["dtype"] == "float32"
    assert info["attention_backend"] == "torch_native"
    log = ds_run.server.log_text()
    assert log.count(f"DeepseekV2Model captures layers {list(AUX_LAYERS)}") == 2
    installed = {
        rank_of(m): m[3]
        for m in re.finditer(RANK + r"hsx hook installed: aux layers \[2, 3, 5\], .*?, "
                             r"(writing rank|non-writing rank)", log)
    }  # fmt: skip
    # TP 2: attention-TP rank 0 writes, rank 1 does not; DP attention: both are leaders.
    if layout.dp == 1:
        assert installed == {"TP0": "writing rank", "TP1": "non-writing rank"}
    else:
        assert installed == {"DP0 TP0": "writing rank", "DP1 TP1": "writing rank"}


def test_hsx_run_writes_every_sample(ds_run: DsRun) -> None:
    assert ds_run.hsx.returncode == 0, ds_run.hsx.stdout[-3000:]
    entries = {canonical_id(e.id): e for e in read_manifest(ds_run.out)}
    assert set(entries) == set(ds_run.samples)
    assert '"samples_retried":0' in ds_run.hsx.stdout, "a dump was refused and retried"
    assert "hsx: no dump for rid" not in ds_run.server.log_text()


def test_a_lone_prompt_is_tiled_in_chunks(ds_run: DsRun, deepseek_hf: Any) -> None:
    """Each rank's chunk is chunked_prefill_size / attention-DP size = 64 rows: two full
    parts and the rest, equal to the forward."""
    n = len(TILING_PROMPT)
    assert ds_run.tiling.parts == [(0, 64), (64, 128), (128, n)]
    truth = reference_hidden_states(deepseek_hf, TILING_PROMPT, AUX_LAYERS)
    assert bf16_mismatch(ds_run.tiling.rows, truth) is None


def prefill_passes(log: str) -> list[tuple[str, int, int]]:
    """(rank, #new-seq, #new-token) of every prefill pass in SGLang's log."""
    pattern = RANK + r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)"
    return [(rank_of(m), int(m[3]), int(m[4])) for m in re.finditer(pattern, log)]


def test_concurrent_requests_were_chunked_and_batched(ds_run: DsRun) -> None:
    passes = prefill_passes(ds_run.server.log_text())
    assert passes
    assert max(tokens for _, _, tokens in passes) == ROWS_PER_PASS, "no full chunk"
    assert max(seqs for _, seqs, _ in passes) >= 2, "no pass batched two requests"
    if ds_run.layout.dp > 1:
        ranks = {rank for rank, _, _ in passes}
        assert ranks == {"DP0 TP0", "DP1 TP1"}, ranks
        assert "chunked prefill size is adjusted from 128 to 64" in ds_run.server.log_text()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per vector, without the massive channels."""
    keep = [c for c in range(HIDDEN) if c not in MASSIVE_CHANNELS]
    g, w = got.float()[..., keep], want.float()[..., keep]
    error: torch.Tensor = (g - w).norm(dim=-1) / w.norm(dim=-1)
    return error


def float32_forward(model: Any, ids: list[int]) -> torch.Tensor:
    """[T, L, H] float32 of one unchunked forward: hidden_states[k] for each aux layer k,
    then the output of model.norm."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    slots = [out.hidden_states[k][0] for k in AUX_LAYERS] + [out.last_hidden_state[0]]
    return torch.stack(slots, dim=1)


def test_dataset_equals_a_float32_hugging_face_forward(ds_run: DsRun, deepseek_hf: Any) -> None:
    worst_cosine, worst_error = 1.0, 0.0
    for entry in read_manifest(ds_run.out):
        sid = canonical_id(entry.id)
        ids = ds_run.samples[sid]
        tensors = load_file(ds_run.out / entry.path)
        np.testing.assert_array_equal(tensors["input_ids"].numpy(), np.array(ids))
        got = tensors["hidden_states"]
        truth = float32_forward(deepseek_hf, ids)
        assert got.dtype == torch.bfloat16 and got.shape == truth.shape == (len(ids), 4, HIDDEN)
        problem = bf16_mismatch(got, truth.to(torch.bfloat16))
        assert problem is None, f"{sid} ({ds_run.layout.name}): {problem}"
        cosine = torch.nn.functional.cosine_similarity(got.float(), truth, dim=-1)
        worst_cosine = min(worst_cosine, float(cosine.min()))
        worst_error = max(worst_error, float(relative_error(got, truth).max()))
    print(f"{ds_run.layout.name}: worst cosine {worst_cosine:.7f}, error {worst_error:.5f}")
    assert worst_cosine >= MIN_COSINE
    assert worst_error <= MAX_RELATIVE_ERROR


def test_slots_are_their_layers_not_neighbours_nor_a_misplaced_norm(
    ds_run: DsRun, deepseek_hf: Any
) -> None:
    """On the longest sample: aux slot k is far from hidden_states[k - 1] and [k + 1]; the
    final slot is the output of model.norm, not its input nor the norm applied twice (the
    norm gains are U(0.2, 3) per channel)."""
    sid = max(ds_run.samples, key=lambda s: len(ds_run.samples[s]))
    ids = ds_run.samples[sid]
    entry = next(e for e in read_manifest(ds_run.out) if canonical_id(e.id) == sid)
    got = load_file(ds_run.out / entry.path)["hidden_states"]
    norm = final_norm(deepseek_hf, ids)
    layers = [*norm.hidden_states[:LAYERS], norm.pre]  # entering layer k; the last: the norm's
    errors = {}
    for slot, k in enumerate(AUX_LAYERS):
        for wrong in (k - 1, k + 1):
            errors[f"slot {slot} vs layer {wrong}"] = relative_error(got[:, slot], layers[wrong])
    final = got[:, -1]
    errors["final vs the norm's input"] = relative_error(final, norm.pre)
    errors["final vs the norm applied twice"] = relative_error(final, norm.twice)
    medians = {name: float(e.median()) for name, e in errors.items()}
    print(f"{ds_run.layout.name}: {medians}")
    assert min(medians.values()) > MIN_WRONG_ERROR, medians
    assert float(relative_error(final, norm.post).max()) <= MAX_RELATIVE_ERROR


def test_plain_requests_get_hugging_faces_greedy_answer(ds_run: DsRun, deepseek_hf: Any) -> None:
    check_plain_answers(ds_run.plain, deepseek_hf, PLAIN_NEW_TOKENS)
    assert ds_run.dump_root_after == [], "a plain request left a dump"


def test_each_dp_leader_writes_its_own_requests(ds_run: DsRun) -> None:
    """DP attention: both DP leaders commit dumps, every sample's exactly once (a rank sees
    only the requests the DP controller sent it, so each writes its own)."""
    if ds_run.layout.dp == 1:
        pytest.skip("TP 2: the writing rank is checked by test_server_runs_the_layout")
    pattern = RANK + r"hsx: committed (\S+)"
    commits = [(rank_of(m), m[3]) for m in re.finditer(pattern, ds_run.server.log_text())]
    # A sample's rid is <nonce>-<line>-<attempt>; hsx check's, hsx run's admission probe's
    # (<nonce>-probe-<n>) and the tiling probe's are not samples.
    sample_rid = re.compile(r"[0-9a-f]+-(\d+)-\d+")
    lines = [(rank, int(m[1])) for rank, rid in commits if (m := sample_rid.fullmatch(rid))]
    assert sorted(line for _, line in lines) == list(range(len(ds_run.samples)))
    by_rank = {rank: sum(1 for r, _ in lines if r == rank) for rank, _ in lines}
    assert set(by_rank) == {"DP0 TP0", "DP1 TP1"}, by_rank


DRAFT_IDS = re.compile(r'"eagle_aux_hidden_state_layer_ids": \[([\d, ]+)\]')


def test_printed_draft_ids_make_deepseek_and_kimi_capture_the_dataset_layers(
    ds_run: DsRun, layer_probe: dict[str, Any]
) -> None:
    """``hsx check`` against the live server names the ids for its model's family; fed to
    SGLang's own methods of DeepseekV3ForCausalLM and of Kimi-K2.5's class (which hands
    them to its DeepSeek-V3 text model) they capture the layers the dataset holds."""
    assert ds_run.check.returncode == 0, ds_run.check.stdout + ds_run.check.stderr
    line = next(row for row in ds_run.check.stdout.splitlines() if "draft ids" in row)
    assert ARCHITECTURE in line, line
    match = DRAFT_IDS.search(line)
    assert match, line
    ids = [int(i) for i in match[1].split(",")]
    assert draft_ids(KIMI_ARCHITECTURE, AUX_LAYERS, LAYERS).ids == tuple(ids)
    for arch in (ARCHITECTURE, KIMI_ARCHITECTURE):
        assert captured_by(layer_probe, arch, ids, LAYERS) == list(AUX_LAYERS), arch
    # The layers the hook captured (its meta.json) and the dataset records (provenance.json).
    assert ds_run.tiling.aux_layers == AUX_LAYERS
    provenance = read_provenance(ds_run.out)
    assert provenance is not None and tuple(provenance["aux_layers"]) == AUX_LAYERS
