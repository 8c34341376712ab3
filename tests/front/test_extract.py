"""The front's extraction (:mod:`hsx_async.front.extract`) against the fake server, without
Mooncake: the rows are the server's, the final state converted to pre-norm as the export
converts it; faults are named by whose they are; one front per dump namespace."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx_async.config import Config
from hsx_async.dataset.export.plan import FinalConversion
from hsx_async.dataset.target import pre_from_post
from hsx_async.errors import ConfigError
from hsx_async.front.extract import ExtractionFailed, Extractor, check_config, extracting
from hsx_async.protocol import PRE_NORM
from hsx_async.server.fake.options import FakeOptions
from hsx_async.server.fake.server import expected_hidden_states, running_fake_server
from tests.e2e import free_port, make_config, write_samples

VOCAB = 50_000


@pytest.fixture
async def fake(shm_root: Path) -> AsyncIterator[str]:
    options = FakeOptions(dump_root=shm_root, chunk_size=32, vocab_size=VOCAB)
    async with running_fake_server(options) as srv:
        yield srv.url


def _config(
    tmp: Path, urls: list[str], dump: Path, *, server: dict[str, Any] | None = None, **output: str
) -> Config:
    tmp.mkdir(parents=True, exist_ok=True)
    samples = write_samples(tmp / "samples.jsonl", 1).path
    return make_config(tmp, samples, urls, dump, output=dict(output), server=server or {})


async def test_rows_are_the_servers_with_the_final_state_pre_norm(
    tmp_path: Path, fake: str, shm_root: Path
) -> None:
    gain = torch.rand(64, generator=torch.Generator().manual_seed(1)) * 2.8 + 0.2
    config = _config(tmp_path, [fake], shm_root)
    ids = [3, 1, 4, 1, 5, 9, 2, 6] * 9  # 72 tokens: three chunks of the fake's 32
    async with extracting(config, FinalConversion(PRE_NORM, gain, 1e-5), tmp_path / "st") as ex:
        got = await ex.extract(ex.next_rid(), ids)
        assert [list((shm_root / ns).iterdir()) for ns in ex.namespaces] == [[]]  # read: gone
    raw = expected_hidden_states(np.asarray(ids), 64, 4)
    want = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    assert torch.equal(got.hidden_states[:, :-1], want[:, :-1])
    assert torch.equal(got.hidden_states[:, -1], pre_from_post(want[:, -1], gain))
    assert got.token_ids.tolist() == ids and got.token_ids.dtype == torch.int64


async def test_concurrent_prompts_each_get_their_own_rows(
    tmp_path: Path, fake: str, shm_root: Path
) -> None:
    """A trainer's dataloader workers ask at once: no request's dump is swept as another's
    debris (each in flight has a namespace of its own; before, all but one failed with
    dump_missing after dump.timeout)."""
    gain = torch.rand(64, generator=torch.Generator().manual_seed(2)) * 2.8 + 0.2
    config = _config(tmp_path, [fake], shm_root)
    prompts = [[3 + i] * (20 + 7 * i) for i in range(8)]
    async with extracting(config, FinalConversion(PRE_NORM, gain, 1e-5), tmp_path / "st") as ex:
        got = await asyncio.wait_for(
            asyncio.gather(*(ex.extract(ex.next_rid(), ids) for ids in prompts)), 30.0
        )
        assert 1 < len(ex.namespaces) <= len(prompts)
        assert all(list((shm_root / ns).iterdir()) == [] for ns in ex.namespaces)
    for ids, sample in zip(prompts, got, strict=True):
        raw = expected_hidden_states(np.asarray(ids), 64, 4)
        want = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        assert torch.equal(sample.hidden_states[:, :-1], want[:, :-1])
        assert sample.token_ids.tolist() == ids
    assert not (shm_root / ex.namespaces[0]).exists()  # removed with the front


async def test_faults_name_the_sample_or_the_server(
    tmp_path: Path, fake: str, shm_root: Path
) -> None:
    """Only servers hsx run's admission admitted take a prompt (one that is down never
    does); the sample's fault is final."""
    dead = f"http://127.0.0.1:{free_port()}"
    config = _config(tmp_path, [dead, fake], shm_root)
    async with extracting(config, FinalConversion(PRE_NORM, torch.ones(64), 1e-5), tmp_path) as ex:
        for _ in range(3):
            got = await ex.extract(ex.next_rid(), [1, 2])
            assert got.token_ids.tolist() == [1, 2]
        with pytest.raises(ExtractionFailed) as refused:
            await ex.extract(ex.next_rid(), [1, VOCAB + 1])
        assert (refused.value.cause, refused.value.kind) == ("sample", "rejected")
        [down] = ex.pool.out_of_rotation()
        assert down.url == dead
        assert [s.requests for s in ex.pool.servers] == [0, 4]


async def test_a_server_that_fails_leaves_rotation_and_the_prompt_moves_on(
    tmp_path: Path, shm_root: Path
) -> None:
    """Two servers admitted; one stops: the prompt it fails goes to the other, and it is
    out of rotation (as hsx run takes it out); both stopped: the prompt fails as the
    servers' fault, naming each."""
    options = FakeOptions(dump_root=shm_root, chunk_size=32, vocab_size=VOCAB)
    async with contextlib.AsyncExitStack() as servers:
        a = await servers.enter_async_context(running_fake_server(options))
        b = await servers.enter_async_context(running_fake_server(options))
        config = _config(tmp_path, [a.url, b.url], shm_root)
        conv = FinalConversion(PRE_NORM, torch.ones(64), 1e-5)
        async with extracting(config, conv, tmp_path / "st") as ex:
            await ex.extract(ex.next_rid(), [1, 2])
            await ex.extract(ex.next_rid(), [1, 2])
            assert not ex.pool.out_of_rotation()
            await a.stop()
            for _ in range(2):  # one of them goes to a first
                assert (await ex.extract(ex.next_rid(), [3, 4])).token_ids.tolist() == [3, 4]
            [out] = ex.pool.out_of_rotation()
            assert (out.url, out.out_kind) == (a.url, "unreachable")
            await b.stop()
            with pytest.raises(ExtractionFailed, match="server fault") as down:
                await ex.extract(ex.next_rid(), [1, 2])
            assert (down.value.cause, down.value.kind) == ("server", "unreachable")
            assert b.url in str(down.value)


async def test_a_server_that_refuses_everything_after_its_probe_costs_no_sample(
    tmp_path: Path, shm_root: Path
) -> None:
    """hsx run's arbitration (issue 38): a server admitted, then answering 400 to every
    request, refuses its probe too: its refusals are its own fault, not the samples'. It
    leaves rotation and the prompt moves on to the other server."""
    options = FakeOptions(dump_root=shm_root, chunk_size=32, vocab_size=VOCAB)
    async with running_fake_server(options) as good, running_fake_server(options) as bad:
        config = _config(tmp_path, [good.url, bad.url], shm_root)
        conv = FinalConversion(PRE_NORM, torch.ones(64), 1e-5)
        async with extracting(config, conv, tmp_path / "st") as ex:
            await ex.extract(ex.next_rid(), [1, 2])
            assert not ex.pool.out_of_rotation()
            bad.set_rejects(True)
            for _ in range(4):
                assert (await ex.extract(ex.next_rid(), [5, 6])).token_ids.tolist() == [5, 6]
            [out] = ex.pool.out_of_rotation()
            assert out.url == bad.url and "400" in out.last_error
        assert bad.stats.bad_requests >= 2  # a sample's request, then its probe


async def test_no_server_in_rotation_fails_the_prompt_in_bounded_time(
    tmp_path: Path, shm_root: Path
) -> None:
    """No server ever admitted: a prompt waits server.unreachable_timeout, then fails as
    the servers' fault, naming what each said; the front is still up for the next one."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = _config(tmp_path, dead, shm_root, server={"unreachable_timeout": 0.5})
    async with extracting(config, FinalConversion(PRE_NORM), tmp_path / "st") as ex:
        for _ in range(2):
            with pytest.raises(ExtractionFailed) as none:
                await asyncio.wait_for(ex.extract(ex.next_rid(), [1, 2]), 10.0)
            assert (none.value.cause, none.value.kind) == ("server", "unreachable")
            assert "no server answered for 0.5 s" in str(none.value)
            assert all(url in str(none.value) for url in dead)


async def test_a_post_norm_server_needs_the_final_norm(
    tmp_path: Path, fake: str, shm_root: Path
) -> None:
    config = _config(tmp_path, [fake], shm_root)
    async with extracting(config, FinalConversion(PRE_NORM), tmp_path / "st") as ex:
        with pytest.raises(ExtractionFailed, match="needs the final norm: give --model") as n:
            await ex.extract(ex.next_rid(), [1, 2])
        assert n.value.cause == "server"


async def test_one_front_per_dump_namespace(tmp_path: Path, fake: str, shm_root: Path) -> None:
    config = _config(tmp_path, [fake], shm_root)
    async with Extractor(config, FinalConversion(PRE_NORM), tmp_path / "a"):
        with pytest.raises(ConfigError, match=re.escape("dump.namespace_prefix")):
            async with Extractor(config, FinalConversion(PRE_NORM), tmp_path / "b"):
                pass
    async with Extractor(config, FinalConversion(PRE_NORM), tmp_path / "c"):
        pass  # released at the end of the first


def test_fp8_storage_is_refused_for_now(tmp_path: Path) -> None:
    config = _config(tmp_path, ["http://127.0.0.1:1"], tmp_path / "d", dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match=re.escape('set [output].dtype = "bfloat16"')):
        check_config(config)
