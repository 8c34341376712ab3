"""Server faults (issue 7): every fault the fake server can inject is retried until the
sample is written bit-exact. A server that meets a fault on every request is the server's
fault, not the samples' (issue 24): it is never admitted (its probes fail too), nothing is
charged or quarantined, the run exits 3 with a reason that names the problem, and once
the server is fixed the rerun writes everything. Nothing faulty ever reaches the dataset,
and nothing is left in /dev/shm.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from hsx_async.config import Config
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.errors import DumpError, NoServerError
from hsx_async.protocol import DumpMeta
from hsx_async.run.daemon.daemon import Daemon, RunSummary
from hsx_async.run.dumps import dump as dump_module
from hsx_async.run.dumps.dump import validate_dump
from hsx_async.run.pipeline import workers as workers_module
from hsx_async.server.fake.server import ALL_FAULTS, FakeServerHandle, running_fake_server
from tests.crash_driver import (
    AUX,
    H,
    L,
    fake_options,
    pause_at_request,
    requests_queued,
    requests_seen,
)
from tests.e2e import (
    SampleSet,
    check_dataset,
    make_config,
    shm_leftovers,
    write_samples,
)

# What the reason a server is out of rotation for must say, for each fault.
REASONS: dict[str, str] = {
    "http_500": r"HTTP 500: .*injected fault http_500",
    "drop_before": r"ServerDisconnectedError",
    "drop_after": r"ServerDisconnectedError",
    "abort_dump": r"no meta\.json appeared under dump\.root .* within dump\.timeout",
    "late_meta": r"no meta\.json appeared under dump\.root .* within dump\.timeout",
    "truncated_part": r"part part-\d{10}-\d{10}\.bin has \d+ bytes, expected \d+",
    "oversized_part": r"part part-\d{10}-\d{10}\.bin has \d+ bytes, expected \d+",
    "gap_parts": r"parts have a gap at row \d+",
    "overlap_parts": r"parts have a overlap at row \d+",
    "wrong_num_tokens": r"meta\.json num_tokens is \d+, the request had \d+",
    "wrong_hidden_size": rf"meta\.json hidden_size is {H + 1}, config \[model\]\.hidden_size",
    "wrong_layers": r"meta\.json aux_layers is \[1, 3, 6\], config \[model\]\.aux_layers",
    "cached_tokens": r"cached_tokens is \d+: a prefix-cache hit skips rows",
    "wrong_prompt_tokens": r"meta_info\.prompt_tokens is \d+, the request had \d+ tokens",
    "wrong_rid": r"meta_info\.id is '.*-not-mine', expected",
    "hang": r"no response within [\d.]+ s \(server\.request_timeout\)",
}
# Enough attempts that a sample failing every one at a 30% fault rate is out of reach
# (0.3^12 ≈ 5e-7), though rids, hence fault draws, change on every run.
MANY_ATTEMPTS = 12


def test_every_fault_has_a_reason() -> None:
    assert set(REASONS) == set(ALL_FAULTS)


def _config(tmp: Path, samples: SampleSet, url: str, root: Path, **overrides: Any) -> Config:
    """make_config with short timeouts: faults must cost fractions of a second."""
    base: Any = {
        "server": {"request_timeout": 0.5},
        "dump": {"timeout": 0.5},
    }
    for section, keys in overrides.items():
        base.setdefault(section, {}).update(keys)
    return make_config(tmp, samples.path, [url], root, **base)


async def _late_commits_done(fake: FakeServerHandle) -> None:
    """Wait until every late meta.json the server promised has been written."""
    late = [rid for rid, fault in fake.stats.fault_log.items() if fault == "late_meta"]
    async with asyncio.timeout(20):
        await asyncio.gather(*(fake.stats.wait_committed(rid) for rid in late))


@pytest.mark.parametrize("fault", ALL_FAULTS)
async def test_a_fault_on_every_request_is_the_servers_and_burns_nothing(
    fault: str, tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=24, seed=1)
    options = fake_options(shm_root, fault_rate=1.0, faults=(fault,), late_meta_s=0.3)
    async with running_fake_server(options) as fake:
        # dump.timeout 0.05 < late_meta_s: a late commit is too late for this client.
        config = _config(tmp_path, samples, fake.url, shm_root,
                         workers={"max_attempts": 2}, dump={"timeout": 0.05},
                         server={"request_timeout": 0.3, "unreachable_timeout": 1.0})  # fmt: skip
        with pytest.raises(NoServerError) as err:
            await Daemon(config).run()
        assert re.search(REASONS[fault], str(err.value)), str(err.value)
        assert fake.stats.faults.get(fault, 0) >= 1  # the probes met it
        await _late_commits_done(fake)
        _check_nothing_made(config.output.dir)
        fake.set_faults(0.0)  # the server is fixed: the rerun does everything
        summary = await Daemon(config).run()
    assert (summary.done, summary.quarantined, summary.unfinished) == (len(samples.good), 0, 0)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


def _check_nothing_made(out: Path) -> None:
    """Nothing written, nothing quarantined: no sample paid for the server's fault."""
    assert read_manifest(out) == []
    assert not [p for p in (out / "data").rglob("*") if p.is_file()]
    assert read_quarantine(out) == []


@pytest.mark.parametrize("fault", ALL_FAULTS)
async def test_a_fault_on_some_attempts_is_retried_and_written_bit_exact(
    fault: str, tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=40, seed=2)
    options = fake_options(shm_root, fault_rate=0.3, faults=(fault,), late_meta_s=0.05, seed=3)
    async with running_fake_server(options) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root,
                         workers={"max_attempts": MANY_ATTEMPTS, "concurrency": 6},
                         server={"request_timeout": 0.3}, dump={"timeout": 0.5})  # fmt: skip
        summary = await _run_until_faulted(config, fake, fault)
    assert summary.done == len(samples.good) and summary.quarantined == 0
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def _run_until_faulted(config: Any, fake: FakeServerHandle, fault: str) -> RunSummary:
    """Run; if by chance no request met the fault, run a fresh output again (rids, so
    fault draws, differ on every run). A test must see the fault it names."""
    for _ in range(5):
        summary = await Daemon(config).run()
        if fake.stats.faults.get(fault, 0) > 0:
            return summary
        shutil.rmtree(config.output.dir)
    raise AssertionError(f"5 runs at fault_rate 0.3 never met {fault}")


@pytest.mark.parametrize("on_loop", [True, False], ids=["dumps-read-on-loop", "in-threads"])
async def test_every_fault_at_once_with_random_chunks(
    on_loop: bool, tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30% of requests faulty, every kind mixed, prompts split at random: every sample is
    still written exactly once, bit-exact. Both ways of looking at a dump: on the event
    loop (dump root on a tmpfs) and from a thread (any other file system)."""
    looked_on_main: list[bool] = []

    def read_dump(rid_dir: Path) -> Any:
        looked_on_main.append(threading.current_thread() is threading.main_thread())
        return dump_module.read_dump(rid_dir)

    monkeypatch.setattr(workers_module, "on_tmpfs", lambda path: on_loop)
    monkeypatch.setattr(workers_module, "read_dump", read_dump)
    samples = write_samples(tmp_path / "in.jsonl", 80, max_len=64, seed=4, bad_every=13)
    options = fake_options(shm_root, fault_rate=0.3, random_chunks=True, late_meta_s=0.05, seed=5)
    async with running_fake_server(options) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root,
                         workers={"max_attempts": MANY_ATTEMPTS, "concurrency": 8},
                         server={"request_timeout": 0.3}, dump={"timeout": 2.0})  # fmt: skip
        summary = await Daemon(config).run()
        met = dict(fake.stats.faults)
    assert len(met) >= 8 and sum(met.values()) >= 15, f"too few faults met: {met}"
    assert looked_on_main and set(looked_on_main) == {on_loop}
    assert summary.done == len(samples.good)
    assert summary.quarantined == len(samples.bad_lines)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


async def test_server_restart_with_requests_in_flight(tmp_path: Path, shm_root: Path) -> None:
    """The server restarts while every worker's request sits in its queue: the restart
    drops them (a real restart loses its state); each is retried and written once."""
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=32, seed=6)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root,
                         workers={"max_attempts": 5})  # fmt: skip
        paused = pause_at_request(fake, 8)
        run = asyncio.create_task(Daemon(config).run())
        await paused.wait()
        await requests_queued(fake.stats, 4).wait()
        await fake.restart()
        fake.resume_passes()
        summary = await run
    assert fake.stats.restarts == 1
    assert summary.done == len(samples.good)
    assert summary.quarantined == 0
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


def _wipe(root: Path) -> None:
    for entry in list(root.iterdir()):
        shutil.rmtree(entry, ignore_errors=True)


async def test_dump_root_wiped_mid_run(tmp_path: Path, shm_root: Path) -> None:
    """/dev/shm loses everything under the dump root mid-run (a tmpfs remount, an operator's
    rm -rf) while every worker waits on the server and writers may be copying: the lost
    dumps are redone and the dataset is still complete and exact."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=48, seed=7)
    async with running_fake_server(fake_options(shm_root, random_chunks=True)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root)
        paused = pause_at_request(fake, 14)  # some 10 samples dumped, perhaps being copied
        run = asyncio.create_task(Daemon(config).run())
        await paused.wait()
        # Wipe while every worker waits on the server, writers perhaps copying; the
        # narrower race inside validation is test_dump_dir_vanishing_during_validation_...
        await requests_queued(fake.stats, 4).wait()
        await asyncio.to_thread(_wipe, shm_root)
        fake.resume_passes()
        summary = await run
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


@pytest.mark.slow
async def test_dump_root_wiped_again_and_again(tmp_path: Path, shm_root: Path) -> None:
    """The dump root is emptied every few milliseconds for a whole run: every race between
    the wipe and the server, the workers and the writers is met; none loses or corrupts."""
    samples = write_samples(tmp_path / "in.jsonl", 200, max_len=48, seed=9)
    async with running_fake_server(fake_options(shm_root, random_chunks=True)) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root,
                         workers={"max_attempts": 50})  # fmt: skip
        run = asyncio.create_task(Daemon(config).run())
        wipes = 0
        while not run.done():
            await asyncio.to_thread(_wipe, shm_root)
            wipes += 1
            await asyncio.sleep(0.005)  # the wipe period, not a synchronisation
        summary = await run
        # A dump wiped under the writer of one of the last samples is requeued after the
        # workers left (see test_enospc_on_the_last_sample_is_retried_in_the_same_run):
        # unfinished, not lost; the resume does it.
        again = await Daemon(config).run()
    assert wipes > 10
    assert summary.done + again.done == len(samples.good)
    assert again.done == summary.unfinished
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []


def test_dump_dir_vanishing_during_validation_is_a_dump_error(shm_root: Path) -> None:
    """The rid directory is gone between reading meta.json and listing the parts: the
    attempt fails (and is retried); the run goes on."""
    meta = DumpMeta("r1", 2, H, AUX, ((0, 2),), "m", "s").to_json()
    with pytest.raises(DumpError):
        validate_dump(shm_root / "ns" / "r1", meta, rid="r1", num_tokens=2, hidden_size=H,
                      aux_layers=AUX)  # fmt: skip


async def test_hanging_server_is_timed_out_then_recovers(tmp_path: Path, shm_root: Path) -> None:
    """Every request hangs until the server heals: attempts time out after
    server.request_timeout and are retried; nothing is lost or written twice."""
    samples = write_samples(tmp_path / "in.jsonl", 16, max_len=24, seed=8)
    options = fake_options(shm_root, fault_rate=1.0, faults=("hang",))
    async with running_fake_server(options) as fake:
        config = _config(tmp_path, samples, fake.url, shm_root,
                         server={"request_timeout": 0.2}, workers={"max_attempts": 6})  # fmt: skip
        hung = requests_seen(fake.stats, 8)  # two rounds of attempts from 4 workers
        run = asyncio.create_task(Daemon(config).run())
        await hung.wait()
        fake.set_faults(0.0)
        summary = await run
        assert fake.stats.faults["hang"] >= 8
    assert summary.done == len(samples.good)
    check_dataset(config.output.dir, samples, hidden_size=H, num_layers=L)
    assert shm_leftovers(shm_root) == []
