"""The hook's device path on a GPU against the plain path, in one run (issue 28 item 3;
issue 40: the first passes apart, FP8 on the device, the writer threads swept).

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
- **device**: ``HSX_DEVICE_STACK=1`` (the default since issue 40): the hook lays the pass
  out as ``[T, L, H]`` bfloat16 on the device (on the copy stream: a float32 model's rows
  are rounded there) and makes ONE copy into pinned memory; the writers write each part
  as one contiguous slice;
- **fp8 on device**: every request asks for FP8 (all slots, the default
  ``per_token_slot_outliers16`` layout): the hook quantizes the pass on the device
  (``encode_to_host``: the top-16 outlier selection per vector, then e4m3) and copies only
  the sections; the row also times that encoding and the top-16 selection alone on the
  device, per pass.

As in SGLang's overlap scheduling, the scheduler thread issues pass N's copies, then
processes pass N-1's result (waiting for its ``copy_done``, planning, handing it to the
writers). Per configuration: the scheduler thread's wall and CPU time in the hook per GB
dumped, the sustained dump rate (first measured pass issued → last byte written; the
target is ≥ 2 GB/s), the bytes that crossed the bus per byte dumped, the writers' CPU per
GB, the host memory the writers held at most. Committed dumps are deleted after each pass,
as the client would.

Before its first pass each configuration makes page-locked memory ready as the hook does
at its first forward (``warm_host_memory``: ``--pinned-warmup on``, the default; ``off``
for the old behaviour). The first ``--warmup`` passes after that are measured apart (the
"first passes" columns: their mean and their worst single pass, scheduler CPU per GB),
then the writers drain and the ``--passes`` steady passes are measured. Then the writer
threads are swept (``--writers``) on ``--sweep-modes``: where tmpfs stops scaling.

    python bench/hook_gpu.py                 # on a GPU: 6 configurations + the sweep, ~4 min
    python bench/hook_gpu.py --smoke         # tiny passes; on the CPU, what CI runs

On a machine without a GPU (``--device cpu``, the default there) the same code runs on
CPU tensors: ``async_d2h`` then copies nothing (as SGLang's does on the CPU), and under
``--smoke`` the glue is told the CPU is its device, so the device path's code (the stack,
the rounding) runs too. Those figures measure nothing about a GPU.

On a lent device (the H200 image has torch and numpy, not orjson/structlog/tomli_w), carry their
wheels. The device tool sends the checkout its session started in (main, where this
script lands), so in that checkout: ``echo /.whl/ >> .git/info/exclude`` and
``python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64 -d .whl orjson structlog tomli_w``; then one call, with
``carry=[".whl"]`` and ``timeout_s=540``: ``python3 -m pip install -q --no-index --no-deps
--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 bench/hook_gpu.py --warmup 8
--passes 30 --results-dir $OUT``. The tables, the JSON and the plot come back from
``$OUT`` (bench/README.md, "Next lent device", has the exact lines).
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
SCHED_GOAL_MS_PER_GB = 20.0  # the scheduler thread's CPU in the hook, per GB dumped
TOP_K = 16  # the outliers layout's top-16 per vector (per_token_slot_outliers16)


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    device_stack: bool
    dtype: str  # the model's: "bfloat16" or "float32"
    fp8: bool = False  # every request asks for FP8, all slots, the default layout


MODES = (
    Mode("plain, bf16 model", device_stack=False, dtype="bfloat16"),
    Mode("device stack, bf16 model", device_stack=True, dtype="bfloat16"),
    Mode("plain, float32 model", device_stack=False, dtype="float32"),
    Mode("device stack, float32 model", device_stack=True, dtype="float32"),
    Mode("fp8 on device, bf16 model", device_stack=True, dtype="bfloat16", fp8=True),
    Mode("fp8 on device, float32 model", device_stack=True, dtype="float32", fp8=True),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_args(parser)
    add = parser.add_argument
    add("--device", help="torch device (default: cuda if one is there, else cpu)")
    add("--rows", type=int, default=16384, help="rows per pass")
    add("--passes", type=int, default=12, help="steady passes measured per configuration")
    add("--warmup", type=int, default=2, help="first passes, measured apart, before those")
    add("--requests-per-pass", type=int, default=8)
    add("--hidden-size", type=int, default=7168)
    add("--aux-layers", default="2,30,58")
    add("--threads", type=int, default=4, help="writer threads (HSX_WRITER_THREADS)")
    add("--queue-mb", type=int, default=4096, help="the writers' budget (HSX_WRITE_QUEUE_MB)")
    add("--modes", help="only the configurations whose names contain one of these")
    add(
        "--pinned-warmup",
        choices=("on", "off"),
        default="on",
        help="make page-locked memory ready before the first pass, as the hook does",
    )
    add("--writers", default="2,4,8,12", help="writer threads to sweep ('' : no sweep)")
    add(
        "--sweep-modes",
        default="device stack, bf16 model",
        help="the sweep's configurations (names, or parts of them, separated by ';')",
    )
    return parser.parse_args()


def fp8_storage(layers: int) -> Any:
    from hsx_async.protocol import FP8, PER_TOKEN_SLOT_OUTLIERS16, Storage

    return Storage(FP8, tuple(range(layers)), PER_TOKEN_SLOT_OUTLIERS16)


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


def host_grown(torch: Any, device: str) -> tuple[int, float]:
    """Blocks PyTorch's caching host allocator has page-locked to grow its pool so far in
    this process, and the seconds it spent doing so (0 on the CPU: no pool; -1 where this
    torch keeps no such counts)."""
    if device == "cpu":
        return 0, 0.0
    read = getattr(torch.cuda, "host_memory_stats", None)
    stats = read() if read is not None else {}
    if "num_host_alloc" not in stats:
        return -1, -1.0
    return int(stats["num_host_alloc"]), float(stats.get("host_alloc_time.total", 0)) / 1e6


def grew(before: float, after: float) -> Any:
    """``after - before`` of a :func:`host_grown` count, None where torch keeps none."""
    return None if before < 0 or after < 0 else after - before


def empty_host_cache(torch: Any, device: str) -> None:
    """Each configuration starts as a server does: with no page-locked block cached."""
    if device == "cpu":
        return
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if release is None:
        release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        torch.cuda.synchronize()
        release()


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

    def __init__(
        self, args: argparse.Namespace, mode: Mode, device: str, root: Path, threads: int
    ) -> None:
        import torch

        from hsx_async.protocol import storage_params
        from hsx_async.server.dumper import PrefillDumper
        from hsx_async.server.hook_core import HookConfig
        from hsx_async.server.hook_writer import BackgroundWriter
        from hsx_async.server.sglang import hook as glue

        self.torch, self.glue, self.args, self.mode, self.root = torch, glue, args, mode, root
        self.device, self.threads = device, threads
        self.layers = tuple(int(x) for x in args.aux_layers.split(","))
        k, h, rows = len(self.layers), args.hidden_size, args.rows
        self.per_req = rows // args.requests_per_pass
        self.storage = fp8_storage(k + 1) if mode.fp8 else None
        self.params = storage_params(self.storage) if self.storage is not None else {}
        row_bytes = (k + 1) * h * 2 if self.storage is None else self.storage.row_bytes(k + 1, h)
        self.pass_bytes = self.per_req * args.requests_per_pass * row_bytes
        cfg = HookConfig(
            dump_root=root,
            aux_layers=self.layers,
            model="bench",
            server="bench",
            writer_threads=threads,
            write_queue_bytes=args.queue_mb << 20,
            device_stack=mode.device_stack,
            pass_rows=rows,
        )
        self.writer = BackgroundWriter(root, threads=threads, queue_bytes=args.queue_mb << 20)
        self.copies = Copies(torch)
        self.api = sglang_api(torch, self.copies, device)
        dtype = getattr(torch, mode.dtype)
        state = glue.HookState(
            cfg,
            PrefillDumper(cfg, model="bench", sink=self.writer),
            True,
            background=self.writer,
            allocate_pinned=glue.pinned_allocator() if device != "cpu" else None,
        )
        # The decoder stack as the hook finds it at the first forward: its captured
        # layers, and the final norm whose width and dtype the warm-up reads.
        norm = SimpleNamespace(weight=torch.empty(h, dtype=dtype, device=device))
        state.stack = SimpleNamespace(layers_to_capture=list(self.layers), norm=norm)
        state.graph_layers = self.layers
        self.state = state
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
            api.req_cls(f"p{p}-r{j}", range(n), params(ns=NS, **self.params))
            for j in range(self.args.requests_per_pass)
        ]
        self.state.pass_rids = tuple(r.rid for r in reqs)  # the forward wrapper's note
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

    def warm(self) -> dict[str, Any]:
        """What the hook does at its first forward: page-locked memory made ready."""
        if self.args.pinned_warmup == "off":
            return {"pinned_warmup": "off"}
        done = self.glue.warm_host_memory(self.state, None)
        if done is None:
            return {"pinned_warmup": "no page-locked memory (CPU)"}
        return {
            "pinned_warmup": "on",
            "warmup_s": done.seconds,
            "warmup_gb": done.nbytes / GB,
            "warmup_error": done.error,
        }

    def measure(self) -> dict[str, Any]:
        args = self.args
        grown0 = host_grown(self.torch, self.device)
        row: dict[str, Any] = self.warm()
        grown1 = host_grown(self.torch, self.device)
        first = self._first_passes()
        grown2 = host_grown(self.torch, self.device)
        self.copies.bytes = 0
        pending: tuple[Any, Any] | None = None
        dirs: list[Path] = []
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
        grown3 = host_grown(self.torch, self.device)
        stats = self.writer.stats
        gb = self.pass_bytes * args.passes / GB
        other_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime) - (main1 - main0)
        gb_per_s = gb / (finished - started)
        row.update(
            {
                "mode": self.mode.name,
                "device_stack": self.mode.device_stack,
                "dtype": self.mode.dtype,
                "fp8": self.mode.fp8,
                "threads": self.threads,
                "gb": gb,
                "sched_ms_per_gb": hook_wall * 1000 / gb,
                "sched_cpu_ms_per_gb": hook_cpu * 1000 / gb,
                "gb_per_s": gb_per_s,
                "mrows_per_s": args.passes
                * self.per_req
                * args.requests_per_pass
                / (finished - started)
                / 1e6,
                "meets_target": gb_per_s >= TARGET_GB_PER_S,
                "bus_bytes_per_dump_byte": self.copies.bytes / (self.pass_bytes * args.passes),
                "writer_cpu_s_per_gb": max(0.0, other_cpu) / gb,
                "peak_queued_mb": stats.peak_queued_bytes / 1e6,
                "stalls": stats.stalls,
                "committed": stats.committed,
                "encoded_passes": self.state.encoded_passes,
                # Pinned blocks grown (page-locked on the calling thread) and the seconds
                # it took: by the warm-up, in the first passes, in the steady passes.
                "grown_warmup": grew(grown0[0], grown1[0]),
                "grown_first": grew(grown1[0], grown2[0]),
                "grown_steady": grew(grown2[0], grown3[0]),
                "grow_s_first": grew(grown1[1], grown2[1]),
                **first,
            }
        )
        if self.storage is not None:
            row.update(self.encode_costs())
        return row

    def _first_passes(self) -> dict[str, Any]:
        """The first passes after start, one by one (each step: issue pass p, process
        p - 1), then drained: their scheduler CPU per GB, the mean and the worst pass."""
        pending: tuple[Any, Any] | None = None
        dirs: list[Path] = []
        cpu: list[float] = []
        gb = self.pass_bytes / GB
        for p in range(self.args.warmup):
            c0 = time.thread_time()
            pending = self._step(p, pending, dirs)
            cpu.append((time.thread_time() - c0) * 1000 / gb)
            dirs = hook.collect(dirs)
        self._drain(pending, dirs)
        return {
            "first_passes": len(cpu),
            "first_sched_cpu_ms_per_gb": sum(cpu) / len(cpu) if cpu else 0.0,
            "first_worst_sched_cpu_ms_per_gb": max(cpu, default=0.0),
            "first_sched_cpu_ms_per_gb_each": cpu,
        }

    def encode_costs(self, repeats: int = 3) -> dict[str, Any]:
        """The device's time per pass to encode it (``encode_rows``, what
        ``encode_to_host`` runs) and to select the top-16 channels of every vector alone
        (the outliers layout's extra work), on this pass's rows; events on a GPU."""
        from hsx_async.quantize import encode_rows

        torch, k = self.torch, len(self.layers)
        t, h = int(self.final.shape[0]), int(self.final.shape[1])
        rows = torch.empty((t, k + 1, h), dtype=torch.bfloat16, device=self.device)
        rows[:, :k, :].copy_(self.aux.reshape(t, k, h))
        rows[:, k, :].copy_(self.final)
        storage = self.storage
        assert storage is not None

        def encode() -> None:
            encode_rows(rows, storage)

        def select() -> None:
            torch.topk(rows.abs(), TOP_K + 1, dim=-1)

        encode_ms, select_ms = self._device_ms(encode, repeats), self._device_ms(select, repeats)
        return {
            "encode_ms_per_pass": encode_ms,
            "top16_ms_per_pass": select_ms,
            "encode_ms_per_gb": encode_ms / (self.pass_bytes / GB),
        }

    def _device_ms(self, work: Callable[[], None], repeats: int) -> float:
        torch = self.torch
        work()  # kernels loaded, buffers cached
        if self.device == "cpu":
            t0 = time.perf_counter()
            for _ in range(repeats):
                work()
            return (time.perf_counter() - t0) * 1000 / repeats
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            work()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / repeats

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


def run_mode(
    args: argparse.Namespace, mode: Mode, device: str, root: Path, threads: int
) -> dict[str, Any]:
    import torch

    from hsx_async.server.sglang import hook as glue

    empty_host_cache(torch, device)
    run = Run(args, mode, device, root, threads)
    try:
        glue.install(run.state, run.api)
        with cpu_is_the_device(glue, args.smoke and device == "cpu"):
            row = run.measure()
    finally:
        glue.uninstall(run.api)
        run.close()
    return row


def pick(names: str | None, sep: str = ",") -> list[Mode]:
    """The configurations whose names contain one of ``names`` (split at ``sep``)."""
    wanted = [w.strip() for w in (names or "").split(sep) if w.strip()]
    return [m for m in MODES if not wanted or any(w in m.name for w in wanted)]


def modes_table(rows: list[dict[str, Any]], title: str) -> str:
    return common.print_table(
        title,
        [
            "configuration",
            "GB/s",
            "Mrows/s",
            f"≥ {TARGET_GB_PER_S:g}",
            "sched ms/GB",
            "sched CPU ms/GB",
            "first passes: CPU ms/GB, worst",
            "pinned grown: warm-up, first, steady",
            "bus B per dump B",
            "writer CPU s/GB",
            "queued MB max",
            "stalls",
            "encode, top-16 ms/pass",
        ],
        [
            [
                r["mode"],
                r["gb_per_s"],
                r["mrows_per_s"],
                "yes" if r["meets_target"] else "no",
                r["sched_ms_per_gb"],
                r["sched_cpu_ms_per_gb"],
                f"{r['first_sched_cpu_ms_per_gb']:.1f}, {r['first_worst_sched_cpu_ms_per_gb']:.1f}",
                f"{r['grown_warmup']}, {r['grown_first']}, {r['grown_steady']}",
                r["bus_bytes_per_dump_byte"],
                r["writer_cpu_s_per_gb"],
                r["peak_queued_mb"],
                r["stalls"],
                f"{r['encode_ms_per_pass']:.2f}, {r['top16_ms_per_pass']:.2f}" if r["fp8"] else "",
            ]
            for r in rows
        ],
    )


def sweep_table(rows: list[dict[str, Any]], title: str) -> str:
    return common.print_table(
        title,
        ["configuration", "writer threads", "GB/s", "sched ms/GB", "writer CPU s/GB", "stalls"],
        [
            [
                r["mode"],
                r["threads"],
                r["gb_per_s"],
                r["sched_ms_per_gb"],
                r["writer_cpu_s_per_gb"],
                r["stalls"],
            ]
            for r in rows
        ],
    )


def ratios_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    ratios = {}
    for dtype in ("bfloat16", "float32"):
        same = [r for r in rows if r["dtype"] == dtype and not r["fp8"]]
        plain = next((r for r in same if not r["device_stack"]), None)
        stack = next((r for r in same if r["device_stack"]), None)
        if plain is not None and stack is not None:
            ratios[dtype] = {
                "gb_per_s_device_over_plain": stack["gb_per_s"] / plain["gb_per_s"],
                "sched_ms_per_gb_plain_over_device": plain["sched_ms_per_gb"]
                / max(stack["sched_ms_per_gb"], 1e-9),
            }
    return ratios


def main() -> None:
    args = parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.rows, args.passes, args.warmup, args.requests_per_pass = 256, 3, 2, 4
        args.hidden_size = 1024
        args.writers = "1,2" if args.writers == "2,4,8,12" else args.writers
    torch.set_num_threads(1)  # no torch worker threads counted as the writers'
    modes = pick(args.modes)
    writers = [int(w) for w in args.writers.split(",") if w.strip()]
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)  # (all dumps go to tmpfs)
    root = Path(args.shm_dir) / f"hsx-bench-hook-gpu-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        rows = []
        for mode in modes:
            rows.append(run_mode(args, mode, device, root, args.threads))
            print(f"  {mode.name}: {rows[-1]['gb_per_s']:.2f} GB/s", flush=True)
        sweep = []
        for mode in pick(args.sweep_modes, ";") if writers else []:
            for threads in writers:
                sweep.append(run_mode(args, mode, device, root, threads))
                print(f"  {mode.name}, {threads} writers: {sweep[-1]['gb_per_s']:.2f} GB/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    layers = [int(x) for x in args.aux_layers.split(",")]
    pass_gb = args.rows * (len(layers) + 1) * args.hidden_size * 2 / GB
    name = torch.cuda.get_device_name() if device != "cpu" else "cpu (no GPU: code paths only)"
    shape = (
        f"{args.rows:,}-row passes ({pass_gb:.2f} GB in bf16), H {args.hidden_size}, "
        f"{len(layers)} aux + final, {args.warmup} first + {args.passes} steady passes, "
        f"page-locked warm-up {args.pinned_warmup}"
    )
    tables = [
        modes_table(rows, f"hook paths on {name}: {shape}, {args.threads} writer threads"),
    ]
    if sweep:
        tables.append(sweep_table(sweep, f"writer threads swept on {name}: {shape}"))
    ratios = ratios_of(rows)
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
            "pinned_warmup": args.pinned_warmup,
            "writers": writers,
        },
        "target_gb_per_s": TARGET_GB_PER_S,
        "sched_goal_ms_per_gb": SCHED_GOAL_MS_PER_GB,
        "rows": rows,
        "sweep": sweep,
        "ratios": ratios,
    }
    results = Path(args.results_dir)
    common.save_results(results, "hook_gpu", data, tables)
    swept = [{**r, "mode": f"{r['mode']}, {r['threads']} writers"} for r in sweep]
    hook.plot(
        rows + swept,
        results / "hook_gpu.png",
        old=lambda row: not row["device_stack"],
        sched_goal_ms=None,
        rate_target=TARGET_GB_PER_S,
    )
    print(orjson.dumps(ratios).decode())


if __name__ == "__main__":
    main()
