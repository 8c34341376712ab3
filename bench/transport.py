"""A trainer on another node: which transport moves a live dataset's samples best?

Measured in one run, side by side, on 127.0.0.1 (the same files, warm page cache, each
round in a rotated order, median of ``--repeat``):

- ``local``: the bytes read and XXH3-hashed where they lie — what a reader on the node that
  holds the dataset, or on a shared file system serving from its cache, pays at best (no
  network: the ceiling the others are compared with);
- ``hsx serve``: the live reader's own path (``RemoteSource.fetch``: HTTP, ``sendfile`` on
  the server, each file into the reader's tmpfs and checked against its manifest hash), in
  three modes side by side: ``plain`` (no secret, what serve was before issue 37),
  ``secret`` (``--secret-file``: the ``Authorization`` header checked on every request) and
  ``secret+TLS`` (``--tls-cert``/``--tls-key``, ``https://``: no ``sendfile``, every byte
  encrypted by the server and decrypted by the reader);
- ``mooncake``: Mooncake's transfer engine over TCP (``mooncake-transfer-engine-non-cuda``,
  what SpecForge and speculators use): the producer loads each file into a registered
  buffer, the reader ``transfer_sync_read``s it into its own and hashes it. Needs
  ``--mooncake-python`` (a venv with that package, numpy and xxhash; Debian's
  ``libibverbs1``); without it the row says so.

Rates are GB/s of verified bytes; CPU is each process's own ``getrusage`` (readers) or
``/proc`` delta (``hsx serve``) over the transfer window, per GB. Ratios are against
``local`` of the same round, and each serve mode's against ``plain`` serve's (rate, and
serve's CPU per GB). On one node the network is loopback, so this ranks the
transports' own costs (copies, CPU, protocol), not a NIC.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import (
    GB,
    PYTHON,
    REPO,
    child_env,
    common_args,
    machine_info,
    print_table,
    pyplot,
    save_results,
    scratch,
    warm_up,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.dataset.live.test_dataset import mark_input
from tests.dataset_factory import write_dataset
from tests.e2e import free_port

PEER = Path(__file__).with_name("transport_peer.py")
HIDDEN = 1024  # 4 layer slots × 1024 × 2 bytes = 8 KiB per token


SERVE_MODES = ("plain", "secret", "secret+TLS")


def _peers(
    python: str, argvs: list[list[str]], timeout: float = 600.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the peers side by side; their bytes and CPU summed, the longest wall time."""
    env = child_env() | {"PYTHONPATH": str(REPO)} | (env or {})
    procs = [
        subprocess.Popen(
            [python, str(PEER), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for argv in argvs
    ]
    results = []
    for proc, argv in zip(procs, argvs, strict=True):
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"transport peer {argv[0]} failed: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "bytes": sum(r["bytes"] for r in results),
        "wall_s": max(r["wall_s"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
    }


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    return [items[i::parts] for i in range(parts)]


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_options(mode: str, work: Path) -> tuple[list[str], dict[str, str]]:
    """``hsx serve``'s flags for ``mode`` and its readers' environment (a secret file, a
    self-signed certificate for 127.0.0.1 that is its own CA)."""
    if mode == "plain":
        return [], {"HSX_SERVE_SECRET_FILE": "", "HSX_SERVE_SECRET": ""}
    secret = work / "serve.secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
    flags, env = ["--secret-file", str(secret)], {"HSX_SERVE_SECRET_FILE": str(secret)}
    if mode == "secret+TLS":
        cert, key = work / "serve.pem", work / "serve.key"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", "1", "-subj", "/CN=hsx-bench", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        flags += ["--tls-cert", str(cert), "--tls-key", str(key)]
        env["HSX_SERVE_CA_FILE"] = str(cert)
    return flags, env


@contextlib.contextmanager
def hsx_serve(out: Path, flags: list[str]) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [PYTHON, "-m", "hsx_async", "serve", str(out), "--listen", f"127.0.0.1:{port}",
            *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            cwd=REPO, env=child_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("hsx serve:"):
            raise RuntimeError(f"hsx serve did not start: {line!r}")
        yield line.rsplit(" on ", 1)[1].strip(), proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def mooncake_serve(python: str, files: list[Path]) -> Iterator[tuple[dict[str, Any], Any]]:
    proc = subprocess.Popen([python, str(PEER), "mc-serve", *map(str, files)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=REPO, env=child_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().decode()
        if not first.strip():
            raise RuntimeError("mooncake server did not start")
        yield json.loads(first), proc
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        proc.wait(30)


Rounds = dict[str, list[dict[str, Any]]]


def measure(args: argparse.Namespace, out: Path, files: list[Path], work: Path) -> Rounds:
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_bytes().splitlines()]
    by_path = {out / r["path"]: r for r in records}
    _peers(PYTHON, [["local", *map(str, files)]])  # warm the page cache
    rounds: Rounds = {}
    with contextlib.ExitStack() as stack:
        serves = {}
        for mode in SERVE_MODES:
            flags, env = serve_options(mode, work)
            serves[f"hsx serve {mode}"] = (*stack.enter_context(hsx_serve(out, flags)), env)
        mc = None
        if args.mooncake_python:
            mc = stack.enter_context(mooncake_serve(args.mooncake_python, files))
        kinds = ("local", *serves, *(("mooncake",) if mc else ()))
        methods = [(m, n) for n in args.streams for m in kinds]
        for r in range(args.repeat):
            for method, n in methods[r % len(methods) :] + methods[: r % len(methods)]:
                key = f"{method} ×{n}"
                rounds.setdefault(key, [])
                parts = _split(files, n)
                if method == "local":
                    rounds[key].append(_peers(PYTHON, [["local", *map(str, p)] for p in parts]))
                elif method in serves:
                    url, serve_pid, env = serves[method]
                    argvs = []
                    for i, part in enumerate(parts):
                        listing = out.parent / f"entries-{i}.json"
                        listing.write_bytes(json.dumps([by_path[f] for f in part]).encode())
                        argvs.append(["http", url, str(listing)])
                    before = _proc_cpu(serve_pid)
                    got = _peers(PYTHON, argvs, env=env)
                    rounds[key].append(got | {"server_cpu_s": _proc_cpu(serve_pid) - before})
                elif mc is not None:
                    regions = dict(zip(files, mc[0]["regions"], strict=True))
                    argvs = [["mc-read", str(mc[0]["port"]), json.dumps([regions[f] for f in part])]
                             for part in parts]  # fmt: skip
                    got = _peers(args.mooncake_python, argvs)
                    rounds[key].append(got | {"load": mc[0]["load"]})
    return rounds


def summarise(rounds: Rounds) -> list[dict[str, Any]]:
    rows = []
    base = statistics.median(r["bytes"] / r["wall_s"] for r in rounds["local ×1"])
    for method, runs in rounds.items():
        gbs = [r["bytes"] / GB for r in runs]
        rate = statistics.median(r["bytes"] / r["wall_s"] for r in runs)
        reader = statistics.median(r["cpu_s"] / g for r, g in zip(runs, gbs, strict=True))
        server = None
        if method.startswith("hsx serve"):
            server = statistics.median(
                r["server_cpu_s"] / g for r, g in zip(runs, gbs, strict=True)
            )
        elif method.startswith("mooncake"):
            server = runs[0]["load"]["cpu_s"] / gbs[0]  # loading into registered memory
        rows.append({
            "method": method, "gb_per_s": rate / GB,
            "vs_local": rate / base, "reader_cpu_s_per_gb": reader,
            "server_cpu_s_per_gb": server, "rounds": len(runs),
            "streams": int(method.rsplit("×", 1)[1]),
        })  # fmt: skip
    return _against_plain(rows)


def _against_plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each serve mode's rate and serve CPU per GB as ratios to plain serve's, same streams."""
    plain = {r["streams"]: r for r in rows if r["method"].startswith("hsx serve plain")}
    for row in rows:
        base = plain.get(row["streams"]) if row["method"].startswith("hsx serve") else None
        row["vs_plain"] = None if base is None else row["gb_per_s"] / base["gb_per_s"]
        row["server_cpu_vs_plain"] = (  # None: too little CPU to count (clock ticks)
            None
            if base is None or not base["server_cpu_s_per_gb"]
            else row["server_cpu_s_per_gb"] / base["server_cpu_s_per_gb"]
        )
    return rows


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    parser.add_argument("--files", type=int, default=32, help="sample files moved per round")
    parser.add_argument("--file-mb", type=float, default=32.0, help="MiB per sample file")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (the median is shown)")
    parser.add_argument("--mooncake-python", help="a Python with mooncake-transfer-engine-non-cuda")
    parser.add_argument(
        "--streams", type=int, nargs="+", default=[1, 2], help="readers side by side"
    )
    args = parser.parse_args()
    if args.smoke:
        args.files, args.file_mb, args.repeat, args.streams = 4, 0.5, 1, [1, 2]
    warm_up()
    tokens = max(1, int(args.file_mb * (1 << 20) / (4 * HIDDEN * 2)))
    with scratch(args, "transport") as s:
        out = s.disk / "out"
        written = write_dataset(out, num_samples=args.files, hidden_size=HIDDEN,
                                lengths=[tokens] * args.files, loss_mask="none")  # fmt: skip
        mark_input(out, args.files)
        keys = s.disk / "keys"  # not s.work: the logs there are kept with the results
        keys.mkdir()
        rows = summarise(measure(args, out, [w.path for w in written], keys))
        moved = sum(w.entry.size for w in written)
        data = {"smoke": args.smoke, "machine": machine_info(s.disk, s.shm), "rows": rows,
                "files": args.files, "bytes_per_round": moved,
                "mooncake": bool(args.mooncake_python)}  # fmt: skip
    missing = "" if args.mooncake_python else " (mooncake not measured: no --mooncake-python)"
    table = print_table(
        f"Moving {args.files} sample files ({moved / GB:.2f} GB) to readers, 127.0.0.1{missing}",
        ["transport", "GB/s", "× local", "× plain serve", "reader CPU-s/GB", "server CPU-s/GB",
         "server CPU × plain"],
        [
            [r["method"], r["gb_per_s"], r["vs_local"], _or_dash(r["vs_plain"]),
             r["reader_cpu_s_per_gb"], _or_dash(r["server_cpu_s_per_gb"]),
             _or_dash(r["server_cpu_vs_plain"])]
            for r in rows
        ],
    )  # fmt: skip
    plt = pyplot()
    measured = rows
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["method"] for r in measured], [r["gb_per_s"] for r in measured])
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("GB/s verified")
    ax.set_title("transport of sample files, 127.0.0.1")
    fig.tight_layout()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.results_dir / "transport.png")
    save_results(args.results_dir, "transport", data, [table])


if __name__ == "__main__":
    main()
