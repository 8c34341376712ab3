"""``hsx front specforge`` end to end on real parts: a real ``mooncake_master``, the front
(its own Mooncake client and segment) in .venv-mooncake, the fake server, and SpecForge
0.2.0's own online producer (``SGLangServerCaptureAdapter.produce_refs``, its request code
unchanged, pointed at the front's URL) and data-plane consumer (``StreamingRefChannel``,
``MooncakeFeatureStore.get``) in ``tests/front/specforge_client.py``. What the consumer
reads equals what ``hsx run`` + ``hsx export --format specforge`` write for the same prompts
(aux layers concatenated, the post-norm target); failures reach the producer as its own
``ServerCaptureFailure`` (the front's per-task error) or ``CaptureMismatchError``, and no
object of theirs is left in Mooncake."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from hsx_async.dataset.export.specforge import specforge_relpath
from hsx_async.errors import ArgumentError
from hsx_async.front.specforge import capture_layer_ids
from tests.dataset.test_export import model_dir
from tests.e2e import config_raw, free_port, make_config, write_config, write_samples
from tests.front.conftest import VOCAB, stop
from tests.front.harness import master_that_goes, produce, run_and_export, scrape, start_front, task

pytestmark = pytest.mark.mooncake

HIDDEN = 64
AUX = [1, 3, 5]  # the fake server's and the configs' aux layers (hsx numbering)
IDS = [0, 2, 4]  # the same layers as a Llama drafter's config names them (SpecForge's)
FEATURES = ("hidden_state", "target", "input_ids", "loss_mask", "attention_mask")


@pytest.fixture
def one_sample(tmp_path: Path) -> tuple[Path, Path]:
    """A one-sample input file (the front reads none; its config names one) and the model."""
    sample_set = write_samples(tmp_path / "samples.jsonl", 1, seed=3, max_len=40)
    model, _ = model_dir(tmp_path / "model", HIDDEN)
    return sample_set.path, model


async def _front(
    tmp: Path,
    samples: Path,
    urls: list[str],
    dump: Path,
    *,
    model: Path,
    master: str,
    buffer_mib: int = 16,
    segment_mib: int = 64,
    server: dict[str, Any] | None = None,
) -> tuple[asyncio.subprocess.Process, str]:
    # Bounds for prefill on two busy cores (five 9000-token prompts at once in one test).
    bounds = {"request_timeout": 60.0} | (server or {})
    raw = config_raw(
        tmp / "front",
        samples,
        urls,
        dump,
        hidden_size=HIDDEN,
        server=bounds,
        dump={"timeout": 60.0},
    )
    config = write_config(tmp, raw, "front.toml")
    return await start_front(
        tmp,
        config,
        model=model,
        master=master,
        buffer_mib=buffer_mib,
        segment_mib=segment_mib,
        trainer="specforge",
    )


async def test_specforge_reads_what_hsx_run_writes(
    tmp_path: Path, fake: str, shm_root: Path, mooncake_master: str
) -> None:
    samples = write_samples(tmp_path / "samples.jsonl", 3, seed=7, max_len=90).path
    model, _ = model_dir(tmp_path / "model", HIDDEN)
    dest = await run_and_export(
        tmp_path, samples, fake, shm_root, model=model, fmt="specforge", hidden_size=HIDDEN
    )
    offline = [torch.load(dest / specforge_relpath(i), weights_only=True) for i in range(3)]
    tasks = [task(o["input_ids"].tolist(), o["loss_mask"].tolist()) for o in offline]
    tasks.append(task([1, VOCAB + 5, 2]))  # the server refuses it: the sample's fault
    tasks.append(task(tasks[0]["input_ids"], tasks[0]["loss_mask"], attempt=1))  # a retry

    proc, url = await _front(
        tmp_path, samples, [fake], shm_root, model=model, master=mooncake_master
    )
    try:
        got = await produce(
            url, mooncake_master, tmp_path, tasks, aux_layer_ids=IDS, hidden_size=HIDDEN
        )
        async with aiohttp.ClientSession() as session:
            metrics = await scrape(session, url)
    finally:
        await stop(proc)
    read, notes = got.tensors, got.notes
    for i in (0, 1, 2, 4):
        want = offline[i % 4]
        length = len(want["input_ids"])
        assert f"error_{i}" not in notes, notes
        assert read[f"hidden_state_{i}"].dtype == torch.bfloat16
        assert read[f"hidden_state_{i}"].shape == (1, length, len(AUX) * HIDDEN)
        assert torch.equal(read[f"hidden_state_{i}"], want["aux_hidden_state"])
        assert read[f"target_{i}"].shape == (1, length, HIDDEN)
        assert torch.equal(read[f"target_{i}"], want["hidden_state"])  # post-norm
        assert torch.equal(read[f"input_ids_{i}"], want["input_ids"].unsqueeze(0))
        assert torch.equal(read[f"loss_mask_{i}"], want["loss_mask"].unsqueeze(0))
        assert torch.equal(read[f"attention_mask_{i}"], torch.ones(1, length, dtype=torch.int64))
    assert not any(k.endswith("_3") for k in read)
    assert notes["error_3"].startswith("server_capture:sample fault"), notes
    assert notes["retryable_3"] == "True"
    assert notes["consumed"] == "4"
    assert [notes[f"gone_{i}"] for i in range(5)] == ["1"] * 5  # SpecForge freed them all
    assert metrics['hsx_front_requests_total{outcome="published"}'] == 4
    assert metrics['hsx_front_requests_total{outcome="error_marker"}'] == 1
    assert metrics["hsx_front_mooncake_objects_held"] == 0


async def test_a_capture_the_draft_cannot_use_is_the_producers_mismatch(
    tmp_path: Path, one_sample: tuple[Path, Path], fake: str, shm_root: Path, mooncake_master: str
) -> None:
    """The front answers its aux layer ids and shapes; a producer whose draft wants other
    layers or another hidden size refuses the capture with its own ``CaptureMismatchError``
    (not retryable) and aborts the keys: nothing is left in Mooncake."""
    samples, model = one_sample
    proc, url = await _front(
        tmp_path, samples, [fake], shm_root, model=model, master=mooncake_master
    )
    try:
        layers = await produce(
            url,
            mooncake_master,
            tmp_path,
            [task([1, 2, 3])],
            aux_layer_ids=[2, 4, 6],
            hidden_size=HIDDEN,
        )
        width = await produce(
            url,
            mooncake_master,
            tmp_path,
            [task([4, 5])],
            aux_layer_ids=IDS,
            hidden_size=2 * HIDDEN,
        )
    finally:
        await stop(proc)
    assert (
        "aux-layer id mismatch: recorded (0, 2, 4) != requested (2, 4, 6)"
        in (layers.notes["error_0"])
    ), layers.notes
    assert (
        f"aux width {3 * HIDDEN} != len(aux_layer_ids)*target_hidden_size"
        in (width.notes["error_0"])
    ), width.notes
    for got in (layers, width):
        assert got.notes["retryable_0"] == "False"
        assert got.notes["gone_0"] == "1"
        assert got.notes["consumed"] == "0"


# SpecForge's clients with no segment (its launcher's online roles): Mooncake refuses the
# put (no space); with one each: Mooncake would place the object in theirs, and it would go
# with them, so the front takes it back and refuses it as full.
@pytest.mark.parametrize(
    ("client_segment_mib", "why"),
    [(0, "(status -200)"), (16, "Mooncake placed it with ['127.0.0.1:")],
)
async def test_a_full_mooncake_and_a_server_down_are_the_producers_failures(
    tmp_path: Path,
    one_sample: tuple[Path, Path],
    fake: str,
    shm_root: Path,
    mooncake_master: str,
    *,
    client_segment_mib: int,
    why: str,
) -> None:
    """The front takes the servers in turn (the fake one and one that is down: what the down
    one fails moves on to the fake one) and has a 16 MiB segment (Mooncake's least). In one
    lease batch of five 9000-token prompts (4.7 MiB each: at most three fit), the ones that
    find the segment full are the producer's retryable failures naming it, with none of
    their objects left; the others are read as published, from the front's segment."""
    samples, model = one_sample
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = await _front(
        tmp_path,
        samples,
        [fake, dead],
        shm_root,
        model=model,
        master=mooncake_master,
        buffer_mib=4,
        segment_mib=16,
    )
    prompts = [[10 + i] * 9000 for i in range(5)]
    try:
        got = await produce(
            url,
            mooncake_master,
            tmp_path,
            [task(p) for p in prompts],
            aux_layer_ids=IDS,
            hidden_size=HIDDEN,
            client_segment_mib=client_segment_mib,
        )
        async with aiohttp.ClientSession() as session:
            metrics = await scrape(session, url)
    finally:
        await stop(proc)
    full = [i for i in range(5) if f"error_{i}" in got.notes]
    assert len(full) >= 2, got.notes
    for i in full:
        assert "server_capture:Mooncake is full" in got.notes[f"error_{i}"], got.notes
        assert why in got.notes[f"error_{i}"], got.notes
        assert got.notes[f"retryable_{i}"] == "True"
    for i in set(range(5)) - set(full):
        assert got.tensors[f"input_ids_{i}"].tolist() == [prompts[i]]
        assert got.tensors[f"hidden_state_{i}"].shape == (1, 9000, len(AUX) * HIDDEN)
    assert [got.notes[f"gone_{i}"] for i in range(5)] == ["1"] * 5
    assert got.notes["consumed"] == str(5 - len(full))
    failures = 'hsx_front_failures_total{cause="mooncake",kind="mooncake_full"}'
    assert metrics[failures] == len(full)
    assert metrics["hsx_front_mooncake_objects_held"] == 0


def test_the_layer_ids_are_answered_in_specforges_numbering_or_the_front_does_not_start(
    tmp_path: Path,
) -> None:
    """SpecForge's drafter names layers as SGLang's family rule does (a Llama's ids are
    hsx's minus one); without ``--model`` the family is unknown, and a family hsx has no
    rule for, or layers no ids express, stop the front before it serves."""
    config = make_config(
        tmp_path, tmp_path / "unused.jsonl", ["http://127.0.0.1:1"], tmp_path, hidden_size=HIDDEN
    )
    model, _ = model_dir(tmp_path / "llama", HIDDEN)
    assert capture_layer_ids(config, model) == IDS
    deepseek, _ = model_dir(
        tmp_path / "deepseek", HIDDEN, architecture="DeepseekV3ForCausalLM", model_type="x"
    )
    unknown, _ = model_dir(tmp_path / "unknown", HIDDEN, architecture="NoSuchForCausalLM")
    with pytest.raises(ArgumentError, match="argument --model: hsx front specforge needs"):
        capture_layer_ids(config, None)
    with pytest.raises(ArgumentError, match="NoSuchForCausalLM: no draft-config ids"):
        capture_layer_ids(config, unknown)
    # DeepSeek-V3's rule adds one only to ids starting at 1: none give layers [1, 3, 5].
    with pytest.raises(ArgumentError, match="rule 'plus_one_if_first_is_one' maps no ids"):
        capture_layer_ids(config, deepseek)


async def _generate(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(f"{url}/generate", json=body) as resp:
        return resp.status, await resp.json()


def _entry(**overrides: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "store_id": "sf",
        "sample_id": "run:t0",
        "gen": 1,
        "replace": False,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": [1, 2], "shape": [1, 2], "dtype": "int64"}],
    }
    entry.update(overrides)
    return entry


def _body(ids: Any, *entries: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "extra_key": ["k"] * len(entries),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0},
        "spec_capture": list(entries),
    }
    body.update(overrides)
    return body


async def test_requests_that_are_not_specforges_are_refused_and_a_server_down_named(
    tmp_path: Path, one_sample: tuple[Path, Path], shm_root: Path, mooncake_master: str
) -> None:
    """A body that is not SpecForge's capture request is SGLang's 400 (the producer fails
    the lease batch); an entry this capture cannot write is that task's error, naming the
    identity it asked for; with the only server down (unreachable for 1 s) every task is
    the server's fault; the front stays up."""
    samples, model = one_sample
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = await _front(
        tmp_path,
        samples,
        [dead],
        shm_root,
        model=model,
        master=mooncake_master,
        server={"unreachable_timeout": 1.0},
    )
    refused: list[tuple[Any, dict[str, Any]]] = [
        ([1, 2], {}),  # no spec_capture
        ([], {"spec_capture": [_entry()]}),
        ([[1, 2], [3]], {"spec_capture": [_entry()]}),  # two prompts, one entry
        ([1, 2], {"spec_capture": [_entry()], "sampling_params": {"max_new_tokens": 4}}),
        ("text", {"spec_capture": [_entry()]}),
    ]
    bad_entries = {
        "gen 0": _entry(gen=0),
        "artifacts ['logits']": _entry(features={"logits": "x"}),
        "shape [1, 3]": _entry(
            passthrough=[{"name": "m", "data": [1, 1, 1], "shape": [1, 3], "dtype": "int64"}]
        ),
        "'float32'": _entry(
            passthrough=[{"name": "m", "data": [1, 1], "shape": [1, 2], "dtype": "float32"}]
        ),
        "twice": _entry(
            passthrough=[{"name": "target", "data": [1, 1], "shape": [1, 2], "dtype": "int64"}]
        ),
    }
    try:
        async with aiohttp.ClientSession() as session:
            for ids, extra in refused:
                body = {"input_ids": ids, **extra}
                status, answer = await _generate(session, url, body)
                assert status == 400, (body, answer)
                assert answer["error"]["message"], answer
            async with session.post(f"{url}/generate", data=b"{not json") as resp:
                assert resp.status == 400
            status, rows = await _generate(session, url, _body([[1, 2]] * 5, *bad_entries.values()))
            assert status == 200
            for (want, entry), row in zip(bad_entries.items(), rows, strict=True):
                result = row["meta_info"]["spec_capture"]
                assert want in result["error"], (want, result)
                assert {k: result[k] for k in ("store_id", "sample_id", "gen")} == {
                    k: entry[k] for k in ("store_id", "sample_id", "gen")
                }
            single = {"input_ids": [1, 2], "spec_capture": _entry()}  # not batched: one row
            status, row = await _generate(session, url, single)
            assert status == 200
            down = row["meta_info"]["spec_capture"]["error"]
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 200
            metrics = await scrape(session, url)
    finally:
        await stop(proc)
    assert down.startswith("server fault (unreachable)"), down
    assert metrics['hsx_front_requests_total{outcome="refused"}'] == 6
    assert metrics['hsx_front_requests_total{outcome="error_marker"}'] == 6
    assert metrics['hsx_front_failures_total{cause="request",kind="spec_capture"}'] == 5


async def test_mooncake_down_is_each_tasks_error_naming_the_master(
    tmp_path: Path, one_sample: tuple[Path, Path], fake: str, shm_root: Path
) -> None:
    """With mooncake_master gone the capture cannot be written: the task's error names the
    master (the producer retries it); the front stays up."""
    samples, model = one_sample
    async with master_that_goes(tmp_path) as (master, stop_master):
        proc, url = await _front(tmp_path, samples, [fake], shm_root, model=model, master=master)
        try:
            async with aiohttp.ClientSession() as session:
                status, row = await _generate(session, url, _body([[1, 2]], _entry()))
                assert status == 200
                assert "error" not in row[0]["meta_info"]["spec_capture"], row
                await stop_master()
                again = _body([[1, 2]], _entry(sample_id="run:t1"))
                status, row = await _generate(session, url, again)
                assert status == 200
                error = row[0]["meta_info"]["spec_capture"]["error"]
                async with session.get(f"{url}/health") as resp:
                    assert resp.status == 200
        finally:
            await stop(proc)
    assert f"Mooncake's master at {master} did not answer" in error, error


def _stale(store_id: str, ids: list[int]) -> dict[str, Any]:
    """The body of an attempt at task ``t0`` of run ``run`` whose answer the producer lost,
    with the features its producer names."""
    shape = [1, len(ids)]
    passthrough = [
        {"name": name, "data": data, "shape": shape, "dtype": "int64"}
        for name, data in (("input_ids", ids), ("loss_mask", [1] * len(ids)))
    ]
    passthrough.append(
        {"name": "attention_mask", "data": [1] * len(ids), "shape": shape, "dtype": "int64"}
    )
    return _body([ids], _entry(store_id=store_id, sample_id="run:t0", passthrough=passthrough))


async def test_a_retry_replaces_what_a_lost_answer_left_and_a_first_attempt_is_refused(
    tmp_path: Path, one_sample: tuple[Path, Path], fake: str, shm_root: Path, mooncake_master: str
) -> None:
    """An attempt's objects are in Mooncake but its answer never reached the producer: the
    retry (``replace``) reads its own prompt's features, not the lost attempt's (Mooncake
    keeps an old object on a put to its key); a first attempt finding its keys taken is
    refused instead of answering with someone else's bytes."""
    samples, model = one_sample
    proc, url = await _front(
        tmp_path, samples, [fake], shm_root, model=model, master=mooncake_master
    )
    try:
        async with aiohttp.ClientSession() as session:
            for store_id in ("retry", "first"):
                status, rows = await _generate(session, url, _stale(store_id, [7, 8, 9]))
                assert status == 200 and "error" not in rows[0]["meta_info"]["spec_capture"]
        fresh = await produce(
            url, mooncake_master, tmp_path, [task([4, 5, 6])], aux_layer_ids=IDS, hidden_size=HIDDEN
        )
        retry = await produce(
            url,
            mooncake_master,
            tmp_path,
            [task([4, 5, 6], attempt=1)],
            aux_layer_ids=IDS,
            hidden_size=HIDDEN,
            store_id="retry",
        )
        first = await produce(
            url,
            mooncake_master,
            tmp_path,
            [task([4, 5, 6])],
            aux_layer_ids=IDS,
            hidden_size=HIDDEN,
            store_id="first",
        )
    finally:
        await stop(proc)
    assert "error_0" not in retry.notes, retry.notes
    assert retry.tensors["input_ids_0"].tolist() == [[4, 5, 6]]
    for name in ("hidden_state", "target"):
        assert torch.equal(retry.tensors[f"{name}_0"], fresh.tensors[f"{name}_0"])
    assert retry.notes["gone_0"] == "1"
    error = first.notes["error_0"]
    assert "are already in Mooncake and this is the task's first attempt" in error, error
    assert "sf/run:t0" not in error and "first/run:t0/g1/hidden_state" in error
    assert "input_ids_0" not in first.tensors
