"""``hsx regenerate`` against the reference server (a real model decoding on the CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import tomli_w

from hsx_async.config import Config, config_from_dict
from hsx_async.errors import ConfigError
from hsx_async.prepare.regenerate import RegenPaths, regenerate
from hsx_async.prepare.template import ChatEncoder, load_tokenizer
from hsx_async.server.reference.server import (
    ReferenceOptions,
    ReferenceServer,
    running_reference_server,
)
from tests.e2e import config_raw
from tests.prepare.conftest import TINY_SEED, WriteLines, tiny_conversation
from tests.prepare.regenerate.decode_servers import vllm_front

REPO = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 90


def _raw(tmp: Path, server: ReferenceServer, model_dir: Path, **regen: Any) -> dict[str, Any]:
    settings = {"tokenizer": str(model_dir), "max_new_tokens": 4, **regen}
    return config_raw(
        tmp,
        tmp / "conversations.jsonl",
        [server.url],
        tmp / "unused-dump-root",
        hidden_size=server.hidden_size,
        aux_layers=server.aux_layers,
        regenerate=settings,
        workers={"concurrency": 3, "max_attempts": 3, "backoff_base": 0.001, "backoff_max": 0.01},
    )


def _config(tmp: Path, server: ReferenceServer, model_dir: Path, **regen: Any) -> Config:
    return config_from_dict(_raw(tmp, server, model_dir, **regen), base=tmp)


def _records(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        assert rec["id"] not in out, "each conversation exactly once"
        out[rec["id"]] = rec
    return out


async def _greedy(url: str, ids: list[int], n: int) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as resp:
        answer = await resp.json()
    output: list[int] = answer["output_ids"]
    return output


def test_bad_regenerate_settings_name_the_key(tmp_path: Path) -> None:
    raw = config_raw(tmp_path, tmp_path / "c.jsonl", ["http://127.0.0.1:1"], tmp_path)
    for key, value in (("top_p", 0.0), ("max_new_tokens", 0), ("temperature", -1.0)):
        with pytest.raises(ConfigError, match=f"regenerate.{key}"):
            config_from_dict({**raw, "regenerate": {key: value}}, base=tmp_path)


async def test_each_turn_sees_the_regenerated_history(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    convs = [tiny_conversation(i, turns=2) for i in range(5)]
    src = write_jsonl(tmp_path / "conversations.jsonl", [*convs, b"not json"])
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        config = _config(tmp_path, server, tiny_model_dir)
        stats = await regenerate(config, src, tmp_path / "regen.jsonl")
        assert (stats.done, stats.quarantined, stats.turns) == (5, 1, 10)
        out = _records(tmp_path / "regen.jsonl")
        tok = load_tokenizer(tiny_model_dir)
        enc = ChatEncoder(tok, tok.chat_template)
        for conv in convs:
            got = out[str(conv["id"])]["messages"]
            msgs: list[dict[str, str]] = conv["messages"]  # type: ignore[assignment]
            assert [m["role"] for m in got] == [m["role"] for m in msgs]
            history: list[dict[str, str]] = []
            for given, regen in zip(msgs, got, strict=True):
                if given["role"] != "assistant":
                    assert regen == given
                    history.append(given)
                    continue
                # The answer the model gives to exactly this history, regenerated turns in it.
                want = await _greedy(server.url, enc.prompt_ids(history), 4)
                assert regen["content"] == tok.decode(want, skip_special_tokens=True)
                history.append({"role": "assistant", "content": regen["content"]})
            meta = out[str(conv["id"])]["hsx_regenerate"]
            assert [t["index"] for t in meta["turns"]] == [2, 4]
    quarantine = [
        orjson.loads(x) for x in (tmp_path / "regen.quarantine.jsonl").read_bytes().splitlines()
    ]
    assert [q["line"] for q in quarantine] == [5]
    recorded = orjson.loads((tmp_path / "regen.meta.json").read_bytes())
    assert recorded["max_new_tokens"] == 4 and recorded["temperature"] == 0.0


async def test_sampling_is_seeded_and_length_caps_are_marked(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(4)])
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        outs = {}
        for name, seed in (("a", 5), ("b", 5), ("c", 6)):
            config = _config(tmp_path, server, tiny_model_dir, temperature=1.5, seed=seed)
            await regenerate(config, src, tmp_path / f"{name}.jsonl")
            outs[name] = _records(tmp_path / f"{name}.jsonl")
    assert outs["a"] == outs["b"]  # same seed, different batching: same answers
    assert outs["a"] != outs["c"]
    for rec in outs["a"].values():
        for message in rec["messages"]:
            if message["role"] == "assistant":
                assert message["hsx_length_capped"] is True  # no stop token in 4 tokens
        assert rec["hsx_regenerate"]["length_capped"] is True


async def test_a_stop_token_ends_the_answer_unmarked(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    conv = tiny_conversation(3, turns=1)
    src = write_jsonl(tmp_path / "conversations.jsonl", [conv])
    tok = load_tokenizer(tiny_model_dir)
    enc = ChatEncoder(tok, tok.chat_template)
    prompt = enc.prompt_ids(conv["messages"][:2])  # type: ignore[index]
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        free = await _greedy(server.url, prompt, 4)
        stop = next(t for t in free[1:] if t != free[0])  # the model's own later token
        config = _config(tmp_path, server, tiny_model_dir, stop_token_ids=[stop])
        await regenerate(config, src, tmp_path / "regen.jsonl")
    [rec] = _records(tmp_path / "regen.jsonl").values()
    answer = rec["messages"][2]
    assert (
        "hsx_length_capped" not in answer and rec["hsx_regenerate"]["turns"][0]["finish"] == "stop"
    )
    assert answer["content"] == tok.decode(free[: free.index(stop)], skip_special_tokens=True)


async def test_resume_with_other_settings_is_refused(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "conversations.jsonl", [tiny_conversation(0)])
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        await regenerate(_config(tmp_path, server, tiny_model_dir), src, tmp_path / "r.jsonl")
        with pytest.raises(ConfigError, match="max_new_tokens"):
            config = _config(tmp_path, server, tiny_model_dir, max_new_tokens=5)
            await regenerate(config, src, tmp_path / "r.jsonl")


def _requests(server: ReferenceServer) -> list[str]:
    """The per-process nonce (``hsx-regen-XXXXXXXX``, the start of every rid) of every
    distinct turn request the server has run a pass of; the admission probes (one per run
    and server, ``<nonce>-probe-N``) are not turns."""
    rids = {rid for passes in server.stats.pass_log for rid, _, _ in passes}
    return ["-".join(rid.split("-")[:3]) for rid in rids if "-probe-" not in rid]


def _nonces(server: ReferenceServer) -> set[str]:
    return set(_requests(server))


def _child_env(failpoint: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HSX_FAILPOINT"}
    if failpoint:
        env["HSX_FAILPOINT"] = failpoint
    return env


async def _child(config: Path, src: Path, out: Path, failpoint: str | None) -> tuple[int, str]:
    env = _child_env(failpoint)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hsx_async", "regenerate", str(src),
        "--config", str(config), "--out", str(out),
        cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            output, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("hsx regenerate did not end in time") from None
    return proc.returncode or 0, output.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("point", ["regenerate.after_append", "regenerate.before_append"])
async def test_killed_run_resumes_without_redoing_finished_conversations(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines, point: str
) -> None:
    convs = [tiny_conversation(i, turns=1 + i % 3) for i in range(12)]
    src = write_jsonl(tmp_path / "conversations.jsonl", convs)
    turns = {str(c["id"]): (1 + i % 3) for i, c in enumerate(convs)}
    async with running_reference_server(
        ReferenceOptions(dump_root=shm_root, seed=TINY_SEED)
    ) as server:
        raw = _raw(tmp_path, server, tiny_model_dir, temperature=1.0, seed=11)
        config = tmp_path / "job.toml"
        config.write_text(tomli_w.dumps(raw))
        out = tmp_path / "regen.jsonl"
        code, log = await _child(config, src, out, f"{point}:4")
        assert code == -9, f"the failpoint did not fire:\n{log}"
        kept = out.read_bytes()
        done_before = _records(out)
        assert 3 <= len(done_before) < len(convs)
        first_nonces = _nonces(server)
        code, log = await _child(config, src, out, None)
        assert code == 0, log
        # Append-only: the lines of the killed run are untouched, and no finished
        # conversation was asked again — only the others' turns reached the server.
        assert out.read_bytes().startswith(kept)
        redo = sum(n for cid, n in turns.items() if cid not in done_before)
        # Requests of the first run still in flight at the kill may finish later: count the
        # second run's own requests, told apart by the per-process rid nonce.
        second = [n for n in _requests(server) if n not in first_nonces]
        assert len(second) == redo
        # Same result as one uninterrupted run (seeded sampling).
        whole = tmp_path / "whole.jsonl"
        await regenerate(config_from_dict(raw, base=tmp_path), src, whole)
    assert _records(out) == _records(whole)
    assert not RegenPaths.beside(out).quarantine.read_bytes()


async def test_sigterm_finishes_the_conversations_in_flight_and_exits_0(
    tmp_path: Path, shm_root: Path, tiny_model_dir: Path, write_jsonl: WriteLines
) -> None:
    convs = [tiny_conversation(i, turns=2) for i in range(10)]
    src = write_jsonl(tmp_path / "conversations.jsonl", convs)
    async with (
        running_reference_server(ReferenceOptions(dump_root=shm_root)) as server,
        # The turns wait at the front's gate; the admission probe (one token) does not.
        vllm_front(server.url, hold_turns=True) as front,
    ):
        raw = _raw(tmp_path, server, tiny_model_dir)
        raw["server"].update(urls=[front.url], engine="vllm")
        config = tmp_path / "job.toml"
        config.write_text(tomli_w.dumps(raw))
        out = tmp_path / "regen.jsonl"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hsx_async", "regenerate", str(src),
            "--config", str(config), "--out", str(out),
            cwd=REPO, env=_child_env(None), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            async with asyncio.timeout(CHILD_TIMEOUT_S):
                await front.wait_held(3)  # every worker has a first turn out
                proc.send_signal(signal.SIGTERM)
                front.release()
                output, _ = await proc.communicate()
        finally:
            if proc.returncode is None:  # the test failed: leave no process behind
                proc.kill()
                await proc.wait()
        text = output.decode(errors="replace")
        assert proc.returncode == 0, text[-3000:]
        first = _records(out)
        assert len(first) == 3  # the three in flight, both turns each; nothing else begun
        assert "3 conversations regenerated" in text and "run the same command again" in text
        code, log = await _child(config, src, out, None)
        assert code == 0, log
    assert len(_records(out)) == len(convs)
