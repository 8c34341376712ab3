"""One job run into each mistake of issue 24, fixed, rerun — and every sample done exactly
once in the end. The CLI runs as the operator would (exit codes, one-line errors); the
reload step runs in-process to send SIGHUP at a known moment. Against the fake server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from hsx_async.config import load_config
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.dataset.provenance import read_provenance
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.servers.pool import Server
from hsx_async.server.fake.server import FakeOptions, FakeServerHandle, running_fake_server
from tests.crash_driver import AUX, H, L, fake_options
from tests.e2e import (
    check_dataset,
    config_raw,
    shm_leftovers,
    when_done,
    write_config,
    write_samples,
)

REPO = Path(__file__).resolve().parents[2]


async def _hsx(*args: str) -> tuple[int, str, str]:
    """``hsx ARGS`` as a child process: (exit code, stdout, the last stderr line)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSX_", "SLURM_", "JOB_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hsx_async", *args, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(90):
        out, err = await proc.communicate()
    lines = err.decode().strip().splitlines()
    return proc.returncode or 0, out.decode(), lines[-1] if lines else ""


@dataclasses.dataclass
class _Job:
    raw: dict[str, Any]
    path: Path
    main: FakeServerHandle  # the job's server
    base: FakeOptions  # what it serves once fixed

    @property
    def out(self) -> Path:
        return Path(self.raw["output"]["dir"])

    def write(self) -> None:
        write_config(self.path.parent, self.raw)

    async def run(self) -> tuple[int, str]:
        code, _, err = await _hsx("run", "--config", str(self.path), "--no-report")
        return code, err


async def _config_mistakes(job: _Job, elsewhere: Path) -> None:
    """1. Config and servers disagree: the layers, then the dump root. Exit 2, one line
    naming the key and what the servers reported; nothing charged."""
    code, err = await job.run()
    assert code == 2 and "config key 'model.aux_layers'" in err and "[1, 3, 5]" in err
    assert read_quarantine(job.out) == []
    job.raw["model"]["aux_layers"] = list(AUX)
    job.raw["dump"]["root"] = str(elsewhere)
    job.write()
    code, err = await job.run()
    assert code == 2 and "config key 'dump.root'" in err
    job.raw["dump"]["root"] = job.base.dump_root.as_posix()
    job.write()


async def _server_mistakes(job: _Job) -> None:
    """2. The job's server runs without the hook, the other serves another model than
    [model].name: neither is admitted, nothing is charged, exit 3 (not exit 0)."""
    code, err = await job.run()
    assert code == 3 and "no server in rotation" in err and "hsx hook" in err
    assert read_manifest(job.out) == [] and read_quarantine(job.out) == []


async def _reload_mistake(job: _Job) -> None:
    """3. The hook fixed (a restart); the other model still refused, never mixed in.
    Mid-run a reload points at the wrong engine: the server leaves rotation and the
    samples wait; the reload that fixes it brings it back. Samples whose ids are past
    the server's vocabulary are the samples' own fault: quarantined, once each."""
    job.main.options = job.base
    await job.main.restart()
    daemon = Daemon(load_config(job.path))
    some = when_done(daemon, 8)
    refused = asyncio.Event()

    def on_change(server: Server, in_rotation: bool) -> None:
        if not in_rotation and "server.engine" in server.last_error:
            refused.set()

    daemon.on_server_change.append(on_change)
    run = asyncio.create_task(daemon.run())
    await some.wait()
    job.raw["server"]["engines"] = ["vllm", "sglang"]
    job.write()
    await daemon.reload()
    async with asyncio.timeout(10):
        await refused.wait()
    job.raw["server"].pop("engines")
    job.write()
    await daemon.reload()
    summary = await run
    assert summary.unfinished == 0
    prov = read_provenance(job.out)
    assert prov is not None and set(prov["servers"]) == {job.main.url}
    assert prov["identity"]["model"] == "/models/base"


async def _quarantine_retried(job: _Job) -> None:
    """4. The vocabulary fixed: the quarantine is put back and the rerun finishes it."""
    refused = read_quarantine(job.out)
    assert refused and all("out of vocabulary" in q.reason for q in refused)
    job.main.options = dataclasses.replace(job.base, vocab_size=0)
    await job.main.restart()
    code, text, _ = await _hsx("status", str(job.out))
    assert code == 0 and f"{len(refused)} after failed attempts could be retried" in text
    code, text, _ = await _hsx("quarantine", str(job.out), "--retry")
    assert code == 0 and f"{len(refused)} lines put back" in text
    code, err = await job.run()
    assert code == 0, err


async def test_a_job_through_every_mistake_ends_with_every_sample_once(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 60, max_len=24, seed=11)
    elsewhere = shm_root / "elsewhere"
    elsewhere.mkdir()
    base = fake_options(shm_root, model="/models/base", vocab_size=45_000, latency_base_ms=3)
    async with (
        running_fake_server(dataclasses.replace(base, hook=False)) as main,
        running_fake_server(fake_options(shm_root, model="/models/instruct")) as other,
    ):
        raw = config_raw(tmp_path, samples.path, [main.url, other.url], shm_root,
                         aux_layers=(2, 4, 6), server={"unreachable_timeout": 2.0},
                         dump={"timeout": 0.3}, daemon={"log_format": "json"},
                         model={"name": "/models/base"})  # fmt: skip
        job = _Job(raw, write_config(tmp_path, raw), main, base)
        await _config_mistakes(job, elsewhere)
        await _server_mistakes(job)
        await _reload_mistake(job)
        await _quarantine_retried(job)
    check_dataset(job.out, samples, hidden_size=H, num_layers=L)  # every sample exactly once
    assert read_quarantine(job.out) == []
    assert shm_leftovers(shm_root) in ([], ["elsewhere"])
