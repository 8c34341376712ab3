"""Prepare: ``hsx prepare`` throughput (samples/s) on 1 and 2 worker processes.

    python bench/prepare.py            # 20,000 conversations, 3 rounds: ~5 minutes
    python bench/prepare.py --smoke    # tiny, checks the script runs (CI)

Input: synthetic multi-turn conversations (1–4 exchanges, log-normal turn lengths) over a
byte-level BPE tokenizer with the Llama-3 template (tests/prepare/chat_styles.py), built
locally. Each configuration is one ``hsx prepare`` process, timed from start to exit, run
``--rounds`` times in rotating order (the median round is kept); a run on a single record
gives the fixed start-up cost, subtracted in the "net" column. CPU per sample is what each
process reports of its own encoding work (start-up excluded).
The baseline, measured in the same run, is what a preparation script without a mask
does: one process, ``apply_chat_template(tokenize=True)`` per record, ids written as JSON
lines. The ratio to it is the price of the mask (one extra rendering per assistant turn)
and of the checks.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from common import (
    PYTHON,
    Scratch,
    apply_common,
    common_args,
    machine_info,
    print_table,
    pyplot,
    run_measured,
    save_results,
    scratch,
    usage_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.prepare.chat_styles import CORPUS, STYLES, build_tokenizer

WORDS = sorted({w for line in CORPUS for w in line.split()})

BASELINE = """
import sys, time, orjson
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
started = time.process_time()
with open(sys.argv[2], "rb") as src, open(sys.argv[3], "wb") as out:
    for line in src:
        msgs = orjson.loads(line)["messages"]
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        out.write(orjson.dumps({"input_ids": list(ids)}) + b"\\n")
print(orjson.dumps({"encode_cpu_s": time.process_time() - started}).decode())
"""


def write_conversations(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(mean_words: float) -> str:
        k = max(1, int(rng.lognormvariate(0, 0.8) * mean_words))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with path.open("wb") as fh:
        for i in range(n):
            msgs = [{"role": "system", "content": text(10)}] if i % 3 == 0 else []
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": text(30)})
                msgs.append({"role": "assistant", "content": text(60)})
            fh.write(orjson.dumps({"id": f"c{i}", "messages": msgs}) + b"\n")


def run_prepare(s: Scratch, tok: Path, src: Path, name: str, workers: int) -> dict[str, Any]:
    out = s.disk / f"{name}.jsonl"
    argv = [PYTHON, "-m", "hsx_async", "prepare", str(src), "--tokenizer", str(tok),
            "--out", str(out), "--workers", str(workers)]  # fmt: skip
    usage = run_measured(argv, s.work / f"{name}.log")
    if usage.returncode != 0:
        raise SystemExit(f"{name} failed: see {s.work / f'{name}.log'}")
    summary = orjson.loads((s.disk / f"{name}.summary.json").read_bytes())
    return {"name": name, "workers": workers, "samples": summary["samples"],
            "tokens": summary["tokens"], "encode_cpu_s": summary["encode_cpu_s"],
            **usage_dict(usage)}  # fmt: skip


def run_baseline(s: Scratch, tok: Path, src: Path, n: int) -> dict[str, Any]:
    out = s.disk / "baseline.jsonl"
    usage = run_measured([PYTHON, "-c", BASELINE, str(tok), str(src), str(out)],
                         s.work / "baseline.log")  # fmt: skip
    if usage.returncode != 0:
        raise SystemExit(f"baseline failed: see {s.work / 'baseline.log'}")
    tokens = sum(len(orjson.loads(x)["input_ids"]) for x in out.read_bytes().splitlines())
    cpu = orjson.loads((s.work / "baseline.log").read_bytes().splitlines()[-1])
    return {"name": "baseline (no mask, 1 process)", "workers": 1, "samples": n,
            "tokens": tokens, "encode_cpu_s": cpu["encode_cpu_s"],
            **usage_dict(usage)}  # fmt: skip


def run_all(args: argparse.Namespace, s: Scratch) -> dict[str, Any]:
    tok = build_tokenizer(STYLES["llama3"], s.work / "tokenizer")
    src, one = s.disk / "conversations.jsonl", s.disk / "one.jsonl"
    write_conversations(src, args.conversations)
    write_conversations(one, 1)

    # Rounds, the order rotated each round, the median kept: the machine's load drifts.
    def job(name: str) -> dict[str, Any]:
        if name == "baseline":
            return run_baseline(s, tok, src, args.conversations)
        w = int(name.removeprefix("w"))
        return run_prepare(s, tok, src, f"prepare-{name}", w)

    jobs = ["baseline", *(f"w{w}" for w in args.workers)]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for k in range(args.rounds):
        for name in jobs[k % len(jobs) :] + jobs[: k % len(jobs)]:
            rounds[name].append(job(name))
    runs = [_median_run(rounds[name]) for name in jobs]
    # After the big runs, so the caches are as warm as theirs were; the faster of two.
    startup = {
        w: min((run_prepare(s, tok, one, f"startup-w{w}-{k}", w)
                for k in range(1 if args.smoke else 2)),
               key=lambda r: r["wall_s"])
        for w in sorted(set(args.workers))
    }  # fmt: skip
    for r in runs:
        # CPU per sample: the encoding CPU each process reports of itself, start-up
        # excluded (the workers are children of the fork server, not of this script, so
        # rusage would miss them).
        r["cpu_ms_per_sample"] = 1000 * r["encode_cpu_s"] / r["samples"]
        r["samples_per_s"] = r["samples"] / r["wall_s"]
        fixed = startup[r["workers"]]["wall_s"] if r["name"].startswith("prepare") else 0.0
        net = r["wall_s"] - fixed
        r["net_samples_per_s"] = r["samples"] / net if net > 0.2 * r["wall_s"] else None
    return {"conversations": args.conversations, "startup": list(startup.values()), "runs": runs}


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median wall time, with every round's wall time beside it."""
    ordered = sorted(results, key=lambda r: r["wall_s"])
    return {**ordered[len(ordered) // 2], "rounds_wall_s": [r["wall_s"] for r in results]}


def report(data: dict[str, Any]) -> list[str]:
    rows = [
        [r["name"], r["samples"], r["tokens"], r["wall_s"], r["cpu_ms_per_sample"],
         r["samples_per_s"], r["net_samples_per_s"] or "-",
         r["samples_per_s"] / data["runs"][0]["samples_per_s"]]
        for r in data["runs"]
    ]  # fmt: skip
    headers = ["run", "samples", "tokens", "wall s", "CPU ms/sample", "samples/s",
               "net of start-up", "× baseline"]  # fmt: skip
    start = [[r["name"], r["wall_s"], r["cpu_s"]] for r in data["startup"]]
    load = data["machine"]["load_avg_at_start"]
    return [
        print_table(f"hsx prepare throughput (load average at start {load[0]:.1f})", headers, rows),
        print_table("start-up (one record; CPU: this process only)", ["run", "wall s", "CPU s"],
                    start),
    ]  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    runs = data["runs"]
    ax.barh([r["name"] for r in runs], [r["samples_per_s"] for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (wall, start-up included)")
    m = data["machine"]
    ax.set_title(f"hsx prepare — {data['conversations']} conversations, {m['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    common_args(p)
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3, help="runs of each; the median is kept")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.rounds = 50, 1
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    apply_common(args)
    with scratch(args, "prepare") as s:
        data: dict[str, Any] = {
            "machine": machine_info(args.out_dir, args.shm_dir),
            "smoke": args.smoke,
        }
        data |= run_all(args, s)
    tables = report(data)
    path = save_results(args.results_dir, "prepare", data, tables)
    plot(data, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
