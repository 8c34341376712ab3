"""A trainer's data side in a process of its own, for the online tests and the bench: a
LiveDataset (local directory or ``hsx serve`` URL) read to the end, acknowledging every
``--ack-every`` samples; one JSON line per event on stdout (``got``, ``acked``, ``end``),
flushed, so a test reacts to what happened rather than to time.

``--sleep S`` makes it slow (a step of S seconds per sample); ``--hold-after N`` makes it
stop after N samples and wait, leases held, until it is killed (a consumer that vanishes);
``--tokens-per-s R`` paces it at R tokens per second (the bench's consumer at a set rate).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset


def emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> int:
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
    args = parser.parse_args()
    live = LiveDataset(
        args.source, consumer=args.consumer, rank=args.rank, world_size=args.world,
        lease_timeout=args.lease_timeout, prefetch=args.prefetch, poll_interval=0.05,
        wait_timeout=args.wait_timeout,
    )  # fmt: skip
    emit(owner=live.owner)
    pending: list[str] = []
    count, started = 0, time.monotonic()
    busy = 0.0  # seconds of "training" so far (the paced consumer's budget)
    for sample in live:
        sample_id = sample[HSX_ID]
        count += 1
        emit(got=sample_id)
        if args.tokens_per_s:
            busy += int(sample["input_ids"].shape[0]) / args.tokens_per_s
            time.sleep(max(0.0, started + busy - time.monotonic()))  # the paced step
        elif args.sleep:
            time.sleep(args.sleep)  # the slow step
        live.done(sample)
        pending.append(sample_id)
        if len(pending) >= args.ack_every:
            live.ack()
            emit(acked=pending)
            pending = []
        if args.hold_after and count >= args.hold_after:
            emit(holding=count)
            threading.Event().wait()  # until killed: the leases stay held
    live.ack()
    if pending:
        emit(acked=pending)
    emit(end=count, seconds=round(time.monotonic() - started, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
