"""Regenerate ``hsx_async/data/demo_samples.jsonl``, the demo input for the tiny reference model.

Deterministic: the same file on every run and machine (``random.Random`` with a fixed seed;
its integer draws are stable across Python versions). Token ids lie in the built-in tiny
Llama's vocabulary; lengths run from 8 to 300, so prompts longer than the reference
server's default ``chunk_size`` (64) get chunked; every eighth sample has a ``loss_mask``
(a prompt part of 0s, then 1s, like a chat template's assistant turn).

    python bench/make_demo_samples.py           # rewrite the file
    python bench/make_demo_samples.py --check   # exit 1 if the file is not up to date
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import orjson

OUT = Path(__file__).resolve().parent.parent / "hsx_async" / "data" / "demo_samples.jsonl"
SEED = 0
NUM_SAMPLES = 48
VOCAB_SIZE = 1024  # reference_model.TINY_VOCAB (not imported: that would import torch)
MIN_LEN, MAX_LEN = 8, 300
# Edges that matter to the chunking: the extremes and both sides of 64/128-row chunks.
ANCHOR_LENGTHS = (MIN_LEN, MAX_LEN, 63, 64, 65, 128, 129)


def make_samples(seed: int = SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    lengths = list(ANCHOR_LENGTHS)
    lengths += [rng.randint(MIN_LEN, MAX_LEN) for _ in range(NUM_SAMPLES - len(lengths))]
    rng.shuffle(lengths)
    samples: list[dict[str, Any]] = []
    for index, length in enumerate(lengths):
        sample: dict[str, Any] = {
            "id": f"demo-{index:04d}",
            "input_ids": [rng.randrange(VOCAB_SIZE) for _ in range(length)],
        }
        if index % 8 == 3:
            prompt = rng.randint(1, length - 1)
            sample["loss_mask"] = [0] * prompt + [1] * (length - prompt)
        samples.append(sample)
    return samples


def render(samples: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(sample) + b"\n" for sample in samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the file")
    args = parser.parse_args()
    data = render(make_samples())
    if args.check:
        current = OUT.read_bytes() if OUT.exists() else b""
        if current != data:
            print(f"{OUT} is out of date: run python bench/make_demo_samples.py")
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.write_bytes(data)
    print(f"wrote {NUM_SAMPLES} samples to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
