"""Crash soak (issue 7): hundreds of kills of ``hsx run``, each followed by a resume, and the
final dataset compared with an uninterrupted run every time.

Each round makes a fresh input (random lengths, a few bad lines at the end) and its
reference dataset (an uninterrupted in-process run), then runs ``hsx run`` as a child
process against an in-process fake server up to ``--kills-per-round`` times, stopping
each run in one of four ways, drawn at random:

- ``random``: SIGKILL a random 0–20 ms after a random ``sample_done`` log event;
- ``early``: SIGKILL a random 0–80 ms after ``run_started`` (often mid-cleanup or before
  the first commit);
- ``failpoint``: ``HSX_FAILPOINT=<random point>:<1..4>`` (the process kills itself there);
- ``sigterm``: SIGTERM after a random ``sample_done`` (must drain and exit 0).

After each kill the server restarts (so nothing the dead client asked for is written
later), and the next run resumes. A round ends with a resume to exit 0 and the checks of
``tests/crash_driver.verify``: same manifest (id, xxh3_64, bytes) as the reference, every
file bit-exact, every bad line quarantined, no temp file or orphan, /dev/shm empty. Half
the rounds also inject server faults (5%, every kind but ``hang``) and random chunking.

    python -m bench.crash_soak --kills 300           # from the repository root
    python -m bench.crash_soak --kills 20 --seed 7   # a quick look

Prints a summary and writes ``bench/results/crash_soak-<time>.json``. Exit 1 when a round
fails its checks (the JSON has the details and the seed to replay it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hsx_async.logs import configure_logging
from hsx_async.run.dumps.failpoints import POINTS
from hsx_async.server.fake.server import ALL_FAULTS, running_fake_server
from tests.crash_driver import (
    ChildRun,
    CrashBed,
    Kill,
    cleanup_counts,
    crash_samples,
    fake_options,
    make_bed,
    reference_run,
    run_child,
    verify,
)

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("random", "early", "failpoint", "sigterm")
MODE_WEIGHTS = (0.45, 0.1, 0.35, 0.1)


@dataclass
class Tally:
    kills: int = 0  # runs ended by SIGKILL (random or failpoint)
    sigterms: int = 0  # runs ended by a drained SIGTERM
    finished_early: int = 0  # runs that ended before their kill could land
    child_runs: int = 0
    rounds: int = 0
    rounds_verified: int = 0
    samples_verified: int = 0
    temp_files_cleaned: int = 0
    orphans_cleaned: int = 0
    faults_injected: int = 0
    by_mode: collections.Counter[str] = field(default_factory=collections.Counter)
    by_point: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)


def draw_stop(rng: random.Random, samples: int) -> tuple[str, str | None, Kill | None]:
    """(mode, failpoint, kill) of one run."""
    mode = rng.choices(MODES, MODE_WEIGHTS)[0]
    if mode == "failpoint":
        return mode, f"{rng.choice(POINTS)}:{rng.randint(1, 4)}", None
    if mode == "early":
        return mode, None, Kill(event="run_started", delay=rng.uniform(0.0, 0.08))
    after = rng.randint(1, max(1, samples // 4))
    if mode == "sigterm":
        return mode, None, Kill(after=after, sig=signal.SIGTERM)
    return mode, None, Kill(after=after, delay=rng.uniform(0.0, 0.02))


def account(tally: Tally, mode: str, failpoint: str | None, run: ChildRun) -> bool:
    """Record how a run ended; True when it finished the dataset (exit 0, no signal)."""
    tally.child_runs += 1
    if run.killed:
        tally.kills += 1
        tally.by_mode[mode] += 1
        if failpoint:
            tally.by_point[failpoint.partition(":")[0]] += 1
        return False
    if mode == "sigterm" and run.signalled and run.returncode == 0:
        tally.sigterms += 1
        tally.by_mode[mode] += 1
        return False
    if run.returncode in (0, 1):  # 1: unfinished samples, resumable
        tally.finished_early += 1
        return run.returncode == 0
    raise AssertionError(f"unexpected exit {run.returncode}:\n{run.tail()}")


def _round_dirs(work: Path, number: int) -> tuple[Path, Path]:
    """A fresh dump root in /dev/shm (like production) and a work directory."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    root = shm / f"hsx-soak-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    tmp = work / f"round-{number}"
    tmp.mkdir()
    return root, tmp


async def one_round(
    tally: Tally, rng: random.Random, work: Path, args: argparse.Namespace, budget: int
) -> None:
    seed = rng.randrange(1 << 30)
    root, tmp = _round_dirs(work, tally.rounds)
    try:
        samples = crash_samples(tmp / "in.jsonl", args.samples, seed=seed)
        reference = await reference_run(samples, tmp / "reference", root)
        faulty = rng.random() < 0.5
        options = fake_options(
            root,
            random_chunks=faulty,
            fault_rate=0.05 if faulty else 0.0,
            faults=tuple(f for f in ALL_FAULTS if f != "hang"),
            late_meta_s=0.02,
            seed=seed,
        )
        async with running_fake_server(options) as fake:
            bed = make_bed(tmp / "run", root, samples, fake, dump={"timeout": 1.0})
            try:
                await _kill_and_resume(tally, rng, bed, min(args.kills_per_round, budget))
                verify(bed.out, root, samples, reference)
            finally:
                tally.faults_injected += sum(fake.stats.faults.values())
        tally.rounds_verified += 1
        tally.samples_verified += len(samples.good)
    except AssertionError as exc:
        tally.failures.append({"round": tally.rounds, "seed": seed, "error": str(exc)[:4000],
                               "trace": traceback.format_exc()[-4000:]})  # fmt: skip
        # Keep the evidence: the round's input, config, output and logs are small.
        shutil.copytree(tmp, RESULTS / f"crash_soak-failed-{seed}", dirs_exist_ok=True)
    finally:
        tally.rounds += 1
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


async def _kill_and_resume(tally: Tally, rng: random.Random, bed: CrashBed, kills: int) -> None:
    runs: list[ChildRun] = []
    try:
        for _ in range(kills):
            mode, failpoint, kill = draw_stop(rng, len(bed.samples.good))
            run = await run_child(bed.config, failpoint=failpoint, kills=[kill] if kill else None)
            runs.append(run)
            if account(tally, mode, failpoint, run):
                return
            await bed.barrier()
        resumes = await bed.resume()
        runs += resumes
        tally.child_runs += len(resumes)
    finally:
        # Every run starts by repairing what the previous one left: count them all.
        temp, orphans = cleanup_counts(runs)
        tally.temp_files_cleaned += temp
        tally.orphans_cleaned += orphans


def summary(tally: Tally, seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    data = asdict(tally)
    # asdict() rebuilds a Counter from (key, value) pairs, counting the pairs: undo that.
    data.update(by_mode=dict(tally.by_mode), by_point=dict(tally.by_point))
    data.update(
        seconds=round(seconds, 1),
        seed=args.seed,
        samples_per_round=args.samples,
        kills_per_round=args.kills_per_round,
        python=sys.version.split()[0],
        cpus=os.cpu_count(),
    )
    return data


def print_summary(data: dict[str, Any], path: Path) -> None:
    print(
        f"crash soak: {data['kills']} SIGKILLs + {data['sigterms']} SIGTERMs survived over "
        f"{data['rounds_verified']}/{data['rounds']} rounds ({data['child_runs']} runs of "
        f"hsx, {data['samples_verified']} samples verified bit-exact, "
        f"{data['faults_injected']} server faults injected) in {data['seconds']:.0f} s"
    )
    print(f"  by mode: {dict(data['by_mode'])}")
    print(f"  failpoints: {dict(data['by_point'])}")
    print(
        f"  resumes removed {data['temp_files_cleaned']} temp files and "
        f"{data['orphans_cleaned']} orphans; runs ending before their kill: "
        f"{data['finished_early']}"
    )
    print(f"  failures: {len(data['failures'])}; details in {path}")


async def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally()
    started = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hsx-crash-soak-") as work:
        while tally.kills + tally.sigterms < args.kills:
            budget = args.kills - tally.kills - tally.sigterms
            await one_round(tally, rng, Path(work), args, budget)
            if tally.failures and not args.keep_going:
                break
            if tally.rounds % 5 == 0:
                print(f"  ... {tally.kills + tally.sigterms} kills, {tally.rounds} rounds",
                      flush=True)  # fmt: skip
    data = summary(tally, time.monotonic() - started, args)
    path = RESULTS / f"crash_soak-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    print_summary(data, path)
    return 1 if tally.failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--kills", type=int, default=300, help="stop after this many kills")
    p.add_argument("--kills-per-round", type=int, default=5, help="kills of one dataset")
    p.add_argument("--samples", type=int, default=60, help="good samples per round")
    p.add_argument("--seed", type=int, default=int(time.time()), help="replay a soak")
    p.add_argument("--keep-going", action="store_true", help="go on after a failed round")
    args = p.parse_args()
    configure_logging("console", "error")  # the in-process reference runs stay quiet
    return asyncio.run(soak(args))


if __name__ == "__main__":
    raise SystemExit(main())
