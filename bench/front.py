"""A trainer pulling through ``hsx front speculators`` (Mooncake) against one pulling from
``hsx serve`` while ``hsx run`` extracts: the same samples, the same fake server, one run.

    python bench/front.py --mooncake-python .venv-mooncake/bin/python   # ~2 minutes
    python bench/front.py --smoke --mooncake-python ...                 # tiny (CI)

One fake server with a GPU-like latency model (a pass costs ``--latency-base-ms`` plus
``--latency-per-token-us`` per row, passes batched), so extraction is bound by the "GPU"
as in a real job. Both paths extract each sample on demand and keep ``--concurrency``
requests in flight:

1. **hsx serve**: ``hsx run`` (``retention = "acked"``, one consumer) with ``hsx serve`` on
   its output, and a :class:`~hsx_async.dataset.live.LiveDataset` reader here taking each
   sample as soon as it is committed (no training step). Rate: samples from ``hsx run``'s
   start to the reader's last sample.
2. **front**: ``mooncake_master`` and ``hsx front speculators``; speculators' own
   trainer-side calls (``bench/front_reader.py``, in ``--mooncake-python``'s venv: their
   OpenAI call, hs-connectors' ``MooncakeTransfer``, their delete) from
   ``--concurrency`` threads. Rate: from the first request to the last sample read.

The table gives each path's samples/s and its GB/s of tensors read, the front's ratio to
``hsx serve``, and the CPU seconds hsx's processes used per GB read (``hsx run`` and
``hsx serve``; the front), the readers' own excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import common
from transport import hsx_serve, serve_options

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tomli_w

from hsx_async.dataset.live.dataset import LiveDataset
from tests.dataset.test_export import model_dir
from tests.e2e import free_port

REPO = Path(__file__).resolve().parent.parent
READER = Path(__file__).with_name("front_reader.py")
CONSUMER = "trainer"


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tensor_bytes(sample: dict[str, Any]) -> int:
    """What the front delivers of a sample (the view adds a loss mask it does not)."""
    return int(sample["hidden_states"].nbytes) + int(sample["token_ids"].nbytes)


def run_started(log: Path) -> float:
    """The wall-clock time of an ``hsx run`` log's ``run_started`` event."""
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{") and b'"run_started"' in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
    raise RuntimeError(f"no run_started in {log}")


def serve_phase(
    args: argparse.Namespace, s: common.Scratch, url: str, dump_root: Path, model: common.Model
) -> dict[str, Any]:
    samples = s.work / "samples.jsonl"
    out = s.fresh("out-serve")
    out.mkdir(parents=True, exist_ok=True)  # hsx serve waits for hsx run's first files
    raw = common.client_config(url=url, samples=samples, out_dir=out, dump_root=dump_root,
                               model=model, workers={"concurrency": args.concurrency},
                               input={"max_tokens": args.tokens},
                               output={"retention": "acked", "consumers": [CONSUMER]})  # fmt: skip
    flags, env = serve_options("plain", s.work)
    os.environ.update(env)
    target, _ = model_dir(s.work / "model-serve", model.hidden_size)  # the pre-norm view
    got = {"samples": 0, "bytes": 0, "done_at": 0.0}
    errors: list[BaseException] = []
    with hsx_serve(out, flags) as (serve_url, serve_pid):
        cpu0 = _cpu(serve_pid)

        def read() -> None:
            try:
                live = LiveDataset(serve_url, consumer=CONSUMER, wait_timeout=args.timeout,
                                   view="speculators", model=target)  # fmt: skip
                for sample in live:
                    got["samples"] += 1
                    got["bytes"] += tensor_bytes(sample)
                    live.done(sample)
                    live.ack()
                got["done_at"] = time.time()
            except BaseException as exc:  # noqa: BLE001 - carried to the phase, which raises it
                errors.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        run = common.run_hsx(raw, s.work, "serve-run")
        started = run_started(s.work / "serve-run.log")  # hsx run's start-up excluded
        reader.join(args.timeout)
        cpu = _cpu(serve_pid) - cpu0 + (run.run_cpu_s or run.usage.cpu_s)  # + hsx run's
    if errors or got["samples"] != args.samples or run.done != args.samples:
        raise RuntimeError(f"hsx serve: read {got['samples']} of {run.done}: {errors!r}")
    wall = got["done_at"] - started
    return {"path": "hsx run + hsx serve", "wall_s": wall, "samples": got["samples"],
            "bytes": got["bytes"], "serving_cpu_s": cpu, "failed": 0}  # fmt: skip


def front_phase(
    args: argparse.Namespace, s: common.Scratch, url: str, dump_root: Path, model: common.Model
) -> dict[str, Any]:
    venv_bin = Path(args.mooncake_python).parent
    raw = common.client_config(url=url, samples=s.work / "samples.jsonl",
                               out_dir=s.fresh("out-front"), dump_root=dump_root, model=model,
                               input={"max_tokens": args.tokens})  # fmt: skip
    config = s.work / "front.toml"
    config.write_text(tomli_w.dumps(raw))
    target, _ = model_dir(s.work / "model", model.hidden_size)  # its final norm: pre-norm
    prompts = s.work / "prompts.json"
    prompts.write_text(json.dumps([[1 + (i + t) % 1000 for t in range(args.tokens)]
                                   for i in range(args.samples)]))  # fmt: skip
    port = free_port()
    with contextlib.ExitStack() as stack:
        master_log = stack.enter_context((s.work / "mooncake_master.log").open("wb"))
        master = subprocess.Popen([str(venv_bin / "mooncake_master"), f"-rpc_port={port}",
                                   "-rpc_address=127.0.0.1", f"-metrics_port={free_port()}"],
                                  stdout=master_log, stderr=master_log)  # fmt: skip
        stack.callback(master.wait, 30)
        stack.callback(master.terminate)
        argv = [args.mooncake_python, "-m", "hsx_async", "front", "speculators",
                "--config", str(config), "--model", str(target),
                "--listen", f"127.0.0.1:{free_port()}", "--served-model-name", "bench",
                "--mooncake-master", f"127.0.0.1:{port}",
                "--mooncake-segment-mib", str(args.segment_mib),
                "--mooncake-buffer-mib", str(args.buffer_mib)]  # fmt: skip
        front = stack.enter_context(
            common.ServerProcess(
                argv, s.work / "front.log", listening=re.compile(rb"on (http://\S+)")
            )
        )
        assert front.proc is not None
        cpu0 = front.cpu_s()
        done = subprocess.run(
            [args.mooncake_python, str(READER), front.url, f"127.0.0.1:{port}", str(prompts),
             str(args.concurrency)],
            capture_output=True, text=True, timeout=args.timeout, check=False, cwd=REPO,
            env=common.child_env(),
        )  # fmt: skip
        cpu = front.cpu_s() - cpu0
    if done.returncode != 0:
        raise RuntimeError(f"the front's reader failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["samples"] != args.samples:
        raise RuntimeError(f"the front's reader read {got['samples']} of {args.samples}: {got}")
    return {"path": "hsx front speculators", "wall_s": got["wall_s"], "samples": got["samples"],
            "bytes": got["bytes"], "serving_cpu_s": cpu, "failed": got["failed"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_args(parser)
    add = parser.add_argument
    add("--mooncake-python", required=True,
        help="a Python with mooncake-transfer-engine-non-cuda, speculators 0.9.0 and "
             "hs-connectors 0.9.0 (.venv-mooncake: bash .ci/mooncake-env)")  # fmt: skip
    add("--samples", type=int, default=200, help="samples a path")
    add("--tokens", type=int, default=512, help="tokens a sample")
    add("--hidden", type=int, default=1024, help="hidden size (4 states a token)")
    add("--latency-base-ms", type=float, default=5.0, help="the fake server's cost a pass")
    add("--latency-per-token-us", type=float, default=180.0, help="... and a row")
    add("--concurrency", type=int, default=8, help="requests in flight, each path")
    add("--segment-mib", type=int, default=512, help="the front's Mooncake segment")
    add("--buffer-mib", type=int, default=64, help="the front's Mooncake client buffer")
    add("--timeout", type=float, default=600.0, help="the most one path may take")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.tokens, args.hidden, args.concurrency = 12, 64, 64, 4
        args.segment_mib, args.buffer_mib, args.timeout = 32, 16, 180.0
    load_before = os.getloadavg()
    common.apply_common(args)
    model = common.Model(hidden_size=args.hidden, aux_layers=(1, 3, 5))
    with common.scratch(args, "front") as s:
        samples = s.work / "samples.jsonl"
        common.write_samples(samples, [args.tokens] * args.samples)
        dump_root = s.fresh("dumps", on_shm=True)
        argv = common.fake_server_argv(model, dump_root, latency_base_ms=args.latency_base_ms,
                                latency_per_token_us=args.latency_per_token_us)  # fmt: skip
        with common.ServerProcess(argv, s.work / "fake-server.log") as srv:
            rows = [serve_phase(args, s, srv.url, dump_root, model),
                    front_phase(args, s, srv.url, dump_root, model)]  # fmt: skip
        for row in rows:
            row["rate"] = row["samples"] / row["wall_s"]
            row["gb_s"] = row["bytes"] / common.GB / row["wall_s"]
            row["cpu_per_gb"] = row["serving_cpu_s"] / (row["bytes"] / common.GB)
            row["vs_serve"] = row["rate"] / rows[0]["rate"]
            print(f"{row['path']}: {row['rate']:.2f} samples/s", flush=True)
        data = {"smoke": args.smoke, "machine": common.machine_info(s.disk, s.shm),
                "load_before": load_before, "load_after": os.getloadavg(), "rows": rows,
                "workload": {"samples": args.samples, "tokens": args.tokens,
                             "hidden": args.hidden, "concurrency": args.concurrency}}  # fmt: skip
    report(args, data)


def report(args: argparse.Namespace, data: dict[str, Any]) -> None:
    rows = data["rows"]
    table = common.print_table(
        f"A trainer pulling {args.samples} samples of {args.tokens} tokens (hidden "
        f"{args.hidden}, 4 states a token), {args.concurrency} in flight, fake server "
        f"{args.latency_base_ms:g} ms + {args.latency_per_token_us:g} µs/row a pass",
        ["path", "samples/s", "common.GB/s read", "× hsx serve", "hsx CPU s/common.GB", "failed"],
        [[r["path"], r["rate"], r["gb_s"], r["vs_serve"], r["cpu_per_gb"], r["failed"]]
         for r in rows],
    )  # fmt: skip
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["path"] for r in rows], [r["rate"] for r in rows])
    ax.set_xlabel("samples/s the trainer got")
    fig.tight_layout()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.results_dir / "front.png")
    common.save_results(args.results_dir, "front", data, [table])


if __name__ == "__main__":
    main()
