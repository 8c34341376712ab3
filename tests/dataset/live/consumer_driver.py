"""A trainer's data side in a process of its own, for the online tests and the bench: a
LiveDataset (local directory or ``hsx serve`` URL) read to the end, acknowledging every
``--ack-every`` samples; one JSON line per event on stdout (``got``, ``acked``, ``end``),
flushed, so a test reacts to what happened rather than to time.

``--sleep S`` makes it slow (a step of S seconds per sample); ``--hold-after N`` makes it
stop after N samples and wait, leases held, until it is killed (a consumer that vanishes);
``--tokens-per-s R`` paces it at R tokens per second (the bench's consumer at a set rate).

A trainer as the soak needs it: ``--checkpoint PATH`` saves ``state_dict()`` (durably)
before each ack, as a trainer saves it with its model, and a process started with it
loads it first (``load_state_dict``: what it holds is acknowledged for the process it
came from); ``--clock-skew S`` puts this process's wall clock S seconds ahead (leases
must not care); ``--hashes`` adds each sample's XXH3-64 over its tensors to ``got``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset
from hsx_async.errors import LiveError


def emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("--consumer", default="train")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--ack-every", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--tokens-per-s", type=float, default=0.0)
    parser.add_argument("--hold-after", type=int, default=0)
    parser.add_argument("--lease-timeout", type=float, default=600.0)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--wait-timeout", type=float, default=120.0)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--clock-skew", type=float, default=0.0)
    parser.add_argument("--hashes", action="store_true")
    return parser.parse_args()


def main() -> int:
    args = _parse()
    if args.clock_skew:
        wall = time.time
        time.time = lambda: wall() + args.clock_skew
    live = LiveDataset(
        args.source, consumer=args.consumer, rank=args.rank, world_size=args.world,
        lease_timeout=args.lease_timeout, prefetch=args.prefetch, poll_interval=0.05,
        wait_timeout=args.wait_timeout,
    )  # fmt: skip
    emit(owner=live.owner)
    if args.checkpoint is not None and args.checkpoint.is_file():
        state = json.loads(args.checkpoint.read_bytes())
        live.load_state_dict(state)
        emit(restored=state["done"])
    pending: list[str] = []
    count, started = 0, time.monotonic()
    busy = 0.0  # seconds of "training" so far (the paced consumer's budget)
    for sample in live:
        sample_id = sample[HSX_ID]
        count += 1
        emit(got=sample_id, **({"xxh3": _digest(sample)} if args.hashes else {}))
        if args.tokens_per_s:
            busy += int(sample["input_ids"].shape[0]) / args.tokens_per_s
            time.sleep(max(0.0, started + busy - time.monotonic()))  # the paced step
        elif args.sleep:
            time.sleep(args.sleep)  # the slow step
        live.done(sample)
        pending.append(sample_id)
        if len(pending) >= args.ack_every:
            _checkpoint(live, args.checkpoint)
            live.ack()
            emit(acked=pending)
            pending = []
        if args.hold_after and count >= args.hold_after:
            emit(holding=count)
            threading.Event().wait()  # until killed: the leases stay held
    _checkpoint(live, args.checkpoint)
    live.ack()
    if pending:
        emit(acked=pending)
    seconds = round(time.monotonic() - started, 3)
    emit(end=count, lost=live.lost, refused=live.refused, seconds=seconds)
    return 0


def _checkpoint(live: LiveDataset, path: Path | None) -> None:
    """Save the live state durably, as a trainer's checkpoint holds it (temp, fsync, rename)."""
    if path is None:
        return
    if path.is_file():  # the one before stays too: a trainer may restart from an older one
        path.replace(path.with_suffix(".prev"))
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as fh:
        fh.write(json.dumps(live.state_dict()).encode())
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def _digest(sample: dict[str, Any]) -> str:
    hasher = xxhash.xxh3_64()
    for key in sorted(sample):
        value = sample[key]
        if hasattr(value, "contiguous"):
            hasher.update(key.encode())
            hasher.update(value.contiguous().view(-1).view(dtype=torch.uint8).numpy())
    return str(hasher.hexdigest())


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LiveError as exc:  # told to stop (replaced, unreachable): said, exit 3
        emit(error=str(exc))
        sys.exit(3)
