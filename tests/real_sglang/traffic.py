"""What the real-SGLang tier sends a server and what it must get back: ``hsx run`` (the
dev environment's ``hsx``, in a subprocess, bounded in time) while plain requests keep
arriving, so that marked and ordinary requests share prefill batches; the Hugging Face
greedy decode those plain requests must equal; and the Hugging Face final norm's input and
output that the dumps' final slot is told apart by."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.real_sglang.conftest import Server

PLAIN_ROUNDS = 3  # rounds of all plain prompts at once during one hsx run, at most
# A plain request may wait for the prefill passes ahead of it (DP attention runs a decode
# step only when no DP rank has a prefill to run): bounded, but not short.
PLAIN_TIMEOUT = 240.0


@dataclass
class Plain:
    """A plain (unmarked) request: greedy, a few new tokens, no custom_params."""

    input_ids: list[int]
    alone: dict[str, Any] = field(default_factory=dict)  # sent to an idle server
    beside: list[dict[str, Any]] = field(default_factory=list)  # sent during `hsx run`


def generate_plain(server: Server, ids: list[int], new_tokens: int) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
    answer: dict[str, Any] = server.post("/generate", body, timeout=PLAIN_TIMEOUT)
    return answer


def hsx_command() -> list[str]:
    """The dev environment's ``hsx`` (the one pytest runs in), not the SGLang venv's."""
    exe = shutil.which("hsx", path=str(Path(sys.executable).parent))
    assert exe is not None, f"no hsx next to {sys.executable}: pip install -e ."
    return [exe]


def run_hsx_beside_plain_traffic(
    server: Server, config: Path, plain: list[Plain], new_tokens: int, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``hsx run --config`` in a subprocess while rounds of the plain prompts are sent (until
    hsx is done, at most PLAIN_ROUNDS); bounded by ``timeout``."""
    proc = subprocess.Popen(
        [*hsx_command(), "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    done = threading.Event()

    def plain_traffic() -> None:
        with ThreadPoolExecutor(len(plain)) as pool:
            for _ in range(PLAIN_ROUNDS):
                answers = list(
                    pool.map(lambda p: generate_plain(server, p.input_ids, new_tokens), plain)
                )
                for p, answer in zip(plain, answers, strict=True):
                    p.beside.append(answer)
                if done.is_set():
                    return

    with ThreadPoolExecutor(1) as traffic:
        sent = traffic.submit(plain_traffic)
        try:
            output, _ = proc.communicate(timeout=timeout)
        finally:
            done.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sent.result(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, None)


def check_plain_answers(plain: list[Plain], hf_model: Any, new_tokens: int) -> None:
    """Each plain request got Hugging Face's greedy answer, alone and during the run, with
    no hidden states and its own prompt length."""
    for p in plain:
        assert p.beside, "no plain request was answered during the run"
        want = greedy(hf_model, p.input_ids, new_tokens)
        assert p.alone["output_ids"] == want
        for answer in p.beside:
            assert answer["output_ids"] == want, "a plain request's answer changed"
            assert "hidden_states" not in answer["meta_info"]
            assert answer["meta_info"]["prompt_tokens"] == len(p.input_ids)


@dataclass(frozen=True)
class FinalNorm:
    """One forward of a prompt: what enters ``model.norm``, what leaves it (the final
    slot), and the norm applied twice (what a post-norm state normed again gives), each
    ``[T, H]`` float32; and every ``hidden_states[k]``."""

    pre: torch.Tensor
    post: torch.Tensor
    twice: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


def final_norm(hf_model: Any, ids: list[int]) -> FinalNorm:
    seen: dict[str, torch.Tensor] = {}
    hook = hf_model.model.norm.register_forward_hook(
        lambda _m, args, out: seen.update(pre=args[0][0], post=out[0])
    )
    try:
        with torch.inference_mode():
            out = hf_model.model(
                input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True
            )
    finally:
        hook.remove()
    with torch.inference_mode():
        twice = hf_model.model.norm(seen["post"][None])[0]
    hidden = tuple(h[0] for h in out.hidden_states)
    return FinalNorm(seen["pre"], seen["post"], twice, hidden)


def greedy(hf_model: Any, ids: list[int], steps: int) -> list[int]:
    """Hugging Face's greedy continuation of ``ids`` (full forwards, no cache)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf_model(input_ids=torch.tensor([out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]
