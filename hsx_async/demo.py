"""``hsx demo``: a real extraction with no GPU and no configuration.

Starts the reference server (a small seeded Llama on the CPU) in this process, extracts the
sample set shipped with the package through the full pipeline (HTTP, /dev/shm dumps,
durable dataset), and says where the dataset is and what it holds (the handler,
:mod:`hsx_async.cli.handlers.demo`, prints it).
"""

from __future__ import annotations

import importlib.resources
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsx_async.config import Config, config_from_dict
from hsx_async.dataset.inspection import verify_dataset
from hsx_async.protocol import DEFAULT_DUMP_ROOT
from hsx_async.run.daemon.daemon import Daemon, RunSummary
from hsx_async.units import human_bytes


def demo_samples() -> Path:
    return Path(str(importlib.resources.files("hsx_async.data") / "demo_samples.jsonl"))


def demo_config(
    out: Path,
    *,
    url: str,
    hidden_size: int,
    aux_layers: tuple[int, ...],
    dump_root: Path,
    samples: Path,
) -> Config:
    raw: dict[str, Any] = {
        "server": {"urls": [url], "unreachable_timeout": 60.0},
        "input": {"path": str(samples), "max_tokens": 4096},
        "output": {"dir": str(out), "disk_reserve": "100MiB"},
        "dump": {"root": str(dump_root), "shm_budget": "256MiB"},
        "model": {"hidden_size": hidden_size, "aux_layers": list(aux_layers)},
        "workers": {"concurrency": 8},
        "daemon": {"metrics_listen": "", "log_level": "warning", "progress_interval": 5.0},
    }
    return config_from_dict(raw, base=out)


def _quiet(_: str) -> None:
    pass


async def run_demo(
    out: Path, samples: Path, say: Callable[[str], None] = _quiet
) -> tuple[RunSummary, Config]:
    """``say`` hears each step as it starts (the CLI prints them)."""
    say("loading torch and the reference model (a seeded tiny Llama, on the CPU) …")
    # Imported after the line above is shown: torch and the model take seconds to load.
    from hsx_async.server.reference.server import ReferenceOptions, running_reference_server  # noqa: PLC0415

    dump_root = Path(DEFAULT_DUMP_ROOT).parent / f"hsx-demo-{secrets.token_hex(4)}"
    started = time.monotonic()
    try:
        say("starting the reference server on 127.0.0.1 …")
        async with running_reference_server(
            ReferenceOptions(dump_root=dump_root, threads=2)
        ) as srv:
            say(
                f"server ready at {srv.url} after {time.monotonic() - started:.1f} s; "
                f"extracting {samples.name} (hidden states to {dump_root}, then to disk) …"
            )
            config = demo_config(
                out,
                url=srv.url,
                hidden_size=srv.hidden_size,
                aux_layers=srv.aux_layers,
                dump_root=dump_root,
                samples=samples,
            )
            summary = await Daemon(config).run()
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
    return summary, config


def describe(summary: RunSummary, config: Config) -> str:
    out = config.output.dir
    verify = verify_dataset(out)
    first = next(iter(sorted((out / "data").rglob("*.safetensors"))), None)
    lines = [
        "",
        f"dataset:   {out}",
        f"samples:   {summary.done} written now, {summary.skipped} already there, "
        f"{summary.quarantined} quarantined",
        f"tokens:    {summary.tokens:,}   bytes: {human_bytes(summary.bytes)}",
        f"rate:      {summary.tokens / max(summary.seconds, 1e-9):,.0f} tokens/s in "
        f"{summary.seconds:.1f} s (a CPU model: the pipeline itself is benchmarked in bench/)",
        f"layers:    aux {list(config.model.aux_layers)} + final, "
        f"hidden size {config.model.hidden_size}",
        f"verify:    {'OK' if verify.ok else 'FAILED'} ({verify.checked} files re-hashed)",
    ]
    if first is not None:
        lines.append(f"look:      {hsx_invocation()} inspect {first}")
    hsx = hsx_invocation()
    lines.append(f"next:      {hsx} status {out}  ·  {hsx} verify {out} --deep")
    activate = Path(hsx).parent / "activate"
    if hsx != "hsx" and activate.is_file():
        lines.append(f"           (`. {activate}` puts hsx on your PATH)")
    return "\n".join(lines)


def hsx_invocation() -> str:
    """How to call hsx from this shell: ``hsx`` when that is the one on PATH, else the
    path of the running entry point (``.venv/bin/hsx`` before the venv is activated)."""
    me = Path(sys.argv[0])
    if me.name != "hsx":
        return f"{Path(sys.executable)} -m hsx_async"
    found = shutil.which("hsx")
    if found is not None and Path(found).resolve() == me.resolve():
        return "hsx"
    return str(me)
