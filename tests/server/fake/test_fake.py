"""The fake SGLang server: PROTOCOL §2–3 dumps, batching and chunking, faults, safety, CLI."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from hsx_async import __version__, protocol
from hsx_async.cli import build_parser, main
from hsx_async.errors import ConfigError, DumpError
from hsx_async.run.dumps.dump import validate_dump
from hsx_async.server.fake.options import draw_fault, random_cuts
from hsx_async.server.fake.server import (
    ALL_FAULTS,
    BENIGN_FAULTS,
    SERVER_NAME,
    FakeOptions,
    FakeServerHandle,
    expected_hidden_states,
    options_from_args,
    running_fake_server,
)
from tests.server.fp8 import check_fp8_dump, read_bf16_rows

H = 64
AUX = (1, 3, 5)
L = len(AUX) + 1
NS = "worker-0"
WAIT_S = 20.0  # bound on awaiting a server event; never reached when things work


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 150_000, n)]


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/generate", json=body) as resp:
        return resp.status, await resp.json()


async def post_hsx(
    session: aiohttp.ClientSession, url: str, rid: str, ids: list[int], ns: str = NS
) -> tuple[int, dict[str, Any]]:
    return await post(session, url, protocol.generate_body(rid, ns, ids))


def read_meta(root: Path, rid: str, ns: str = NS) -> protocol.DumpMeta:
    return protocol.parse_meta((root / ns / rid / protocol.META_NAME).read_bytes())


def part_sizes(root: Path, rid: str, ns: str = NS) -> dict[tuple[int, int], int]:
    sizes = {}
    for path in (root / ns / rid).iterdir():
        span = protocol.parse_part_name(path.name)
        if span is not None:
            sizes[span] = path.stat().st_size
    return sizes


def check_dump(root: Path, rid: str, ids: list[int], ns: str = NS) -> protocol.DumpMeta:
    """Everything a client checks (PROTOCOL §3), plus the bytes themselves."""
    meta = read_meta(root, rid, ns)
    protocol.check_meta(meta, rid=rid, num_tokens=len(ids), hidden_size=H, aux_layers=AUX)
    protocol.check_part_sizes(meta, part_sizes(root, rid, ns), protocol.row_bytes(H, AUX))
    data = b"".join(
        (root / ns / rid / protocol.part_name(s, e)).read_bytes() for s, e in meta.parts
    )
    assert data == expected_hidden_states(ids, H, L).tobytes()
    assert not [p for p in (root / ns / rid).iterdir() if p.name.startswith(".")]
    return meta


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # force_close: a connection the server dropped on purpose is never reused.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


# --- content -------------------------------------------------------------------------------


def test_expected_hidden_states_is_finite_deterministic_and_distinct() -> None:
    ids = [0, 1, 7, 7, 7, 2**31 - 1, 2**40, 5, 5]
    rows = expected_hidden_states(ids, H, L)
    assert rows.dtype == np.uint16
    assert rows.shape == (len(ids), L, H)
    assert ((rows >> 7) & 0xFF).max() < 0xFF  # exponent all ones would be Inf/NaN
    assert np.array_equal(rows, expected_hidden_states(np.array(ids), H, L))
    flat = rows.reshape(len(ids) * L, H)
    assert len({r.tobytes() for r in flat}) == len(flat)  # every (position, layer) differs
    # The same token at another position differs; a prefix is stable.
    assert not np.array_equal(rows[2], rows[3])
    assert np.array_equal(expected_hidden_states(ids[:4], H, L), rows[:4])


def test_other_weights_are_other_numbers_with_the_same_headers() -> None:
    """``weights``: another checkpoint of one shape (issue 38); 0 is the default's rows."""
    ids = prompt(6)
    mine, other = expected_hidden_states(ids, H, L), expected_hidden_states(ids, H, L, weights=1)
    assert np.array_equal(expected_hidden_states(ids, H, L, weights=0), mine)
    assert np.array_equal(mine[:, :, :9], other[:, :, :9])  # layer, position, token id
    assert np.count_nonzero(mine[:, :, 9:] != other[:, :, 9:]) > 0.9 * mine[:, :, 9:].size
    assert ((other >> 7) & 0xFF).max() < 0xFF


async def test_a_refusing_server_answers_400_to_every_request(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    async with running_fake_server(FakeOptions(dump_root=shm_root)) as srv:
        srv.set_rejects(True)
        status, _ = await post_hsx(session, srv.url, "a", prompt(3))
        async with session.get(f"{srv.url}/health") as resp:
            health = resp.status
        srv.set_rejects(False)
        again, _ = await post_hsx(session, srv.url, "b", prompt(3))
    assert (status, health, again) == (400, 200, 200)
    assert srv.stats.bad_requests == 1


def test_expected_hidden_states_big_hidden_is_finite() -> None:
    rows = expected_hidden_states(prompt(50), 7168, 4)
    assert ((rows >> 7) & 0xFF).max() < 0xFF
    assert rows.view("<u2").tobytes() == rows.tobytes()


# --- pure pieces -----------------------------------------------------------------------------


def test_random_cuts_are_deterministic_and_bounded() -> None:
    for i in range(50):
        cuts = random_cuts(7, f"r{i}", 100)
        assert cuts == random_cuts(7, f"r{i}", 100)
        assert 1 <= len(cuts) <= 4 and cuts[-1] == 100
        assert list(cuts) == sorted(set(cuts)) and cuts[0] > 0
    assert random_cuts(7, "x", 1) == (1,)


def test_fault_draw_depends_on_seed_and_rid_only() -> None:
    rids = [f"s{i}-a0" for i in range(400)]
    draws = [draw_fault(3, r, 0.5, ALL_FAULTS) for r in rids]
    assert draws == [draw_fault(3, r, 0.5, ALL_FAULTS) for r in rids]
    hit = sum(d is not None for d in draws)
    assert 120 < hit < 280
    assert len({d for d in draws if d is not None}) > 8
    assert draws != [draw_fault(4, r, 0.5, ALL_FAULTS) for r in rids]
    assert all(draw_fault(3, r, 0.0, ALL_FAULTS) is None for r in rids)
    assert all(draw_fault(3, r, 1.0, ("hang",)) == "hang" for r in rids)


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="fault_rate"):
        FakeOptions(fault_rate=1.5)
    with pytest.raises(ConfigError, match="unknown fault 'nope'"):
        FakeOptions(faults=("nope",))
    with pytest.raises(ConfigError, match="hidden_size"):
        FakeOptions(hidden_size=0)
    assert set(BENIGN_FAULTS) < set(ALL_FAULTS)


# --- clean dumps -----------------------------------------------------------------------------


async def test_clean_request_dumps_what_the_protocol_says(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    ids = prompt(37)
    async with running_fake_server(FakeOptions(dump_root=shm_root, model="m1")) as srv:
        status, body = await post_hsx(session, srv.url, "rid-1", ids)
    assert status == 200
    assert body == {  # SGLang's answer, from the built-in servers' one front end
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "rid-1",
            "prompt_tokens": 37,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
        },
    }
    protocol.check_response(body, rid="rid-1", num_tokens=37)
    meta = check_dump(shm_root, "rid-1", ids)
    assert meta.parts == ((0, 37),)
    assert (meta.model, meta.server) == ("m1", SERVER_NAME)
    assert f"hsx-fake {__version__}" == SERVER_NAME
    assert srv.stats.tokens_dumped == 37 and srv.stats.commits == 1


async def test_chunk_size_splits_into_parts(shm_root: Path, session: aiohttp.ClientSession) -> None:
    ids = prompt(35)
    async with running_fake_server(FakeOptions(dump_root=shm_root, chunk_size=10)) as srv:
        assert (await post_hsx(session, srv.url, "r", ids))[0] == 200
    assert check_dump(shm_root, "r", ids).parts == ((0, 10), (10, 20), (20, 30), (30, 35))


async def test_batch_budget_splits_a_long_prompt(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    ids = prompt(40)
    async with running_fake_server(FakeOptions(dump_root=shm_root, max_batch_tokens=16)) as srv:
        assert (await post_hsx(session, srv.url, "r", ids))[0] == 200
        assert srv.stats.passes == 3
    assert check_dump(shm_root, "r", ids).parts == ((0, 16), (16, 32), (32, 40))


async def test_random_chunks_split_prompts(shm_root: Path, session: aiohttp.ClientSession) -> None:
    options = FakeOptions(dump_root=shm_root, random_chunks=True, seed=5)
    prompts = {f"r{i}": prompt(20 + i, seed=i) for i in range(8)}
    async with running_fake_server(options) as srv:
        for rid, ids in prompts.items():
            assert (await post_hsx(session, srv.url, rid, ids))[0] == 200
    counts = []
    for rid, ids in prompts.items():
        meta = check_dump(shm_root, rid, ids)
        assert tuple(e for _, e in meta.parts) == random_cuts(5, rid, len(ids))
        counts.append(len(meta.parts))
    assert max(counts) > 1


async def post_queued(
    srv: FakeServerHandle, session: aiohttp.ClientSession, prompts: dict[str, list[int]]
) -> list[int]:
    """POST every prompt with passes paused until all are queued, so passes are batches;
    returns the HTTP statuses in prompt order."""
    srv.pause_passes()
    tasks = [
        asyncio.create_task(post_hsx(session, srv.url, rid, ids)) for rid, ids in prompts.items()
    ]
    async with asyncio.timeout(WAIT_S):
        for rid in prompts:
            await srv.stats.wait_received(rid)
    srv.resume_passes()
    return [status for status, _ in await asyncio.gather(*tasks)]


async def test_concurrent_requests_are_batched_and_each_dump_is_right(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    prompts = {f"c{i}": prompt(5 + 7 * i, seed=i) for i in range(10)}
    options = FakeOptions(dump_root=shm_root, max_batch_tokens=100, writer_threads=2)
    async with running_fake_server(options) as srv:
        statuses = await post_queued(srv, session, prompts)
        assert srv.stats.max_pass_requests > 2
    assert statuses == [200] * len(prompts)
    parts = 0
    for rid, ids in prompts.items():
        parts += len(check_dump(shm_root, rid, ids).parts)
    assert parts > len(prompts)  # the budget made some prompts continue in the next pass
    assert srv.stats.tokens_dumped == sum(len(v) for v in prompts.values())


async def test_with_modelled_gpu_time_passes_overlap_their_writes_and_dumps_stay_right(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    """Latency on: a pass's parts are written while the next pass computes. Chunked
    prompts run in consecutive passes, so their parts land in order, and every dump
    is complete and exact when its response arrives."""
    prompts = {f"o{i}": prompt(9 + 11 * i, seed=i) for i in range(8)}
    options = FakeOptions(
        dump_root=shm_root,
        max_batch_tokens=40,
        chunk_size=16,
        latency_base_ms=1.0,
        latency_per_token_us=1.0,
        writer_threads=2,
    )
    async with running_fake_server(options) as srv:
        statuses = await post_queued(srv, session, prompts)
        assert srv.stats.passes > 4
    assert statuses == [200] * len(prompts)
    for rid, ids in prompts.items():
        meta = check_dump(shm_root, rid, ids)
        assert meta.parts[-1][1] == len(ids)
    assert srv.stats.tokens_dumped == sum(len(v) for v in prompts.values())


async def test_request_without_ns_is_served_and_dumps_nothing(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    async with running_fake_server(FakeOptions(dump_root=shm_root)) as srv:
        body = {"rid": "plain", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
        status, answer = await post(session, srv.url, body)
        status2, _ = await post(session, srv.url, {"text": "hello there"})
    assert (status, status2) == (200, 200)
    assert answer["meta_info"]["id"] == "plain"
    assert answer["meta_info"]["prompt_tokens"] == 3
    assert files_under(shm_root) == []
    assert srv.stats.hsx_requests == 0 and srv.stats.requests == 2


# --- safety ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ns", "rid"),
    [
        ("../x", "r"),
        ("/abs", "r"),
        ("..", "r"),
        (".hidden", "r"),
        ("a/b", "r"),
        ("a\x00b", "r"),
        ("n" * 65, "r"),
        ("", "r"),
        ("ok\n", "r"),
        (NS, "../x"),
        (NS, "/etc"),
        (NS, "r\x00"),
        (NS, "r" * 129),
        (NS, ""),
        (NS, "a/b"),
    ],
)
async def test_invalid_ns_or_rid_is_400_and_writes_nothing(
    shm_root: Path, session: aiohttp.ClientSession, ns: str, rid: str
) -> None:
    root = shm_root / "root"
    async with running_fake_server(FakeOptions(dump_root=root)) as srv:
        status, body = await post(session, srv.url, protocol.generate_body(rid, ns, [1, 2]))
        assert srv.stats.bad_requests == 1 and srv.stats.hsx_requests == 0
    assert status == 400
    assert "does not match" in body["error"]["message"]
    assert files_under(shm_root) == []  # not even the dump root was created


async def test_symlinked_namespace_is_refused(
    shm_root: Path, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (shm_root / NS).symlink_to(target)
    async with running_fake_server(FakeOptions(dump_root=shm_root)) as srv:
        status, body = await post_hsx(session, srv.url, "r", prompt(5))
    assert status == 500
    assert "not a plain directory" in body["error"]["message"]
    assert list(target.iterdir()) == []
    assert files_under(shm_root) == [NS]


# --- faults ----------------------------------------------------------------------------------


async def _faulty(
    shm_root: Path, session: aiohttp.ClientSession, kind: str, ids: list[int], **kw: Any
) -> tuple[int | None, dict[str, Any] | None, FakeServerHandle]:
    """One request with fault ``kind``; status None means the connection was dropped."""
    options = FakeOptions(dump_root=shm_root, chunk_size=8, fault_rate=1.0, faults=(kind,), **kw)
    async with running_fake_server(options) as srv:
        try:
            status, body = await post_hsx(session, srv.url, "rf", ids)
        except aiohttp.ServerDisconnectedError:
            status, body = None, None
    assert srv.stats.fault_log == {"rf": kind}
    assert srv.stats.faults == {kind: 1}
    return status, body, srv


async def test_fault_http_500_writes_nothing(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    status, _, _ = await _faulty(shm_root, session, "http_500", prompt(20))
    assert status == 500
    assert files_under(shm_root) == []


async def test_fault_drop_before_writes_nothing(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    status, _, _ = await _faulty(shm_root, session, "drop_before", prompt(20))
    assert status is None
    assert files_under(shm_root) == []


async def test_fault_drop_after_dumps_fully(shm_root: Path, session: aiohttp.ClientSession) -> None:
    ids = prompt(20)
    status, _, _ = await _faulty(shm_root, session, "drop_after", ids)
    assert status is None
    assert check_dump(shm_root, "rf", ids).parts == ((0, 8), (8, 16), (16, 20))


async def test_fault_abort_dump_leaves_parts_without_meta(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    status, _, srv = await _faulty(shm_root, session, "abort_dump", prompt(20))
    assert status == 200
    assert not (shm_root / NS / "rf" / protocol.META_NAME).exists()
    assert sorted(part_sizes(shm_root, "rf")) == [(0, 8), (8, 16), (16, 20)]
    assert srv.stats.commits == 0


async def test_fault_late_meta_commits_after_the_response(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    ids = prompt(20)
    options = FakeOptions(
        dump_root=shm_root, fault_rate=1.0, faults=("late_meta",), late_meta_s=1.0
    )
    async with running_fake_server(options) as srv:
        status, body = await post_hsx(session, srv.url, "rl", ids)
        assert status == 200
        protocol.check_response(body, rid="rl", num_tokens=20)
        # 1 s margin: the check runs right after the response, the commit a second later.
        assert not (shm_root / NS / "rl" / protocol.META_NAME).exists()
        async with asyncio.timeout(WAIT_S):
            await srv.stats.wait_committed("rl")
    check_dump(shm_root, "rl", ids)
    assert srv.stats.fault_log == {"rl": "late_meta"}


@pytest.mark.parametrize(
    ("kind", "symptom"),
    [
        ("truncated_part", "has .* bytes, expected"),
        ("oversized_part", "has .* bytes, expected"),
    ],
)
async def test_fault_part_size(
    shm_root: Path, session: aiohttp.ClientSession, kind: str, symptom: str
) -> None:
    status, _, _ = await _faulty(shm_root, session, kind, prompt(20))
    assert status == 200
    meta = read_meta(shm_root, "rf")
    protocol.check_meta(meta, rid="rf", num_tokens=20, hidden_size=H, aux_layers=AUX)
    with pytest.raises(DumpError, match=symptom):
        protocol.check_part_sizes(meta, part_sizes(shm_root, "rf"), protocol.row_bytes(H, AUX))


@pytest.mark.parametrize(
    ("kind", "symptom"),
    [
        ("gap_parts", "gap at row 16"),
        ("overlap_parts", "overlap at row 20"),
        ("wrong_num_tokens", "num_tokens is 21"),
        ("wrong_hidden_size", "hidden_size is 65"),
        ("wrong_layers", "aux_layers is"),
    ],
)
async def test_fault_meta(
    shm_root: Path, session: aiohttp.ClientSession, kind: str, symptom: str
) -> None:
    status, _, _ = await _faulty(shm_root, session, kind, prompt(20))
    assert status == 200
    meta = read_meta(shm_root, "rf")
    with pytest.raises(DumpError, match=symptom):
        protocol.check_meta(meta, rid="rf", num_tokens=20, hidden_size=H, aux_layers=AUX)
    if kind in ("gap_parts", "overlap_parts"):  # the files agree with their names
        protocol.check_part_sizes(meta, part_sizes(shm_root, "rf"), protocol.row_bytes(H, AUX))


@pytest.mark.parametrize(
    ("kind", "symptom"),
    [
        ("cached_tokens", "cached_tokens"),
        ("wrong_prompt_tokens", "prompt_tokens is 21"),
        ("wrong_rid", "meta_info.id"),
    ],
)
async def test_fault_response(
    shm_root: Path, session: aiohttp.ClientSession, kind: str, symptom: str
) -> None:
    ids = prompt(20)
    status, body, _ = await _faulty(shm_root, session, kind, ids)
    assert status == 200
    with pytest.raises(DumpError, match=symptom):
        protocol.check_response(body, rid="rf", num_tokens=20)
    check_dump(shm_root, "rf", ids)


async def test_fault_hang_is_released_by_stop(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    options = FakeOptions(dump_root=shm_root, fault_rate=1.0, faults=("hang",))
    async with running_fake_server(options) as srv:
        task = asyncio.create_task(post_hsx(session, srv.url, "rh", prompt(5)))
        async with asyncio.timeout(WAIT_S):
            await srv.stats.wait_received("rh")
            await srv.stop()  # must not wait for the hung request
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await task
    assert files_under(shm_root) == []


def test_every_fault_kind_is_tested() -> None:
    tested = {
        "http_500", "drop_before", "drop_after", "abort_dump", "late_meta", "truncated_part",
        "oversized_part", "gap_parts", "overlap_parts", "wrong_num_tokens", "wrong_hidden_size",
        "wrong_layers", "cached_tokens", "wrong_prompt_tokens", "wrong_rid", "hang",
    }  # fmt: skip
    assert tested == set(ALL_FAULTS)


# --- runtime knobs ---------------------------------------------------------------------------


async def test_faults_and_health_change_at_runtime(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    async with running_fake_server(FakeOptions(dump_root=shm_root)) as srv:
        assert (await post_hsx(session, srv.url, "a", prompt(3)))[0] == 200
        srv.set_faults(1.0, ("http_500",))
        assert (await post_hsx(session, srv.url, "b", prompt(3)))[0] == 500
        srv.set_faults(0.0)
        assert (await post_hsx(session, srv.url, "c", prompt(3)))[0] == 200
        with pytest.raises(ConfigError):
            srv.set_faults(1.0, ("bogus",))
        async with session.get(f"{srv.url}/health") as resp:
            assert resp.status == 200
        srv.set_healthy(False)
        async with session.get(f"{srv.url}/health") as resp:
            assert resp.status == 503
        srv.set_healthy(True)
        async with session.get(f"{srv.url}/health") as resp:
            assert resp.status == 200
        async with session.get(f"{srv.url}/hsx_fake/stats") as resp:
            stats = await resp.json()
    assert stats["fault_log"] == {"b": "http_500"}
    assert stats["hsx_requests"] == 3 and stats["faults"] == {"http_500": 1}
    assert stats["commits"] == 2


async def test_restart_keeps_the_url_and_drops_requests_in_flight(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    async with running_fake_server(FakeOptions(dump_root=shm_root)) as srv:
        url = srv.url
        srv.pause_passes()
        task = asyncio.create_task(post_hsx(session, url, "queued", prompt(5)))
        async with asyncio.timeout(WAIT_S):
            await srv.stats.wait_received("queued")
        await srv.stop()
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await task
        with pytest.raises(aiohttp.ClientConnectionError):
            await post_hsx(session, url, "down", prompt(5))
        srv.resume_passes()
        await srv.restart()
        assert srv.url == url and srv.stats.restarts == 1
        ids = prompt(9)
        assert (await post_hsx(session, url, "after", ids))[0] == 200
    assert not (shm_root / NS / "queued").exists()
    check_dump(shm_root, "after", ids)


async def test_info_endpoints(shm_root: Path, session: aiohttp.ClientSession) -> None:
    options = FakeOptions(dump_root=shm_root, hidden_size=32, aux_layers=(2, 30), model="x/y")
    async with running_fake_server(options) as srv:
        async with session.get(f"{srv.url}/get_model_info") as resp:
            model = await resp.json()
        async with session.get(f"{srv.url}/get_server_info") as resp:
            server = await resp.json()
    assert model == {
        "model_path": "x/y",
        "is_generation": True,
        "hidden_size": 32,
        "hsx_aux_layers": [2, 30],
    }
    assert server["version"] == f"fake-{__version__}"
    assert server["disable_radix_cache"] is True


# --- command line ----------------------------------------------------------------------------


def test_cli_parser_builds_options(shm_root: Path) -> None:
    args = build_parser().parse_args(
        [
            "fake-server",
            "--port", "0",
            "--hidden-size", "7168",
            "--aux-layers", "2,30,58",
            "--dump-root", str(shm_root),
            "--chunk-size", "4096",
            "--random-chunks",
            "--max-batch-tokens", "8192",
            "--latency-base-ms", "1.5",
            "--latency-per-token-us", "20",
            "--fault-rate", "0.1",
            "--faults", "http_500,hang",
            "--late-meta-s", "2",
            "--seed", "9",
        ]
    )  # fmt: skip
    options = options_from_args(args)
    assert options == FakeOptions(
        hidden_size=7168,
        aux_layers=(2, 30, 58),
        dump_root=shm_root,
        chunk_size=4096,
        random_chunks=True,
        max_batch_tokens=8192,
        latency_base_ms=1.5,
        latency_per_token_us=20.0,
        fault_rate=0.1,
        faults=("http_500", "hang"),
        late_meta_s=2.0,
        seed=9,
    )
    assert options_from_args(build_parser().parse_args(["fake-server"])) == FakeOptions()


def test_cli_rejects_unknown_fault(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fake-server", "--faults", "http_500,nope"])
    assert "unknown fault 'nope'" in capsys.readouterr().err


async def test_cli_serves_until_sigterm_and_exits_0(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hsx_async", "fake-server", "--port", "0",
        "--dump-root", str(shm_root), "--chunk-size", "4",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(WAIT_S):
            line = (await proc.stdout.readline()).decode()
            url = line.rsplit(" ", 1)[-1].strip()
            assert line.startswith("hsx fake-server listening on http://127.0.0.1:")
            ids = prompt(10)
            assert (await post_hsx(session, url, "cli", ids))[0] == 200
            proc.terminate()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert check_dump(shm_root, "cli", ids).parts == ((0, 4), (4, 8), (8, 10))
    assert {p.split("/")[0] for p in files_under(shm_root)} == {NS}


def test_cli_on_a_taken_port_says_so_in_one_line_and_exits_2(
    shm_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as owner:
        owner.bind(("127.0.0.1", 0))
        owner.listen(1)
        port = owner.getsockname()[1]
        code = main(["fake-server", "--port", str(port), "--dump-root", str(shm_root)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"hsx: error: argument --port: 127.0.0.1:{port} is in use (another server is "
        "listening there, and hsx run would talk to it): stop that one, or give this one a "
        "free --port and the job's server.urls the same port\n"
    )
    assert files_under(shm_root) == []


# --- FP8 storage ---------------------------------------------------------------------------

FAKE_FP8_ALL = protocol.Storage(protocol.FP8, tuple(range(L)), protocol.PER_TOKEN_SLOT_OUTLIERS16)
FAKE_FP8_AUX = protocol.Storage(
    protocol.FP8, tuple(range(L - 1)), protocol.PER_TOKEN_SLOT_OUTLIERS16
)
FAKE_FP8_ALL_V3 = protocol.Storage(protocol.FP8, tuple(range(L)), protocol.PER_TOKEN_SLOT)


@pytest.mark.parametrize(
    "storage",
    [FAKE_FP8_ALL, FAKE_FP8_AUX, FAKE_FP8_ALL_V3],
    ids=["all", "aux", "all-per_token_slot"],
)
async def test_fp8_request_dumps_encode_rows_of_its_bf16_rows(
    shm_root: Path, session: aiohttp.ClientSession, storage: protocol.Storage
) -> None:
    ids = prompt(35, seed=4)
    async with running_fake_server(FakeOptions(dump_root=shm_root, chunk_size=16)) as srv:
        assert (await post_hsx(session, srv.url, "bf", ids))[0] == 200
        body = protocol.generate_body("q", NS, ids, storage)
        assert (await post(session, srv.url, body))[0] == 200
        assert (srv.stats.fp8_requests, srv.stats.storage_fallbacks) == (1, 0)
    check_dump(shm_root, "bf", ids)  # the bfloat16 dump is the one the fake always wrote
    bf16 = read_bf16_rows(shm_root / NS / "bf")
    parts = check_fp8_dump(shm_root / NS / "q", bf16, storage, aux_layers=AUX)
    assert parts == [(0, 16), (16, 32), (32, 35)]
    fp8_bytes = sum(part_sizes(shm_root, "q").values())
    assert fp8_bytes == 35 * storage.row_bytes(L, H)
    if storage.scales == protocol.PER_TOKEN_SLOT:  # at H 64 the 16 outliers outweigh FP8's gain
        assert fp8_bytes < sum(part_sizes(shm_root, "bf").values())


async def test_unusable_fp8_request_is_dumped_bf16(
    shm_root: Path, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    ids = prompt(12)
    body = protocol.generate_body("r", NS, ids)
    body["sampling_params"]["custom_params"].update(hsx_dtype=protocol.FP8, hsx_quantized=[L])
    async with running_fake_server(FakeOptions(dump_root=shm_root, chunk_size=5)) as srv:
        assert (await post(session, srv.url, body))[0] == 200
        assert (srv.stats.fp8_requests, srv.stats.storage_fallbacks) == (0, 1)
    assert check_dump(shm_root, "r", ids).storage == protocol.BF16_STORAGE
    [line] = [r.getMessage() for r in caplog.records if "dumped as bfloat16" in r.getMessage()]
    assert f"past the {L} layer slots" in line


async def test_fp8_part_size_fault_is_caught_by_the_client(
    shm_root: Path, session: aiohttp.ClientSession
) -> None:
    ids = prompt(20)
    options = FakeOptions(
        dump_root=shm_root, chunk_size=8, fault_rate=1.0, faults=("truncated_part",)
    )
    async with running_fake_server(options) as srv:
        body = protocol.generate_body("rf", NS, ids, FAKE_FP8_AUX)
        assert (await post(session, srv.url, body))[0] == 200
    d = shm_root / NS / "rf"
    with pytest.raises(DumpError, match=r"has \d+ bytes, expected"):
        validate_dump(
            d, (d / protocol.META_NAME).read_bytes(), rid="rf", num_tokens=20, hidden_size=H,
            aux_layers=AUX, storage=FAKE_FP8_AUX,
        )  # fmt: skip
