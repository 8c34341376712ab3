"""Faults belong to whoever caused them (issue 24): the sample, a server, or the job.

Only a sample's own faults charge attempts and quarantine it. A server's fault takes that
server out of rotation with its reason, puts the sample back uncharged and brings the
server back once a probe shows it fixed; with no server left the run waits, saying so,
then exits 3 — burning nothing. A job's fault (config and servers disagree) stops the run
before any sample is charged, in one line naming the key; nothing recorded blocks the
corrected rerun. Against the fake server (its fault injection, a no-hook mode, a
vocabulary): the real-vLLM no-connector case is in tests/real_vllm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hsx_async.config import Config, load_config
from hsx_async.dataset.manifest import AppendLog, read_manifest, read_quarantine
from hsx_async.dataset.provenance import read_provenance
from hsx_async.errors import ConfigError, NoServerError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.notify import Notifier
from hsx_async.run.report.numbers import build_report
from hsx_async.run.servers.pool import Server
from hsx_async.server.fake import app as fake_app
from hsx_async.server.fake import options as fake_options_module
from hsx_async.server.fake.server import FakeServerHandle, running_fake_server
from tests.crash_driver import AUX, H, L, fake_options, requests_seen
from tests.e2e import (
    check_dataset,
    config_raw,
    make_config,
    shm_leftovers,
    when_done,
    write_config,
    write_samples,
)


def _config(tmp: Path, samples: Path, urls: list[str], root: Path, **over: Any) -> Config:
    shape = {k: over.pop(k) for k in ("hidden_size", "aux_layers") if k in over}
    base: dict[str, Any] = {"server": {"unreachable_timeout": 1.5}}
    for section, keys in over.items():
        base.setdefault(section, {}).update(keys)
    return make_config(tmp, samples, urls, root, **shape, **base)


def _nothing_made(config: Config) -> None:
    out = config.output.dir
    assert read_manifest(out) == []
    assert read_quarantine(out) == []


def server_change(daemon: Daemon, wanted: Callable[[Server, bool], bool]) -> asyncio.Event:
    """An event set the first time a server change matches ``wanted``."""
    event = asyncio.Event()

    def check(server: Server, in_rotation: bool) -> None:
        if wanted(server, in_rotation):
            event.set()

    daemon.on_server_change.append(check)
    return event


def _rids_of(server: FakeServerHandle) -> list[str]:
    """The rids of every marked request ``server`` receives from now on."""
    rids: list[str] = []
    note = server.stats.note_received

    def noting(rid: str, fault: str | None) -> None:
        rids.append(rid)
        note(rid, fault)

    server.stats.note_received = noting  # type: ignore[method-assign]
    return rids


class _StatusLines(Notifier):
    """A notifier that counts its status lines (what systemd would show)."""

    def __init__(self, wanted: str, count: int) -> None:
        super().__init__(None)
        self.wanted, self.count, self.seen = wanted, count, asyncio.Event()
        self.lines: list[str] = []

    def status(self, text: str) -> None:
        self.lines.append(text)
        if sum(self.wanted in line for line in self.lines) >= self.count:
            self.seen.set()


# -- a server's fault: out of rotation, nothing charged, exit 3 ----------------------------


async def test_a_server_without_the_hook_burns_nothing_and_exits_3(
    tmp_path: Path, shm_root: Path
) -> None:
    """SGLang started without the hook: every marked request is answered 200 with no
    dump. Today: every sample quarantined at dump.timeout pace, exit 0, a rerun skips all."""
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=16)
    async with running_fake_server(fake_options(shm_root, hook=False)) as srv:
        config = _config(tmp_path, samples.path, [srv.url], shm_root, dump={"timeout": 0.2})
        daemon = Daemon(config)
        with pytest.raises(NoServerError, match="hsx hook"):
            await daemon.run()
        status = daemon.status()
    _nothing_made(config)
    (server,) = status["servers"]
    assert not server["healthy"]
    assert (
        server["out_of_rotation"].startswith("dump_missing: ")
        and "dump.root" in server["out_of_rotation"]
    )
    # The job report names the server taken out and why.
    out = build_report(config.output.dir)["servers_out"]
    assert out and out[0]["server"] == srv.url and out[0]["kind"] == "dump_missing"
    async with running_fake_server(fake_options(shm_root), port=int(srv.url.rsplit(":", 1)[1])):
        summary = await Daemon(config).run()  # the server fixed: the rerun does everything
    assert summary.done == len(samples.good) and summary.quarantined == 0
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def test_a_server_failing_every_request_is_out_until_a_probe_shows_it_fixed(
    tmp_path: Path, shm_root: Path
) -> None:
    """Every request answered 500 mid-run: the server leaves rotation, its probes fail,
    the samples wait uncharged; once it heals, a probe brings it back and every sample is
    written once. Today: each sample burns its attempts and is quarantined."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=16)
    async with running_fake_server(fake_options(shm_root)) as srv:
        config = _config(
            tmp_path,
            samples.path,
            [srv.url],
            shm_root,
            server={"unreachable_timeout": 30.0},
            workers={"max_attempts": 2},
        )
        daemon = Daemon(config)
        broken = server_change(daemon, lambda s, up: not up and s.out_kind == "http_5xx")
        admitted = when_done(daemon, 1)
        run = asyncio.create_task(daemon.run())
        await admitted.wait()
        srv.set_faults(1.0, ("http_500",))
        async with asyncio.timeout(20):
            await broken.wait()
            await requests_seen(srv.stats, srv.stats.hsx_requests + 3).wait()  # probes, failing
        srv.set_faults(0.0)
        summary = await run
    assert summary.quarantined == 0 and summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_a_sample_that_fails_where_others_succeed_is_still_quarantined(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 that only one sample meets (it crashes the server every time) is the
    sample's after all: the server works for the others, so it is charged."""
    draw = fake_options_module.draw_fault

    def one_sample_fails(seed: int, rid: str, rate: float, faults: Any) -> str | None:
        return "http_500" if rid.split("-")[-2] == "2" else draw(seed, rid, rate, faults)

    monkeypatch.setattr(fake_app, "draw_fault", one_sample_fails)
    samples = write_samples(tmp_path / "in.jsonl", 8, max_len=16)
    async with running_fake_server(fake_options(shm_root)) as srv:
        config = _config(
            tmp_path,
            samples.path,
            [srv.url],
            shm_root,
            workers={"max_attempts": 3, "concurrency": 1},
        )
        summary = await Daemon(config).run()
    assert (summary.done, summary.quarantined) == (7, 1)
    (q,) = read_quarantine(config.output.dir)
    # Charged as the evidence comes (the server served another sample, or passed its probe
    # after the failures took it out), and never past max_attempts.
    assert q.line == 2 and q.reason.startswith("3 attempts failed; last: "), q.reason
    assert "HTTP 500" in q.reason
    # issue 38: the line says so in fields, the fault charged last as classified
    assert (q.cause, q.kind, q.retriable) == ("server", "http_5xx", True)


# -- a sample's fault: quarantined at once, not retried -----------------------------------


async def test_a_refusal_of_the_content_is_quarantined_without_retries(
    tmp_path: Path, shm_root: Path
) -> None:
    """A token id past the vocabulary: 400, deterministic. Today it is retried
    max_attempts times; now once, then quarantined with the server's words (issue 26)."""
    samples = write_samples(tmp_path / "in.jsonl", 10, max_len=16)  # ids < 50,000
    async with running_fake_server(fake_options(shm_root, vocab_size=40_000)) as srv:
        config = _config(tmp_path, samples.path, [srv.url], shm_root, workers={"max_attempts": 5})
        summary = await Daemon(config).run()
        refused = srv.stats.bad_requests
    quarantined = read_quarantine(config.output.dir)
    assert summary.quarantined == len(quarantined) > 0
    assert refused == len(quarantined)  # one request each: nothing retried
    for q in quarantined:
        assert "refused the sample itself, not retried" in q.reason
        assert "out of vocabulary" in q.reason
        assert (q.cause, q.kind, q.retriable) == ("sample", "rejected", True)
    assert summary.done + summary.quarantined == len(samples.good)


# -- a job's fault: exit 2 before anything is charged, the corrected rerun works ----------


@pytest.mark.parametrize(
    ("key", "wrong"),
    [("model.aux_layers", {"aux_layers": (2, 4, 6)}), ("model.hidden_size", {"hidden_size": 32})],
)
async def test_config_and_server_disagree_stops_the_job_at_once(
    tmp_path: Path, shm_root: Path, key: str, wrong: dict[str, Any]
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=16)
    async with running_fake_server(fake_options(shm_root)) as srv:
        bad = _config(tmp_path, samples.path, [srv.url], shm_root, **wrong)
        with pytest.raises(ConfigError) as err:
            await Daemon(bad).run()
        assert err.value.key == key
        assert str(err.value).count("\n") == 0 and srv.url in str(err.value)
        assert "[1, 3, 5]" in str(err.value) or "64" in str(err.value)  # what it reported
        assert srv.stats.hsx_requests <= 2  # the probes: no sample was sent
        _nothing_made(bad)
        # The corrected rerun: nothing recorded blocks it (no --allow-provenance-change).
        good = _config(tmp_path, samples.path, [srv.url], shm_root)
        summary = await Daemon(good).run()
    assert summary.done == len(samples.good) and summary.quarantined == 0
    check_dataset(good.output.dir, samples, hidden_size=H, num_layers=L)
    assert read_provenance(good.output.dir)["aux_layers"] == list(AUX)  # type: ignore[index]


async def test_a_dump_root_that_is_not_the_servers_stops_the_job(
    tmp_path: Path, shm_root: Path
) -> None:
    """Today: every sample waits dump.timeout max_attempts times, then quarantine."""
    samples = write_samples(tmp_path / "in.jsonl", 10, max_len=16)
    elsewhere = shm_root / "elsewhere"
    elsewhere.mkdir()
    async with running_fake_server(fake_options(elsewhere)) as srv:
        bad = _config(tmp_path, samples.path, [srv.url], shm_root, dump={"timeout": 0.3})
        with pytest.raises(ConfigError) as err:
            await Daemon(bad).run()
    assert err.value.key == "dump.root" and str(elsewhere) in str(err.value)
    _nothing_made(bad)


async def test_a_reload_to_the_wrong_engine_takes_the_server_out_not_the_samples(
    tmp_path: Path, shm_root: Path
) -> None:
    """SIGHUP with server.engines = ["vllm"] on an SGLang server: every request would be
    a 404. Today: accepted, never out of rotation, samples quarantined in seconds."""
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=16)
    async with running_fake_server(fake_options(shm_root, latency_base_ms=5)) as srv:
        raw = config_raw(
            tmp_path,
            samples.path,
            [srv.url],
            shm_root,
            server={"unreachable_timeout": 30.0},
            workers={"concurrency": 1},
        )
        path = write_config(tmp_path, raw)
        daemon = Daemon(load_config(path))
        some = when_done(daemon, 5)
        run = asyncio.create_task(daemon.run())
        await some.wait()
        raw["server"]["engines"] = ["vllm"]
        write_config(tmp_path, raw)
        refused = server_change(daemon, lambda s, up: not up and s.out_kind == "identity")
        await daemon.reload()
        async with asyncio.timeout(10):
            await refused.wait()
        assert daemon.servers is not None
        (server,) = [s for s in daemon.servers.servers if not s.retired]
        assert "server.engine" in server.last_error and "'sglang'" in server.last_error
        raw["server"]["engines"] = ["sglang"]  # the operator fixes it
        write_config(tmp_path, raw)
        await daemon.reload()
        summary = await run
    assert summary.quarantined == 0
    check_dataset(daemon.config.output.dir, samples, hidden_size=H, num_layers=L)


# -- server identity: pinned, recorded, never mixed ---------------------------------------


async def test_two_servers_two_models_never_mix(tmp_path: Path, shm_root: Path) -> None:
    """Two servers of one shape, different checkpoints. Today: half the samples come
    from the other model, exit 0, verify OK, and only the first model is recorded."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=16)
    async with (
        running_fake_server(fake_options(shm_root, model="/models/base")) as base,
        running_fake_server(fake_options(shm_root, model="/models/instruct")) as other,
    ):
        config = _config(tmp_path, samples.path, [base.url, other.url], shm_root)
        asked_other = _rids_of(other)
        daemon = Daemon(config)
        summary = await daemon.run()
        status = daemon.status()
    assert summary.done == len(samples.good)
    assert asked_other and all("-probe-" in rid for rid in asked_other)  # no sample went there
    prov = read_provenance(config.output.dir)
    assert prov is not None
    assert prov["identity"]["model"] == "/models/base"
    assert set(prov["servers"]) == {base.url}  # the refused one is not the job's
    refused = next(s for s in status["servers"] if s["url"] == other.url)
    assert not refused["healthy"] and "/models/instruct" in refused["out_of_rotation"]


async def test_a_server_restarted_with_another_model_is_refused_until_it_is_back(
    tmp_path: Path, shm_root: Path
) -> None:
    """Mid-run the server comes back serving another checkpoint: it is refused (never
    mixed in) until it serves the job's model again."""
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=16)
    options = fake_options(shm_root, model="/models/base", latency_base_ms=5)
    async with running_fake_server(options) as srv:
        config = _config(
            tmp_path,
            samples.path,
            [srv.url],
            shm_root,
            server={"unreachable_timeout": 30.0},
            workers={"concurrency": 2},
        )
        daemon = Daemon(config)
        some = when_done(daemon, 10)
        refused = server_change(daemon, lambda s, up: "/models/other" in s.last_error)
        run = asyncio.create_task(daemon.run())
        await some.wait()
        srv.options = dataclasses.replace(options, model="/models/other")
        await srv.restart()
        async with asyncio.timeout(10):
            await refused.wait()
        done_while_wrong = daemon.metrics.totals.samples_done
        srv.options = options
        await srv.restart()
        summary = await run
    assert summary.done == len(samples.good) and summary.quarantined == 0
    assert done_while_wrong < len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


# -- the events log may fail; the run may not ---------------------------------------------


async def test_a_full_disk_under_the_events_log_does_not_stop_the_run(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Today ENOSPC from the events log's tick kills the run (exit 1, a traceback)."""
    real_append = AppendLog.append

    def full(self: AppendLog, lines: Any, *, sync: bool = True) -> None:
        if self.path.name.startswith("events"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, lines, sync=sync)

    monkeypatch.setattr(AppendLog, "append", full)
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=16)
    async with running_fake_server(fake_options(shm_root, latency_base_ms=20)) as srv:
        config = _config(tmp_path, samples.path, [srv.url], shm_root)
        with capture_logs() as logs:
            summary = await Daemon(config).run()
    assert summary.done == len(samples.good)
    assert [e for e in logs if e["event"] == "events_log_not_written"]
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


# -- the operator's view: no server needed when done; waiting says what it waits for ------


async def test_a_finished_dataset_needs_no_server(tmp_path: Path, shm_root: Path) -> None:
    """Issue 26: "run it again, it exits at once" waited for the stopped server, then 3.
    With nothing left to send, no server is even asked."""
    samples = write_samples(tmp_path / "in.jsonl", 10, max_len=16, bad_every=4)
    async with running_fake_server(fake_options(shm_root)) as srv:
        config = _config(
            tmp_path, samples.path, [srv.url], shm_root, server={"unreachable_timeout": 60.0}
        )
        await Daemon(config).run()
        asked = srv.stats.requests
        again = await Daemon(config).run()
        assert srv.stats.requests == asked  # nothing sent, not even a probe
    assert again.skipped == len(samples.good) and again.done == 0 and again.unfinished == 0
    stale = shm_root / "hsx-wprobe" / "stale-probe"  # what a killed run's probe left
    stale.mkdir(parents=True)
    (stale / "meta.json").write_bytes(b"{}")
    async with asyncio.timeout(10):  # the server is gone: at once, not after 60 s
        gone = await Daemon(config).run()
    assert gone.skipped == len(samples.good) and gone.unfinished == 0
    assert shm_leftovers(shm_root) == []


async def test_waiting_for_a_server_says_so_periodically_and_stops_on_a_signal(
    tmp_path: Path, shm_root: Path
) -> None:
    """Issue 26: one line, then nothing; a stop there went unanswered until exit 3."""
    samples = write_samples(tmp_path / "in.jsonl", 5, max_len=16)
    config = _config(
        tmp_path,
        samples.path,
        ["http://127.0.0.1:9"],
        shm_root,
        server={"unreachable_timeout": 60.0},
        daemon={"progress_interval": 0.2},
    )
    notifier = _StatusLines("waiting for a server", 3)
    daemon = Daemon(config, notifier=notifier)
    with capture_logs() as logs:
        run = asyncio.create_task(daemon.run())
        async with asyncio.timeout(10):
            await notifier.seen.wait()
        daemon.request_stop()
        async with asyncio.timeout(10):
            summary = await run
    waits = [e for e in logs if e["event"] == "waiting_for_server"]
    assert all("127.0.0.1:9" in str(e["servers"]) and "exit_in_s" in e for e in waits)
    assert [e for e in logs if e["event"] == "stopped_while_waiting_for_server"]
    assert summary.stopped and summary.done == 0
    _nothing_made(config)
