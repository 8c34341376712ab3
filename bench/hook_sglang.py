"""The hook inside a real SGLang 0.5.23 on the CPU: the scheduler thread's share of time in
hsx code (py-spy on the scheduler process), with plain requests and with marked ones.

A tiny realistic-norm Llama (``save_default_model``) is served with the project's own
``deploy/sglang/launch.sh`` and the CPU flags of the real-SGLang tier, from that tier's
environment (``--sglang-python``, default ``$HSX_SGLANG_PYTHON`` or ``.venv-sglang``), with
THIS checkout's hsx first on ``PYTHONPATH``. For each phase, ``--concurrency`` clients post
prefill-only requests for ``--seconds`` while ``py-spy record`` samples the scheduler
process (all threads, idle included); a client deletes each committed dump. The report
gives, per phase and per ``HSX_WRITER_THREADS`` setting, the scheduler main thread's
samples inside ``hsx_async`` (and inside ``process_batch_result_prefill`` overall) and the
writer threads' samples.

    python bench/hook_sglang.py --seconds 20       # ~3 min: 2 servers × 2 phases

The forward of a tiny model on the CPU is far cheaper per row than a real model's on a GPU
is slow, so these shares are an upper bound of what hsx takes from a real scheduler.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

REPO = Path(__file__).resolve().parent.parent
CPU_FLAGS = (
    "--device", "cpu", "--mem-fraction-static", "0.3", "--max-total-tokens", "4096",
    "--context-length", "1024", "--skip-server-warmup", "--dtype", "float32",
    "--chunked-prefill-size", "512",
)  # fmt: skip
AUX = "1,3,5"
NS = "prof"
SHM = Path("/dev/shm")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    default_py = os.environ.get("HSX_SGLANG_PYTHON") or str(REPO / ".venv-sglang/bin/python")
    add("--sglang-python", default=default_py)
    add("--seconds", type=float, default=20.0)
    add("--concurrency", type=int, default=8)
    add("--prompt-tokens", type=int, default=700)
    add("--writer-threads", default="4,0", help="HSX_WRITER_THREADS values, one server each")
    add("--results-dir", type=Path, default=common.RESULTS_DIR)
    add("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server(
    args: argparse.Namespace, model: Path, root: Path, threads: str, log: Path
) -> Iterator[str]:
    port = free_port()
    shm_before = {p.name for p in SHM.iterdir()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    env.update(
        HSX_PYTHON=args.sglang_python,
        HSX_AUX_LAYERS=AUX,
        HSX_DUMP_ROOT=str(root),
        HSX_PORT=str(port),
        HSX_WRITER_THREADS=threads,
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = ["bash", str(REPO / "deploy/sglang/launch.sh"), str(model), *CPU_FLAGS]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"SGLang did not start:\n{log.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    break
            time.sleep(0.5)  # polling a starting server: bounded by the deadline above
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        # What the killed server left in /dev/shm (SGLang's load files).
        for path in SHM.iterdir():
            if path.name not in shm_before and path.name.startswith("sglang_"):
                path.unlink(missing_ok=True)


def scheduler_pid(launcher_pid_hint: str) -> int:
    """The newest ``sglang::scheduler`` process (SGLang names its processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if (proc / "comm").read_text().strip().startswith("sglang::schedul"):
                    found.append((proc.stat().st_mtime, int(proc.name)))
    if not found:
        raise SystemExit(f"no sglang::scheduler process found ({launcher_pid_hint})")
    return max(found)[1]


def drive(url: str, root: Path, *, marked: bool, seconds: float, args: argparse.Namespace) -> int:
    """Clients posting prefill-only requests until ``seconds`` pass; returns requests done."""
    stop = time.monotonic() + seconds
    done = Counter[str]()
    rng = np.random.default_rng(0)

    def client(i: int) -> None:
        while time.monotonic() < stop:
            rid = f"c{i}-{uuid.uuid4().hex[:10]}"
            ids = rng.integers(3, 1024, args.prompt_tokens).tolist()
            params: dict[str, Any] = {"max_new_tokens": 0}
            if marked:
                params["custom_params"] = {"hsx_ns": NS}
            body = orjson.dumps({"rid": rid, "input_ids": ids, "sampling_params": params})
            req = urllib.request.Request(
                url + "/generate", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
            if marked:
                meta = root / NS / rid / "meta.json"
                deadline = time.monotonic() + 60
                while not meta.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)  # the dump is committed by a writer thread
                shutil.rmtree(root / NS / rid, ignore_errors=True)
            done["n"] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done["n"]


# The SGLang methods the hook's wrappers call through: time below them is SGLang's own.
ORIGINALS = (
    "ModelRunner.forward ",
    "SchedulerBatchResultProcessor.process_batch_result_prefill ",
    "GenerationBatchResult.copy_to_cpu ",
    "Req.__init__ ",
)


def in_hsx(frames: list[str]) -> bool:
    """The sample is hsx's own work: an hsx_async frame with no SGLang original below it
    (torch, numpy and system calls made by hsx count as hsx)."""
    last = max((i for i, f in enumerate(frames) if "hsx_async/" in f), default=-1)
    return last >= 0 and not any(f.startswith(ORIGINALS) for f in frames[last + 1 :])


def shares(raw: Path) -> dict[str, Any]:
    """From py-spy's ``--format raw`` (collapsed stacks, first frame the thread)."""
    threads: Counter[str] = Counter()
    main = Counter[str]()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        if "hsx-writer" in thread:
            threads["writer active" if "write_job" in stack else "writer idle"] += n
        elif "MainThread" in thread:
            main["total"] += n
            main["hsx"] += n * in_hsx(frames)
            main["prefill"] += n * ("process_batch_result_prefill" in stack)
            main["forward"] += n * ("ModelRunner.forward " in stack)
        else:
            threads["other"] += n
    total = main["total"] or 1
    return {
        "samples": dict(threads) | {"main": main["total"]},
        "main_hsx_share": main["hsx"] / total,
        "main_prefill_share": main["prefill"] / total,
        "main_forward_share": main["forward"] / total,
    }


def main() -> None:
    args = parse_args()
    from hsx_async.server.reference.model import save_default_model

    results: list[dict[str, Any]] = []
    args.results_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hsx-hook-sglang-") as tmp:
        work = Path(tmp)
        model = save_default_model(work / "tiny-llama", seed=0)
        for threads in args.writer_threads.split(","):
            root = SHM / f"hsx-prof-{os.getpid()}-{threads}"
            log = work / f"sglang-{threads}.log"
            try:
                with server(args, model, root, threads, log) as url:
                    pid = scheduler_pid(url)
                    for marked in (False, True):
                        raw = work / f"spy-{threads}-{int(marked)}.txt"
                        spy = subprocess.Popen(
                            [args.py_spy, "record", "--pid", str(pid), "--idle", "--threads",
                             "--rate", "200", "--format", "raw", "--output", str(raw),
                             "--duration", str(int(args.seconds))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        )  # fmt: skip
                        n = drive(url, root, marked=marked, seconds=args.seconds, args=args)
                        _, err = spy.communicate(timeout=args.seconds + 60)
                        if not raw.exists():
                            raise SystemExit(f"py-spy wrote nothing: {err.decode()[-2000:]}")
                        row = {"writer_threads": int(threads), "marked": marked, "requests": n}
                        results.append(row | shares(raw))
                        shutil.copy(raw, args.results_dir / raw.name)
                        print(results[-1], flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
                if log.exists():
                    shutil.copy(log, args.results_dir / log.name)
    table = common.print_table(
        "real SGLang 0.5.23 on the CPU, scheduler process under py-spy",
        ["HSX_WRITER_THREADS", "requests", "marked", "main thread in hsx code",
         "main in prefill result", "main in forward", "writer samples active"],
        [
            [r["writer_threads"], r["requests"], r["marked"], f"{100 * r['main_hsx_share']:.2f}%",
             f"{100 * r['main_prefill_share']:.2f}%", f"{100 * r['main_forward_share']:.1f}%",
             r["samples"].get("writer active", 0)]
            for r in results
        ],
    )  # fmt: skip
    data = {
        "machine": common.machine_info(Path(tempfile.gettempdir()), Path("/dev/shm")),
        "rows": results,
    }
    common.save_results(args.results_dir, "hook_sglang", data, [table])


if __name__ == "__main__":
    main()
