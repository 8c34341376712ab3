"""What ``hsx prepare`` reports: counts, trainable share, lengths, and the extraction's size.

Pure except :func:`disk_free` (one ``statvfs``).
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_async.dataset.quarantine import reason_kind
from hsx_async.prepare.encode import Outcome
from hsx_async.units import human_bytes

# Upper bounds (inclusive) of the length histogram's buckets; the last bucket is open.
HISTOGRAM_BOUNDS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket_label(n: int) -> str:
    for bound in HISTOGRAM_BOUNDS:
        if n <= bound:
            return f"<={bound}"
    return f">{HISTOGRAM_BOUNDS[-1]}"


@dataclass
class PrepareStats:
    records: int = 0
    samples: int = 0
    quarantined: int = 0
    truncated: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    max_tokens_seen: int = 0
    encode_cpu_s: float = 0.0  # CPU of rendering + tokenizing, all processes together
    histogram: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome) -> None:
        self.records += 1
        if outcome.reason:
            self.quarantined += 1
            self.reasons[reason_kind(outcome.reason)] += 1
            return
        self.samples += 1
        self.tokens += outcome.tokens
        self.trainable_tokens += outcome.trainable
        self.truncated += outcome.truncated_from > 0
        self.max_tokens_seen = max(self.max_tokens_seen, outcome.tokens)
        self.histogram[bucket_label(outcome.tokens)] += 1

    def to_json(self) -> dict[str, Any]:
        order = [f"<={b}" for b in HISTOGRAM_BOUNDS] + [f">{HISTOGRAM_BOUNDS[-1]}"]
        return {
            "records": self.records,
            "samples": self.samples,
            "quarantined": self.quarantined,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "trainable_tokens": self.trainable_tokens,
            "trainable_share": round(self.trainable_tokens / self.tokens, 4) if self.tokens else 0,
            "longest": self.max_tokens_seen,
            "encode_cpu_s": round(self.encode_cpu_s, 3),
            "length_histogram": {k: self.histogram[k] for k in order if self.histogram[k]},
            "quarantine_reasons": dict(self.reasons.most_common(20)),
        }


def disk_free(path: Path) -> tuple[Path, int]:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def size_estimate(
    tokens: int, hidden_size: int, aux_layers: int, free: int, reserve: int
) -> dict[str, Any]:
    """The dataset ``hsx run`` will write: tokens × L × H × 2 bytes (bf16), L = aux + 1."""
    layers = aux_layers + 1
    need = tokens * layers * hidden_size * 2
    return {
        "tokens": tokens,
        "layers": layers,
        "hidden_size": hidden_size,
        "bytes": need,
        "gib": round(need / (1 << 30), 3),
        "disk_free_bytes": free,
        "disk_reserve_bytes": reserve,
        "fits": need + reserve <= free,
    }


def row(label: str, value: str) -> str:
    """One line of a command's summary for a person, after its headline: ``hsx prepare``'s
    and ``hsx regenerate``'s summaries are laid out by these two functions."""
    return f"  {label + ':':<12} {value}"


def reason_rows(reasons: Mapping[str, int]) -> list[str]:
    """The quarantine's reason kinds under their ``row``, most frequent first."""
    return [f"    {n:>7,}  {kind}" for kind, n in reasons.items()]


def describe(summary: dict[str, Any]) -> str:
    """``hsx prepare``'s summary for a person (``samples.summary.json`` has every figure)."""
    files = summary["files"]
    lines = [
        f"hsx prepare: {summary['samples']:,} samples from {summary['records']:,} records → "
        f"{files['samples']}",
        row(
            "tokens",
            f"{summary['tokens']:,}, {100 * summary['trainable_share']:.1f}% trainable "
            f"(loss_mask 1); longest {summary['longest']:,}",
        ),
    ]
    if summary["truncated"]:
        lines.append(
            row("truncated", f"{summary['truncated']:,} at --max-tokens {summary['max_tokens']:,}")
        )
    histogram = ", ".join(f"{k} {v:,}" for k, v in summary["length_histogram"].items())
    if histogram:
        lines.append(row("lengths", histogram))
    if summary["quarantined"]:
        lines.append(row("quarantined", f"{summary['quarantined']:,} → {files['quarantine']}"))
        lines += reason_rows(summary["quarantine_reasons"])
    estimate = summary.get("extraction_estimate")
    if estimate:
        fits = "fits" if estimate["fits"] else "does NOT fit"
        lines.append(
            row(
                "extraction",
                f"~{human_bytes(estimate['bytes'])} ({estimate['layers']} layers × "
                f"{estimate['hidden_size']} × bf16 per token); {fits} in "
                f"{human_bytes(estimate['disk_free_bytes'])} free at {estimate['output_dir']} "
                f"(reserve {human_bytes(estimate['disk_reserve_bytes'])})",
            )
        )
    lines.append(row("summary", files["summary"]))
    return "\n".join(lines)
