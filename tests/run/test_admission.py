"""The admission's critical path (issue 27): what a server's first contact waits for, and
what it must never let through. The verdicts themselves are tested where their causes are
(test_fault_causes.py, test_server_wait.py, test_final_state.py)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from hsx_async.dataset.manifest import read_manifest
from hsx_async.dataset.provenance import read_provenance, record_server
from hsx_async.errors import ConfigError
from hsx_async.run.client import Server, SGLangClient
from hsx_async.run.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import make_config, write_samples

H, AUX = 64, (1, 3, 5)
BOUND_S = 20.0  # no wait below lasts longer: a regression fails, it does not hang


async def test_samples_go_out_while_the_record_is_written_and_commit_only_after_it(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admitted server's identity is written into provenance.json while it takes its
    first samples; no sample is named or listed before that write is done. The record is
    held here until a sample's request has been answered (before, the run wrote it first
    and only then sent a sample: this would wait out BOUND_S)."""
    samples = write_samples(tmp_path / "in.jsonl", 6, max_len=16, seed=5)
    answered = threading.Event()  # a sample's request came back
    seen: dict[str, Any] = {}
    real_generate = SGLangClient.generate

    def held_record(out: Path, *args: Any, **kwargs: Any) -> None:
        seen["overlapped"] = answered.wait(BOUND_S)
        seen["listed_before"] = len(read_manifest(out))
        record_server(out, *args, **kwargs)

    async def generate(self: SGLangClient, server: Server, *, rid: str, **kw: Any) -> None:
        await real_generate(self, server, rid=rid, **kw)
        if "-probe-" not in rid:
            answered.set()

    monkeypatch.setattr("hsx_async.run.daemon.record_server", held_record)
    monkeypatch.setattr(SGLangClient, "generate", generate)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        summary = await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
    assert seen == {"overlapped": True, "listed_before": 0}
    assert summary.done == 6
    out = config.output.dir
    assert len(read_manifest(out)) == 6
    record = read_provenance(out)
    assert record is not None and list(record["servers"]) == [fake.url]
    assert record["final_state"] == "post_norm"  # the kind, in the same write


def _info_after_probe(
    monkeypatch: pytest.MonkeyPatch, get_json: Any, probed: asyncio.Event, sent: list[str]
) -> None:
    """``get_json`` replaces the info calls; every request's rid goes into ``sent``, and
    ``probed`` is set once a probe's request came back."""
    real_generate = SGLangClient.generate

    async def generate(self: SGLangClient, server: Server, *, rid: str, **kw: Any) -> None:
        sent.append(rid)
        await real_generate(self, server, rid=rid, **kw)
        if "-probe-" in rid:
            probed.set()

    monkeypatch.setattr(SGLangClient, "get_json", get_json)
    monkeypatch.setattr(SGLangClient, "generate", generate)


async def test_the_probe_goes_out_while_the_info_endpoints_are_read(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The info calls are held until the probe's request has been answered (one after the
    other, the probe waited for them: this would wait out BOUND_S)."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=16, seed=6)
    probed = asyncio.Event()
    seen: list[bool] = []
    real_get_json = SGLangClient.get_json

    async def get_json(self: SGLangClient, url: str, path: str, timeout: float = 10.0) -> object:
        try:
            await asyncio.wait_for(probed.wait(), BOUND_S)
            seen.append(True)
        except TimeoutError:
            seen.append(False)
        return await real_get_json(self, url, path, timeout)

    _info_after_probe(monkeypatch, get_json, probed, [])
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        summary = await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
    assert seen and all(seen)
    assert summary.done == 3


async def test_a_server_whose_info_disagrees_is_judged_by_it_although_its_probe_passed(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict reads the info before the probe, as when they ran one after the other:
    a server that reports another hidden size stops the job on ``model.hidden_size``
    (the config's fault) even though its probe, sent alongside, came back valid, and no
    sample is sent to it."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=16, seed=7)
    probed = asyncio.Event()
    sent: list[str] = []
    real_get_json = SGLangClient.get_json

    async def get_json(self: SGLangClient, url: str, path: str, timeout: float = 10.0) -> object:
        await asyncio.wait_for(probed.wait(), BOUND_S)
        found = await real_get_json(self, url, path, timeout)
        if isinstance(found, dict) and "hidden_size" in found:
            found = {**found, "hidden_size": 2 * H}
        return found

    _info_after_probe(monkeypatch, get_json, probed, sent)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        with pytest.raises(ConfigError, match=r"model.hidden_size.*reports hidden size 128"):
            await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
    assert sent and all("-probe-" in rid for rid in sent)
    assert read_manifest(config.output.dir) == []


async def test_a_server_examined_again_answers_health_before_it_is_sent_a_probe(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a server's first contact sends the probe alongside /health: a server that
    answers /health 503 is examined every ``server.health_interval``, and is sent no probe
    again until /health answers 200 (a sick or hung one is not sent a probe a round)."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=16, seed=8)
    probes_while_sick: list[str] = []
    checks = 0
    real_health = SGLangClient.health
    real_generate = SGLangClient.generate
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        fake.set_healthy(False)
        sick = True

        async def health(self: SGLangClient, url: str, timeout: float = 5.0) -> str:
            nonlocal checks, sick
            checks += 1
            if checks == 4:  # three rounds answered 503; well from the fourth on
                fake.set_healthy(True)
                sick = False
            return await real_health(self, url, timeout)

        async def generate(self: SGLangClient, server: Server, *, rid: str, **kw: Any) -> None:
            if sick:
                probes_while_sick.append(rid)
            await real_generate(self, server, rid=rid, **kw)

        monkeypatch.setattr(SGLangClient, "health", health)
        monkeypatch.setattr(SGLangClient, "generate", generate)
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, server={"health_interval": 0.02}
        )
        summary = await asyncio.wait_for(Daemon(config).run(), BOUND_S)
    assert checks >= 4
    assert len(probes_while_sick) == 1 and "-probe-" in probes_while_sick[0]
    assert summary.done == 3


async def test_a_wrong_dump_root_leaves_nothing_in_the_servers_real_one(
    tmp_path: Path, shm_root: Path
) -> None:
    """Issue 39: the probe the server dumped under its own HSX_DUMP_ROOT (not dump.root)
    stayed there after the run was refused."""
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=16)
    theirs, ours = shm_root / "theirs", shm_root / "ours"
    theirs.mkdir()
    (theirs / "someone-else").mkdir()  # another job's namespace: left alone
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=theirs)
    async with running_fake_server(options) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], ours, dump={"timeout": 0.3})
        with pytest.raises(ConfigError) as err:
            await asyncio.wait_for(Daemon(config).run(), BOUND_S)
        assert fake.stats.hsx_requests >= 1  # the probe was dumped, there
    assert err.value.key == "dump.root" and str(theirs) in str(err.value)
    assert sorted(p.name for p in theirs.rglob("*")) == ["someone-else"]
    assert [p for p in ours.iterdir() if not p.name.startswith(".")] == []
