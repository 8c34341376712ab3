"""The hook's device path on a GPU against the plain path, in one run (issue 28 item 3).

Prefill passes at Kimi-K2.5's shape (H 7168, 3 aux layers + the final state, 16,384-row
passes: 0.94 GB of dumps each) lie on the device, in the model's dtype, as SGLang 0.5.23
leaves them, and go through the real glue (``hsx_async.server.sglang.hook``, installed on
stand-in SGLang classes that copy as SGLang does: ``async_d2h`` into pinned host memory,
``non_blocking``, on SGLang's copy stream behind the forward, a ``copy_done`` event) and
the real background writers (their defaults: 4 threads, a 4 GiB queue) into /dev/shm.
Two paths, each with a bfloat16 and a float32 model:

- **plain**: SGLang's own copy of the aux rows and the hook's copy of the final rows
  (rounded to bfloat16 on the device first); the writers write two slices per row, and
  round a float32 model's aux rows themselves;
- **device**: ``HSX_DEVICE_STACK=1``: the hook lays the pass out as ``[T, L, H]`` bfloat16
  on the device (on the copy stream: a float32 model's rows are rounded there) and makes
  ONE copy into pinned memory; the writers write each part as one contiguous slice.

As in SGLang's overlap scheduling, the scheduler thread issues pass N's copies, then
processes pass N-1's result (waiting for its ``copy_done``, planning, handing it to the
writers). Per configuration: the scheduler thread's wall and CPU time in the hook per GB
dumped, the sustained dump rate (first measured pass issued → last byte written; the
target is ≥ 2 GB/s), the bytes that crossed the bus per byte dumped, the writers' CPU per
GB, the host memory the writers held at most. Committed dumps are deleted after each pass,
as the client would. Warm-up passes (pinned buffers allocated, kernels loaded) are not
measured.

    python bench/hook_gpu.py                 # on a GPU: 4 configurations × 12 passes, ~2 min
    python bench/hook_gpu.py --smoke         # tiny passes; on the CPU, what CI runs

On a machine without a GPU (``--device cpu``, the default there) the same code runs on
CPU tensors: ``async_d2h`` then copies nothing (as SGLang's does on the CPU), and under
``--smoke`` the glue is told the CPU is its device, so the device path's code (the stack,
the rounding) runs too. Those figures measure nothing about a GPU.

On a lent device (the H200 image has torch and numpy, not orjson/tomli_w), carry their
wheels. The device tool sends the checkout its session started in (main, where this
script lands), so in that checkout: ``echo /.whl/ >> .git/info/exclude`` and
``python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64 -d .whl orjson tomli_w``; then one call, with
``carry=[".whl"]`` and ``timeout_s=420``: ``python3 -m pip install -q --no-index --no-deps
--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 bench/hook_gpu.py --results-dir
$OUT``. The table, the JSON and the plot come back from ``$OUT``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common
import hook  # bench/hook.py: collect() the committed dumps as the client would, plot()

GB = 1e9
NS = "gpu"
TARGET_GB_PER_S = 2.0


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    device_stack: bool
    dtype: str  # the model's: "bfloat16" or "float32"


MODES = (
    Mode("plain, bf16 model", device_stack=False, dtype="bfloat16"),
    Mode("device stack, bf16 model", device_stack=True, dtype="bfloat16"),
    Mode("plain, float32 model", device_stack=False, dtype="float32"),
    Mode("device stack, float32 model", device_stack=True, dtype="float32"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_args(parser)
    add = parser.add_argument
    add("--device", help="torch device (default: cuda if one is there, else cpu)")
    add("--rows", type=int, default=16384, help="rows per pass")
    add("--passes", type=int, default=12, help="measured passes per configuration")
    add("--warmup", type=int, default=2, help="passes before the measured ones")
    add("--requests-per-pass", type=int, default=8)
    add("--hidden-size", type=int, default=7168)
    add("--aux-layers", default="2,30,58")
    add("--threads", type=int, default=4, help="writer threads (HSX_WRITER_THREADS)")
    add("--queue-mb", type=int, default=4096, help="the writers' budget (HSX_WRITE_QUEUE_MB)")
    add("--modes", help="only the configurations whose names contain one of these")
    return parser.parse_args()


# -- SGLang 0.5.23's copies, on stand-in classes ----------------------------------------------


class Copies:
    """SGLang's ``async_d2h`` (``srt/utils/common.py``): on the CPU the tensor itself;
    else a pinned host buffer filled ``non_blocking`` on the current stream, the device
    tensor kept alive for that stream. Counts the bytes that cross the bus."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.bytes = 0

    def __call__(self, tensor: Any) -> Any:
        torch = self.torch
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(torch.cuda.current_stream())
        self.bytes += int(tensor.nbytes)
        return host


class NoEvent:
    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


def sglang_api(torch: Any, copies: Copies, device: str) -> Any:
    """The glue's view of SGLang: the tests' stand-in Req/processor/runner, and a
    GenerationBatchResult whose ``copy_to_cpu`` copies the aux rows as SGLang's does."""
    from hsx_async.server.sglang.hook import SglangApi
    from tests.server.sglang.standins import FULL, make_api

    base = make_api([])

    class Result:
        def __init__(self, logits_output: Any, lens: list[int]) -> None:
            self.logits_output = logits_output
            self.extend_input_len_per_req = lens
            self.can_run_cuda_graph = False
            self.copy_done: Any = torch.cuda.Event() if device != "cpu" else NoEvent()

        def copy_to_cpu(self, return_logprob: bool, return_hidden_states: bool = True) -> None:
            out = self.logits_output
            if return_hidden_states and out.hidden_states is not None:
                out.hidden_states = copies(out.hidden_states)

    return SglangApi(
        req_cls=base.req_cls,
        processor_cls=base.processor_cls,
        result_cls=Result,
        runner_cls=base.runner_cls,
        full_capture=FULL,
        async_d2h=copies,
    )


# -- one configuration ---------------------------------------------------------------------------


class Run:
    """One configuration: the installed glue, the device rows, the measured loop."""

    def __init__(self, args: argparse.Namespace, mode: Mode, device: str, root: Path) -> None:
        import torch

        from hsx_async.server.dumper import PrefillDumper
        from hsx_async.server.hook_core import HookConfig
        from hsx_async.server.hook_writer import BackgroundWriter
        from hsx_async.server.sglang import hook as glue

        self.torch, self.glue, self.args, self.mode, self.root = torch, glue, args, mode, root
        self.device = device
        self.layers = tuple(int(x) for x in args.aux_layers.split(","))
        k, h, rows = len(self.layers), args.hidden_size, args.rows
        self.per_req = rows // args.requests_per_pass
        self.dump_bytes = self.per_req * args.requests_per_pass * (k + 1) * h * 2
        cfg = HookConfig(
            dump_root=root,
            aux_layers=self.layers,
            model="bench",
            server="bench",
            writer_threads=args.threads,
            write_queue_bytes=args.queue_mb << 20,
            device_stack=mode.device_stack,
        )
        self.writer = BackgroundWriter(root, threads=args.threads, queue_bytes=args.queue_mb << 20)
        self.copies = Copies(torch)
        self.api = sglang_api(torch, self.copies, device)
        state = glue.HookState(
            cfg, PrefillDumper(cfg, model="bench", sink=self.writer), True, background=self.writer
        )
        state.stack = SimpleNamespace(layers_to_capture=list(self.layers))
        state.graph_layers = self.layers
        self.state = state
        dtype = getattr(torch, mode.dtype)
        gen = torch.Generator(device=device).manual_seed(0)
        # The forward's output buffers, reused pass after pass (as a model's are).
        self.aux = torch.randn((rows, k * h), generator=gen, device=device).to(dtype)
        self.final = torch.randn((rows, h), generator=gen, device=device).to(dtype)
        cuda = device != "cpu"
        self.forward_stream = torch.cuda.current_stream() if cuda else None
        self.copy_stream = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]

    def _copy_context(self) -> Any:
        if self.copy_stream is None:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.copy_stream)

    def issue(self, p: int) -> tuple[Any, Any]:
        """Pass ``p``'s forward output, then its copies issued on the copy stream (SGLang's
        ``copy_to_cpu`` with the hook's wrapper in front). Returns (batch, result)."""
        from tests.server.sglang.standins import params

        torch, api, n = self.torch, self.api, self.per_req
        self.aux.add_(1)  # "the forward": the rows change on the device
        reqs = [
            api.req_cls(f"p{p}-r{j}", range(n), params(ns=NS))
            for j in range(self.args.requests_per_pass)
        ]
        out = SimpleNamespace(
            hidden_states=self.aux, last_hidden_states=self.final, hidden_states_token_indices=None
        )
        result = api.result_cls(out, [n] * len(reqs))
        if self.copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record(self.forward_stream)
            self.copy_stream.wait_event(ready)
        with self._copy_context():
            result.copy_to_cpu(False, return_hidden_states=True)
            result.copy_done.record()
        batch = SimpleNamespace(reqs=reqs, prefix_lens=[0] * len(reqs), extend_lens=[n] * len(reqs))
        return batch, result

    def process(self, batch: Any, result: Any) -> None:
        self.api.processor_cls().process_batch_result_prefill(batch, result)

    def measure(self) -> dict[str, Any]:
        args = self.args
        pending: tuple[Any, Any] | None = None
        dirs: list[Path] = []
        for p in range(args.warmup):
            pending = self._step(p, pending, dirs)
        self._drain(pending, dirs)
        pending, dirs = None, []
        self.copies.bytes = 0
        hook_wall = hook_cpu = 0.0
        ru0, main0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        started = time.perf_counter()
        for p in range(args.warmup, args.warmup + args.passes):
            t0, c0 = time.perf_counter(), time.thread_time()
            pending = self._step(p, pending, dirs)
            hook_wall += time.perf_counter() - t0
            hook_cpu += time.thread_time() - c0
            dirs = hook.collect(dirs)
        t0, c0 = time.perf_counter(), time.thread_time()
        self._drain(pending, dirs)
        hook_wall += time.perf_counter() - t0
        hook_cpu += time.thread_time() - c0
        finished = time.perf_counter()
        ru1, main1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        stats = self.writer.stats
        gb = self.dump_bytes * args.passes / GB
        other_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime) - (main1 - main0)
        gb_per_s = gb / (finished - started)
        return {
            "mode": self.mode.name,
            "device_stack": self.mode.device_stack,
            "dtype": self.mode.dtype,
            "gb": gb,
            "sched_ms_per_gb": hook_wall * 1000 / gb,
            "sched_cpu_ms_per_gb": hook_cpu * 1000 / gb,
            "gb_per_s": gb_per_s,
            "meets_target": gb_per_s >= TARGET_GB_PER_S,
            "bus_bytes_per_dump_byte": self.copies.bytes / (self.dump_bytes * args.passes),
            "writer_cpu_s_per_gb": max(0.0, other_cpu) / gb,
            "peak_queued_mb": stats.peak_queued_bytes / 1e6,
            "stalls": stats.stalls,
            "committed": stats.committed,
        }

    def _step(self, p: int, pending: tuple[Any, Any] | None, dirs: list[Path]) -> tuple[Any, Any]:
        """Issue pass ``p``'s copies, then process the previous pass's result (overlap)."""
        issued = self.issue(p)
        dirs += [self.root / NS / r.rid for r in issued[0].reqs]
        if pending is not None:
            self.process(*pending)
        return issued

    def _drain(self, pending: tuple[Any, Any] | None, dirs: list[Path]) -> None:
        if pending is not None:
            self.process(*pending)
        assert self.writer.flush(600.0), "the writers did not drain"
        left = hook.collect(dirs)
        assert not left, f"{len(left)} dumps never committed"

    def close(self) -> None:
        self.writer.close()


@contextlib.contextmanager
def cpu_is_the_device(glue: Any, enabled: bool) -> Iterator[None]:
    """``--smoke`` on the CPU: the glue takes its device path for CPU tensors too, so that
    path's code runs (it measures nothing about a GPU)."""
    if not enabled:
        yield
        return
    real: Callable[[Any], bool] = glue._on_accelerator
    glue._on_accelerator = lambda tensor: True
    try:
        yield
    finally:
        glue._on_accelerator = real


def run_mode(args: argparse.Namespace, mode: Mode, device: str, root: Path) -> dict[str, Any]:
    from hsx_async.server.sglang import hook as glue

    run = Run(args, mode, device, root)
    try:
        glue.install(run.state, run.api)
        with cpu_is_the_device(glue, args.smoke and device == "cpu"):
            row = run.measure()
    finally:
        glue.uninstall(run.api)
        run.close()
    return row


def main() -> None:
    args = parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.rows, args.passes, args.warmup, args.requests_per_pass = 256, 3, 1, 4
    torch.set_num_threads(1)  # no torch worker threads counted as the writers'
    wanted = [w.strip() for w in (args.modes or "").split(",") if w.strip()]
    modes = [m for m in MODES if not wanted or any(w in m.name for w in wanted)]
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)  # (all dumps go to tmpfs)
    root = Path(args.shm_dir) / f"hsx-bench-hook-gpu-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        rows = []
        for mode in modes:
            rows.append(run_mode(args, mode, device, root))
            print(f"  {mode.name}: {rows[-1]['gb_per_s']:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    layers = [int(x) for x in args.aux_layers.split(",")]
    pass_gb = args.rows * (len(layers) + 1) * args.hidden_size * 2 / GB
    name = torch.cuda.get_device_name() if device != "cpu" else "cpu (no GPU: code paths only)"
    table = common.print_table(
        f"hook device path vs plain path on {name}: {args.rows:,}-row passes ({pass_gb:.2f} "
        f"GB), H {args.hidden_size}, {len(layers)} aux + final, {args.passes} passes, "
        f"{args.threads} writer threads",
        [
            "configuration",
            "GB/s",
            f"≥ {TARGET_GB_PER_S:g}",
            "sched ms/GB",
            "sched CPU ms/GB",
            "bus B per dump B",
            "writer CPU s/GB",
            "queued MB max",
            "stalls",
        ],
        [
            [
                r["mode"],
                r["gb_per_s"],
                "yes" if r["meets_target"] else "no",
                r["sched_ms_per_gb"],
                r["sched_cpu_ms_per_gb"],
                r["bus_bytes_per_dump_byte"],
                r["writer_cpu_s_per_gb"],
                r["peak_queued_mb"],
                r["stalls"],
            ]
            for r in rows
        ],
    )
    ratios = {}
    for dtype in ("bfloat16", "float32"):
        plain = next((r for r in rows if r["dtype"] == dtype and not r["device_stack"]), None)
        stack = next((r for r in rows if r["dtype"] == dtype and r["device_stack"]), None)
        if plain is not None and stack is not None:
            ratios[dtype] = {
                "gb_per_s_device_over_plain": stack["gb_per_s"] / plain["gb_per_s"],
                "sched_ms_per_gb_plain_over_device": plain["sched_ms_per_gb"]
                / max(stack["sched_ms_per_gb"], 1e-9),
            }
    for dtype, ratio in ratios.items():
        print(f"{dtype} model: " + ", ".join(f"{k} {v:.2f}×" for k, v in ratio.items()))
    data = {
        "smoke": args.smoke,
        "device": device,
        "device_name": name,
        "machine": common.machine_info(Path(args.out_dir), Path(args.shm_dir)),
        "shape": {
            "rows": args.rows,
            "hidden_size": args.hidden_size,
            "aux_layers": layers,
            "pass_gb": pass_gb,
            "requests_per_pass": args.requests_per_pass,
        },
        "settings": {
            "passes": args.passes,
            "warmup": args.warmup,
            "threads": args.threads,
            "queue_mb": args.queue_mb,
        },
        "target_gb_per_s": TARGET_GB_PER_S,
        "rows": rows,
        "ratios": ratios,
    }
    results = Path(args.results_dir)
    common.save_results(results, "hook_gpu", data, [table])
    hook.plot(
        rows,
        results / "hook_gpu.png",
        old=lambda row: not row["device_stack"],
        sched_goal_ms=None,
        rate_target=TARGET_GB_PER_S,
    )
    print(orjson.dumps(ratios).decode())


if __name__ == "__main__":
    main()
