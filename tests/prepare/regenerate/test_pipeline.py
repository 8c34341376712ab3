"""``hsx regenerate`` as a client of the run pipeline: the engine seam (vLLM's wire), one
regenerate per output, every answer checked against the tokenizer and the request (a bad
answer is the server's fault: never a traceback, never written), 1-based lines in the
logs, and a summary a person reads."""

from __future__ import annotations

import asyncio
import errno
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import tomli_w
from structlog.testing import capture_logs

from hsx_async.config import Config, config_from_dict
from hsx_async.dataset.events import read_events
from hsx_async.dataset.manifest import AppendLog
from hsx_async.errors import ConfigError, DatasetError, DiskFullError
from hsx_async.prepare.regenerate import RegenPaths, regenerate
from hsx_async.run.report.numbers import ServerSpells
from hsx_async.run.servers.probe import PROBE_IDS
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server
from tests.e2e import config_raw
from tests.prepare.conftest import WriteLines, tiny_conversation
from tests.prepare.regenerate.decode_servers import hostile_server, vllm_front

REPO = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 90


def _raw(
    tmp: Path, urls: list[str], model_dir: Path, *, server: dict[str, Any] | None = None
) -> dict[str, Any]:
    raw = config_raw(
        tmp,
        tmp / "conversations.jsonl",
        urls,
        tmp / "unused-dump-root",
        regenerate={"tokenizer": str(model_dir), "max_new_tokens": 4},
        workers={"concurrency": 3, "max_attempts": 3, "backoff_base": 0.001, "backoff_max": 0.01},
    )
    raw["server"].update(server or {})
    return raw


def _config(tmp: Path, urls: list[str], model_dir: Path, **server: Any) -> Config:
    return config_from_dict(_raw(tmp, urls, model_dir, server=server), base=tmp)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def _report_spells(events: Path) -> list[dict[str, Any]]:
    fold = ServerSpells()
    for rec in read_events(events):
        fold.add(rec)
    return fold.spells


def _by_id(path: Path) -> dict[str, dict[str, Any]]:
    records = _lines(path)
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "each conversation exactly once"
    return by_id


async def test_vllm_engine_decodes_through_v1_completions(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """``[server].engine = "vllm"``: the answers come from /v1/completions (seeded, as ids),
    the same as the reference model gives through SGLang's wire. (Before: every turn went
    to SGLang's /generate, 404, every conversation quarantined, exit 0.)"""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(6)])
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        async with vllm_front(ref.url) as front:
            vllm = _config(tmp_path, [front.url], tiny_model_dir, engine="vllm")
            stats = await regenerate(vllm, src, tmp_path / "via-vllm.jsonl")
        sglang = _config(tmp_path, [ref.url], tiny_model_dir)
        await regenerate(sglang, src, tmp_path / "via-sglang.jsonl")
    assert (stats.done, stats.quarantined, stats.turns) == (6, 0, 12)
    assert _by_id(tmp_path / "via-vllm.jsonl") == _by_id(tmp_path / "via-sglang.jsonl")
    assert front.requests and all(r["return_token_ids"] is True for r in front.requests)
    assert all("seed" in r and "kv_transfer_params" not in r for r in front.requests)


async def test_the_wrong_engine_costs_no_conversation(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """SGLang's wire sent to a vLLM server (a 404 on /generate, vLLM's /v1/models there): the
    job's fault — the run stops before any conversation is sent (exit 2, naming the key and
    the fix), nothing is quarantined, and the rerun with the right engine does them all."""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(4)])
    out = tmp_path / "regen.jsonl"
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref,
        vllm_front(ref.url) as front,
    ):
        wrong = _config(tmp_path, [front.url], tiny_model_dir)
        with pytest.raises(ConfigError, match=r"server\.engine.*404.*to 'vllm'"):
            await regenerate(wrong, src, out)
        assert front.requests == []  # not one turn sent
        assert _lines(RegenPaths.beside(out).quarantine) == []
        assert _lines(out) == []
        right = _config(tmp_path, [front.url], tiny_model_dir, engine="vllm")
        stats = await regenerate(right, src, out)
    assert (stats.done, stats.quarantined) == (4, 0)


async def test_two_regenerates_on_one_output_cannot_run_at_once(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """(Before: both ran, and 120 conversations came out as 232 lines.)"""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(8)])
    out = tmp_path / "regen.jsonl"
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        config = _config(tmp_path, [ref.url], tiny_model_dir)
        ref.scheduler.pause()  # the first one holds the output while its turns wait
        first = asyncio.create_task(regenerate(config, src, out))
        await ref.scheduler.wait_queued(1)
        with pytest.raises(DatasetError, match="another hsx regenerate is writing"):
            await regenerate(config, src, out)
        ref.scheduler.resume()
        stats = await first
    assert stats.done == 8
    assert len(_by_id(out)) == 8


def _asked(body: dict[str, Any]) -> int:
    return int(body["sampling_params"]["max_new_tokens"])


def _negative(body: dict[str, Any]) -> list[Any]:
    return [-1, 5, 6][: _asked(body)]


def _past_the_vocabulary(body: dict[str, Any]) -> list[Any]:
    return [10**6, 5, 6][: _asked(body)]


def _too_many(body: dict[str, Any]) -> list[Any]:
    return [7] * 50_000


def _after_admission(bad: Any, honest: list[int]) -> Any:
    """Honest to the one-token probe that admits a server (``honest``: the model's own
    greedy answer, which the admission compares across servers), ``bad`` to every turn."""

    def answer(body: dict[str, Any]) -> list[Any]:
        return honest if _asked(body) == 1 else bad(body)

    return answer


async def _greedy_probe(url: str) -> list[int]:
    """The reference model's greedy answer to the admission probe."""
    body = {
        "input_ids": [int(t) for t in PROBE_IDS],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    }
    async with aiohttp.ClientSession() as session, session.post(f"{url}/generate", json=body) as r:
        return [int(t) for t in (await r.json())["output_ids"]]


_BAD_ANSWERS = [
    (_negative, "token id -1 at position 0"),
    (_past_the_vocabulary, "token id 1000000 at position 0"),
    (_too_many, "50000 token ids for max_new_tokens"),
]


_CASES = [(*bad, when) for when in ("at_admission", "after_admission") for bad in _BAD_ANSWERS]


@pytest.mark.usefixtures("fresh_structlog")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"{c[0].__name__.strip('_')}-{c[2]}")
async def test_a_bad_answer_is_the_servers_fault_never_written(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines, case: Any
) -> None:
    """Beside a good server, a hostile one answers with ids no honest server gives: a
    negative id (before: OverflowError in the tokenizer, a traceback), an id past the
    vocabulary (before: silently dropped from the text), 50,000 ids for max_new_tokens = 8
    (before: written as a normal turn). Every answer is checked: the hostile server is
    refused (at its admission probe, or taken out of rotation when it turns bad later),
    no conversation is charged, and every one comes from the good server."""
    convs = [tiny_conversation(i) for i in range(6)]
    src = write_jsonl(tmp_path / "conversations.jsonl", convs)

    def config(urls: list[str]) -> Config:
        raw = _raw(tmp_path, urls, tiny_model_dir)
        raw["regenerate"]["max_new_tokens"] = 8
        return config_from_dict(raw, base=tmp_path)

    answer, why, when = case
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        honest = await _greedy_probe(ref.url)
        hostile = answer if when == "at_admission" else _after_admission(answer, honest)
        await regenerate(config([ref.url]), src, tmp_path / "good.jsonl")
        async with hostile_server(hostile, model=ref.model_name) as bad:
            with capture_logs() as logs:
                summary = await regenerate(
                    config([bad.url, ref.url]), src, tmp_path / "mixed.jsonl"
                )
    assert (summary.done, summary.quarantined) == (6, 0)
    assert _by_id(tmp_path / "mixed.jsonl") == _by_id(tmp_path / "good.jsonl")
    spells = summary.servers_out
    assert spells and all(s["server"] == bad.url and why in s["reason"] for s in spells)
    # The summary's spells are the job report's rule over the run's own events log.
    assert spells == _report_spells(RegenPaths.beside(tmp_path / "mixed.jsonl").events)
    turns = [r for r in bad.requests if _asked(r) != 1]
    failed = [e for e in logs if e.get("event") == "attempt_failed"]
    assert len(failed) == len(turns) and all(why in str(e["error"]) for e in failed)
    if when == "after_admission":
        assert turns, "the hostile server was given turns"
        assert all(e["cause"] == "server" for e in failed)


async def test_quarantined_lines_are_logged_1_based(
    tmp_path: Path,
    shm_root: Path,
    tiny_model_dir: Path,
    write_jsonl: WriteLines,
    fresh_structlog: None,
) -> None:
    """The quarantine keeps the 0-based ``line`` (like hsx run's); the log says the line an
    editor shows, as ``input_line`` (before: regenerate logged ``line=5`` for line 6)."""
    lines = [tiny_conversation(0), tiny_conversation(1), b"not json"]
    src = write_jsonl(tmp_path / "conversations.jsonl", lines)
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        with capture_logs() as logs:
            await regenerate(
                _config(tmp_path, [ref.url], tiny_model_dir), src, tmp_path / "r.jsonl"
            )
    [record] = _lines(RegenPaths.beside(tmp_path / "r.jsonl").quarantine)
    assert record["line"] == 2
    [event] = [
        e for e in logs if e.get("event") in ("sample_quarantined", "regenerate.quarantined")
    ]
    assert event.get("input_line") == 3 and "line" not in event


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hsx_async", "regenerate", *args,
        cwd=REPO, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:  # timed out: leave no process behind
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_summary_is_for_a_person_and_json_on_request(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """(Before: one raw JSON line and nothing else.)"""
    src = write_jsonl(
        tmp_path / "conversations.jsonl", [tiny_conversation(0), tiny_conversation(1), b"{"]
    )
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        raw = _raw(tmp_path, [ref.url], tiny_model_dir)
        raw["daemon"]["log_level"] = "warning"
        config = tmp_path / "job.toml"
        config.write_text(tomli_w.dumps(raw))
        out = tmp_path / "regen.jsonl"
        code, stdout, stderr = await _cli(str(src), "--config", str(config), "--out", str(out))
        assert code == 0, stderr
        assert "2 conversations regenerated" in stdout and "1 quarantined" in stdout
        assert str(out) in stdout and "{" not in stdout.splitlines()[0]
        code, stdout, stderr = await _cli(
            str(src), "--config", str(config), "--out", str(out), "--json"
        )
        assert code == 0, stderr
        summary = orjson.loads(stdout)
        assert (summary["done"], summary["skipped"]) == (0, 3)
        assert summary == orjson.loads(RegenPaths.beside(out).summary.read_bytes())
    events = [e["event"] for e in _lines(RegenPaths.beside(out).events)]
    assert events.count("start") == events.count("end") == 2


async def test_an_empty_input_is_an_empty_run(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "conversations.jsonl", [])
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        summary = await regenerate(
            _config(tmp_path, [ref.url], tiny_model_dir), src, tmp_path / "r.jsonl"
        )
    assert (summary.done, summary.quarantined, summary.skipped, summary.unfinished) == (0, 0, 0, 0)
    assert (tmp_path / "r.jsonl").read_bytes() == b""


async def test_an_output_that_cannot_be_written_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(0)])
    (tmp_path / "file").write_bytes(b"")
    config = _config(tmp_path, ["http://127.0.0.1:9"], tiny_model_dir)
    with pytest.raises(DatasetError, match="cannot write --out"):
        await regenerate(config, src, tmp_path / "file" / "r.jsonl")  # a file as a directory


async def test_a_full_disk_stops_the_run_and_loses_nothing(
    tmp_path: Path,
    shm_root: Path,
    tiny_model_dir: Path,
    write_jsonl: WriteLines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENOSPC on the output: the run stops with the reason (exit 2 from the CLI), every
    line written before it stays, and the rerun finishes each conversation exactly once."""
    convs = [tiny_conversation(i) for i in range(8)]
    src = write_jsonl(tmp_path / "conversations.jsonl", convs)
    out = tmp_path / "r.jsonl"
    real = AppendLog.append
    appended = 0

    def append(self: AppendLog, lines: Any, *, sync: bool = True) -> None:
        nonlocal appended
        if self.path == out:
            # By lines, not calls: the group commit may write the 8 in 3 batches.
            if appended >= 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            appended += len(lines)
        real(self, lines, sync=sync)

    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        config = _config(tmp_path, [ref.url], tiny_model_dir)
        monkeypatch.setattr(AppendLog, "append", append)
        with pytest.raises(DiskFullError, match="no space left writing"):
            await regenerate(config, src, out)
        kept = out.read_bytes()
        assert 1 <= len(kept.splitlines()) < len(convs)
        monkeypatch.setattr(AppendLog, "append", real)
        summary = await regenerate(config, src, out)
    assert out.read_bytes().startswith(kept)
    assert len(_by_id(out)) == len(convs)
    assert summary.skipped == len(kept.splitlines())


async def test_two_servers_two_models_are_never_mixed(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """Two servers of one shape serving different checkpoints: the first admitted pins the
    model, the other is refused (issue 24's "two servers, two models", regenerate's side)."""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(6)])
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root, seed=0)) as a,
        running_reference_server(ReferenceOptions(dump_root=shm_root, seed=1)) as b,
    ):
        assert a.model_name != b.model_name
        alone = {}
        for ref in (a, b):
            alone[ref.url] = tmp_path / f"alone-{ref.model_name}.jsonl"
            await regenerate(_config(tmp_path, [ref.url], tiny_model_dir), src, alone[ref.url])
        summary = await regenerate(
            _config(tmp_path, [a.url, b.url], tiny_model_dir), src, tmp_path / "both.jsonl"
        )
    [spell] = summary.servers_out
    assert spell["kind"] == "identity" and "is not this job's server: model is" in spell["reason"]
    admitted = a.url if spell["server"] == b.url else b.url
    assert _by_id(tmp_path / "both.jsonl") == _by_id(alone[admitted])
    assert summary.servers[spell["server"]] == 0  # not one turn went to the other model


async def test_a_finished_output_needs_no_server(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    """Run again when everything is done: it says so and ends, asking no server (the
    servers may be gone by then)."""
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(3)])
    out = tmp_path / "r.jsonl"
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as ref:
        await regenerate(_config(tmp_path, [ref.url], tiny_model_dir), src, out)
    gone = _config(tmp_path, ["http://127.0.0.1:9"], tiny_model_dir, unreachable_timeout=1.0)
    summary = await regenerate(gone, src, out)
    assert (summary.done, summary.skipped, summary.unfinished) == (0, 3, 0)
    assert summary.input_done and summary.servers_out == []
