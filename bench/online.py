"""Training while extracting: what a consumer at a set rate costs extraction, in one run.

    python bench/online.py            # 240 samples of 4 MiB a phase, 4 phases: ~3 minutes
    python bench/online.py --smoke    # tiny, checks the script runs (CI)

One fake server with a GPU-like latency model (a pass costs ``--latency-base-ms`` plus
``--latency-per-token-us`` per row, passes batched), so extraction is bound by the
"GPU", as in a real job, and not by this machine's two cores. Phases, in this order, each
a fresh ``hsx run`` of the same input into a fresh directory:

1. **alone**: ``retention = "keep"``, no consumer: the extraction rate without a trainer
   (R0, samples/s from the run's ``run_started`` to ``run_finished``).
2. **consumer at S × R0, limit**: ``retention = "acked"`` with one consumer and
   ``spool_limit`` (``--spool-fraction`` of the dataset's bytes). The consumer is a
   :class:`~hsx_async.dataset.live.LiveDataset` in this process, stepping at S × R0
   samples/s (each sample is one training step of ``1 / (S × R0)`` s: it waits out the
   rest of its step after reading the sample) and acknowledging every ``--ack-every``
   samples. One phase per ``--speeds`` S (default 2: keeps up; 0.5: falls behind, the
   spool fills and intake pauses).
3. **consumer at the slowest S, no limit**: what the limit buys (the spool then grows
   with the lag).

Measured per phase, by a thread that looks every ``--poll-ms``: the bytes under
``data/`` (sample and temp files, on the disk: what the limit bounds), the consumer's lag
(samples committed, from the manifest, minus samples it acknowledged, from its durable
log), the extraction rate and its ratio to R0 of the same run, and how long the consumer
still needed after extraction ended (the drain). A ratio near 1 with a fast consumer is
the online mode's cost; with a slow one and a limit, extraction is throttled to the
consumer (ratio ≈ S) and the peak spool stays at or under the limit. Each consumer
phase also gets what ``hsx check``'s spool model (:mod:`hsx_async.run.check.spool_estimate`)
predicts from R0, the consumer's rate and its ack interval: its rate ÷ the measured one.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    GB,
    MB,
    ClientRun,
    Model,
    Scratch,
    ServerProcess,
    apply_common,
    client_config,
    common_args,
    fake_server_argv,
    machine_info,
    print_table,
    pyplot,
    run_hsx,
    save_results,
    scratch,
    write_samples,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hsx_async.config import config_from_dict, spool_bytes_bound
from hsx_async.dataset.live.dataset import LiveDataset
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.run.check.spool_estimate import spool_need
from tests.run.daemon.test_spool import data_bytes

CONSUMER = "trainer"


@dataclass
class Watch:
    """The spool on the disk and the consumer's lag, looked at every ``interval`` s until
    stopped (a sampling interval, not a synchronisation)."""

    out: Path
    interval: float
    consumer: str | None
    points: list[tuple[float, int, int]] = field(default_factory=list)  # (t, bytes, lag)
    ended_at: float | None = None  # when extraction finished (set by the phase)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _committed(self) -> int:
        try:
            return (self.out / "manifest.jsonl").read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        log = ConsumerLog(self.out, self.consumer) if self.consumer else None
        while not self._stop.is_set():
            self._look(log)
            self._stop.wait(self.interval)
        self._look(log)  # at the stop: after the consumer's last acknowledgement

    def _look(self, log: ConsumerLog | None) -> None:
        held = data_bytes(self.out / "data")
        lag = 0
        if log is not None and (self.out / "consumers").is_dir():
            committed = self._committed()  # before the acks: the lag is never negative
            lag = max(0, committed - len(log.refresh().acked.get(0, set())))
        self.points.append((time.monotonic() - self._t0, held, lag))

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@dataclass
class Consumed:
    samples: int = 0
    bytes: int = 0
    finished_at: float = 0.0  # monotonic
    error: BaseException | None = None


def consume(out: Path, rate: float, ack_every: int, timeout: float, got: Consumed) -> None:
    """A trainer's data side at ``rate`` steps per second, one sample a step."""
    try:
        live = LiveDataset(out, consumer=CONSUMER, poll_interval=0.02, wait_timeout=timeout,
                           prefetch=2)  # fmt: skip
        step = 1.0 / rate
        for n, sample in enumerate(live, start=1):
            started = time.monotonic()
            got.samples += 1
            got.bytes += sum(int(v.nbytes) for v in sample.values() if hasattr(v, "nbytes"))
            live.done(sample)
            if n % ack_every == 0:
                live.ack()
            left = step - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)  # the rest of the training step: the consumer's set rate
        live.ack()
        got.finished_at = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - carried to the phase, which raises it
        got.error = exc


@dataclass
class Phase:
    name: str
    speed: float | None  # the consumer's rate as a multiple of R0; None: no consumer
    limit: int  # bytes; 0: none


def run_phase(
    phase: Phase, args: argparse.Namespace, *, s: Scratch, url: str, dump_root: Path,
    model: Model, samples: Path, r0: float | None, n: int,
) -> dict[str, Any]:  # fmt: skip
    out = s.fresh(f"out-{phase.name.replace(' ', '-')}")
    sections: dict[str, Any] = {"workers": {"concurrency": args.concurrency},
                                "input": {"max_tokens": args.tokens}}  # fmt: skip
    if phase.speed is not None:
        sections["output"] = {"retention": "acked", "consumers": [CONSUMER],
                              "spool_limit": phase.limit}  # fmt: skip
    raw = client_config(url=url, samples=samples, out_dir=out, dump_root=dump_root,
                        model=model, **sections)  # fmt: skip
    rate = None if phase.speed is None or r0 is None else phase.speed * r0
    got = Consumed()
    done: list[ClientRun] = []
    failed: list[BaseException] = []

    def extract() -> None:
        try:
            done.append(run_hsx(raw, s.work, phase.name.replace(" ", "-")))
        except Exception as exc:  # noqa: BLE001 - carried to the phase, which raises it
            failed.append(exc)

    with Watch(out, args.poll_ms / 1000, CONSUMER if rate else None) as watch:
        runner = threading.Thread(target=extract)
        consumer = None
        if rate is not None:
            consumer = threading.Thread(
                target=consume, args=(out, rate, args.ack_every, args.timeout, got), daemon=True
            )
            consumer.start()  # it waits for the run: extraction is not complete before it
        runner.start()
        runner.join(args.timeout)
        extracted_at = time.monotonic()
        if failed or not done:
            raise RuntimeError(f"{phase.name}: hsx run failed: {failed!r}")
        if consumer is not None:
            consumer.join(args.timeout)
            if consumer.is_alive() or got.error is not None:
                raise RuntimeError(f"{phase.name}: the consumer failed: {got.error!r}")
    run = done[0]
    if run.done != n or run.quarantined:
        raise RuntimeError(f"{phase.name}: {run.done} written, {run.quarantined} quarantined")
    if rate is not None and got.samples != n:
        raise RuntimeError(f"{phase.name}: the consumer got {got.samples} of {n} samples")
    predicted = None  # what hsx check's model says this phase takes, from R0 and the rate
    if rate is not None and r0 is not None:
        need = spool_need(config_from_dict(raw, base=s.work), samples=n, tokens=n * args.tokens,
                          extraction=r0 * args.tokens, consumer=rate * args.tokens,
                          ack_interval=args.ack_every / rate)  # fmt: skip
        predicted = need.job_seconds(phase.limit)
    ended = watch.points[-1][0] if watch.points else 0.0
    lags = [p[2] for p in watch.points if p[1] > 0]  # while the spool held anything
    return {
        "phase": phase.name,
        "speed": phase.speed,
        "consumer_rate": rate,
        "spool_limit": phase.limit,
        "samples": run.done,
        "run_s": run.run_s,
        "rate": run.done / run.run_s,
        "peak_spool": max((p[1] for p in watch.points), default=0),
        "end_spool": watch.points[-1][1] if watch.points else 0,
        "peak_lag": max(lags, default=0),
        "mean_lag": sum(lags) / len(lags) if lags else 0.0,
        "drain_s": max(0.0, got.finished_at - extracted_at) if rate is not None else None,
        # hsx check's predicted rate over the measured one (None: no prediction)
        "check_vs_measured": None
        if predicted is None
        else (n / predicted) / (run.done / run.run_s),
        "consumed": got.samples,
        "client_cpu_s": run.usage.cpu_s,
        "timeline": watch.points,
        "span_s": ended,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    add = parser.add_argument
    add("--samples", type=int, default=240, help="samples a phase")
    add("--tokens", type=int, default=512, help="tokens a sample")
    add("--hidden", type=int, default=1024, help="hidden size (4 states a token)")
    add("--latency-base-ms", type=float, default=5.0, help="the fake server's cost a pass")
    add("--latency-per-token-us", type=float, default=180.0, help="... and a row")
    add("--concurrency", type=int, default=8, help="requests in flight")
    add("--speeds", type=float, nargs="+", default=[2.0, 0.5],
        help="the consumer's rates, as multiples of the extraction rate alone")  # fmt: skip
    add("--spool-fraction", type=float, default=0.1, help="spool_limit / the dataset's bytes")
    add("--ack-every", type=int, default=4, help="samples per acknowledgement")
    add("--poll-ms", type=float, default=20.0, help="how often the spool and lag are looked at")
    add("--timeout", type=float, default=600.0, help="the most one phase may take")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.tokens, args.hidden, args.concurrency = 16, 64, 64, 4
        args.latency_base_ms, args.latency_per_token_us, args.timeout = 2.0, 300.0, 120.0
        args.ack_every = 1  # the spool model's window (in flight + 1) then fits the limit
    load_before = os.getloadavg()
    apply_common(args)
    model = Model(hidden_size=args.hidden, aux_layers=(1, 3, 5))
    with scratch(args, "online") as s:
        samples = s.work / "samples.jsonl"
        write_samples(samples, [args.tokens] * args.samples)
        dump_root = s.fresh("dumps", on_shm=True)
        probe = client_config(url="http://127.0.0.1:1", samples=samples, out_dir=s.disk / "x",
                              dump_root=dump_root, model=model,
                              input={"max_tokens": args.tokens})  # fmt: skip
        one_file = spool_bytes_bound(config_from_dict(probe, base=s.work), args.tokens)
        limit = max(one_file * (args.concurrency + 1),
                    int(args.spool_fraction * one_file * args.samples))  # fmt: skip
        phases = [Phase("alone", None, 0)]
        phases += [Phase(f"consumer {sp:g}x, limit", sp, limit) for sp in args.speeds]
        phases.append(Phase(f"consumer {min(args.speeds):g}x, no limit", min(args.speeds), 0))
        argv = fake_server_argv(model, dump_root, latency_base_ms=args.latency_base_ms,
                                latency_per_token_us=args.latency_per_token_us)  # fmt: skip
        rows: list[dict[str, Any]] = []
        with ServerProcess(argv, s.work / "fake-server.log") as srv:
            r0 = None
            for phase in phases:
                row = run_phase(phase, args, s=s, url=srv.url, dump_root=dump_root,
                                model=model, samples=samples, r0=r0, n=args.samples)  # fmt: skip
                if r0 is None:
                    r0 = row["rate"]
                row["vs_alone"] = row["rate"] / r0
                rows.append(row)
                print(f"{phase.name}: {row['rate']:.2f} samples/s", flush=True)
        dataset = one_file * args.samples
        data = {"smoke": args.smoke, "machine": machine_info(s.disk, s.shm),
                "load_before": load_before, "load_after": os.getloadavg(), "rows": rows,
                "spool_limit": limit,
                "file_bytes": one_file, "dataset_bytes": dataset,
                "workload": {"samples": args.samples, "tokens": args.tokens,
                             "hidden": args.hidden}}  # fmt: skip
    report(args, data)


def report(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """The table (printed and saved) and the figure: spool and lag over each phase."""
    rows, limit, one_file = data["rows"], data["spool_limit"], data["file_bytes"]
    dataset = data["dataset_bytes"]
    table = print_table(
        f"Training while extracting: {args.samples} samples of {one_file / MB:.1f} MB "
        f"({dataset / GB:.2f} GB), spool_limit {limit / MB:.0f} MB, fake server "
        f"{args.latency_base_ms:g} ms + {args.latency_per_token_us:g} µs/row a pass",
        ["phase", "consumer /s", "samples/s", "× alone", "peak spool MB", "peak ÷ limit",
         "peak lag", "mean lag", "drain s", "hsx check ÷ measured"],
        [
            [r["phase"], r["consumer_rate"] or "-", r["rate"], r["vs_alone"],
             r["peak_spool"] / MB, r["peak_spool"] / limit if r["speed"] else "-",
             r["peak_lag"] if r["speed"] else "-", r["mean_lag"] if r["speed"] else "-",
             r["drain_s"] if r["drain_s"] is not None else "-",
             r["check_vs_measured"] if r["check_vs_measured"] is not None else "-"]
            for r in rows
        ],
    )  # fmt: skip
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for i, r in enumerate(rows):  # one colour per phase in both panels
        t = [p[0] for p in r["timeline"]]
        top.plot(t, [p[1] / MB for p in r["timeline"]], label=r["phase"], color=f"C{i}")
        if r["speed"]:
            bottom.plot(t, [p[2] for p in r["timeline"]], label=r["phase"], color=f"C{i}")
    top.axhline(limit / MB, color="grey", linestyle="--", label="spool_limit")
    top.set_ylabel("spool on disk, MB")
    bottom.set_ylabel("consumer lag, samples")
    bottom.set_xlabel("s since the phase started")
    top.legend(fontsize=7)
    fig.tight_layout()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.results_dir / "online.png")
    save_results(args.results_dir, "online", data, [table])


if __name__ == "__main__":
    main()
