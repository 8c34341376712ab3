"""The reference server: real hidden states, written through the protocol, equal to one
plain forward pass of the same model (same layers, same rows, same order)."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import torch

from hsx_async.cli import build_parser, load_handler, main
from hsx_async.errors import ConfigError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    PER_TOKEN_SLOT_OUTLIERS16,
    DumpMeta,
    Storage,
    check_aux_layers,
    check_meta,
    check_part_sizes,
    check_response,
    generate_body,
    num_layers,
    parse_meta,
    parse_part_name,
    part_name,
    row_bytes,
)
from hsx_async.server import rows as server_rows
from hsx_async.server.reference.model import (
    TINY_AUX_LAYERS,
    TINY_HIDDEN,
    TINY_VOCAB,
    bf16_mismatch,
    build_default_model,
    default_aux_layers,
)
from hsx_async.server.reference.server import (
    ReferenceOptions,
    ReferenceServer,
    parse_aux_layers,
    reference_hidden_states,
    running_reference_server,
)
from hsx_async.server.sched import (
    Job,
    Slice,
)
from tests.server.fp8 import check_fp8_dump

NS = "w0"
REPO = Path(__file__).resolve().parents[3]


def tokens(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY_VOCAB, length)]


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within bf16 rounding (the tolerance is argued at BF16_RTOL)."""
    problem = bf16_mismatch(got, want)
    assert problem is None, problem


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def read_dump(root: Path, rid: str, num_tokens: int) -> tuple[DumpMeta, torch.Tensor]:
    """Check a committed dump like the client does and reassemble its parts: [T, L, H]."""
    directory = root / NS / rid
    meta = parse_meta((directory / "meta.json").read_bytes())
    check_meta(
        meta, rid=rid, num_tokens=num_tokens, hidden_size=TINY_HIDDEN, aux_layers=TINY_AUX_LAYERS
    )
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(["meta.json", *(part_name(s, e) for s, e in meta.parts)])
    sizes: dict[tuple[int, int], int] = {}
    for path in directory.iterdir():
        span = parse_part_name(path.name)
        if span is not None:
            sizes[span] = path.stat().st_size
    check_part_sizes(meta, sizes, row_bytes(TINY_HIDDEN, TINY_AUX_LAYERS))
    data = bytearray(b"".join((directory / part_name(s, e)).read_bytes() for s, e in meta.parts))
    rows = np.frombuffer(data, dtype="<i2").reshape(
        num_tokens, num_layers(TINY_AUX_LAYERS), TINY_HIDDEN
    )
    return meta, torch.from_numpy(rows).view(torch.bfloat16)


@asynccontextmanager
async def serving(root: Path, **kwargs: Any) -> AsyncIterator[tuple[ReferenceServer, Client]]:
    options = ReferenceOptions(dump_root=root, **kwargs)
    async with running_reference_server(options) as server, aiohttp.ClientSession() as session:
        yield server, Client(session, server.url)


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def post(self, body: object) -> tuple[int, Any]:
        async with self.session.post(f"{self.url}/generate", data=orjson.dumps(body)) as resp:
            return resp.status, orjson.loads(await resp.read())

    async def hsx(self, rid: str, ids: Sequence[int]) -> None:
        status, body = await self.post(generate_body(rid, NS, list(ids)))
        assert status == 200, body
        check_response(body, rid=rid, num_tokens=len(ids))
        assert body["meta_info"]["completion_tokens"] == 0

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(f"{self.url}{path}") as resp:
            data = await resp.read()
            return resp.status, orjson.loads(data) if data else None


async def test_single_short_prompt(shm_root: Path) -> None:
    ids = tokens(1, 20)
    async with serving(shm_root) as (server, client):
        await client.hsx("single-0", ids)
        meta, got = read_dump(shm_root, "single-0", len(ids))
        assert meta.parts == ((0, 20),)
        assert meta.model == "hsx-tiny-llama-seed0"
        assert meta.server.startswith("hsx-reference ")
        assert_bf16_close(got, reference_hidden_states(server.model, ids, server.aux_layers))
        assert server.stats.passes == 1


async def test_chunked_prompt_writes_one_part_per_pass(shm_root: Path) -> None:
    ids = tokens(2, 200)
    async with serving(shm_root, chunk_size=64) as (server, client):
        await client.hsx("chunked-0", ids)
        meta, got = read_dump(shm_root, "chunked-0", len(ids))
        assert meta.parts == ((0, 64), (64, 128), (128, 192), (192, 200))
        assert [list(p) for p in server.stats.pass_log] == [
            [("chunked-0", s, e)] for s, e in meta.parts
        ]
        assert_bf16_close(got, reference_hidden_states(server.model, ids, server.aux_layers))


async def test_concurrent_requests_are_batched_into_shared_passes(shm_root: Path) -> None:
    prompts = {"a": tokens(3, 40), "b": tokens(4, 150), "c": tokens(5, 100), "d": tokens(6, 20)}
    async with serving(shm_root, chunk_size=64, max_batch_tokens=128) as (server, client):
        # Queue all four before any pass starts, so the batches do not depend on timing.
        server.scheduler.pause()
        sends = [asyncio.create_task(client.hsx(rid, ids)) for rid, ids in prompts.items()]
        await server.scheduler.wait_queued(len(prompts))
        server.scheduler.resume()
        await asyncio.gather(*sends)
        # First come, first served: ≤ 64 rows of each request, ≤ 128 rows per pass.
        assert list(server.stats.pass_log) == [
            (("a", 0, 40), ("b", 0, 64), ("c", 0, 24)),
            (("b", 64, 128), ("c", 24, 88)),
            (("b", 128, 150), ("c", 88, 100), ("d", 0, 20)),
        ]
        assert server.stats.max_pass_requests == 3
        assert server.stats.batched_passes == 3
        for rid, ids in prompts.items():
            meta, got = read_dump(shm_root, rid, len(ids))
            expected = [
                (s, e) for record in server.stats.pass_log for r, s, e in record if r == rid
            ]
            assert list(meta.parts) == expected
            assert_bf16_close(got, reference_hidden_states(server.model, ids, server.aux_layers))


def test_comparison_tells_rows_and_layers_apart() -> None:
    """The tolerance is tight enough that a shifted row, swapped layers or another model
    fail it, and loose enough for bf16 rounding flips of float32 noise."""
    model = build_default_model(0)
    ids = tokens(7, 32)
    truth = reference_hidden_states(model, ids, TINY_AUX_LAYERS)
    assert bf16_mismatch(truth, truth) is None
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layers = [out.hidden_states[k][0] for k in TINY_AUX_LAYERS] + [out.last_hidden_state[0]]
    exact = torch.stack(layers, dim=1)
    # float32 noise far above what packing causes (1e-6) still passes...
    noisy = (
        exact * (1 + 1e-5 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(0)))
    ).to(torch.bfloat16)
    assert bf16_mismatch(noisy, truth) is None
    # ...but nothing that is wrong.
    wrong = {
        "shifted rows": torch.cat([truth[1:], truth[:1]]),
        "swapped layers": truth[:, [1, 0, 2, 3]],
        "another model": reference_hidden_states(build_default_model(1), ids, TINY_AUX_LAYERS),
        "one row off": torch.cat([truth[:5], truth[5:6] * 1.05, truth[6:]]),
        "float32": exact,
        "missing row": truth[:-1],
    }
    for what, tensor in wrong.items():
        assert bf16_mismatch(tensor, truth) is not None, what


async def test_ordinary_request_decodes_greedily_and_dumps_nothing(shm_root: Path) -> None:
    ids = tokens(8, 70)
    async with serving(shm_root, chunk_size=32) as (server, client):
        status, body = await client.post(
            {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        )
        assert status == 200, body
        assert body["meta_info"]["prompt_tokens"] == 70
        assert body["meta_info"]["completion_tokens"] == 3
        # Greedy decoding without a cache, one full forward per token.
        expected = list(ids)
        with torch.inference_mode():
            for _ in range(3):
                logits = server.model(input_ids=torch.tensor([expected])).logits
                expected.append(int(logits[0, -1].argmax()))
        assert body["output_ids"] == expected[70:]
    assert entries(shm_root) == []


BAD_BODIES: list[tuple[str, object]] = [
    ("ns with a slash", generate_body("r1", "a/b", [1, 2])),
    ("ns going up", generate_body("r1", "..", [1, 2])),
    ("empty ns", generate_body("r1", "", [1, 2])),
    ("ns with a leading dot", generate_body("r1", ".x", [1, 2])),
    ("rid going up", generate_body("../../etc", NS, [1, 2])),
    ("rid with a space", generate_body("a b", NS, [1, 2])),
    ("rid too long", generate_body("r" * 129, NS, [1, 2])),
    ("rid with a newline", generate_body("r1\n", NS, [1, 2])),
    ("no rid", {k: v for k, v in generate_body("r1", NS, [1, 2]).items() if k != "rid"}),
    (
        "decoding hsx request",
        {
            **generate_body("r1", NS, [1, 2]),
            "sampling_params": {"max_new_tokens": 1, "custom_params": {"hsx_ns": NS}},
        },
    ),
    ("token out of vocab", generate_body("r1", NS, [1, TINY_VOCAB])),
    ("negative token", generate_body("r1", NS, [-1])),
    ("boolean token", generate_body("r1", NS, [True])),
    ("empty prompt", generate_body("r1", NS, [])),
    ("text prompt", {"rid": "r1", "text": "hello", "sampling_params": {"max_new_tokens": 0}}),
    ("batched prompts", generate_body("r1", NS, [[1, 2], [3]])),
    ("streaming", {**generate_body("r1", NS, [1, 2]), "stream": True}),
    ("too long", generate_body("r1", NS, [1] * 4097)),
    ("not an object", [1, 2, 3]),
]


async def test_invalid_requests_get_400_and_write_nothing(shm_root: Path) -> None:
    async with serving(shm_root) as (server, client):
        for what, body in BAD_BODIES:
            status, answer = await client.post(body)
            assert status == 400, what
            assert answer["error"]["message"], what
        async with client.session.post(f"{server.url}/generate", data=b"{not json") as resp:
            assert resp.status == 400
        assert server.stats.passes == 0
    assert entries(shm_root) == []


async def test_rid_in_flight_is_refused(shm_root: Path) -> None:
    async with serving(shm_root) as (server, client):
        server.scheduler.pause()
        first = asyncio.create_task(client.hsx("dup", tokens(9, 10)))
        await server.scheduler.wait_queued(1)
        status, answer = await client.post(generate_body("dup", NS, tokens(10, 12)))
        assert status == 400
        assert "in flight" in answer["error"]["message"]
        server.scheduler.resume()
        await first
        meta, _ = read_dump(shm_root, "dup", 10)
        assert meta.num_tokens == 10


async def test_stop_answers_queued_requests_503(shm_root: Path) -> None:
    async with aiohttp.ClientSession() as session:
        async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
            server.scheduler.pause()
            client = Client(session, server.url)
            pending = asyncio.create_task(client.post(generate_body("late", NS, tokens(11, 10))))
            await server.scheduler.wait_queued(1)
        # The server stopped while "late" waited: it got an answer, not a hang.
        status, answer = await pending
    assert status == 503, answer
    assert not server.scheduler.running
    assert entries(shm_root) == []


async def test_failed_dump_fails_only_its_request(shm_root: Path, tmp_path: Path) -> None:
    """A namespace planted as a symlink: that request gets 500 and nothing is written
    through the link; the hsx and ordinary requests sharing its pass are served."""
    (shm_root / "evil").symlink_to(tmp_path)
    async with serving(shm_root) as (server, client):
        server.scheduler.pause()
        evil = asyncio.create_task(client.post(generate_body("e1", "evil", tokens(15, 12))))
        good = asyncio.create_task(client.hsx("g1", tokens(16, 30)))
        plain_body = {"input_ids": tokens(17, 5), "sampling_params": {"max_new_tokens": 1}}
        plain = asyncio.create_task(client.post(plain_body))
        await server.scheduler.wait_queued(3)
        server.scheduler.resume()
        (evil_status, evil_answer), _, (plain_status, _) = await asyncio.gather(evil, good, plain)
        assert evil_status == 500
        assert "not a plain directory" in evil_answer["error"]["message"]
        assert plain_status == 200
        assert [len(p) for p in server.stats.pass_log] == [3]
        assert server.stats.failed == 1
        _, got = read_dump(shm_root, "g1", 30)
        assert_bf16_close(got, reference_hidden_states(server.model, tokens(16, 30), (1, 3, 5)))
    assert entries(tmp_path) == []


async def test_info_endpoints(shm_root: Path) -> None:
    async with serving(shm_root, chunk_size=32, max_batch_tokens=96) as (_, client):
        status, _ = await client.get("/health")
        assert status == 200
        status, info = await client.get("/get_model_info")
        assert status == 200
        assert info == {
            "model_path": "hsx-tiny-llama-seed0",
            "tokenizer_path": None,
            "is_generation": True,
            "hidden_size": TINY_HIDDEN,
            "hsx_aux_layers": list(TINY_AUX_LAYERS),
            "num_hidden_layers": 6,
            "hsx_final_norm": {"kind": "rms", "eps": 1e-6},
        }
        status, server_info = await client.get("/get_server_info")
        assert status == 200
        assert server_info["version"]
        assert server_info["server"].startswith("hsx-reference ")
        assert server_info["chunked_prefill_size"] == 32
        assert server_info["max_prefill_tokens"] == 96
        assert server_info["hsx_dump_root"] == str(shm_root)


async def test_custom_aux_layers_and_seed(shm_root: Path) -> None:
    ids = tokens(12, 30)
    async with serving(shm_root, aux_layers=(0, 2), seed=3) as (_, client):
        await client.hsx("custom-0", ids)
        meta = parse_meta((shm_root / NS / "custom-0" / "meta.json").read_bytes())
        assert meta.aux_layers == (0, 2)
        assert meta.model == "hsx-tiny-llama-seed3"
        data = bytearray((shm_root / NS / "custom-0" / part_name(0, 30)).read_bytes())
        got = torch.from_numpy(np.frombuffer(data, "<i2").reshape(30, 3, TINY_HIDDEN))
        want = reference_hidden_states(build_default_model(3), ids, (0, 2))
        assert_bf16_close(got.view(torch.bfloat16), want)


async def test_local_model_directory(shm_root: Path, tmp_path: Path) -> None:
    """--model PATH: any local checkpoint; here the tiny model saved with other weights."""
    saved = build_default_model(5)
    await asyncio.to_thread(saved.save_pretrained, tmp_path / "tiny")
    ids = tokens(14, 90)
    options = {"model": str(tmp_path / "tiny"), "chunk_size": 32}
    async with serving(shm_root, **options) as (server, client):
        assert server.model_name == str(tmp_path / "tiny")
        assert server.aux_layers == TINY_AUX_LAYERS
        await client.hsx("local-0", ids)
        meta, got = read_dump(shm_root, "local-0", len(ids))
        assert meta.model == str(tmp_path / "tiny")
        assert len(meta.parts) == 3
        assert_bf16_close(got, reference_hidden_states(saved, ids, TINY_AUX_LAYERS))
    with pytest.raises(ConfigError, match="not a directory"):
        async with running_reference_server(ReferenceOptions(model=str(tmp_path / "nope"))):
            pass


def test_default_model_is_deterministic() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    a, b = build_default_model(0), build_default_model(0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG is left alone


def test_ground_truth_layers() -> None:
    """Aux layer k is the input of decoder layer k; the last layer is the LM head's input
    (post-norm). Checked with hooks, independently of transformers' hidden_states."""
    model = build_default_model(0)
    ids = tokens(13, 16)
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen[name] = (args[0] if args else kwargs["hidden_states"])[0].clone()

        return hook

    hooks = [
        model.model.layers[0].register_forward_pre_hook(grab("layer0"), with_kwargs=True),
        model.model.layers[4].register_forward_pre_hook(grab("layer4"), with_kwargs=True),
        model.lm_head.register_forward_pre_hook(grab("head"), with_kwargs=True),
    ]
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    truth = reference_hidden_states(model, np.asarray(ids), (4, 0))
    assert truth.shape == (16, 3, TINY_HIDDEN)
    assert torch.equal(truth[:, 0], seen["layer4"].to(torch.bfloat16))
    assert torch.equal(truth[:, 1], seen["layer0"].to(torch.bfloat16))
    assert torch.equal(truth[:, 2], seen["head"].to(torch.bfloat16))


def test_aux_layer_choices() -> None:
    assert default_aux_layers(6) == TINY_AUX_LAYERS
    assert default_aux_layers(32) == (2, 16, 29)  # SGLang's EAGLE-3 default
    assert default_aux_layers(61) == (2, 30, 58)
    assert default_aux_layers(1) == (0,)
    check_aux_layers((0, 5), key="aux_layers", num_layers=6)
    for bad in [(), (6,), (-1,), (1, 1), (5, 1)]:
        with pytest.raises(ConfigError):
            check_aux_layers(bad, key="aux_layers", num_layers=6)
    assert parse_aux_layers("1,3,5") == (1, 3, 5)
    for text in ["", "1,x", "1,-2"]:
        with pytest.raises(ConfigError):
            parse_aux_layers(text)


async def test_out_of_range_aux_layers_refused(shm_root: Path) -> None:
    with pytest.raises(ConfigError, match="does not fit a model with 6 layers"):
        async with running_reference_server(ReferenceOptions(dump_root=shm_root, aux_layers=(6,))):
            pass


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        ReferenceOptions(chunk_size=0)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        ReferenceOptions(max_batch_tokens=0)
    with pytest.raises(ConfigError, match="threads"):
        ReferenceOptions(threads=0)


def test_cli_parser() -> None:
    args = build_parser().parse_args(
        ["reference-server", "--port", "0", "--aux-layers", "0,2", "--chunk-size", "16"]
    )
    assert args.port == 0
    assert args.aux_layers == "0,2"
    assert args.chunk_size == 16
    assert args.max_batch_tokens == 256
    assert callable(load_handler(args.handler))
    defaults = build_parser().parse_args(["reference-server"])
    assert (defaults.chunk_size, defaults.max_batch_tokens, defaults.seed) == (
        ReferenceOptions.chunk_size,
        ReferenceOptions.max_batch_tokens,
        ReferenceOptions.seed,
    )
    # HSX_DUMP_ROOT is read when the command runs, the one way every hook reads it.
    assert defaults.dump_root is None


def test_cli_on_a_taken_port_refuses_before_loading_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as owner:
        owner.bind(("127.0.0.1", 0))
        owner.listen(1)
        port = owner.getsockname()[1]
        # A model directory that does not exist: the port is refused before it is read.
        argv = ["reference-server", "--port", str(port), "--model", "/nonexistent/model"]
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"hsx: error: argument --port: 127.0.0.1:{port} is in use")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_demo_samples_are_current_and_fit_the_tiny_model() -> None:
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "bench/make_demo_samples.py")
    assert spec is not None and spec.loader is not None
    make_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_demo)
    data = (resources.files("hsx_async.data") / "demo_samples.jsonl").read_bytes()
    assert data == make_demo.render(make_demo.make_samples())
    samples = [orjson.loads(line) for line in data.splitlines()]
    assert 40 <= len(samples) <= 64
    assert len({s["id"] for s in samples}) == len(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert min(lengths) == 8
    assert max(lengths) == 300
    assert sum(n > ReferenceOptions.chunk_size for n in lengths) >= 10
    assert all(0 <= t < TINY_VOCAB for s in samples for t in s["input_ids"])
    masked = [s for s in samples if "loss_mask" in s]
    assert masked
    assert all(len(s["loss_mask"]) == len(s["input_ids"]) for s in masked)


async def test_passes_go_through_the_hooks_core_and_drops_abort(shm_root: Path) -> None:
    """The reference server's passes are written by the dumper every hook uses
    (PrefillDumper): a request the scheduler drops between chunks (its client went away)
    is reported as aborted, so its dump never commits and the dumper keeps no state for it."""
    from hsx_async.protocol import parse_meta
    from hsx_async.server.reference.model import PackedEngine, build_default_model
    from hsx_async.server.reference.passes import PassRunner

    engine = PackedEngine(build_default_model(0), TINY_AUX_LAYERS)
    runner = PassRunner(engine, shm_root, "tiny", "srv")
    gone = Job("gone", list(range(3, 43)), 0, "ns0")
    kept = Job("kept", list(range(5, 15)), 0, "ns0")
    first = runner([Slice(gone, 0, 16), Slice(kept, 0, 10)])
    assert [r.error for r in first] == [None, None]
    assert "gone" in runner.dumper.registry
    assert (shm_root / "ns0" / "kept" / "meta.json").exists()
    assert parse_meta((shm_root / "ns0" / "kept" / "meta.json").read_bytes()).parts == ((0, 10),)
    runner.drop(gone)
    later = Job("later", list(range(7, 15)), 0, "ns0")
    runner([Slice(later, 0, 8)])
    assert "gone" not in runner.dumper.registry
    assert sorted(p.name for p in (shm_root / "ns0" / "gone").iterdir()) == [
        "part-0000000000-0000000016.bin"
    ]


# --- FP8 storage ---------------------------------------------------------------------------

REF_LAYERS = num_layers(TINY_AUX_LAYERS)
REF_FP8_ALL = Storage(FP8, tuple(range(REF_LAYERS)), PER_TOKEN_SLOT_OUTLIERS16)
REF_FP8_AUX = Storage(FP8, tuple(range(REF_LAYERS - 1)), PER_TOKEN_SLOT_OUTLIERS16)
REF_FP8_ALL_V3 = Storage(FP8, tuple(range(REF_LAYERS)))


@pytest.mark.parametrize(
    "storage",
    [REF_FP8_ALL, REF_FP8_AUX, REF_FP8_ALL_V3],
    ids=["all", "aux", "all-per_token_slot"],
)
async def test_fp8_request_parts_are_encode_rows_of_its_bf16_dump(
    shm_root: Path, storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same prompt, alone in its passes, once as bfloat16 and once as FP8: the FP8
    passes are quantized where the model produced them (the writer's host quantizer is
    disabled), and each part equals encode_rows of the bfloat16 rows of the same pass."""

    def no_host_quantizer(*_: object) -> None:
        raise AssertionError("an FP8 part was quantized on the host, not in the pass")

    monkeypatch.setattr(server_rows, "encode_bits", no_host_quantizer)
    ids = tokens(7, 150)
    async with serving(shm_root, chunk_size=64) as (_, client):
        await client.hsx("bf", ids)
        status, body = await client.post(generate_body("q", NS, ids, storage))
        assert status == 200, body
        check_response(body, rid="q", num_tokens=len(ids))
    _, bf16 = read_dump(shm_root, "bf", len(ids))
    bits = bf16.view(torch.int16).numpy().view(np.uint16)
    parts = check_fp8_dump(shm_root / NS / "q", bits, storage, aux_layers=TINY_AUX_LAYERS)
    assert parts == [(0, 64), (64, 128), (128, 150)]
    q_bytes = sum((shm_root / NS / "q" / part_name(s, e)).stat().st_size for s, e in parts)
    assert q_bytes == len(ids) * storage.row_bytes(REF_LAYERS, TINY_HIDDEN)
    ratio = q_bytes / (bf16.numel() * 2)  # of the bfloat16 dump's bytes
    # H 256: the outliers' 68 bytes a vector are 27 % of its FP8 values (0.9 % at H 7168)
    assert ratio < (0.70 if storage == REF_FP8_ALL else 0.80 if storage == REF_FP8_AUX else 0.55)


async def test_unusable_fp8_request_is_dumped_bf16(shm_root: Path) -> None:
    ids = tokens(8, 30)
    body = generate_body("r", NS, ids)
    body["sampling_params"]["custom_params"].update(hsx_dtype=FP8, hsx_quantized=[REF_LAYERS])
    async with serving(shm_root) as (server, client):
        status, _ = await client.post(body)
        assert status == 200
        meta, got = read_dump(shm_root, "r", len(ids))  # checked as a bfloat16 dump
        assert meta.storage == BF16_STORAGE
        assert_bf16_close(got, reference_hidden_states(server.model, ids, server.aux_layers))
