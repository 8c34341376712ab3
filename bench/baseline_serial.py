"""The one-request-at-a-time baseline: "clear, send, scan", as the job was first planned.

For each sample in turn: clear the dump directory, send the request and wait for the
answer, scan the directory for the dump that appeared, wait for its ``meta.json``, copy
its parts into one file on the disk and fsync it; then the next sample. A faithful,
simplified version of the original script, which found its dump by scanning the dump
directory rather than by name. It speaks PROTOCOL v1 (one namespace, a fresh rid per
sample) so that it runs against the same fake server as hsx; it writes the hidden states
only (no safetensors header, no hash, no manifest), so it does less work than hsx.

    python bench/baseline_serial.py --url http://127.0.0.1:30000 --input samples.jsonl \\
        --out /var/tmp/serial-out --dump-root /dev/shm/hsx

Prints one JSON line: samples, tokens, bytes and seconds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

COPY_BUFFER = 8 << 20


def clear(ns_dir: Path) -> None:
    shutil.rmtree(ns_dir, ignore_errors=True)
    ns_dir.mkdir(parents=True)


def send(conn: http.client.HTTPConnection, rid: str, ns: str, input_ids: list[int]) -> None:
    body = json.dumps(
        {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0, "custom_params": {"hsx_ns": ns}},
            "stream": False,
        }
    )
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {payload[:200]!r}")


def scan(ns_dir: Path, timeout: float = 120.0) -> Path:
    """The one dump directory that appeared, once its meta.json is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.scandir(ns_dir):
            if entry.is_dir() and (Path(entry.path) / "meta.json").exists():
                return Path(entry.path)
        time.sleep(0.001)  # the original polled the directory
    raise RuntimeError(f"no dump appeared in {ns_dir}")


def copy(dump: Path, dest: Path) -> int:
    meta = json.loads((dump / "meta.json").read_bytes())
    written = 0
    with dest.open("wb") as out:
        for start, end in meta["parts"]:
            with (dump / f"part-{start:010d}-{end:010d}.bin").open("rb") as part:
                shutil.copyfileobj(part, out, COPY_BUFFER)
        out.flush()
        os.fsync(out.fileno())
        written = out.tell()
    return written


def run(args: argparse.Namespace) -> dict[str, float]:
    url = urllib.parse.urlsplit(args.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=600)
    ns_dir = Path(args.dump_root) / args.ns
    args.out.mkdir(parents=True, exist_ok=True)
    samples = tokens = written = 0
    started = time.monotonic()
    with Path(args.input).open("rb") as fh:
        for line_no, line in enumerate(fh):
            if not line.strip():
                continue
            sample = json.loads(line)
            ids = sample["input_ids"]
            clear(ns_dir)
            send(conn, f"serial-{os.getpid()}-{line_no}", args.ns, ids)
            dump = scan(ns_dir)
            written += copy(dump, args.out / f"{sample.get('id', line_no)}.bin")
            samples, tokens = samples + 1, tokens + len(ids)
    seconds = time.monotonic() - started
    shutil.rmtree(ns_dir, ignore_errors=True)
    conn.close()
    return {"samples": samples, "tokens": tokens, "bytes": written, "seconds": seconds}


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--input", required=True, type=Path, help="samples JSONL (PROTOCOL §1)")
    p.add_argument("--out", required=True, type=Path, help="output directory on the disk")
    p.add_argument("--dump-root", required=True, type=Path, help="the server's HSX_DUMP_ROOT")
    p.add_argument("--ns", default="serial", help="dump namespace")
    result = run(p.parse_args(argv))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
