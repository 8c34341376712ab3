"""SpecForge's and speculators' own training steps on samples hsx is still extracting.

``hsx run`` (a child process) extracts through the reference server, serving the tiny Llama
saved with realistic norm gains, into a bounded spool that only a fraction of the dataset
fits, retention ``acked`` with both trainers registered; ``live_driver.py`` (the consumers
venv) trains each trainer's drafter one sample per step on the live dataset in that
trainer's layout, acknowledging each step. The spool makes extraction wait for the
trainers, so steps run while extraction is going on, and each file is deleted once both
trainers have it.

The consumers venv comes from ``bash .ci/consumers-env``; without it these tests skip,
except under ``CI`` where they fail.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.config import config_from_dict, spool_bytes_bound
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.manifest import read_manifest
from hsx_async.server.reference.model import save_default_model
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server
from tests.consumers.test_trainer_loaders import (
    CHUNK,
    MAX_REL,
    MIN_TOP1,
    ROOT,
    add_index,
    consumers_python,
)
from tests.dataset.live.procs import Child
from tests.e2e import config_raw, write_config

pytestmark = [pytest.mark.consumers, pytest.mark.timeout(420)]
DRIVER = Path(__file__).with_name("live_driver.py")
TRAINERS = ("specforge", "speculators")
SAMPLES, MAX_LEN = 14, 80


def _inputs(path: Path) -> list[str]:
    rng = random.Random(7)
    rows, ids = [], []
    for i in range(SAMPLES):
        n = rng.randint(12, MAX_LEN)
        row: dict[str, Any] = {
            "id": f"live-{i}",
            "input_ids": [rng.randrange(3, 1024) for _ in range(n)],
        }
        if i % 2 == 0:
            row["loss_mask"] = [0] * (n // 3) + [1] * (n - n // 3)
        rows.append(orjson.dumps(row))
        ids.append(row["id"])
    path.write_bytes(b"\n".join(rows) + b"\n")
    return ids


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import asyncio

    python = consumers_python()
    tmp = tmp_path_factory.mktemp("live")
    model_dir = save_default_model(tmp / "model", seed=0)
    add_index(model_dir)
    ids = _inputs(tmp / "in.jsonl")
    shm = Path("/dev/shm") / f"hsx-live-train-{os.getpid()}"
    shm.mkdir()

    async def go() -> dict[str, Any]:
        options = ReferenceOptions(model=str(model_dir), dump_root=shm, chunk_size=CHUNK,
                                   max_batch_tokens=96, threads=1)  # fmt: skip
        async with running_reference_server(options) as srv:
            raw = config_raw(tmp, tmp / "in.jsonl", [srv.url], shm, hidden_size=srv.hidden_size,
                             aux_layers=srv.aux_layers, input={"max_tokens": MAX_LEN},
                             workers={"concurrency": 2},
                             server={"request_timeout": 60.0})  # fmt: skip
            limit = 3 * spool_bytes_bound(config_from_dict(raw, base=tmp), MAX_LEN)
            raw["output"] |= {
                "retention": "acked",
                "consumers": list(TRAINERS),
                "spool_limit": limit,
            }
            config = write_config(tmp, raw)
            (tmp / "out").mkdir()  # the trainer may come first: it waits in an empty directory
            hsx = await Child.start("hsx run", "-m", "hsx_async", "run", "--config", str(config),
                                    "--no-report", logs=True)  # fmt: skip
            aux = ",".join(map(str, srv.aux_layers))
            driver = await asyncio.create_subprocess_exec(
                str(python), str(DRIVER), "--out", str(tmp / "out"), "--model", str(model_dir),
                "--aux-layers", aux, "--work", str(tmp), cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                stdout, stderr = await asyncio.wait_for(driver.communicate(), 360)
                assert driver.returncode == 0, stderr.decode()[-4000:]
                assert await hsx.finish(120) == 0, "\n".join(hsx.lines[-20:])
            finally:
                await hsx.kill()
                if driver.returncode is None:
                    driver.kill()
                    await driver.wait()
        return {"report": json.loads(stdout), "limit": limit, "hsx": hsx}

    try:
        run = asyncio.run(go())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"tmp": tmp, "ids": ids, "out": tmp / "out", **run}


def test_each_trainer_trains_every_sample_once(live_run: dict[str, Any]) -> None:
    for name in TRAINERS:
        steps = live_run["report"][name]
        assert sorted(s["id"] for s in steps) == sorted(live_run["ids"]), name
        state = ConsumerLog(live_run["out"], name).refresh()
        assert state.acked[0] == set(live_run["ids"]) and state.duplicate_acks == 0, name


def test_steps_ran_while_hsx_was_still_extracting(live_run: dict[str, Any]) -> None:
    """The spool holds ~3 samples: most steps run before extraction is complete, with
    only part of the dataset committed."""
    for name in TRAINERS:
        steps = live_run["report"][name]
        early = [s for s in steps if not s["complete"] and s["committed"] < SAMPLES]
        assert len(early) >= SAMPLES // 2, (name, [(s["committed"], s["complete"]) for s in steps])
    paused = live_run["hsx"].count("event", "intake_paused_limit")
    assert paused > 0  # extraction waited for the trainers


def test_the_training_steps_learn_from_the_models_own_targets(live_run: dict[str, Any]) -> None:
    for name in TRAINERS:
        steps = live_run["report"][name]
        for s in steps:
            assert math.isfinite(s["loss"]) and s["loss"] > 0, (name, s)
            assert s["moved"] > 0, (name, s)  # the optimizer step changed the drafter
            assert s["teacher"]["rel"] < MAX_REL, (name, s["teacher"])
        agree = sum(s["teacher"]["agree"] for s in steps) / sum(
            s["teacher"]["tokens"] for s in steps
        )
        assert agree >= MIN_TOP1, name


def test_the_spool_is_empty_once_both_trainers_have_everything(live_run: dict[str, Any]) -> None:
    out = live_run["out"]
    assert read_manifest(out) == []
    written = sorted(canonical_id(e.id) for e in read_manifest(out, retired=True))
    assert written == sorted(live_run["ids"])
    assert not any(p.is_file() for p in (out / "data").rglob("*"))
