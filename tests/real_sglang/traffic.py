"""What the real-SGLang tier sends a server: ``hsx run`` (the dev environment's ``hsx``, in
a subprocess, bounded in time) while plain requests keep arriving, so that marked and
ordinary requests share prefill batches; and the Hugging Face greedy decode those plain
requests must equal."""

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


def greedy(hf_model: Any, ids: list[int], steps: int) -> list[int]:
    """Hugging Face's greedy continuation of ``ids`` (full forwards, no cache)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf_model(input_ids=torch.tensor([out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]
