"""FP8 storage of hidden states (issue 19), measured against bfloat16 side by side, one run.

    python bench/fp8.py              # ~12 minutes on the 2-core machine
    python bench/fp8.py --smoke      # tiny, checks the script runs (CI)

Four phases; every figure is a ratio to bfloat16 from the same run:

1. **End to end, the hook quantizing**, through ``hsx reference-server`` (a real
   ``transformers`` Llama on the CPU: the built-in tiny one, whose RMSNorm gains are drawn
   per channel from U(0.2, 3) as a trained checkpoint's are, or ``--model DIR``, given such
   gains if it has unit ones): the same samples with ``[output] dtype = "bfloat16"``,
   ``"float8_e4m3fn"`` with ``quantize = "all"`` and with ``quantize = "aux"``, in rounds
   whose order rotates, one ``hsx run`` process each. Dataset bytes per token (from the
   files), samples/s, and the client's CPU (the ``hsx run`` process, from ``wait4``) per GB
   written and per token, net of an empty run's start-up. Which side quantized is read from
   a probe dump's ``meta.json`` for each storage (the reference server's hook quantizes as
   the request asks: it dumps FP8).
1b. **End to end, the hook vs the client's fallback**, through two ``hsx fake-server``
   processes of the teacher's shape and the same samples: one quantizes in its hook as
   asked, the other plays a hook older than protocol version 3 (``FakeOptions(
   honour_storage=False)``: it dumps bfloat16 whatever the request asks, and the client's
   writer quantizes). The reference server has no such option, so the fallback is measured
   end to end here, where no model runs and the client's side is all there is to time. The
   two paths' datasets must be byte-identical (equal manifest hashes: one quantizer).
2. **The writer alone** (``FileWriter.stage`` + ``publish``, fsync on, in this process, as
   the client's copy threads call them) on dumps of a large model's shape built in
   /dev/shm: copying a bfloat16 dump, copying an FP8 dump (what a quantizing hook leaves;
   copied unchanged) and quantizing a bfloat16 dump into FP8 (the fallback). CPU s per GB,
   the median of interleaved rounds; the hook-path and the fallback files must be
   byte-identical (one quantizer).
3. **Quality** of phase 1's FP8 datasets against its bfloat16 dataset (the same samples
   through the same server), every dataset read back through
   ``hsx_async.dataset.HiddenStateDataset`` (bfloat16, the default: FP8 dequantized), which
   must equal ``quantize.assemble`` of the file's own tensors bit for bit (and its
   ``storage="raw"`` sections the file's): per layer slot, cosine and relative RMS error of
   the rows as read, ``quantize.rounding_error`` (estimated from the stored values alone)
   against the measured FP8 error, and the teacher's logits through the model's own
   ``lm_head``: KL(softmax(bf16) ‖ softmax(FP8)) and top-1 agreement with the final state
   quantized ("all") and kept ("aux", where the KL must be exactly 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import fp8_sinks
import numpy as np
import orjson
import torch
from common import (
    GB,
    PYTHON,
    Model,
    Scratch,
    ServerProcess,
    apply_common,
    client_config,
    common_args,
    fake_server_argv,
    lognormal_lengths,
    machine_info,
    print_table,
    pyplot,
    remove,
    run_hsx,
    save_results,
    scratch,
    self_cpu_s,
    usage_dict,
)
from safetensors import safe_open

from hsx_async.dataset.layout import build_layout, data_relpath, read_header, sample_key
from hsx_async.dataset.manifest import read_manifest
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    HIDDEN,
    META_NAME,
    OUTLIER_INDEX,
    OUTLIER_VALUES,
    PER_TOKEN_SLOT,
    PER_TOKEN_SLOT_OUTLIERS16,
    POST_NORM,
    PRE_NORM,
    SCALES,
    UNQUANTIZED,
    DumpMeta,
    Storage,
    generate_body,
    num_layers,
    parse_meta,
    part_name,
    row_bytes,
    storage_from_metadata,
)
from hsx_async.quantize import assemble, dequantize, encode_rows, rounding_error
from hsx_async.run.dumps import writer as writer_module
from hsx_async.run.dumps.dump import Dump, prepare_namespace, remove_tree, wait_for_meta
from hsx_async.run.dumps.writer import FileWriter, WriteJob
from hsx_async.run.source import Sample

STORAGES = ("bf16", "fp8-all", "fp8-aux")  # FP8: the default layout (outliers16)
# The writer phase also measures version 3's layout (one scale per vector alone).
WRITER_STORAGES = (*STORAGES, "fp8-all-v3")
OUTPUT_KEYS: dict[str, dict[str, str]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp8-all": {"dtype": "float8_e4m3fn", "quantize": "all"},
    "fp8-aux": {"dtype": "float8_e4m3fn", "quantize": "aux"},
    "fp8-all-v3": {"dtype": "float8_e4m3fn", "quantize": "all", "scales": PER_TOKEN_SLOT},
}
PHASES = ("e2e", "fallback", "writer", "sinks")
_URL = re.compile(rb"url=(http://\S+)")  # the reference server's reference_server.listening
MAX_PART_ROWS = 16384  # like chunked prefill: a part holds at most this many rows
_GEN_ROWS = 1024  # rows generated (and quantized) at once while building the writer's dumps


def storage_of(name: str, layers: int) -> Storage:
    """``[output]`` ``dtype``/``quantize``/``scales`` of ``name`` as the dataset's storage
    (``scales`` unset: the default, the outliers layout)."""
    keys = OUTPUT_KEYS[name]
    if keys["dtype"] == "bfloat16":
        return BF16_STORAGE
    slots = range(layers) if keys["quantize"] == "all" else range(layers - 1)
    return Storage(FP8, tuple(slots), keys.get("scales", PER_TOKEN_SLOT_OUTLIERS16))


@dataclass
class Ctx:
    args: argparse.Namespace
    s: Scratch
    dump_root: Path


# -- the model --------------------------------------------------------------------------------


@dataclass
class Teacher:
    model: Any  # a transformers causal LM, float32
    model_dir: Path | None  # None: the server builds the built-in model from --seed
    shape: Model  # hidden size and aux layers as the client's [model] section
    vocab: int
    gains: dict[str, float]  # the RMSNorm gains: min, max, mean over every norm's channels
    gains_set_here: bool  # the checkpoint had unit gains: U(0.2, 3) drawn by this bench


def norm_gains(model: Any) -> torch.Tensor:
    return torch.cat(
        [p.detach().float().flatten() for n, p in model.named_parameters()
         if "norm" in n and p.dim() == 1]
    )  # fmt: skip


def load_teacher(args: argparse.Namespace, work: Path) -> Teacher:
    from hsx_async.server.reference import model as rm  # transformers: seconds

    set_here = False
    model_dir: Path | None = None
    if args.model is None:
        model = rm.build_default_model(args.seed)  # gains U(0.2, 3) per channel already
    else:
        model = rm.load_model(str(args.model))
        model_dir = Path(args.model)
        if bool((norm_gains(model) == 1).all()):
            # Unit gains hide a pre-/post-norm mix-up and flatter the quantizer: give the
            # checkpoint realistic ones, as the real-SGLang tier does (save_default_model).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.seed)
                rm.set_realistic_norm_gains(model)
            model_dir = work / "model-realistic-gains"
            model.save_pretrained(model_dir, safe_serialization=True)
            set_here = True
    config = rm.text_config(model)
    aux = tuple(args.aux_layers or rm.default_aux_layers(config.num_hidden_layers))
    gains = norm_gains(model)
    return Teacher(
        model=model.float().eval(),
        model_dir=model_dir,
        shape=Model(hidden_size=config.hidden_size, aux_layers=aux),
        vocab=config.vocab_size,
        gains={"min": float(gains.min()), "max": float(gains.max()), "mean": float(gains.mean())},
        gains_set_here=set_here,
    )


def reference_server_argv(args: argparse.Namespace, teacher: Teacher, dump_root: Path) -> list[str]:
    argv = [
        PYTHON, "-m", "hsx_async", "reference-server", "--port", "0",
        "--dump-root", str(dump_root),
        "--aux-layers", ",".join(map(str, teacher.shape.aux_layers)),
        "--chunk-size", str(args.chunk_size),
        "--max-batch-tokens", str(args.max_batch_tokens),
        "--threads", str(args.server_threads),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if teacher.model_dir is not None:
        argv += ["--model", str(teacher.model_dir)]
    return argv


def write_token_samples(path: Path, lengths: Sequence[int], vocab: int, seed: int) -> None:
    """A JSONL input of random token ids the model knows (ids 0-2 are its specials)."""
    rng = np.random.default_rng(seed)
    with path.open("wb") as fh:
        for i, n in enumerate(lengths):
            ids = rng.integers(3, vocab, size=n, dtype=np.int64)
            line = orjson.dumps(
                {"id": f"f{i}", "input_ids": ids}, option=orjson.OPT_SERIALIZE_NUMPY
            )
            fh.write(line + b"\n")


def sample_lengths(n: int, mean: float, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu = float(np.log(mean)) - sigma * sigma / 2
    draws = rng.lognormal(mu, sigma, size=n)
    return [int(min(max_len, max(16, round(float(d))))) for d in draws]


# -- phase 1: end to end --------------------------------------------------------------------


def probe_dump(url: str, root: Path, storage: Storage, name: str, vocab: int) -> dict[str, Any]:
    """One request of our own asking for ``storage``: which storage did the hook dump?"""
    ns, rid, n = f"probe-{name}", "probe-0", 40
    ns_dir = prepare_namespace(root, ns)
    try:
        ids = [3 + i % (vocab - 3) for i in range(n)]
        body = orjson.dumps(generate_body(rid, ns, ids, storage))
        request = urllib.request.Request(
            f"{url}/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
        raw = asyncio.run(wait_for_meta(ns_dir / rid, 60.0))
        meta = parse_meta(raw)
        part_bytes = sum((ns_dir / rid / part_name(s, e)).stat().st_size for s, e in meta.parts)
    finally:
        remove_tree(ns_dir)
    dumped = meta.storage
    if not storage.is_fp8:
        where = "none (bfloat16)"
    elif dumped == storage:
        where = "server hook"
    else:
        where = "client writer (server dumped bfloat16)"
    return {
        "requested": storage.describe(),
        "dumped": dumped.describe(),
        "meta_protocol": orjson.loads(raw).get("protocol"),
        "quantized_in": where,
        "dump_bytes_per_token": part_bytes / n,
    }


def hidden_bytes(out_dir: Path) -> tuple[int, int]:
    """(bytes of the hidden sections, tokens) over a dataset's files, from their headers."""
    total = tokens = 0
    for entry in read_manifest(out_dir):
        header, _ = read_header(out_dir / entry.path)
        for name in (HIDDEN, SCALES, OUTLIER_INDEX, OUTLIER_VALUES, UNQUANTIZED):
            if name in header:
                start, end = header[name]["data_offsets"]
                total += end - start
        tokens += entry.num_tokens
    return total, tokens


def client_run(
    ctx: Ctx,
    srv: ServerProcess,
    *,
    model: Model,
    output: dict[str, str],
    tag: str,
    inp: Path,
    name: str,
    concurrency: int | None = None,
) -> tuple[dict[str, Any], Path]:
    """One ``hsx run`` process against ``srv``: its figures, and its output directory."""
    out = ctx.s.fresh(f"{tag}-out")
    raw = client_config(
        url=srv.url, samples=inp, out_dir=out, dump_root=ctx.dump_root, model=model,
        workers={"concurrency": concurrency or ctx.args.concurrency}, output=output,
    )  # fmt: skip
    os.sync()  # the previous run's writes are not flushed during this one
    cpu0 = srv.cpu_s()
    run = run_hsx(raw, ctx.s.work, tag)
    row = {
        "storage": name,
        "samples": run.done,
        "quarantined": run.quarantined,
        "tokens": run.tokens,
        "seconds": run.run_s,
        "bytes": run.bytes_on_disk,
        "cpu_s": run.usage.cpu_s,
        "server_cpu_s": srv.cpu_s() - cpu0,
        "peak_rss_mb": run.usage.peak_rss / 1e6,
        # Every thread but the event loop's: the copy threads (and torch's workers while
        # the writer quantizes), the directory syncs, the resolver.
        "other_threads_cpu_s": sum(
            t["user_s"] + t["sys_s"] for kind, t in run.usage.threads.items() if kind != "main"
        ),
        "usage": usage_dict(run.usage),
    }
    return row, out


def e2e_phase(ctx: Ctx, teacher: Teacher) -> dict[str, Any]:
    args = ctx.args
    lengths = sample_lengths(args.samples, args.mean_len, args.max_len, args.seed)
    samples = ctx.s.work / "samples.jsonl"
    write_token_samples(samples, lengths, teacher.vocab, args.seed)
    empty = ctx.s.work / "empty.jsonl"
    empty.write_bytes(b"")
    layers = teacher.shape.layers
    argv = reference_server_argv(args, teacher, ctx.dump_root)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in STORAGES}
    kept: dict[str, Path] = {}
    with ServerProcess(argv, ctx.s.work / "reference-server.log", listening=_URL) as srv:
        probes = {
            n: probe_dump(srv.url, ctx.dump_root, storage_of(n, layers), n, teacher.vocab)
            for n in STORAGES
        }
        for n, p in probes.items():
            print(
                f"  probe {n}: dumped {p['dumped']}; quantized in: {p['quantized_in']}", flush=True
            )

        def one(name: str, tag: str, inp: Path) -> tuple[dict[str, Any], Path]:
            return client_run(
                ctx,
                srv,
                model=teacher.shape,
                output=OUTPUT_KEYS[name],
                tag=tag,
                inp=inp,
                name=name,
            )

        idle, idle_out = one("bf16", "e2e-idle", empty)
        remove(idle_out)
        print(f"  no samples: {idle['cpu_s']:.2f} CPU s (start-up, subtracted)", flush=True)
        for r in range(args.rounds):
            order = STORAGES[r % 3 :] + STORAGES[: r % 3]
            for name in order:
                row, out = one(name, f"e2e-{name}-r{r}", samples)
                if row["samples"] != len(lengths):
                    raise RuntimeError(
                        f"{name}: {row['samples']} of {len(lengths)} samples written"
                    )
                row["round"] = r
                _derive(row, idle)
                runs[name].append(row)
                print(
                    f"  round {r} {name}: {row['samples_per_s']:.2f} samples/s, "
                    f"{row['bytes_per_token']:.0f} B/token, {row['cpu_s_per_gb_net']:.2f} CPU s/GB",
                    flush=True,
                )
                if name in kept:
                    remove(out)
                else:
                    kept[name] = out  # the first round's datasets: bytes per token
        # The quality datasets: concurrency 1, so that every pass holds one request's chunk
        # and each storage's run computes the same rows bit for bit (packed passes of
        # several requests sum in another order: a few float32 ulps, sometimes one bf16 ulp).
        few = ctx.s.work / "quality-samples.jsonl"
        write_token_samples(few, lengths[: args.quality_samples], teacher.vocab, args.seed)
        quality: dict[str, Path] = {}
        for name in STORAGES:
            out = ctx.s.fresh(f"quality-{name}-out")
            raw = client_config(
                url=srv.url, samples=few, out_dir=out, dump_root=ctx.dump_root,
                model=teacher.shape, workers={"concurrency": 1}, output=OUTPUT_KEYS[name],
            )  # fmt: skip
            run_hsx(raw, ctx.s.work, f"quality-{name}")
            quality[name] = out
    summary = e2e_summary(runs, kept, probes)
    for out in kept.values():
        remove(out)
    return {
        "lengths": {"samples": len(lengths), "tokens": sum(lengths),
                    "mean": float(np.mean(lengths)), "max": max(lengths)},
        "idle": idle,
        "probes": probes,
        "runs": runs,
        "summary": summary,
        "quality_datasets": {n: str(p) for n, p in quality.items()},
    }  # fmt: skip


def _derive(row: dict[str, Any], idle: dict[str, Any]) -> None:
    """A run's rates, its CPU net of the empty run's (the start-up)."""
    net = row["cpu_s"] - idle["cpu_s"]
    row["cpu_s_net"] = net
    row["samples_per_s"] = row["samples"] / row["seconds"]
    row["cpu_s_per_gb_net"] = net / (row["bytes"] / GB)
    row["cpu_ms_per_ktoken_net"] = net / row["tokens"] * 1e6
    row["bytes_per_token"] = row["bytes"] / row["tokens"]
    other = row["other_threads_cpu_s"] - idle["other_threads_cpu_s"]
    row["other_threads_ms_per_ktoken_net"] = other / row["tokens"] * 1e6


def _median_ratio(runs: dict[str, list[dict[str, Any]]], name: str, key: str) -> dict[str, float]:
    """The median (and range) of the per-round ratios ``name`` / bf16 of ``key``."""
    ratios = [
        row[key] / base[key]
        for row, base in zip(runs[name], runs["bf16"], strict=True)
        if base[key] > 0
    ]
    if not ratios:
        return {"median": 0.0, "min": 0.0, "max": 0.0}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def e2e_summary(
    runs: dict[str, list[dict[str, Any]]],
    kept: dict[str, Path],
    probes: dict[str, Any],
    names: Sequence[str] = STORAGES,
) -> dict[str, Any]:
    """Each run kind's medians and its per-round ratios to the ``bf16`` runs."""
    out: dict[str, Any] = {}
    base_hidden, base_tokens = hidden_bytes(kept["bf16"])
    for name in names:
        hidden, tokens = hidden_bytes(kept[name])
        rows = runs[name]
        out[name] = {
            "quantized_in": probes[name]["quantized_in"],
            "bytes_per_token": rows[0]["bytes_per_token"],
            "hidden_bytes_per_token": hidden / tokens,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "cpu_s_per_gb_net": statistics.median(r["cpu_s_per_gb_net"] for r in rows),
            "cpu_ms_per_ktoken_net": statistics.median(r["cpu_ms_per_ktoken_net"] for r in rows),
            "ratio_bytes": rows[0]["bytes"] / runs["bf16"][0]["bytes"],
            "ratio_hidden_bytes": (hidden / tokens) / (base_hidden / base_tokens),
            "ratio_samples_per_s": _median_ratio(runs, name, "samples_per_s"),
            "ratio_cpu_per_gb": _median_ratio(runs, name, "cpu_s_per_gb_net"),
            "ratio_cpu_per_token": _median_ratio(runs, name, "cpu_ms_per_ktoken_net"),
            "other_threads_ms_per_ktoken_net": statistics.median(
                r["other_threads_ms_per_ktoken_net"] for r in rows
            ),
            "ratio_other_threads_per_token": _median_ratio(
                runs, name, "other_threads_ms_per_ktoken_net"
            ),
        }
    return out


# -- phase 1b: the client's fallback, end to end ---------------------------------------------

# ``hsx fake-server`` as a hook older than protocol version 3, which never reads hsx_dtype
# and dumps bfloat16 (``FakeOptions.honour_storage=False``): the CLI has no flag for it,
# so the bench starts the same server through the same functions the CLI calls.
_OLD_HOOK_FAKE = """\
import argparse, dataclasses, sys
import uvloop
from hsx_async.cli import fake_server as fake_cli
from hsx_async.server.fake import server as fake
parser = argparse.ArgumentParser()
fake_cli.add_parser(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
options = dataclasses.replace(fake.options_from_args(args), honour_storage=False)
async def ready(url):
    print(f"old-hook fake-server listening on {url}", flush=True)
uvloop.run(fake.serve_until_signal(options, args.host, args.port, ready))
"""


class FallbackRun(NamedTuple):
    name: str
    storage: str  # the [output] keys (OUTPUT_KEYS)
    hook_quantizes: bool  # False: the old-hook fake server (dumps bf16; the client quantizes)


FALLBACK_RUNS = (
    FallbackRun("bf16", "bf16", True),
    FallbackRun("fp8-all hook", "fp8-all", True),
    FallbackRun("fp8-all fallback", "fp8-all", False),
    FallbackRun("fp8-aux hook", "fp8-aux", True),
    FallbackRun("fp8-aux fallback", "fp8-aux", False),
)


def manifest_hashes(out_dir: Path) -> set[tuple[str, str]]:
    return {(str(e.id), e.xxh3_64) for e in read_manifest(out_dir)}


def fallback_phase(ctx: Ctx, teacher: Teacher) -> dict[str, Any]:
    """The same samples through two ``hsx fake-server`` processes of the teacher's shape
    (no model: the client's side is all there is to time): one that quantizes in its hook
    as asked, one that dumps bfloat16 whatever the request asks (the fallback), in rounds
    whose order rotates. The reference server cannot play the old hook (it has no such
    option), so the fallback is measured against the hook path here, on the fake server."""
    args = ctx.args
    lengths = sample_lengths(args.samples, args.mean_len, args.max_len, args.seed)
    samples = ctx.s.work / "fallback-samples.jsonl"
    write_token_samples(samples, lengths, teacher.vocab, args.seed)
    empty = ctx.s.work / "empty.jsonl"
    empty.write_bytes(b"")
    model, layers = teacher.shape, teacher.shape.layers
    argv = fake_server_argv(model, ctx.dump_root)
    old_argv = [PYTHON, "-c", _OLD_HOOK_FAKE, *argv[3:]]  # from "fake-server" on
    names = [r.name for r in FALLBACK_RUNS]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    kept: dict[str, Path] = {}
    with (
        ServerProcess(argv, ctx.s.work / "fake-server.log") as hook_srv,
        ServerProcess(old_argv, ctx.s.work / "fake-server-old-hook.log") as old_srv,
    ):
        servers = {True: hook_srv, False: old_srv}
        probes = {}
        for i, fr in enumerate(FALLBACK_RUNS):
            srv = servers[fr.hook_quantizes]
            storage = storage_of(fr.storage, layers)
            probes[fr.name] = probe_dump(srv.url, ctx.dump_root, storage, f"fb{i}", teacher.vocab)
            print(f"  probe {fr.name}: quantized in: {probes[fr.name]['quantized_in']}", flush=True)
        idle, idle_out = client_run(
            ctx, hook_srv, model=model, output=OUTPUT_KEYS["bf16"], tag="fb-idle", inp=empty,
            name="bf16",
        )  # fmt: skip
        remove(idle_out)
        print(f"  no samples: {idle['cpu_s']:.2f} CPU s (start-up, subtracted)", flush=True)
        # The fallback's first quantize imports torch (the client imports it only then):
        # one 16-token sample through it, less the empty run, is that once-per-run cost.
        one_sample = ctx.s.work / "one-sample.jsonl"
        write_token_samples(one_sample, [16], teacher.vocab, args.seed)
        first, first_out = client_run(
            ctx, old_srv, model=model, output=OUTPUT_KEYS["fp8-all"], tag="fb-first",
            inp=one_sample, name="fp8-all fallback",
        )  # fmt: skip
        remove(first_out)
        import_cpu = first["cpu_s"] - idle["cpu_s"]
        print(f"  one sample, fallback: +{import_cpu:.2f} CPU s (torch's import)", flush=True)
        for r in range(args.rounds):
            k = r % len(FALLBACK_RUNS)
            for fr in FALLBACK_RUNS[k:] + FALLBACK_RUNS[:k]:
                srv = servers[fr.hook_quantizes]
                tag = f"fb-{fr.name.replace(' ', '-')}-r{r}"
                row, out = client_run(
                    ctx, srv, model=model, output=OUTPUT_KEYS[fr.storage], tag=tag,
                    inp=samples, name=fr.name,
                )  # fmt: skip
                if row["samples"] != len(lengths):
                    raise RuntimeError(
                        f"{fr.name}: {row['samples']} of {len(lengths)} samples written"
                    )
                row["round"] = r
                _derive(row, idle)
                runs[fr.name].append(row)
                print(
                    f"  round {r} {fr.name}: {row['samples_per_s']:.2f} samples/s, "
                    f"{row['cpu_ms_per_ktoken_net']:.2f} CPU ms/1k tokens",
                    flush=True,
                )
                if fr.name in kept:
                    remove(out)
                else:
                    kept[fr.name] = out
    identical = {
        st: manifest_hashes(kept[f"{st} hook"]) == manifest_hashes(kept[f"{st} fallback"])
        for st in ("fp8-all", "fp8-aux")
    }
    summary = e2e_summary(runs, kept, probes, names)
    for out in kept.values():
        remove(out)
    # The fallback's extra client CPU per token over the hook path's, round by round.
    extra = {
        st: statistics.median(
            f["cpu_ms_per_ktoken_net"] / h["cpu_ms_per_ktoken_net"]
            for f, h in zip(runs[f"{st} fallback"], runs[f"{st} hook"], strict=True)
        )
        for st in ("fp8-all", "fp8-aux")
    }
    # ... and net of torch's import too: the quantizing alone, per token.
    tokens = sum(lengths)
    extra_net = {
        st: statistics.median(
            (f["cpu_s_net"] - import_cpu) / h["cpu_s_net"]
            for f, h in zip(runs[f"{st} fallback"], runs[f"{st} hook"], strict=True)
        )
        for st in ("fp8-all", "fp8-aux")
    }
    return {
        "lengths": {"samples": len(lengths), "tokens": tokens},
        "first_fallback_sample": first,
        "torch_import_cpu_s": import_cpu,
        "fallback_over_hook_cpu_per_token": extra,
        "fallback_over_hook_cpu_per_token_net_of_import": extra_net,
        "idle": idle,
        "probes": probes,
        "runs": runs,
        "summary": summary,
        "hook_and_fallback_identical": identical,
    }


# -- phase 2: the writer alone ----------------------------------------------------------------


@dataclass
class WriterDumps:
    """One set of dumps per storage of the same rows, and the samples they belong to."""

    samples: list[Sample]
    dumps: dict[str, list[Dump]]  # storage name -> a dump per sample
    hidden: int
    aux: tuple[int, ...]


def _synthetic_rows(n: int, layers: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Rows shaped like a model's residual stream: per-channel gains U(0.2, 3), layers of
    growing magnitude, token norms spread log-normally and the first token 100× the rest."""
    gains = torch.empty(hidden).uniform_(0.2, 3.0, generator=gen)
    layer_scale = torch.tensor([4.0**k for k in range(layers)]).view(1, layers, 1)
    token = torch.exp(torch.randn(n, 1, 1, generator=gen) * 0.5)
    rows = torch.randn(n, layers, hidden, generator=gen) * gains * layer_scale * token
    return rows


def build_writer_dumps(ctx: Ctx, rng_seed: int) -> WriterDumps:
    args = ctx.args
    hidden, aux = args.writer_hidden, tuple(args.writer_aux)
    layers = num_layers(aux)
    per_row = row_bytes(hidden, aux)
    lengths = lognormal_lengths(
        args.writer_gb * GB, per_row, mean=args.writer_mean_len, max_len=32768, seed=rng_seed
    )
    gen = torch.Generator().manual_seed(rng_seed)
    rng = np.random.default_rng(rng_seed)
    samples: list[Sample] = []
    dumps: dict[str, list[Dump]] = {n: [] for n in WRITER_STORAGES}
    for i, n in enumerate(lengths):
        rid = f"w{i}"
        sid = f"writer-{i}"
        ids = rng.integers(0, 128_000, size=n, dtype=np.int64)
        samples.append(Sample(sid, i, ids, None))
        parts = tuple((s, min(n, s + MAX_PART_ROWS)) for s in range(0, n, MAX_PART_ROWS))
        dirs = {}
        for name in WRITER_STORAGES:
            d = ctx.dump_root / name / rid
            d.mkdir(parents=True)
            dirs[name] = d
        for start, end in parts:
            fds = {
                name: os.open(
                    d / part_name(start, end), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                )
                for name, d in dirs.items()
            }
            try:
                rows_in_part = end - start
                for row in range(0, rows_in_part, _GEN_ROWS):
                    m = min(_GEN_ROWS, rows_in_part - row)
                    block = _synthetic_rows(m, layers, hidden, gen).to(torch.bfloat16)
                    if start == 0 and row == 0:
                        block[0] *= 100  # the first token's outsized residual
                    for name, fd in fds.items():
                        _write_sections(fd, block, storage_of(name, layers), rows_in_part, row)
            finally:
                for fd in fds.values():
                    os.close(fd)
        for name, d in dirs.items():
            meta = DumpMeta(rid, n, hidden, aux, parts, "bench-model", "bench",
                            storage=storage_of(name, layers))  # fmt: skip
            (d / META_NAME).write_bytes(meta.to_json())
            dumps[name].append(Dump(d, meta))
    return WriterDumps(samples, dumps, hidden, aux)


def _write_sections(fd: int, block: torch.Tensor, storage: Storage, n: int, row: int) -> None:
    """Rows ``[row, row + m)`` of a part of ``n`` rows, each section at its place
    (PROTOCOL §3: a part holds its rows' sections back to back)."""
    section_start = 0
    for tensor in encode_rows(block, storage):
        per_row = tensor[0].numel() * tensor.element_size()
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        os.pwrite(fd, data, section_start + row * per_row)
        section_start += n * per_row


class WJob(NamedTuple):
    what: str
    dump: str  # the dump's storage
    target: str  # the dataset's storage
    # torch's threads for the fallback (writer.FALLBACK_TORCH_THREADS): 1, what the client
    # uses; 0, torch's default (one per core), for comparison.
    torch_threads: int = 1


WRITER_JOBS = (
    WJob("copy bf16 dump -> bf16 file", "bf16", "bf16"),
    WJob("copy FP8 dump -> FP8 file (all; hook quantized)", "fp8-all", "fp8-all"),
    WJob("quantize bf16 dump -> FP8 file (all; fallback)", "bf16", "fp8-all"),
    WJob("copy FP8 dump -> FP8 file (aux; hook quantized)", "fp8-aux", "fp8-aux"),
    WJob("quantize bf16 dump -> FP8 file (aux; fallback)", "bf16", "fp8-aux"),
    # Version 3's layout, one scale per vector alone: what the outliers cost the fallback.
    WJob("copy FP8 dump -> FP8 file (all, per_token_slot)", "fp8-all-v3", "fp8-all-v3"),
    WJob("quantize bf16 dump -> FP8 file (all, per_token_slot; fallback)", "bf16", "fp8-all-v3"),
    # Not what the client does: the fallback with torch's default threads, for comparison.
    WJob(
        "quantize bf16 dump -> FP8 file (all; fallback), torch's default threads",
        "bf16",
        "fp8-all",
        0,
    ),
)


def writer_job(ctx: Ctx, w: WriterDumps, job_kind: WJob) -> dict[str, Any]:
    what, dump_kind, target, threads = job_kind
    layers = num_layers(w.aux)
    storage = storage_of(target, layers)
    out = ctx.s.fresh("writer-out")
    fw = FileWriter(out, method="auto", fsync=True, row_bytes=row_bytes(w.hidden, w.aux))
    jobs = [
        WriteJob(
            sample,
            dump,
            build_layout(
                sample_id=sample.id,
                num_tokens=sample.num_tokens,
                hidden_size=w.hidden,
                aux_layers=w.aux,
                has_loss_mask=False,
                storage=storage,
            ),
            data_relpath(sample_key(sample.id)),
            "bench",
        )
        for sample, dump in zip(w.samples, w.dumps[dump_kind], strict=True)
    ]
    os.sync()
    default_threads, client_threads = torch.get_num_threads(), writer_module.FALLBACK_TORCH_THREADS
    writer_module.FALLBACK_TORCH_THREADS = threads
    try:
        cpu0, t0 = self_cpu_s(), time.monotonic()
        entries = []
        for job in jobs:
            staged = fw.stage(job)
            fw.publish([staged])
            entries.append(staged.entry)
        cpu, wall = self_cpu_s() - cpu0, time.monotonic() - t0
    finally:
        writer_module.FALLBACK_TORCH_THREADS = client_threads
        torch.set_num_threads(default_threads)
        fw.close()
        remove(out)
    written = sum(e.size for e in entries)
    tokens = sum(s.num_tokens for s in w.samples)
    bf16_gb = tokens * row_bytes(w.hidden, w.aux) / GB
    return {
        "what": what,
        "dump": dump_kind,
        "dataset": target,
        "direct": fw.direct,
        "tokens": tokens,
        "bytes": written,
        "cpu_s": cpu,
        "seconds": wall,
        "cpu_s_per_gb_written": cpu / (written / GB),
        "cpu_s_per_gb_bf16": cpu / bf16_gb,
        "gb_per_s_written": written / GB / wall,
        "digests": [e.xxh3_64 for e in entries],
    }


def writer_phase(ctx: Ctx) -> dict[str, Any]:
    default_threads = torch.get_num_threads()
    w = build_writer_dumps(ctx, ctx.args.seed + 1)
    tokens = sum(s.num_tokens for s in w.samples)
    print(f"  writer: {len(w.samples)} samples, {tokens:,} tokens, hidden {w.hidden}", flush=True)
    rounds: list[list[dict[str, Any]]] = []
    try:
        for r in range(ctx.args.writer_rounds):
            k = r % len(WRITER_JOBS)
            rows = {}
            for job in WRITER_JOBS[k:] + WRITER_JOBS[:k]:
                rows[job.what] = row = writer_job(ctx, w, job)
                print(f"  round {r} {job.what}: {row['cpu_s_per_gb_bf16']:.2f} CPU s per "
                      "bf16 GB", flush=True)  # fmt: skip
            rounds.append([rows[job.what] for job in WRITER_JOBS])
    finally:
        for name in WRITER_STORAGES:
            remove(ctx.dump_root / name)
    identical = {
        target: all(
            rnd[i]["digests"] == rnd[j]["digests"]
            for rnd in rounds
            for i, (_, d1, t1, _) in enumerate(WRITER_JOBS)
            for j, (_, d2, t2, _) in enumerate(WRITER_JOBS)
            if t1 == t2 == target and d1 != d2
        )
        for target in ("fp8-all", "fp8-aux", "fp8-all-v3")
    }
    summary = []
    for i, (what, dump_kind, target, threads) in enumerate(WRITER_JOBS):
        per_round = [rnd[i] for rnd in rounds]
        base = [rnd[0] for rnd in rounds]
        summary.append({
            "what": what, "dump": dump_kind, "dataset": target,
            "torch_threads": threads or default_threads, "direct": per_round[0]["direct"],
            "gb_written": per_round[0]["bytes"] / GB,
            "cpu_s_per_gb_written": statistics.median(p["cpu_s_per_gb_written"] for p in per_round),
            "cpu_s_per_gb_bf16": statistics.median(p["cpu_s_per_gb_bf16"] for p in per_round),
            "gb_per_s_written": statistics.median(p["gb_per_s_written"] for p in per_round),
            "ratio_cpu_per_token": statistics.median(
                p["cpu_s_per_gb_bf16"] / b["cpu_s_per_gb_bf16"]
                for p, b in zip(per_round, base, strict=True)
            ),
            "ratio_cpu_per_gb_written": statistics.median(
                p["cpu_s_per_gb_written"] / b["cpu_s_per_gb_written"]
                for p, b in zip(per_round, base, strict=True)
            ),
        })  # fmt: skip
    for rnd in rounds:
        for row in rnd:
            row.pop("digests")
    return {
        "hidden_size": w.hidden,
        "aux_layers": list(w.aux),
        "samples": len(w.samples),
        "tokens": tokens,
        "bf16_gb": tokens * row_bytes(w.hidden, w.aux) / GB,
        "torch_threads": torch.get_num_threads(),
        "rounds": rounds,
        "summary": summary,
        "hook_and_fallback_identical": identical,
    }


# -- phase 3: quality -------------------------------------------------------------------------


@dataclass
class Stored:
    """A dataset file's hidden sections as stored, and its hidden states as read back."""

    hidden: torch.Tensor  # [T, L, H] bfloat16, as the reader (or quantize.assemble) yields
    q: torch.Tensor | None  # e4m3fn [T, Lq, H]
    scales: torch.Tensor | None  # f32 [T, Lq, 1]
    storage: Storage
    final_state: str
    outlier_index: torch.Tensor | None = None  # the outliers layout: u16 [T, Lq, 16]
    outlier_values: torch.Tensor | None = None  # bf16 [T, Lq, 16]


def read_stored(path: Path) -> Stored:
    """The file's own tensors, and ``quantize.assemble`` of them: the direct way."""
    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata() or {})
        names = set(handle.keys())
        storage = storage_from_metadata(meta, str(path))
        final_state = meta.get("final_state", POST_NORM)
        if not storage.is_fp8:
            return Stored(handle.get_tensor(HIDDEN), None, None, storage, final_state)
        q, scales = handle.get_tensor(HIDDEN), handle.get_tensor(SCALES)
        unq = handle.get_tensor(UNQUANTIZED) if UNQUANTIZED in names else None
        index = handle.get_tensor(OUTLIER_INDEX) if OUTLIER_INDEX in names else None
        values = handle.get_tensor(OUTLIER_VALUES) if OUTLIER_VALUES in names else None
    hidden = assemble(q, scales, unq, storage, torch.bfloat16, outlier_index=index,
                      outlier_values=values)  # fmt: skip
    return Stored(hidden, q, scales, storage, final_state, index, values)


class ReadBack(NamedTuple):
    """A dataset as ``hsx_async.dataset.HiddenStateDataset`` yields it, sample by sample."""

    hidden: dict[str, torch.Tensor]  # [T, L, H] bfloat16 (the default, storage="bf16")
    raw: dict[str, dict[str, torch.Tensor]]  # storage="raw": the sections as stored
    storage: Storage


def read_back(out_dir: Path) -> ReadBack:
    from hsx_async.dataset import HiddenStateDataset

    fields = ("hidden_states", "aux_hidden_states")
    ds = HiddenStateDataset(out_dir, fields=fields)
    raw_ds = HiddenStateDataset(out_dir, fields=fields, storage="raw")
    hidden, raw = {}, {}
    for i, sid in enumerate(ds.ids):
        sample = ds[i]
        final, aux = sample["hidden_states"], sample["aux_hidden_states"]
        t, h = final.shape
        hidden[str(sid)] = torch.cat([aux.reshape(t, -1, h), final[:, None, :]], dim=1)
        raw[str(sid)] = dict(raw_ds[i])
    return ReadBack(hidden, raw, ds.storage)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0)


class _Errors:
    """Per layer slot and per token, what one FP8 dataset's rows differ from bf16's."""

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher
        self.lm_head = teacher.model.get_output_embeddings()
        self.final_norm = teacher.model.base_model.norm
        layers = teacher.shape.layers
        self.cos: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.rel: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.rel32: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.est: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.kl: list[torch.Tensor] = []
        self.top1: list[torch.Tensor] = []
        self.top_p: list[torch.Tensor] = []
        self.final_same: list[torch.Tensor] = []

    def add(self, ref: Stored, got: Stored, hidden: torch.Tensor) -> None:
        """``hidden``: ``got``'s rows as the reader yields them (bfloat16)."""
        x, xh = ref.hidden.double(), hidden.double()
        norm = x.norm(dim=-1)
        cos = (x * xh).sum(-1) / (norm * xh.norm(dim=-1)).clamp_min(1e-300)
        rel = (xh - x).norm(dim=-1) / norm.clamp_min(1e-300)
        for k in range(x.shape[1]):
            self.cos[k].append(cos[:, k])
            self.rel[k].append(rel[:, k])
        if got.q is None or got.scales is None:
            raise RuntimeError("an FP8 dataset file holds no FP8 section")
        # The FP8 error alone (dequantized in float32, no bf16 rounding after it), against
        # what rounding_error estimates from the stored values.
        outliers = (got.outlier_index, got.outlier_values)
        deq = dequantize(got.q, got.scales, torch.float32, *outliers).double()
        estimated = rounding_error(got.q, got.scales, *outliers).double()
        for j, slot in enumerate(got.storage.quantized):
            err = (deq[:, j] - x[:, slot]).norm(dim=-1) / norm[:, slot].clamp_min(1e-300)
            self.rel32[slot].append(err)
            self.est[slot].append(estimated[:, j])
        f_ref, f_got = ref.hidden[:, -1], hidden[:, -1]
        self.final_same.append(f_ref.view(torch.int16).eq(f_got.view(torch.int16)).all(dim=-1))
        with torch.inference_mode():
            a, b = f_ref.float(), f_got.float()
            if got.final_state == PRE_NORM:  # the LM head reads the normed state
                a, b = self.final_norm(a), self.final_norm(b)
            lp = torch.log_softmax(self.lm_head(a).double(), dim=-1)
            lq = torch.log_softmax(self.lm_head(b).double(), dim=-1)
        self.kl.append((lp.exp() * (lp - lq)).sum(-1))
        self.top1.append(lp.argmax(-1) == lq.argmax(-1))
        self.top_p.append(lp.max(-1).values.exp())

    def slots(self, storage: Storage) -> list[dict[str, Any]]:
        out = []
        aux = self.teacher.shape.aux_layers
        for k in range(len(self.cos)):
            c, r = _cat(self.cos[k]), _cat(self.rel[k])
            e, m = _cat(self.est[k]), _cat(self.rel32[k])
            q = k in storage.quantized
            out.append({
                "slot": k,
                "layer": "final" if k == len(aux) else f"aux {aux[k]}",
                "quantized": q,
                "cos_mean": float(c.mean()), "cos_min": float(c.min()),
                "rel_rms_mean": float(r.mean()), "rel_rms_max": float(r.max()),
                "fp8_rel_rms_mean": float(m.mean()) if q else 0.0,
                "estimated_rel_rms_mean": float(e.mean()) if q else 0.0,
                "estimated_over_measured": float(e.mean() / m.mean()) if q else 0.0,
                "estimate_corr": (
                    float(torch.corrcoef(torch.stack([e, m]))[0, 1]) if q and e.numel() > 1
                    else 0.0
                ),
            })  # fmt: skip
        return out

    def logits(self) -> dict[str, Any]:
        kl, top1, same = _cat(self.kl), _cat(self.top1), _cat(self.final_same)
        return {
            "tokens": int(kl.numel()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "kl_exactly_zero": bool((kl == 0).all()),
            "top1_agreement": float(top1.double().mean()),
            "teacher_top1_prob_mean": float(_cat(self.top_p).mean()),
            "final_rows_bit_identical": float(same.double().mean()),
        }


def quality_phase(datasets: dict[str, Path], teacher: Teacher) -> dict[str, Any]:
    """Every dataset read back through ``HiddenStateDataset`` (bfloat16, the default: an
    FP8 file dequantized); cross-checked against ``quantize.assemble`` of the file's own
    tensors (safetensors) and, with ``storage="raw"``, against the sections as stored."""
    base = read_back(datasets["bf16"])
    results: dict[str, Any] = {}
    for name in ("fp8-all", "fp8-aux"):
        out_dir = datasets[name]
        back = read_back(out_dir)
        errors = _Errors(teacher)
        equal_assemble = equal_raw = True
        final_state = ""
        for entry in read_manifest(out_dir):
            sid = str(entry.id)
            direct = read_stored(out_dir / entry.path)  # safetensors + quantize.assemble
            final_state = direct.final_state
            raw = back.raw[sid]
            equal_assemble &= _bits_equal(back.hidden[sid], direct.hidden)
            if direct.q is None or direct.scales is None:
                raise RuntimeError(f"{out_dir / entry.path} holds no FP8 section")
            equal_raw &= _bits_equal(raw[HIDDEN], direct.q)
            equal_raw &= _bits_equal(raw[SCALES], direct.scales)
            if direct.outlier_index is not None and direct.outlier_values is not None:
                equal_raw &= _bits_equal(raw[OUTLIER_INDEX], direct.outlier_index)
                equal_raw &= _bits_equal(raw[OUTLIER_VALUES], direct.outlier_values)
            kept = direct.storage.kept(teacher.shape.layers)
            if kept:  # the kept slots, as stored and as assemble placed them
                equal_raw &= _bits_equal(raw[UNQUANTIZED], direct.hidden[:, list(kept)])
            got = Stored(back.hidden[sid], raw[HIDDEN], raw[SCALES], back.storage, final_state,
                         raw.get(OUTLIER_INDEX), raw.get(OUTLIER_VALUES))  # fmt: skip
            ref = Stored(base.hidden[sid], None, None, base.storage, final_state)
            errors.add(ref, got, back.hidden[sid])
        results[name] = {
            "storage": back.storage.describe(),
            "final_state": final_state,
            "read_via": "hsx_async.dataset.HiddenStateDataset (bf16; raw for the FP8 error)",
            "reader_equals_assemble": equal_assemble,
            "raw_equals_file": equal_raw,
            "slots": errors.slots(back.storage),
        } | errors.logits()  # fmt: skip
    return results


# -- report ---------------------------------------------------------------------------------


def _e2e_tables(data: dict[str, Any]) -> list[str]:
    tables = []
    e2e, t = data["e2e"], data["teacher"]
    rows: list[list[Any]] = []
    for name in STORAGES:
        s = e2e["summary"][name]
        rows.append([
            name, s["quantized_in"], s["bytes_per_token"], s["ratio_bytes"],
            s["hidden_bytes_per_token"], s["ratio_hidden_bytes"],
            s["samples_per_s"], s["ratio_samples_per_s"]["median"],
            s["cpu_s_per_gb_net"], s["ratio_cpu_per_gb"]["median"],
            s["cpu_ms_per_ktoken_net"], s["ratio_cpu_per_token"]["median"],
            s["other_threads_ms_per_ktoken_net"], s["ratio_other_threads_per_token"]["median"],
        ])  # fmt: skip
    lengths = e2e["lengths"]
    tables.append(print_table(
        f"End to end through hsx reference-server (H {t['hidden_size']}, aux {t['aux_layers']}, "
        f"norm gains {t['gains']['min']:.2f}-{t['gains']['max']:.2f}): {lengths['samples']} "
        f"samples, {lengths['tokens']:,} tokens, {data['settings']['rounds']} rounds; "
        "ratios to bf16 (median of per-round ratios)",
        ["storage", "quantized in", "file B/token", "ratio", "hidden B/token", "ratio",
         "samples/s", "ratio", "client CPU s/GB written", "ratio", "client CPU ms/1k tokens",
         "ratio", "of which off the event loop", "ratio"],
        rows,
    ))  # fmt: skip
    return tables


def _fallback_tables(data: dict[str, Any]) -> list[str]:
    tables = []
    t = data["teacher"]
    fb = data["fallback_e2e"]
    frows: list[list[Any]] = []
    for fr in FALLBACK_RUNS:
        s = fb["summary"][fr.name]
        frows.append([
            fr.name, s["quantized_in"], s["hidden_bytes_per_token"], s["ratio_hidden_bytes"],
            s["samples_per_s"], s["ratio_samples_per_s"]["median"],
            s["cpu_ms_per_ktoken_net"], s["ratio_cpu_per_token"]["median"],
            s["other_threads_ms_per_ktoken_net"], s["ratio_other_threads_per_token"]["median"],
            s["cpu_s_per_gb_net"], s["ratio_cpu_per_gb"]["median"],
            statistics.median(r["server_cpu_s"] for r in fb["runs"][fr.name]),
            statistics.median(r["peak_rss_mb"] for r in fb["runs"][fr.name]),
        ])  # fmt: skip
    net = {k: round(v, 2) for k, v in fb["fallback_over_hook_cpu_per_token_net_of_import"].items()}
    tables.append(print_table(
        f"End to end through hsx fake-server (no model; H {t['hidden_size']}, aux "
        f"{t['aux_layers']}; the same {fb['lengths']['samples']} samples, "
        f"{data['settings']['rounds']} rounds): a hook that quantizes vs one that dumps bf16 "
        f"(the client's fallback); fallback / hook client CPU per token: "
        f"{ {k: round(v, 2) for k, v in fb['fallback_over_hook_cpu_per_token'].items()} }, "
        f"net of torch's import ({fb['torch_import_cpu_s']:.2f} CPU s, once a run): {net}; "
        f"byte-identical datasets: {fb['hook_and_fallback_identical']}",
        ["run", "quantized in", "hidden B/token", "ratio", "samples/s", "ratio",
         "client CPU ms/1k tokens", "ratio", "of which off the event loop", "ratio",
         "client CPU s/GB written", "ratio", "server CPU s", "client peak RSS MB"],
        frows,
    ))  # fmt: skip
    return tables


def _writer_tables(data: dict[str, Any]) -> list[str]:
    tables = []
    w = data["writer"]
    tables.append(print_table(
        f"The writer alone (FileWriter, fsync, this process; torch's default: "
        f"{w['torch_threads']} threads): H {w['hidden_size']}, aux {w['aux_layers']}, "
        f"{w['samples']} samples, "
        f"{w['bf16_gb']:.2f} GB as bf16, median of {len(w['rounds'])} rounds; byte-identical "
        f"hook/fallback files: {w['hook_and_fallback_identical']}",
        ["job", "torch threads", "O_DIRECT", "GB written", "CPU s/GB written", "ratio",
         "CPU s per bf16 GB", "ratio", "GB/s written"],
        [[s["what"], s["torch_threads"], s["direct"], s["gb_written"], s["cpu_s_per_gb_written"],
          s["ratio_cpu_per_gb_written"], s["cpu_s_per_gb_bf16"], s["ratio_cpu_per_token"],
          s["gb_per_s_written"]] for s in w["summary"]],
    ))  # fmt: skip
    return tables


def _quality_tables(data: dict[str, Any]) -> list[str]:
    tables = []
    q = data["quality"]
    qrows: list[list[Any]] = []
    for name in ("fp8-all", "fp8-aux"):
        for s in q[name]["slots"]:
            qrows.append([
                name, s["layer"], s["quantized"], f"{s['cos_mean']:.6f}", f"{s['cos_min']:.6f}",
                f"{s['rel_rms_mean']:.4f}", f"{s['rel_rms_max']:.4f}",
                f"{s['fp8_rel_rms_mean']:.4f}", f"{s['estimated_rel_rms_mean']:.4f}",
                s["estimated_over_measured"], s["estimate_corr"],
            ])  # fmt: skip
    tables.append(print_table(
        f"Quality against the bf16 dataset of the same samples (read via: "
        f"{q['fp8-all']['read_via']}); per token vector of each layer slot",
        ["dataset", "slot", "quantized", "cos mean", "cos min", "rel RMS mean (as read, bf16)",
         "rel RMS max", "FP8 rel RMS mean (f32)", "estimated (rounding_error)",
         "estimated / measured", "corr"],
        qrows,
    ))  # fmt: skip
    tables.append(print_table(
        "The teacher's logits: the model's lm_head on the final state "
        f"({q['fp8-all']['final_state']})",
        ["dataset", "final state", "tokens", "KL(bf16 || fp8) mean", "KL max", "exactly 0",
         "top-1 agreement", "teacher's top-1 p (mean)", "final rows bit-identical to bf16"],
        [[n, "quantized" if n == "fp8-all" else "kept (bf16)", q[n]["tokens"],
          f"{q[n]['kl_mean']:.3e}", f"{q[n]['kl_max']:.3e}", q[n]["kl_exactly_zero"],
          f"{q[n]['top1_agreement']:.4f}", f"{q[n]['teacher_top1_prob_mean']:.4f}",
          f"{q[n]['final_rows_bit_identical']:.4f}"]
         for n in ("fp8-all", "fp8-aux")],
    ))  # fmt: skip
    return tables


def report(data: dict[str, Any]) -> list[str]:
    """The tables of the phases that ran."""
    tables = []
    for key, tables_of in (
        ("e2e", _e2e_tables),
        ("fallback_e2e", _fallback_tables),
        ("writer", _writer_tables),
        ("quality", _quality_tables),
    ):
        if key in data:
            tables += tables_of(data)
    if "sinks" in data:
        tables += fp8_sinks.report(data["sinks"], print_table)
    return tables


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax4, ax2, ax3) = plt.subplots(1, 4, figsize=(21, 4.5))
    e2e = data["e2e"]["summary"]
    keys = [
        ("ratio_bytes", "file bytes"),
        ("ratio_samples_per_s", "samples/s"),
        ("ratio_cpu_per_gb", "CPU/GB written"),
        ("ratio_cpu_per_token", "CPU/token"),
    ]
    width = 0.25
    for i, name in enumerate(STORAGES):
        vals = [e2e[name][k] if k == "ratio_bytes" else e2e[name][k]["median"] for k, _ in keys]
        ax1.bar([j + i * width for j in range(len(keys))], vals, width, label=name)
    ax1.set_xticks([j + width for j in range(len(keys))], [label for _, label in keys])
    ax1.axhline(1, color="grey", linewidth=0.8)
    ax1.set_title("reference server (hook quantizes), ratio to bf16")
    ax1.legend()
    fb = data["fallback_e2e"]["summary"]
    fb_names = [fr.name for fr in FALLBACK_RUNS]
    ax4.bar(fb_names, [fb[n]["ratio_cpu_per_token"]["median"] for n in fb_names])
    ax4.axhline(1, color="grey", linewidth=0.8)
    ax4.tick_params(axis="x", labelrotation=20)
    ax4.set_title("fake server: client CPU per token, ratio to bf16")
    w = data["writer"]["summary"]
    ax2.barh([s["what"] for s in w], [s["cpu_s_per_gb_bf16"] for s in w])
    ax2.invert_yaxis()
    ax2.set_xlabel("writer CPU s per GB of bf16 hidden states")
    q = data["quality"]
    for name in ("fp8-all", "fp8-aux"):
        slots = q[name]["slots"]
        ax3.plot([s["layer"] for s in slots], [s["rel_rms_mean"] for s in slots], "o-", label=name)
    ax3.set_ylabel("mean relative RMS error")
    ax3.legend()
    m = data["machine"]
    fig.suptitle(f"FP8 storage vs bf16 — {m['cores']} cores, {m['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    common_args(p)
    add = p.add_argument
    add(
        "--model",
        type=Path,
        help="a local Hugging Face model dir (default: the built-in tiny Llama)",
    )
    add("--seed", type=int, default=0, help="the built-in model's weights, the samples")
    add("--aux-layers", type=int, nargs="+", help="default: the server's default for the model")
    add("--samples", type=int, default=320, help="samples of each end-to-end run")
    add("--mean-len", type=float, default=300.0, help="mean prompt length (log-normal)")
    add("--max-len", type=int, default=2048)
    add("--rounds", type=int, default=3, help="end-to-end rounds (bf16, all, aux each)")
    add("--quality-samples", type=int, default=64, help="samples of the quality runs")
    add("--concurrency", type=int, default=8, help="[workers].concurrency of each run")
    add("--chunk-size", type=int, default=256, help="the reference server's chunk size")
    add("--max-batch-tokens", type=int, default=1024, help="the reference server's pass size")
    add("--server-threads", type=int, default=1, help="the reference server's torch threads")
    add("--writer-gb", type=float, default=1.0, help="GB of bf16 hidden states, writer phase")
    add("--writer-hidden", type=int, default=7168)
    add("--writer-aux", type=int, nargs="+", default=[2, 30, 58])
    add("--writer-mean-len", type=float, default=2350.0)
    add("--writer-rounds", type=int, default=3)
    add("--sink-rows", type=int, default=1024, help="Kimi-shaped tokens of the sinks phase")
    add("--sink-samples", type=int, default=32, help="prompts of the sinks phase's forward")
    add("--sink-mean-len", type=float, default=256.0)
    add("--phases", nargs="+", choices=PHASES, default=list(PHASES),
        help="the phases to run (default: all; e2e includes quality)")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.mean_len, args.max_len, args.rounds = 4, 40.0, 96, 1
        args.quality_samples = 3
        args.writer_gb, args.writer_hidden, args.writer_aux = 0.004, 512, [1, 2, 3]
        args.writer_mean_len, args.writer_rounds = 300.0, 1
        args.sink_rows, args.sink_samples, args.sink_mean_len = 8, 2, 48.0
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    apply_common(args)
    with scratch(args, "fp8") as s:
        ctx = Ctx(args, s, s.shm / "dumps")
        teacher = load_teacher(args, s.work)
        data: dict[str, Any] = {
            "machine": machine_info(args.out_dir, args.shm_dir),
            "smoke": args.smoke,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "teacher": {
                "model": str(args.model)
                if args.model
                else f"built-in tiny Llama, seed {args.seed}",
                "hidden_size": teacher.shape.hidden_size,
                "aux_layers": list(teacher.shape.aux_layers),
                "vocab": teacher.vocab,
                "gains": teacher.gains,
                "gains_set_by_bench": teacher.gains_set_here,
            },
        }
        run_phases(ctx, teacher, data)
    tables = report(data)
    path = save_results(args.results_dir, "fp8", data, tables)
    if all(k in data for k in ("e2e", "fallback_e2e", "writer", "quality")):
        plot(data, path.with_suffix(".png"))
    return 0


def run_phases(ctx: Ctx, teacher: Teacher, data: dict[str, Any]) -> None:
    phases = ctx.args.phases
    if "e2e" in phases:
        print("phase 1: end to end", flush=True)
        data["e2e"] = e2e_phase(ctx, teacher)
        print("phase 3: quality", flush=True)
        datasets = {n: Path(p) for n, p in data["e2e"]["quality_datasets"].items()}
        data["quality"] = quality_phase(datasets, teacher)
        for out in datasets.values():
            remove(out)
    if "fallback" in phases:
        print("phase 1b: end to end, the hook's FP8 vs the client's fallback", flush=True)
        data["fallback_e2e"] = fallback_phase(ctx, teacher)
    if "writer" in phases:
        print("phase 2: the writer alone", flush=True)
        data["writer"] = writer_phase(ctx)
    if "sinks" in phases:
        print("phase 4: attention sinks (non-outlier values, the teacher's KL)", flush=True)
        data["sinks"] = fp8_sinks.phase(ctx.args, teacher.model, teacher.shape.aux_layers)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
