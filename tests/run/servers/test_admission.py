"""The admission's critical path (issue 27): what a server's first contact waits for, and
what it must never let through. The verdicts themselves are tested where their causes are
(test_fault_causes.py, test_server_wait.py, test_final_state.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx_async.config import Config
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.dataset.provenance import read_provenance, record_server
from hsx_async.errors import ConfigError, NoServerError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.servers.client import EngineClient
from hsx_async.run.servers.pool import Server
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.crash_driver import L, fake_options
from tests.e2e import check_dataset, make_config, when_done, write_samples

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
    real_generate = EngineClient.generate

    def held_record(out: Path, *args: Any, **kwargs: Any) -> None:
        seen["overlapped"] = answered.wait(BOUND_S)
        seen["listed_before"] = len(read_manifest(out))
        record_server(out, *args, **kwargs)

    async def generate(self: EngineClient, server: Server, *, rid: str, **kw: Any) -> None:
        await real_generate(self, server, rid=rid, **kw)
        if "-probe-" not in rid:
            answered.set()

    monkeypatch.setattr("hsx_async.run.daemon.daemon.record_server", held_record)
    monkeypatch.setattr(EngineClient, "generate", generate)
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
    real_generate = EngineClient.generate

    async def generate(self: EngineClient, server: Server, *, rid: str, **kw: Any) -> None:
        sent.append(rid)
        await real_generate(self, server, rid=rid, **kw)
        if "-probe-" in rid:
            probed.set()

    monkeypatch.setattr(EngineClient, "get_json", get_json)
    monkeypatch.setattr(EngineClient, "generate", generate)


async def test_the_probe_goes_out_while_the_info_endpoints_are_read(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The info calls are held until the probe's request has been answered (one after the
    other, the probe waited for them: this would wait out BOUND_S)."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=16, seed=6)
    probed = asyncio.Event()
    seen: list[bool] = []
    real_get_json = EngineClient.get_json

    async def get_json(self: EngineClient, url: str, path: str, timeout: float = 10.0) -> object:
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
    real_get_json = EngineClient.get_json

    async def get_json(self: EngineClient, url: str, path: str, timeout: float = 10.0) -> object:
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
    real_health = EngineClient.health
    real_generate = EngineClient.generate
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        fake.set_healthy(False)
        sick = True

        async def health(self: EngineClient, url: str, timeout: float = 5.0) -> str:
            nonlocal checks, sick
            checks += 1
            if checks == 4:  # three rounds answered 503; well from the fourth on
                fake.set_healthy(True)
                sick = False
            return await real_health(self, url, timeout)

        async def generate(self: EngineClient, server: Server, *, rid: str, **kw: Any) -> None:
            if sick:
                probes_while_sick.append(rid)
            await real_generate(self, server, rid=rid, **kw)

        monkeypatch.setattr(EngineClient, "health", health)
        monkeypatch.setattr(EngineClient, "generate", generate)
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


# -- issue 38: the holes in what an examination decides ------------------------------------


def _when(daemon: Daemon, wanted: Callable[[Server, bool], bool], then: Callable[[], None]) -> None:
    """Call ``then`` (at once, in the pool's change) the first time a server change matches."""
    fired = False

    def check(server: Server, in_rotation: bool) -> None:
        nonlocal fired
        if not fired and wanted(server, in_rotation):
            fired = True
            then()

    daemon.on_server_change.append(check)


def _fast(tmp: Path, samples: Path, urls: list[str], root: Path, **over: Any) -> Config:
    base: dict[str, Any] = {"server": {"unreachable_timeout": 1.5}}
    for section, keys in over.items():
        base.setdefault(section, {}).update(keys)
    return make_config(tmp, samples, urls, root, **base)


@pytest.mark.parametrize("alone", [False, True])
async def test_a_server_that_refuses_everything_after_its_probe_costs_no_sample(
    tmp_path: Path, shm_root: Path, alone: bool
) -> None:
    """A server passes its probe, then answers 400 to every request. Before: 270-283 of
    300 samples quarantined beside a healthy server (all of them alone), exit 0, and it
    never left rotation. Now its refusals are arbitrated by its probe, which it refuses
    too: it leaves rotation, and no sample pays (alone: exit 3, nothing quarantined)."""
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=16, seed=11)
    async with (
        running_fake_server(fake_options(shm_root)) as good,
        running_fake_server(fake_options(shm_root)) as bad,
    ):
        urls = [bad.url] if alone else [good.url, bad.url]
        config = _fast(tmp_path, samples.path, urls, shm_root)
        daemon = Daemon(config)
        _when(daemon, lambda s, up: up and s.url == bad.url, lambda: bad.set_rejects(True))
        if alone:
            with pytest.raises(NoServerError, match="refused"):
                await asyncio.wait_for(daemon.run(), 2 * BOUND_S)
        else:
            summary = await asyncio.wait_for(daemon.run(), 2 * BOUND_S)
            assert (summary.done, summary.quarantined) == (len(samples.good), 0)
            check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
        refused = bad.stats.bad_requests
        status = {s["url"]: s for s in daemon.status()["servers"]}
    assert refused > 0  # it did refuse samples
    assert read_quarantine(config.output.dir) == []
    assert not status[bad.url]["healthy"]


async def test_a_refused_sample_still_pays_where_the_server_passes_its_probe(
    tmp_path: Path, shm_root: Path
) -> None:
    """The other side of the arbitration: a server refuses the samples with a token id
    past its vocabulary, and the probe (ids 1-4) passes: those samples are quarantined,
    one request each, and the server stays in rotation for the others."""
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=16, seed=12)
    async with running_fake_server(fake_options(shm_root, vocab_size=40_000)) as srv:
        config = _fast(tmp_path, samples.path, [srv.url], shm_root)
        summary = await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
        refused = srv.stats.bad_requests
    quarantined = read_quarantine(config.output.dir)
    assert 0 < summary.quarantined == len(quarantined) == refused
    assert summary.done + summary.quarantined == len(samples.good)


async def test_a_server_whose_dumps_the_copy_refuses_is_not_admitted(
    tmp_path: Path, shm_root: Path
) -> None:
    """Every FP8 dump of the server names an outlier channel past H: the copy refuses each.
    Before, the probe never ran the copy's checks, so each eviction was settled "the
    server works": 100/100 quarantined, exit 0. Now the probe runs them: the server is
    refused with the copy's words, nothing is charged, and the run exits 3."""
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=16, seed=13)
    options = fake_options(shm_root, bad_outliers=True)
    async with running_fake_server(options) as srv:
        config = _fast(
            tmp_path, samples.path, [srv.url], shm_root, output={"dtype": "float8_e4m3fn"}
        )
        assert config.storage.outliers
        with pytest.raises(NoServerError, match="outlier channels are past the hidden size"):
            await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
        asked = srv.stats.hsx_requests
    assert read_quarantine(config.output.dir) == []
    assert read_manifest(config.output.dir) == []
    assert asked <= 2 * 40  # probes only: one a round (health_interval 0.05 s, 1.5 s)


async def test_two_servers_of_one_model_path_with_other_weights_never_mix(
    tmp_path: Path, shm_root: Path
) -> None:
    """Both say /models/base; the second has other weights. Before: 43-44 of 100 samples
    came from it, exit 0. Now its probe's rows are not the pinned ones: it is refused,
    naming both servers, and every sample is the first's (bit-exact)."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=16, seed=14)
    async with (
        running_fake_server(fake_options(shm_root, model="/models/base")) as base,
        running_fake_server(fake_options(shm_root, model="/models/base", weights=1)) as other,
    ):
        config = _fast(tmp_path, samples.path, [base.url, other.url], shm_root)
        daemon = Daemon(config)
        real = other.stats.note_received
        asked_other: list[str] = []

        def noting(rid: str, fault: str | None) -> None:
            asked_other.append(rid)
            real(rid, fault)

        other.stats.note_received = noting  # type: ignore[method-assign]
        # A first round concludes in the config's order: the first server's rows are pinned,
        # the second's compared with them.
        summary = await asyncio.wait_for(daemon.run(), 2 * BOUND_S)
        status = {s["url"]: s for s in daemon.status()["servers"]}
    assert summary.done == len(samples.good) and summary.quarantined == 0
    assert asked_other and all("-probe-" in rid for rid in asked_other)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    why = status[other.url]["out_of_rotation"]
    assert "other weights" in why and base.url in why and other.url in why


async def test_a_server_restarted_onto_new_weights_under_the_same_path_is_refused(
    tmp_path: Path, shm_root: Path
) -> None:
    """Mid-run the server comes back with other weights under the same model path (how a
    model is rolled forward). Before: 40 of 60 samples were the new weights', exit 0. Now
    it is refused until it serves the pinned weights again; every sample is the first's."""
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=16, seed=15)
    options = fake_options(shm_root, model="/models/base", latency_base_ms=5)
    async with running_fake_server(options) as srv:
        config = _fast(
            tmp_path, samples.path, [srv.url], shm_root,
            server={"unreachable_timeout": 30.0}, workers={"concurrency": 2},
        )  # fmt: skip
        daemon = Daemon(config)
        some = when_done(daemon, 10)
        refused = asyncio.Event()
        _when(daemon, lambda s, up: not up and "other weights" in s.last_error, refused.set)
        run = asyncio.create_task(daemon.run())
        await some.wait()
        srv.options = dataclasses.replace(options, weights=7)
        await srv.restart()
        async with asyncio.timeout(BOUND_S):
            await refused.wait()
        done_while_wrong = daemon.metrics.totals.samples_done
        srv.options = options
        await srv.restart()
        summary = await asyncio.wait_for(run, 2 * BOUND_S)
    assert summary.done == len(samples.good) and summary.quarantined == 0
    assert done_while_wrong < len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_one_misconfigured_server_up_before_the_right_one_does_not_stop_the_job(
    tmp_path: Path, shm_root: Path
) -> None:
    """A server reporting hidden size 128 is up before the correct one. Before: the job
    stopped in 0.7 s with "set [model].hidden_size = 128" although the config was right.
    Now a server not heard from does not count: the wrong one is refused (naming what it
    said), the right one is admitted once it is up, and the job is done."""
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=16, seed=16)
    async with (
        running_fake_server(fake_options(shm_root, hidden_size=128)) as wrong,
        running_fake_server(fake_options(shm_root)) as right,
    ):
        await right.stop()  # its port is kept: it starts later
        config = _fast(
            tmp_path, samples.path, [wrong.url, right.url], shm_root,
            server={"unreachable_timeout": BOUND_S},
        )  # fmt: skip
        daemon = Daemon(config)
        refused = asyncio.Event()
        _when(daemon, lambda s, up: s.url == wrong.url and "128" in s.last_error, refused.set)
        run = asyncio.create_task(daemon.run())
        async with asyncio.timeout(BOUND_S):
            await refused.wait()
        assert not run.done()
        await right.start()
        summary = await asyncio.wait_for(run, 2 * BOUND_S)
        status = {s["url"]: s for s in daemon.status()["servers"]}
    assert summary.done == len(samples.good) and summary.quarantined == 0
    why = status[wrong.url]["out_of_rotation"]
    assert "reports hidden size 128" in why and f"{right.url} agrees with the config" in why


async def test_servers_that_all_say_one_thing_against_the_config_stop_the_job(
    tmp_path: Path, shm_root: Path
) -> None:
    """Every server heard from reports hidden size 128: the config is wrong (exit 2), and
    the one line names which server said what."""
    samples = write_samples(tmp_path / "in.jsonl", 5, max_len=16, seed=17)
    async with (
        running_fake_server(fake_options(shm_root, hidden_size=128)) as one,
        running_fake_server(fake_options(shm_root, hidden_size=128)) as two,
    ):
        config = _fast(tmp_path, samples.path, [one.url, two.url], shm_root)
        with pytest.raises(ConfigError) as err:
            await asyncio.wait_for(Daemon(config).run(), 2 * BOUND_S)
    text = str(err.value)
    assert err.value.key == "model.hidden_size" and "\n" not in text
    assert "set [model].hidden_size = 128" in text and one.url in text and two.url in text
    assert read_manifest(config.output.dir) == []
