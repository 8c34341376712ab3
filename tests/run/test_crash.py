"""Crash consistency (PROTOCOL §4, issue 7): ``hsx run`` killed at every step of the write
path, at random moments and by signals, then resumed, ends with the dataset of an
uninterrupted run: same manifest, same bytes, no orphans, nothing left in /dev/shm.

The CI subset: every failpoint once, a chain of random kills, SIGTERM drains, the drain
deadline and a forced exit. ``python -m bench.crash_soak --kills 300`` is the long soak.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from hsx_async.run.dumps.failpoints import POINTS
from hsx_async.server.fake.server import running_fake_server
from tests.conftest import SHM
from tests.crash_driver import (
    CrashBed,
    Kill,
    KillState,
    ManifestKey,
    cleanup_counts,
    crash_samples,
    fake_options,
    kill_state,
    make_bed,
    pause_at_request,
    reference_run,
    requests_seen,
    run_child,
    verify,
)
from tests.e2e import SampleSet, shm_leftovers

N_SAMPLES = 60
FAILPOINT_HIT = 2  # kill the 2nd time a point is passed: work on both sides of the kill

# What each failpoint must leave behind, proving the kill hit the step it names.
LEFT_BEHIND: dict[str, tuple[str, Callable[[KillState], bool]]] = {
    "writer.after_temp_write": ("a temp file", lambda s: s.temp_files >= 1),
    "writer.after_fsync": ("a temp file", lambda s: s.temp_files >= 1),
    "writer.after_rename": ("a data file without a manifest line", lambda s: s.orphans >= 1),
    "commit.before_append": ("a data file without a manifest line", lambda s: s.orphans >= 1),
    "commit.after_append": ("the dump of a committed sample", lambda s: s.done_dumps >= 1),
    "dump.during_delete": ("the dump of a committed sample", lambda s: s.done_dumps >= 1),
}


def test_every_failpoint_has_an_expectation() -> None:
    assert set(LEFT_BEHIND) == set(POINTS)


@pytest.fixture(scope="module")
def crash_input(tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleSet, set[ManifestKey]]:
    """The input every crash test uses, and the manifest of an uninterrupted run of it."""
    tmp = tmp_path_factory.mktemp("crash-input")
    samples = crash_samples(tmp / "in.jsonl", N_SAMPLES, seed=7)
    root = (SHM if SHM.is_dir() else tmp) / f"hsx-test-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    try:
        reference = asyncio.run(reference_run(samples, tmp / "reference", root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples, reference


# Commit points first: the input's bad lines come last, so early commits carry data lines.
CHAIN = (
    "commit.before_append",
    "commit.after_append",
    "writer.after_temp_write",
    "writer.after_fsync",
    "writer.after_rename",
    "dump.during_delete",
)


async def _kill_at(bed: CrashBed, point: str, hit: int) -> KillState:
    """One run killed by a failpoint; the state it left, checked against LEFT_BEHIND."""
    run = await run_child(bed.config, failpoint=f"{point}:{hit}")
    assert run.killed, f"the failpoint {point}:{hit} did not fire:\n{run.tail()}"
    state = kill_state(bed.out, bed.root, bed.samples)
    what, left = LEFT_BEHIND[point]
    assert left(state), f"a kill at {point} should leave {what}; found {state}"
    assert state.manifest_lines < len(bed.samples.good)
    await bed.barrier()
    return state


async def test_kill_at_every_failpoint_in_turn_then_resume(
    crash_input: tuple[SampleSet, set[ManifestKey]], tmp_path: Path, shm_root: Path
) -> None:
    """Six runs of one dataset, each SIGKILLed at the next failpoint (each run first
    repairs what the previous kill left), then a resume: the uninterrupted run's dataset."""
    assert sorted(CHAIN) == sorted(POINTS)
    samples, reference = crash_input
    async with running_fake_server(fake_options(shm_root)) as fake:
        bed = make_bed(tmp_path, shm_root, samples, fake)
        states = [await _kill_at(bed, point, FAILPOINT_HIT) for point in CHAIN]
        resumes = await bed.resume()
        verify(bed.out, shm_root, samples, reference)
    temp, orphans = cleanup_counts(resumes)
    assert temp >= states[-1].temp_files and orphans >= states[-1].orphans


@pytest.mark.slow
@pytest.mark.parametrize("hit", [1, 5])
@pytest.mark.parametrize("point", POINTS)
async def test_kill_at_failpoint_then_resume(
    point: str,
    hit: int,
    crash_input: tuple[SampleSet, set[ManifestKey]],
    tmp_path: Path,
    shm_root: Path,
) -> None:
    """Each failpoint alone, on a fresh dataset, at its first and a later pass."""
    samples, reference = crash_input
    async with running_fake_server(fake_options(shm_root)) as fake:
        bed = make_bed(tmp_path, shm_root, samples, fake)
        state = await _kill_at(bed, point, hit)
        resumes = await bed.resume()
        verify(bed.out, shm_root, samples, reference)
    temp, orphans = cleanup_counts(resumes)
    assert temp >= state.temp_files and orphans >= state.orphans


async def test_random_kills_and_a_drained_stop_then_resume(
    crash_input: tuple[SampleSet, set[ManifestKey]], tmp_path: Path, shm_root: Path
) -> None:
    """Successive runs of one dataset: SIGKILL at random moments (one before any sample is
    done), a SIGTERM that drains (exit 0, nothing left to clean), another SIGKILL, then a
    resume: still the uninterrupted run's dataset."""
    samples, reference = crash_input
    rng = random.Random(20261130)
    async with running_fake_server(fake_options(shm_root, random_chunks=True)) as fake:
        bed = make_bed(tmp_path, shm_root, samples, fake)
        for kill in (
            Kill(event="run_started", delay=rng.uniform(0.0, 0.05)),
            Kill(after=rng.randint(1, 8), delay=rng.uniform(0.0, 0.01)),
        ):
            run = await run_child(bed.config, kills=[kill])
            assert run.killed, f"{kill} did not land:\n{run.tail()}"
            await bed.barrier()
        done_before = kill_state(bed.out, shm_root, samples).manifest_lines
        run = await run_child(bed.config, kills=[Kill(after=4, sig=signal.SIGTERM)])
        assert run.returncode == 0, run.tail()
        assert run.events["stop_requested"] == 1
        assert run.ended - run.signalled[0] < 10.0  # daemon.drain_timeout
        # A drained stop leaves nothing to clean: no temp file, no orphan, empty /dev/shm.
        state = kill_state(bed.out, shm_root, samples)
        assert (state.temp_files, state.orphans) == (0, 0)
        assert done_before + 4 <= state.manifest_lines < len(samples.good)
        assert shm_leftovers(shm_root) == []
        run = await run_child(bed.config, kills=[Kill(after=rng.randint(1, 6))])
        assert run.killed, run.tail()
        await bed.barrier()
        await bed.resume()
        verify(bed.out, shm_root, samples, reference)


async def _stuck_bed(bed: CrashBed, kills: list[Kill]) -> tuple[int, float]:
    """Run with every request stuck in the server's queue; (exit code, seconds from the
    first signal to the exit). The server stops forming passes at the run's second
    request: its first is the probe that admits the server."""
    pause_at_request(bed.fake, bed.fake.stats.hsx_requests + 2)
    run = await run_child(bed.config, kills=kills)
    await bed.barrier()  # drops the queued requests: nothing stale is written later
    bed.fake.resume_passes()
    assert run.signalled, run.tail()
    return run.returncode, run.ended - run.signalled[0]


async def test_stop_past_the_drain_deadline_and_forced_exit_then_resume(
    crash_input: tuple[SampleSet, set[ManifestKey]], tmp_path: Path, shm_root: Path
) -> None:
    """With every request stuck in the server: one SIGTERM exits 0 once
    ``daemon.drain_timeout`` has passed; a second SIGTERM exits 130 at once. A resume then
    finishes the dataset."""
    samples, reference = crash_input
    async with running_fake_server(fake_options(shm_root)) as fake:
        bed = make_bed(tmp_path, shm_root, samples, fake, daemon={"drain_timeout": 1.0})
        stuck = requests_seen(fake.stats, 1 + 4)  # the probe, then every worker's request
        code, seconds = await _stuck_bed(bed, [Kill(sig=signal.SIGTERM, when=stuck)])
        assert code == 0
        assert 1.0 <= seconds < 8.0
        stuck = requests_seen(fake.stats, fake.stats.hsx_requests + 1 + 4)
        kills = [
            Kill(sig=signal.SIGTERM, when=stuck),
            Kill(event="stop_requested", sig=signal.SIGTERM),
        ]
        code, seconds = await _stuck_bed(bed, kills)
        assert code == 130  # exit 0 would mean the drain deadline, not the signal, ended it
        assert seconds < 8.0
        await bed.resume()
        verify(bed.out, shm_root, samples, reference)
