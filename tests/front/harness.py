"""Driving ``hsx front speculators|specforge``, speculators' own reader and SpecForge's own
producer and consumer as subprocesses of .venv-mooncake (the front's own Mooncake client
and segment; the trainers' code as they run it), shared by the fake-server and the
real-SGLang tiers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from safetensors.torch import load_file

from hsx_async.cli import main
from hsx_async.run.daemon.daemon import Daemon
from tests.e2e import free_port, make_config
from tests.front.conftest import REPO, mooncake_python, running_master, stop, wait_listening

READER = Path(__file__).with_name("speculators_reader.py")
CLIENT = Path(__file__).with_name("specforge_client.py")
READ_TIMEOUT = 180.0  # s: a real server's prefill of every prompt on two busy cores


async def run_and_export(
    tmp: Path, samples: Path, url: str, dump: Path, *, model: Path, fmt: str, hidden_size: int
) -> Path:
    """``hsx run`` of the 3 samples then ``hsx export --format FMT --model``: where it wrote."""
    config = make_config(tmp / "run", samples, [url], dump, hidden_size=hidden_size)
    summary = await Daemon(config).run()
    assert (summary.done, summary.quarantined) == (3, 0), summary
    dest = tmp / fmt
    args = ["export", str(config.output.dir), "--format", fmt, "--to", str(dest)]
    code = await asyncio.to_thread(main, [*args, "--model", str(model)])
    assert code == 0
    return dest


async def start_front(
    tmp: Path,
    config: Path,
    *,
    model: Path,
    master: str,
    buffer_mib: int = 16,
    segment_mib: int = 64,
    name: str = "tiny",
    trainer: str = "speculators",
) -> tuple[asyncio.subprocess.Process, str]:
    """``hsx front <trainer>`` listening on 127.0.0.1 (its log: ``tmp/front.log``)."""
    port = free_port()
    log = (tmp / "front.log").open("wb")
    named = ["--served-model-name", name] if trainer == "speculators" else []
    proc = await asyncio.create_subprocess_exec(
        mooncake_python(),
        "-m",
        "hsx_async",
        "front",
        trainer,
        "--config",
        str(config),
        "--model",
        str(model),
        "--listen",
        f"127.0.0.1:{port}",
        *named,
        "--mooncake-master",
        master,
        "--mooncake-segment-mib",
        str(segment_mib),
        "--mooncake-buffer-mib",
        str(buffer_mib),
        stdout=log,
        stderr=log,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    log.close()
    try:
        await wait_listening(port, proc, "hsx front")
    except BaseException:
        await stop(proc)
        print((tmp / "front.log").read_text())
        raise
    return proc, f"http://127.0.0.1:{port}"


@dataclass(frozen=True)
class Read:
    """What speculators' reader got: ``hidden_states_<i>``/``token_ids_<i>`` per sample
    read; ``notes``: ``error_<i>`` for each that failed, ``gone_<i>`` ("0" once the
    trainer's delete removed the object)."""

    tensors: dict[str, torch.Tensor]
    notes: dict[str, str]


async def run_trainer_code(
    script: Path, url: str, master: str, given: object, tmp: Path
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``script URL MASTER GIVEN_JSON OUT`` in .venv-mooncake as the trainer runs its code
    (bounded; its output shown when it fails): the tensors it wrote to OUT and their notes."""
    given_path = tmp / f"{script.stem}.json"
    given_path.write_text(json.dumps(given))
    out = tmp / f"{script.stem}.safetensors"
    proc = await asyncio.create_subprocess_exec(
        mooncake_python(),
        str(script),
        url,
        master,
        str(given_path),
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    try:
        log, _ = await asyncio.wait_for(proc.communicate(), READ_TIMEOUT)
    finally:
        await stop(proc)
    assert proc.returncode == 0, log.decode(errors="replace")[-3000:]
    with safe_open(out, framework="pt") as fh:
        notes = dict(fh.metadata())
    return load_file(out), notes


@contextlib.asynccontextmanager
async def master_that_goes(tmp: Path) -> AsyncIterator[tuple[str, Callable[[], Awaitable[None]]]]:
    """A real mooncake_master (its HOST:PORT) and the call that stops it early."""
    async with contextlib.AsyncExitStack() as masters:
        master = await masters.enter_async_context(running_master(tmp))
        yield master, masters.aclose


async def read_through(url: str, master: str, tmp: Path, prompts: list[list[int]]) -> Read:
    """speculators' own reader over ``prompts``, one request each, in order."""
    return Read(*await run_trainer_code(READER, url, master, prompts, tmp))


@dataclass(frozen=True)
class Produced:
    """What SpecForge's consumer read (``{feature}_{i}``) and the notes: ``error_<i>``,
    ``retryable_<i>``, ``gone_<i>``, ``consumed``."""

    tensors: dict[str, torch.Tensor]
    notes: dict[str, str]


async def produce(
    url: str,
    master: str,
    tmp: Path,
    tasks: list[dict[str, Any]],
    *,
    aux_layer_ids: list[int],
    hidden_size: int,
    client_segment_mib: int = 0,
    store_id: str = "",
) -> Produced:
    """SpecForge's producer captures ``tasks`` (one lease batch) through the front; its
    consumer reads every good ref off the channel; the producer frees them."""
    plan = {
        "store_id": store_id or f"sf{free_port()}",
        "run_id": "run",
        "aux_layer_ids": aux_layer_ids,
        "hidden_size": hidden_size,
        "client_segment_mib": client_segment_mib,
        "tasks": tasks,
    }
    return Produced(*await run_trainer_code(CLIENT, url, master, plan, tmp))


def task(ids: list[int], mask: list[int] | None = None, attempt: int = 0) -> dict[str, Any]:
    """One of SpecForge's prompt tasks for :func:`produce` (all-ones loss mask by default)."""
    return {"input_ids": ids, "loss_mask": mask or [1] * len(ids), "attempt": attempt}


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The front's ``/metrics``: each counter, gauge and histogram count by its series
    (``name{label="value",...}``), buckets and sums left out."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_sum", "_created")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
