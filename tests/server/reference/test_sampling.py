"""The reference server's decoding: SGLang's sampling parameters, seeded sampling, stops."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import torch

from hsx_async.server.front import BadRequest, Sampling, parse_sampling
from hsx_async.server.reference.sampling import TokenPicker
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server


def test_parse_sampling_defaults_and_refusals() -> None:
    assert parse_sampling({}, 10) == Sampling()  # greedy unless a temperature is given
    got = parse_sampling(
        {"temperature": 0.5, "top_p": 0.9, "sampling_seed": -3, "stop_token_ids": [1, 2]}, 10
    )
    assert got == Sampling(0.5, 0.9, -3, frozenset({1, 2}))
    for params in (
        {"temperature": -1},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"sampling_seed": 1.5},
        {"stop_token_ids": [10]},
        {"stop_token_ids": 1},
    ):
        with pytest.raises(BadRequest):
            parse_sampling(params, 10)


def test_picker_is_seeded_and_top_p_keeps_the_head() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0])
    draw = [TokenPicker(Sampling(1.0, 1.0, 7))(logits) for _ in range(3)]
    assert len(set(draw)) == 1  # a fresh picker with the same seed draws the same
    picker = TokenPicker(Sampling(1.0, 1.0, 7))
    assert len({picker(logits) for _ in range(200)}) >= 3  # the full distribution
    head = TokenPicker(Sampling(1.0, 0.5, 7))
    assert {head(logits) for _ in range(200)} <= {0, 1}  # 0.5 of the mass: top two only
    assert TokenPicker(Sampling(0.0))(logits) == 0


async def test_generate_stops_on_a_stop_token(shm_root: Path) -> None:
    async with running_reference_server(ReferenceOptions(dump_root=shm_root)) as server:
        url = f"{server.url}/generate"
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6}}
            async with s.post(url, json=body) as resp:
                free = await resp.json()
            ids = free["output_ids"]
            assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            stop = ids[2]
            body["sampling_params"] = {"max_new_tokens": 6, "stop_token_ids": [stop]}
            async with s.post(url, json=body) as resp:
                stopped = await resp.json()
            assert stopped["output_ids"] == ids[: ids.index(stop) + 1]
            assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            sampled = []
            for _ in range(2):
                body["sampling_params"] = {"max_new_tokens": 6, "temperature": 2.0,
                                           "sampling_seed": 9}  # fmt: skip
                async with s.post(url, json=body) as resp:
                    sampled.append((await resp.json())["output_ids"])
            assert sampled[0] == sampled[1]
