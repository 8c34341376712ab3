"""``hsx front speculators`` end to end on real parts: a real ``mooncake_master``, the front
(its own Mooncake client and segment) in .venv-mooncake, the fake server, and speculators'
own trainer-side code (``tests/front/speculators_reader.py``) reading what the front
published. What the trainer reads equals what ``hsx run`` + ``hsx export --format
speculators`` write for the same prompts; a prompt the server refuses reaches the trainer
as hs-connectors' ``:error`` marker naming the sample's fault."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest
import torch
from safetensors.torch import load_file

from hsx_async.front.mooncake import aligned
from tests.dataset.test_export import model_dir
from tests.e2e import config_raw, free_port, write_config, write_samples
from tests.front.conftest import VOCAB, stop
from tests.front.harness import master_that_goes, read_through, run_and_export, scrape, start_front

pytestmark = pytest.mark.mooncake

HIDDEN = 64


async def _front(
    tmp: Path,
    samples: Path,
    url: str,
    dump: Path,
    *,
    model: Path,
    master: str,
    urls: list[str] | None = None,
    buffer_mib: int = 16,
    segment_mib: int = 64,
) -> tuple[asyncio.subprocess.Process, str]:
    raw = config_raw(tmp / "front", samples, urls or [url], dump, hidden_size=HIDDEN)
    config = write_config(tmp, raw, "front.toml")
    return await start_front(
        tmp, config, model=model, master=master, buffer_mib=buffer_mib, segment_mib=segment_mib
    )


async def test_speculators_reads_what_hsx_run_writes(
    tmp_path: Path, fake: str, shm_root: Path, mooncake_master: str
) -> None:
    sample_set = write_samples(tmp_path / "samples.jsonl", 3, seed=7, max_len=90)
    model, _ = model_dir(tmp_path / "model", HIDDEN)
    dest = await run_and_export(
        tmp_path,
        sample_set.path,
        fake,
        shm_root,
        model=model,
        fmt="speculators",
        hidden_size=HIDDEN,
    )
    rows = [orjson.loads(line) for line in (dest / "samples.jsonl").read_bytes().splitlines()]
    prompts = [row["input_ids"] for row in rows] + [[1, VOCAB + 5, 2]]

    proc, url = await _front(
        tmp_path, sample_set.path, fake, shm_root, model=model, master=mooncake_master
    )
    try:
        got = await read_through(url, mooncake_master, tmp_path, prompts)
    finally:
        await stop(proc)
    read, notes = got.tensors, got.notes
    for i, row in enumerate(rows):
        offline = load_file(dest / "hidden_states" / f"hs_{i}.safetensors")
        assert f"error_{i}" not in notes, notes
        assert read[f"hidden_states_{i}"].dtype == torch.bfloat16
        assert read[f"hidden_states_{i}"].shape == (len(row["input_ids"]), 4, HIDDEN)
        assert torch.equal(read[f"hidden_states_{i}"], offline["hidden_states"])
        assert torch.equal(read[f"token_ids_{i}"], offline["token_ids"])
        assert notes[f"gone_{i}"] == "0"  # the trainer's delete removed the pinned object
    refused = len(rows)
    assert f"hidden_states_{refused}" not in read
    error = notes[f"error_{refused}"]
    assert error.startswith("MooncakeIntegrityError: Mooncake producer error for key=hsx-")
    assert ":error: sample fault" in error, error
    assert notes[f"gone_{refused}"] == "0"


async def test_failures_reach_the_trainer_as_its_error_markers(
    tmp_path: Path, fake: str, shm_root: Path, mooncake_master: str
) -> None:
    """The front takes the servers in turn (the fake one and one that is down: every prompt
    the down one fails moves on to the fake one) and has a 4 MiB Mooncake buffer and a 16 MiB
    segment (Mooncake's least). A prompt too large for the buffer and one that finds the
    segment full (unread samples hold it) reach speculators' reader as their ``:error``
    markers, each naming its cause; the others as their rows. Requests the trainer's API
    refuses are answered as vLLM answers them."""
    sample_set = write_samples(tmp_path / "samples.jsonl", 1, seed=3, max_len=40)
    model, _ = model_dir(tmp_path / "model", HIDDEN)
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = await _front(
        tmp_path,
        sample_set.path,
        fake,
        shm_root,
        model=model,
        master=mooncake_master,
        urls=[fake, dead],
        buffer_mib=4,
        segment_mib=16,
    )
    big = [7] * 8200  # 8200 tokens x 4 slots x 64 x 2 bytes: over the 4 MiB buffer
    fill = [8] * 7000  # 3.4 MiB: five do not fit in the 16 MiB segment
    prompts = [big, [1, 2, 3], fill, [8, 9], [4, 5, 6]]
    try:
        async with aiohttp.ClientSession() as session:
            await _refusals(session, url)
            for prompt in [fill, [1]] * 4:  # unread: they hold the segment
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
        got = await read_through(url, mooncake_master, tmp_path, prompts)
        async with aiohttp.ClientSession() as session:
            metrics = await scrape(session, url)
    finally:
        await stop(proc)
    read, notes = got.tensors, got.notes
    assert "over the Mooncake client's local buffer" in notes["error_0"], notes
    assert "--mooncake-buffer-mib" in notes["error_0"]
    assert "Mooncake is full" in notes["error_2"], notes
    for i in (1, 3, 4):  # the server that is down cost the trainer nothing
        assert f"error_{i}" not in notes, notes
        assert read[f"token_ids_{i}"].tolist() == prompts[i]
        assert read[f"hidden_states_{i}"].shape == (len(prompts[i]), 4, HIDDEN)
    assert [notes[f"gone_{i}"] for i in range(5)] == ["0"] * 5
    assert metrics == {
        'hsx_front_requests_total{outcome="refused"}': 6.0,
        'hsx_front_requests_total{outcome="published"}': 11.0,
        'hsx_front_requests_total{outcome="error_marker"}': 2.0,
        'hsx_front_failures_total{cause="mooncake",kind="mooncake_too_large"}': 1.0,
        'hsx_front_failures_total{cause="mooncake",kind="mooncake_full"}': 1.0,
        "hsx_front_bytes_published_total": metrics["hsx_front_bytes_published_total"],
        "hsx_front_request_seconds_count": 13.0,
        "hsx_front_publish_seconds_count": 15.0,  # 11 samples, 2 refused, 2 markers
        # The eight unread samples hold the segment; what the trainer read it removed.
        "hsx_front_mooncake_objects_held": 8.0,
        "hsx_front_mooncake_bytes_held": 4 * _packed(len(fill)) + 4 * _packed(1),
    }, metrics
    assert metrics["hsx_front_bytes_published_total"] > metrics["hsx_front_mooncake_bytes_held"]


async def _refusals(session: aiohttp.ClientSession, url: str) -> None:
    refusals = [
        ({"model": "other", "prompt": [1], "max_tokens": 1}, 404),
        ({"model": "tiny", "prompt": "text", "max_tokens": 1}, 400),
        ({"model": "tiny", "prompt": [], "max_tokens": 1}, 400),
        ({"model": "tiny", "prompt": [1, -2], "max_tokens": 1}, 400),
        ({"model": "tiny", "prompt": [1, 2], "max_tokens": 8}, 400),
    ]
    for body, status in refusals:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == status, body
            assert (await resp.json())["error"]["code"] == status
    async with session.post(f"{url}/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400


def _packed(tokens: int) -> int:
    """A sample's object: its hidden states and token ids, each 64-byte aligned."""
    return aligned(tokens * 4 * HIDDEN * 2) + aligned(tokens * 8)


async def test_mooncake_down_is_the_trainers_503_naming_the_master(
    tmp_path: Path, fake: str, shm_root: Path
) -> None:
    """With mooncake_master gone not even the marker can be put: the trainer's request is
    answered 503 (its client raises), naming the master; the front stays up and counts it."""
    sample_set = write_samples(tmp_path / "samples.jsonl", 1, seed=3, max_len=40)
    model, _ = model_dir(tmp_path / "model", HIDDEN)
    async with master_that_goes(tmp_path) as (master, stop_master):
        proc, url = await _front(
            tmp_path, sample_set.path, fake, shm_root, model=model, master=master
        )
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                await stop_master()
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 503
                    message = (await resp.json())["error"]["message"]
                async with session.get(f"{url}/health") as resp:
                    assert resp.status == 200
                metrics = await scrape(session, url)
        finally:
            await stop(proc)
    assert f"Mooncake's master at {master} did not answer" in message, message
    assert metrics['hsx_front_requests_total{outcome="unanswered"}'] == 1
    assert metrics['hsx_front_requests_total{outcome="published"}'] == 1
    assert metrics['hsx_front_failures_total{cause="mooncake",kind="mooncake_unreachable"}'] == 1
