"""The real-SGLang tier: SGLang 0.5.23 on the CPU, from its own environment (and the tests
that compare rows with a Hugging Face forward on 0.5.14, the range's oldest release, from
``.venv-sglang-0.5.14``: ``.ci/engine-range``).

The environment is a separate venv (``bash .ci/sglang-env`` builds ``.venv-sglang`` in the
repository root; ``HSX_SGLANG_PYTHON`` may name another Python that has sglang==0.5.23,
the stand-ins of ``standins/`` and hsx). Without it the tier skips, saying how to build
it, except under ``CI`` (set to anything non-empty), where it fails: CI cannot pass by
skipping.

Each server is started with the project's own ``deploy/sglang/launch.sh`` plus the CPU
flags, waited for within a bound, and always killed (its whole process group) afterwards;
the /dev/shm files it left and its dump root are removed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.shm import LEAKED_BY_KILLS, remove_left_shm, shm_names

REPO = Path(__file__).resolve().parents[2]
ENV_PYTHON = "HSX_SGLANG_PYTHON"
DEFAULT_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
LAUNCH = REPO / "deploy" / "sglang" / "launch.sh"
# PYTHONPATH entry of the servers that need the stand-ins for SGLang's CPU-only gaps
# (standins/sglang_cpu_gaps/sitecustomize.py: the DeepSeek-V3 ones).
CPU_GAPS = REPO / "tests" / "real_sglang" / "standins" / "sglang_cpu_gaps"
SHM = Path("/dev/shm")
# What serves on this CPU (shared/REAL-ENGINES.md): the native torch paths, a small KV
# pool (--max-total-tokens caps it; the memory fraction is generous because SGLang measures
# free host memory around the weight load, which other processes move), no warm-up
# request. float32, so SGLang does the same float32 math as the Hugging Face forward the
# dumps are compared with, and the reference server's bf16 tolerance applies.
CPU_FLAGS = (
    "--device", "cpu", "--mem-fraction-static", "0.3", "--max-total-tokens", "4096",
    "--context-length", "1024", "--skip-server-warmup", "--dtype", "float32",
)  # fmt: skip
START_TIMEOUT = 240.0  # s; 15-30 s when the machine is idle, TP=2 on 2 busy cores is slower
STOP_TIMEOUT = 30.0
# Files SGLang and torch leave in /dev/shm when a server is killed.
SHM_PREFIXES = (
    "sglang_", "sgl_shm_", "multi_tokenizer_args_", "nccl-", "sem.loky-", "torch_",
    *LEAKED_BY_KILLS,
)  # fmt: skip


# The HTTP port of a server under test is bound 30-120 s after it is chosen. A port of the
# kernel's ephemeral range (32768-60999 here) can be taken meanwhile by any connect() or
# bind(0) on the machine (it happened: "address already in use"), so the tier picks one
# below it, and below SGLang's own range for such ports (22000-29999, its nccl port).
# Under DP attention SGLang also binds the port + 233 .. + 240 (ZMQ_TCP_PORT_DELTA).
SERVER_PORTS = range(12000, 21000)
DP_ATTENTION_PORT_OFFSETS = range(233, 241)


def server_port() -> int:
    """A port for a server under test: free now, with the ports SGLang derives from it."""
    pick = random.SystemRandom()  # not the test-seeded module RNG: sessions run side by side
    for port in pick.sample(SERVER_PORTS, 64):
        if all(_bindable(port + offset) for offset in (0, *DP_ATTENTION_PORT_OFFSETS)):
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS} after 64 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def sglang_python() -> Path:
    """The real SGLang environment's Python; skips (fails under CI) when it is missing."""
    path = Path(os.environ.get(ENV_PYTHON) or DEFAULT_PYTHON)
    if path.is_file() and os.access(path, os.X_OK):
        return path
    message = (
        f"no real SGLang environment at {path}: build it with `bash .ci/sglang-env` "
        f"(or set {ENV_PYTHON} to a Python with sglang==0.5.23 and hsx installed)"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def sglang_py() -> Path:
    return sglang_python()


def sglang_release(python: Path) -> str | None:
    """The sglang release installed in ``python``'s environment (its dist-info), read
    without starting it."""
    for site in sorted(python.parent.parent.glob("lib/python3*/site-packages")):
        for dist in sorted(site.glob("sglang-*.dist-info")):
            return dist.name.removeprefix("sglang-").removesuffix(".dist-info")
    return None


@pytest.fixture(scope="session")
def sglang_version(sglang_py: Path) -> str:
    """The release under test (0.5.23 in .venv-sglang; 0.5.14, the range's oldest, in
    .venv-sglang-0.5.14 through HSX_SGLANG_PYTHON): one of the hook's range."""
    from hsx_async.server.sglang.hook import SGLANG_RANGE

    version = sglang_release(sglang_py)
    assert version is not None and SGLANG_RANGE.accepts(version), (sglang_py, version)
    return version


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny realistic-norm Llama as a local Hugging Face directory (bf16 weights)."""
    from hsx_async.server.reference.model import save_default_model

    return save_default_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    """The same weights through transformers, in float32 (the ground truth)."""
    from hsx_async.server.reference.model import load_model

    return load_model(str(model_dir))


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """The tiny DeepSeek-V3 (Kimi-K2.5's architecture) as a local Hugging Face directory,
    built once per session, with the tiny Llama's tokenizer."""
    from tests.real_sglang.tiny_deepseek import save_model

    return save_model(tmp_path_factory.mktemp("model") / "tiny-deepseek-v3", model_dir)


@pytest.fixture(scope="session")
def deepseek_hf(deepseek_dir: Path) -> Any:
    """Its saved weights through transformers, in float32 (the ground truth)."""
    from tests.real_sglang.tiny_deepseek import load_reference

    return load_reference(deepseek_dir)


@pytest.fixture(scope="session")
def layer_probe(sglang_py: Path) -> dict[str, Any]:
    """The installed SGLang's own ``set_eagle3_layers_to_capture`` of every family on the
    cases of ``layer_probe.py`` (one ``import sglang`` per session)."""
    from tests.real_sglang.layer_probe import run_probe

    return run_probe(sglang_py)


@dataclass
class Server:
    url: str
    dump_root: Path
    log: Path
    process: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return orjson.loads(resp.read())

    def post(self, path: str, body: object, timeout: float = 60.0) -> Any:
        req = urllib.request.Request(
            self.url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return orjson.loads(resp.read())


def launch_env(sglang_py: Path, dump_root: Path, port: int, **extra: str) -> dict[str, str]:
    """launch.sh's environment: the CPU engine, aux layers 1, 3, 5 unless ``extra`` names
    others (``HSX_AUX_LAYERS``), and whatever else ``extra`` sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    env.update(
        HSX_PYTHON=str(sglang_py),
        HSX_AUX_LAYERS="1,3,5",
        HSX_DUMP_ROOT=str(dump_root),
        HSX_PORT=str(port),
        SGLANG_USE_CPU_ENGINE="1",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def running(command: Sequence[str], env: dict[str, str], log: Path) -> Iterator[Server]:
    """Start ``command`` in its own process group; kill the group and clean up after."""
    port = int(env["HSX_PORT"])
    dump_root = Path(env["HSX_DUMP_ROOT"])
    dump_root.mkdir(parents=True, exist_ok=True)
    shm_before = shm_names()
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(command), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield Server(f"http://127.0.0.1:{port}", dump_root, log, process)
    finally:
        stop(process)
        shutil.rmtree(dump_root, ignore_errors=True)
        remove_left_shm(shm_before, SHM_PREFIXES)


def launch_command(model: Path, *flags: str) -> list[str]:
    return ["bash", str(LAUNCH), str(model), *CPU_FLAGS, *flags]


def wait_ready(server: Server, timeout: float = START_TIMEOUT) -> None:
    """Until /health answers 200; fails with the log's tail if the server exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(
                f"SGLang exited ({server.process.returncode}):\n{server.log_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        # Polling a starting server: nothing to wait on but the clock (bounded above).
        time.sleep(0.5)
    pytest.fail(f"SGLang not ready after {timeout:.0f} s:\n{server.log_text()[-4000:]}")


def wait_exit(server: Server, timeout: float = START_TIMEOUT) -> int:
    try:
        return server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SGLang still running after {timeout:.0f} s:\n{server.log_text()[-4000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after a bound."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        if _group_gone(process, STOP_TIMEOUT):
            return


def _group_gone(process: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap the launcher: a zombie leader keeps its group alive
        if not _group_alive(process.pid):
            return True
        time.sleep(0.2)
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def new_dump_root() -> Path:
    base = SHM if SHM.is_dir() else Path("/tmp")
    return base / f"hsx-real-sglang-{uuid.uuid4().hex[:12]}"
