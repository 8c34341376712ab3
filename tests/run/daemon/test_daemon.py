"""End to end, in process: the daemon against the fake server (PROTOCOL §1–4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.errors import NoServerError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import ALL_FAULTS, FakeOptions, running_fake_server
from tests.e2e import check_dataset, make_config, shm_leftovers, when_done, write_samples

H, AUX = 64, (1, 3, 5)
L = len(AUX) + 1


def fake_options(root: Path, **kw: object) -> FakeOptions:
    return FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=root, **kw)  # type: ignore[arg-type]


async def test_clean_run_writes_every_sample_bit_exact(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 60, bad_every=7, with_duplicates=True)
    async with running_fake_server(fake_options(shm_root, random_chunks=True)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        summary = await Daemon(config).run()
    assert summary.done == len(samples.good)
    assert summary.quarantined == len(samples.bad_lines)
    assert summary.unfinished == 0
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []
    # issue 38: input lines are the input's fault, in fields: a duplicate id, or not a sample
    kinds = {(q.cause, q.kind, q.retriable) for q in read_quarantine(config.output.dir)}
    assert kinds == {("sample", "duplicate_id", False), ("sample", "bad_input", False)}


async def test_faults_chunking_and_late_commits(tmp_path: Path, shm_root: Path) -> None:
    """Issue 2's acceptance run: a few hundred samples, 5% faults of every kind, random
    chunking and late commits; every valid sample once, bit-exact; nothing left in shm."""
    samples = write_samples(tmp_path / "in.jsonl", 300, max_len=48, bad_every=25, seed=3)
    faults = tuple(f for f in ALL_FAULTS if f != "hang")
    options = fake_options(
        shm_root, random_chunks=True, fault_rate=0.05, faults=faults, late_meta_s=0.02, seed=11
    )
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path,
            samples.path,
            [fake.url],
            shm_root,
            dump={"timeout": 0.5},
            workers={"concurrency": 8},
        )
        summary = await Daemon(config).run()
        injected = sum(fake.stats.faults.values())
    assert injected >= 5, "the run should have met faults"
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def test_hung_request_times_out_and_is_retried(tmp_path: Path, shm_root: Path) -> None:
    # Faults are drawn per rid, and rids carry a fresh nonce each run: with a rate of 0.5
    # and 20 attempts, no hang at all (0.5^12) or a sample failing every attempt
    # (12 × 0.5^20) are both below 3e-4; backoffs are short so the retries cost little.
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=16)
    options = fake_options(shm_root, fault_rate=0.5, faults=("hang",), seed=5)
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, server={"request_timeout": 0.3},
            workers={"max_attempts": 20, "backoff_base": 0.01, "backoff_max": 0.05},
        )  # fmt: skip
        summary = await Daemon(config).run()
        assert fake.stats.faults.get("hang", 0) >= 1
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_a_server_whose_every_dump_is_wrong_quarantines_nothing(
    tmp_path: Path, shm_root: Path
) -> None:
    """Every dump has the wrong hidden size (the server says 64, its dumps 65): the
    server's fault, not the samples' (issue 24). It stays out of rotation with the reason,
    nothing is charged or quarantined, and the run exits 3 (it used to quarantine all)."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8)
    options = fake_options(shm_root, fault_rate=1.0, faults=("wrong_hidden_size",))
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root,
            workers={"max_attempts": 2}, server={"unreachable_timeout": 0.5},
        )  # fmt: skip
        with pytest.raises(NoServerError, match=r"hidden_size is 65"):
            await Daemon(config).run()
    assert not (config.output.dir / "quarantine.jsonl").read_text()
    assert read_manifest(config.output.dir) == []
    assert shm_leftovers(shm_root) == []


async def test_resume_repairs_torn_line_and_orphans(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 30, bad_every=9)
    async with running_fake_server(fake_options(shm_root, chunk_size=17)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        await Daemon(config).run()
        out = config.output.dir
        reference = {(e.id, e.xxh3_64) for e in read_manifest(out)}
        # Simulate crashes: a data file renamed but its line lost, a torn last line,
        # a temp file mid-write.
        lines = (out / "manifest.jsonl").read_bytes().splitlines(keepends=True)
        (out / "manifest.jsonl").write_bytes(b"".join(lines[:-3]) + lines[-2][:25])
        stray = out / "data" / "00" / ".x.safetensors.s0-dead.tmp"
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"partial")
        summary = await Daemon(config).run()
    assert summary.done == 3
    assert summary.skipped == len(samples.good) - 3
    assert {(e.id, e.xxh3_64) for e in read_manifest(out)} == reference
    check_dataset(out, samples, hidden_size=H, num_layers=L)


async def test_two_servers_share_work_and_survive_one_dying(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 80, max_len=32)
    async with (
        running_fake_server(fake_options(shm_root)) as a,
        running_fake_server(fake_options(shm_root)) as b,
    ):
        config = make_config(tmp_path, samples.path, [a.url, b.url], shm_root)
        daemon = Daemon(config)
        halfway = when_done(daemon, 20)
        run = asyncio.create_task(daemon.run())
        await halfway.wait()
        served_by_b = b.stats.hsx_requests
        await b.stop()
        summary = await run
    assert served_by_b > 0 and a.stats.hsx_requests > 0
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_server_restart_mid_run_costs_nothing(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=32)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        daemon = Daemon(config)
        halfway = when_done(daemon, 10)
        run = asyncio.create_task(daemon.run())
        await halfway.wait()
        await fake.restart()
        summary = await run
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_no_server_reachable_is_an_error(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2)
    config = make_config(
        tmp_path,
        samples.path,
        ["http://127.0.0.1:9"],
        shm_root,
        server={"unreachable_timeout": 0.2},
    )
    with pytest.raises(NoServerError, match=r"no server in rotation for 0\.2 s"):
        await Daemon(config).run()


async def test_request_stop_drains_and_resume_finishes(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=32)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        daemon = Daemon(config)
        some = when_done(daemon, 5)
        run = asyncio.create_task(daemon.run())
        await some.wait()
        daemon.request_stop()
        first = await run
        assert first.stopped and first.done < len(samples.good)
        assert shm_leftovers(shm_root) == []
        second = await Daemon(config).run()
    assert first.done + second.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)


async def test_a_record_s_temp_left_by_a_killed_writer_goes_at_the_next_start(
    tmp_path: Path, shm_root: Path
) -> None:
    """A run killed while it wrote the job report (after its last sample) left
    ``.report.json.<pid>-<tag>.tmp`` beside the dataset: the crash soak found one after
    the final resume. Every writer of the top-level records holds the directory's lock, so
    the next run's start-up removes what a dead one left; other files stay."""
    samples = write_samples(tmp_path / "in.jsonl", 6)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        await Daemon(config).run()
        out = config.output.dir
        left = [out / f".{name}.4242-0badf00d.tmp" for name in
                ("report.json", "report.png", "provenance.json")]  # fmt: skip
        for path in left:
            path.write_bytes(b"half")
        kept = out / ".notes.4242-0badf00d.tmp"
        kept.write_bytes(b"someone else's")
        summary = await Daemon(config).run()
    assert summary.done == 0 and summary.unfinished == 0
    assert [p.name for p in left if p.exists()] == []
    assert kept.exists()
    check_dataset(out, samples, hidden_size=H, num_layers=L)
