"""The real-vLLM tier: vLLM 0.32 (CPU build) from its own environment, started with
``deploy/vllm/launch.sh`` on the built-in tiny Llama (realistic norm gains), driven by
``hsx run``. ``bash .ci/vllm-env`` builds ``.venv-vllm``; without it these tests skip,
except under CI (``CI`` set), where they fail. ``HSX_VLLM_PYTHON`` names another vLLM of the
stated range: ``.ci/engine-range`` runs a focused subset on the oldest CPU build that
installs here (``bash .ci/vllm-env 0.27.0`` builds ``.venv-vllm-0.27.0``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsx_async.server.reference.model import TINY_AUX_LAYERS, save_default_model
from tests.e2e import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("HSX_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
LAUNCH = REPO / "deploy" / "vllm" / "launch.sh"
START_TIMEOUT = 240.0  # seconds; vLLM's CPU start-up takes 30-90 s on 2 busy cores
CHUNK = 64  # --max-num-batched-tokens: longer prompts are prefilled in chunks


def vllm_python() -> Path:
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    message = f"{VLLM_PYTHON} is missing: run `bash .ci/vllm-env` to build the vLLM environment"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass(frozen=True)
class VllmServer:
    url: str
    dump_root: Path
    model_dir: Path
    log: Path


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)  # polling a starting process: there is nothing to wait on
    raise AssertionError(f"vLLM not ready after {START_TIMEOUT:g} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], url: str, log: Path) -> Iterator[None]:
    """Run a vLLM server (its own process group, output to ``log``) until ready, then for
    the block; stopped (SIGTERM, then SIGKILL) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        wait_ready(url, proc, log)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_default_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    python = vllm_python()
    root = Path("/dev/shm") / f"hsx-vllm-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {
        **os.environ,
        "HSX_PYTHON": str(python),
        "HSX_PORT": str(port),
        "HSX_DUMP_ROOT": str(root),
        "HSX_AUX_LAYERS": ",".join(map(str, TINY_AUX_LAYERS)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    args = ["bash", str(LAUNCH), str(tiny_model), "--max-model-len", "512",
            "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8",
            "--dtype", "float32"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with serving(args, env, url, log):
            yield VllmServer(url, root, tiny_model, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
