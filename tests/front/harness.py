"""Driving ``hsx front speculators`` and speculators' own reader as subprocesses of
.venv-mooncake (the front's own Mooncake client and segment; the reader as the trainer
runs it), shared by the fake-server and the real-SGLang tiers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from safetensors.torch import load_file

from tests.e2e import free_port
from tests.front.conftest import REPO, mooncake_python, stop, wait_listening

READER = Path(__file__).with_name("speculators_reader.py")
READ_TIMEOUT = 180.0  # s: a real server's prefill of every prompt on two busy cores


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


async def read_through(url: str, master: str, tmp: Path, prompts: list[list[int]]) -> Read:
    """speculators' own reader over ``prompts``, one request each, in order."""
    requests = tmp / "requests.json"
    requests.write_text(json.dumps(prompts))
    out = tmp / "read.safetensors"
    reader = await asyncio.create_subprocess_exec(
        mooncake_python(),
        str(READER),
        url,
        master,
        str(requests),
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    log, _ = await asyncio.wait_for(reader.communicate(), READ_TIMEOUT)
    assert reader.returncode == 0, log.decode(errors="replace")[-3000:]
    with safe_open(out, framework="pt") as fh:
        notes = dict(fh.metadata())
    return Read(load_file(out), notes)


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
