"""``hsx regenerate``'s servers go through the one examination of a server
(:class:`~hsx_async.run.servers.admission.Admission` with the decode probe), so it decides what
``hsx run``'s does (issue 38): a storm of refusals from one server is arbitrated by the
probe before the conversations pay, and a server with other weights under the same model
name is refused by what its probe's answer is, not only by what it says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.config import Config
from hsx_async.errors import NoServerError
from hsx_async.prepare.regenerate import RegenPaths, regenerate
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server
from tests.prepare.conftest import WriteLines, tiny_conversation
from tests.prepare.regenerate.decode_servers import vllm_front
from tests.prepare.regenerate.test_pipeline import _config as vllm_config
from tests.prepare.regenerate.test_pipeline import _lines


def _config(tmp: Path, urls: list[str], model_dir: Path, **server: Any) -> Config:
    return vllm_config(tmp, urls, model_dir, engine="vllm", **server)


async def test_a_storm_of_refusals_is_arbitrated_by_the_probe(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """A server passes its probe, then answers 400 to every request: the refusals are
    arbitrated by a probe, which it refuses too — it leaves rotation, and not one
    conversation is charged or quarantined (the run waits for a server, then exit 3).
    (Before: "a 4xx is the conversation's", and all 10 were quarantined, exit 0.)"""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(10)])
    out = tmp_path / "regen.jsonl"
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref,
        vllm_front(ref.url, refuse_after=1) as storm,  # its admission probe passes
    ):
        config = _config(
            tmp_path, [storm.url], tiny_model_dir, unreachable_timeout=1.0, health_interval=0.1
        )
        with pytest.raises(NoServerError, match=r"refused \(set by the test\)"):
            await regenerate(config, src, out)
    assert len(storm.requests) > 1  # turns were sent, and refused
    assert _lines(RegenPaths.beside(out).quarantine) == []
    assert _lines(out) == []


async def test_a_storm_beside_a_healthy_server_costs_no_conversation(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """The storm server beside a healthy one: it leaves rotation with its probe's refusal,
    and every conversation is written, none quarantined, each from the healthy server."""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(10)])
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref,
        vllm_front(ref.url) as healthy,
        vllm_front(ref.url, refuse_after=1) as storm,
    ):
        config = _config(tmp_path, [storm.url, healthy.url], tiny_model_dir)
        summary = await regenerate(config, src, tmp_path / "regen.jsonl")
    assert (summary.done, summary.quarantined) == (10, 0)
    assert summary.servers_out and all(
        s["server"] == storm.url and "its probe was refused too" not in s["reason"]
        for s in summary.servers_out
    )
    assert _lines(RegenPaths.beside(tmp_path / "regen.jsonl").quarantine) == []


async def test_other_weights_under_one_model_name_are_refused(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """Two servers both say they serve "tiny", with other weights behind them: the second
    is refused by its probe's greedy answer (kind "identity", naming the pinned server),
    and every conversation comes from the first, as it does alone. (Before: both were
    admitted and the output mixed the answers of two models.)"""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(8)])
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root, seed=0)) as a,
        running_reference_server(ReferenceOptions(dump_root=shm_root, seed=1)) as b,
        vllm_front(a.url, model="tiny") as front_a,
        vllm_front(b.url, model="tiny") as front_b,
    ):
        alone = {}
        for front in (front_a, front_b):
            alone[front.url] = tmp_path / f"alone-{front.url.rsplit(':', 1)[1]}.jsonl"
            await regenerate(_config(tmp_path, [front.url], tiny_model_dir), src, alone[front.url])
        both = tmp_path / "both.jsonl"
        summary = await regenerate(
            _config(tmp_path, [front_a.url, front_b.url], tiny_model_dir), src, both
        )
    [spell] = summary.servers_out
    assert spell["kind"] == "identity" and "with other weights than" in spell["reason"]
    admitted = front_a.url if spell["server"] == front_b.url else front_b.url
    assert admitted in spell["reason"]
    assert sorted(map(orjson.dumps, _lines(both))) == sorted(
        map(orjson.dumps, _lines(alone[admitted]))
    )
    assert summary.servers[spell["server"]] == 0  # not one turn went to the other weights
    # The job's identity is pinned as an Identity (not a model string) and reported.
    assert summary.identity is not None
    assert (summary.identity["engine"], summary.identity["model"]) == ("vllm", "tiny")
