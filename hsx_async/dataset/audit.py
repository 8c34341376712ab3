"""Deep audit of a dataset (``hsx verify --deep``) and ``hsx inspect FILE``.

Beyond the hashes (``hsx verify``), decode every ``hidden_states`` tensor and report what a
broken extraction looks like:

- NaN / Inf values (an exponent-bit test on int16 views, in chunks of ~2M elements: ~5 GB/s
  where ``isnan().any()`` manages 0.9, PERF-NOTES);
- all-zero rows (a part that was never written, a row the server skipped);
- rows identical across two layers (a duplicated or wrong layer id);
- per-layer row-norm statistics (mean / max of the L2 norms of the rows), their
  distribution as a PNG, and samples whose norms are far from the others' (a sample from
  another model or config, a final state saved without its norm, or with it where an aux
  layer should be). Residual streams grow with depth and the final state is post-norm, so
  a wrong layer id or a norm / un-norm mix-up shows as a layer out of line.

FP8 datasets are decoded as the trainer sees them (each chunk of rows dequantized, then
the same checks); the FP8 sections themselves are checked too (:mod:`.quant_audit`: every
scale finite and positive, each stored vector's largest ``|q|`` the quantizer's 448) and
the estimated quantization error is reported per layer slot.

Hard faults are ``problems`` (``hsx verify --deep`` fails on them); heuristic findings are
``warnings``. Work is spread over a few threads: numpy and torch release the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash

from hsx_async.dataset import reader as dataset
from hsx_async.dataset.layout import FILE_SUFFIX, canonical_id, read_header
from hsx_async.dataset.manifest import ManifestEntry, read_manifest
from hsx_async.dataset.quant_audit import QuantStats, fp8_warnings, scan_fp8
from hsx_async.dataset.reader import SampleHeader
from hsx_async.errors import DatasetError
from hsx_async.parallel import ordered_map
from hsx_async.protocol import BF16_STORAGE, Storage

CHUNK_ELEMENTS = 2 << 20  # bf16 values per step: large enough to stream, small for the cache
_EXP_MASK = 0x7F80  # bf16 exponent bits: all set means Inf (mantissa 0) or NaN
_MANTISSA = 0x007F
_MAGNITUDE = 0x7FFF  # everything but the sign: zero for +0 and -0
NORM_EDGES = np.linspace(-3.0, 6.0, 181)  # log10 of a row norm, 0.05 decade per bin
MAX_LISTED = 50  # problem lines in a report before "... and N more"
OUTLIER_FACTOR = 4.0  # a sample's mean row norm this far from the median is out of line
MIN_SAMPLES_FOR_OUTLIERS = 5

Progress = Callable[[int, int], None]
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass
class SampleStats:
    """What decoding one sample found; per-layer arrays are indexed in stored order."""

    path: Path
    sample_id: str
    num_tokens: int
    hidden_size: int
    aux_layers: tuple[int, ...]
    nan: np.ndarray
    inf: np.ndarray
    zero_rows: np.ndarray
    rows: np.ndarray  # finite rows per layer (those in the norm statistics)
    norm_sum: np.ndarray
    norm_max: np.ndarray
    value_min: np.ndarray
    value_max: np.ndarray
    hist: np.ndarray  # [L, bins] counts of log10 row norms
    identical: dict[tuple[int, int], int] = field(default_factory=dict)
    first_nonfinite: tuple[int, int] | None = None  # (token, layer)
    first_zero_row: tuple[int, int] | None = None
    negative_ids: int = 0
    mask_values_over_1: int = 0
    mask_ones: int | None = None  # None: the file has no loss_mask
    storage: Storage = BF16_STORAGE
    quant: QuantStats | None = None  # FP8 files: the sections' own checks and error

    @classmethod
    def empty(cls, path: Path, header: SampleHeader) -> SampleStats:
        layers = header.num_layers
        zeros = np.zeros(layers, dtype=np.int64)
        fp8 = header.storage.is_fp8
        return cls(
            path=path,
            sample_id=header.sample_id,
            num_tokens=header.num_tokens,
            hidden_size=header.hidden_size,
            aux_layers=header.aux_layers,
            nan=zeros.copy(),
            inf=zeros.copy(),
            zero_rows=zeros.copy(),
            rows=zeros.copy(),
            norm_sum=np.zeros(layers),
            norm_max=np.zeros(layers),
            value_min=np.full(layers, np.inf),
            value_max=np.full(layers, -np.inf),
            hist=np.zeros((layers, len(NORM_EDGES) - 1), dtype=np.int64),
            storage=header.storage,
            quant=QuantStats.empty(header.storage.quantized, layers) if fp8 else None,
        )

    @property
    def layer_names(self) -> list[str]:
        return layer_names(self.aux_layers)

    @property
    def mean_norm(self) -> np.ndarray:
        mean: np.ndarray = self.norm_sum / np.maximum(self.rows, 1)
        return mean

    def problems(self) -> list[str]:
        where = f"{self.path} (id {self.sample_id!r})"
        names = self.layer_names
        found = []
        if self.nan.any() or self.inf.any():
            token, layer = self.first_nonfinite or (0, 0)
            found.append(
                f"{where}: {int(self.nan.sum())} NaN and {int(self.inf.sum())} Inf values "
                f"in {_per_layer(self.nan + self.inf, names)}; first at token {token}, "
                f"{names[layer]}"
            )
        if self.zero_rows.any():
            token, layer = self.first_zero_row or (0, 0)
            found.append(
                f"{where}: all-zero rows in {_per_layer(self.zero_rows, names)} of "
                f"{self.num_tokens} tokens; first at token {token}, {names[layer]}"
            )
        for (a, b), count in sorted(self.identical.items()):
            found.append(
                f"{where}: {names[a]} and {names[b]} are identical in {count} of "
                f"{self.num_tokens} rows (a duplicated or wrong layer id?)"
            )
        if self.negative_ids:
            found.append(f"{where}: {self.negative_ids} negative input_ids")
        if self.mask_values_over_1:
            found.append(f"{where}: {self.mask_values_over_1} loss_mask values other than 0/1")
        if self.quant is not None:
            found.extend(self.quant.problems(where, names, self.num_tokens))
        return found


def layer_names(aux_layers: Sequence[int]) -> list[str]:
    return [f"layer {i}" for i in aux_layers] + ["final"]


def _per_layer(counts: np.ndarray, names: Sequence[str]) -> str:
    return ", ".join(f"{names[i]}: {int(c)}" for i, c in enumerate(counts) if c)


def _scan_nonfinite(bits: np.ndarray, stats: SampleStats, offset: int) -> np.ndarray | None:
    """Count NaN / Inf from the exponent bits; the mask of non-finite values, None if none."""
    exponent = np.bitwise_and(bits, _EXP_MASK)
    bad: np.ndarray = exponent == _EXP_MASK
    if not bad.any():
        return None
    nan = bad & (np.bitwise_and(bits, _MANTISSA) != 0)
    nan_count = nan.sum(axis=(0, 2))
    stats.nan += nan_count
    stats.inf += bad.sum(axis=(0, 2)) - nan_count
    if stats.first_nonfinite is None:
        token, layer, _ = np.argwhere(bad)[0]
        stats.first_nonfinite = (offset + int(token), int(layer))
    return bad


def _scan_rows(bits: np.ndarray, stats: SampleStats, offset: int) -> None:
    """All-zero rows, and nonzero rows identical across two layers."""
    nonzero = np.bitwise_and(bits, _MAGNITUDE).any(axis=2)
    zero = ~nonzero
    if zero.any():
        stats.zero_rows += zero.sum(axis=0)
        if stats.first_zero_row is None:
            token, layer = np.argwhere(zero)[0]
            stats.first_zero_row = (offset + int(token), int(layer))
    for a, b in combinations(range(bits.shape[1]), 2):
        same = int(((bits[:, a, :] == bits[:, b, :]).all(axis=1) & nonzero[:, a]).sum())
        if same:
            stats.identical[(a, b)] = stats.identical.get((a, b), 0) + same


def _scan_values(values: torch.Tensor, stats: SampleStats, bad: np.ndarray | None) -> None:
    """Smallest and largest finite value per layer (``hsx inspect`` shows them)."""
    wide = values.float()
    if bad is None:  # the usual case: no mask to apply
        low, high = wide.amin(dim=(0, 2)), wide.amax(dim=(0, 2))
    else:
        mask = torch.from_numpy(bad)
        low = wide.masked_fill(mask, float("inf")).amin(dim=(0, 2))
        high = wide.masked_fill(mask, float("-inf")).amax(dim=(0, 2))
    stats.value_min = np.minimum(stats.value_min, low.numpy())
    stats.value_max = np.maximum(stats.value_max, high.numpy())


def _scan_norms(
    bits: np.ndarray, stats: SampleStats, bad: np.ndarray | None, *, values: bool
) -> None:
    hidden = torch.from_numpy(bits).view(torch.bfloat16)
    if values:
        _scan_values(hidden, stats, bad)
    # Accumulate in float32 without materialising a float32 copy of the chunk.
    norms = torch.linalg.vector_norm(hidden, dim=2, dtype=torch.float32).numpy()  # [t, L]
    for layer in range(norms.shape[1]):
        column = norms[:, layer]
        column = column[np.isfinite(column)]  # rows with NaN / Inf are counted apart
        stats.rows[layer] += column.size
        if column.size:
            stats.norm_sum[layer] += float(column.sum(dtype=np.float64))
            stats.norm_max[layer] = max(stats.norm_max[layer], float(column.max()))
            positive = column[column > 0]
            logs = np.clip(np.log10(positive), NORM_EDGES[0], NORM_EDGES[-1])
            stats.hist[layer] += np.histogram(logs, bins=NORM_EDGES)[0]


def scan_file(path: Path, *, num_tokens: int | None = None, values: bool = False) -> SampleStats:
    """Decode one sample file and gather its statistics (raises DatasetError if unreadable).

    ``values`` adds the per-layer min / max values (one more pass over the data). An FP8
    file is dequantized one chunk of rows at a time, as the reader dequantizes it.
    """
    header, stored = dataset.read_hidden(
        path, (dataset.INPUT_IDS, dataset.LOSS_MASK), num_tokens=num_tokens
    )
    stats = SampleStats.empty(path, header)
    ids = stored[dataset.INPUT_IDS].numpy()
    stats.negative_ids = int((ids < 0).sum())
    mask = stored.get(dataset.LOSS_MASK)
    if mask is not None:
        flags = mask.numpy()
        stats.mask_values_over_1 = int((flags > 1).sum())
        stats.mask_ones = int((flags == 1).sum())
    step = max(1, CHUNK_ELEMENTS // max(1, header.num_layers * header.hidden_size))
    for start in range(0, header.num_tokens, step):
        rows = {name: tensor[start : start + step] for name, tensor in stored.items()}
        if stats.quant is not None:
            scan_fp8(rows, stats.quant, start)
        chunk = dataset.hidden_bf16(header, rows).view(_int16()).numpy()  # bf16: no copy
        bad = _scan_nonfinite(chunk, stats, start)
        _scan_rows(chunk, stats, start)
        _scan_norms(chunk, stats, bad, values=values)
    return stats


def _int16() -> torch.dtype:
    return torch.int16


@dataclass(frozen=True, slots=True)
class LayerSummary:
    name: str
    rows: int
    mean_norm: float
    max_norm: float
    nan: int
    inf: int
    zero_rows: int
    # FP8 slots: the estimated relative RMS quantization error of its vectors (mean, max);
    # None for a slot stored as bf16.
    fp8_err_mean: float | None = None
    fp8_err_max: float | None = None
    # and the share of its FP8 values (outliers excluded) stored as subnormals or zero
    fp8_subnormal: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "mean_norm": self.mean_norm,
            "max_norm": self.max_norm,
            "nan": self.nan,
            "inf": self.inf,
            "zero_rows": self.zero_rows,
            "fp8_rel_rms_error_mean": self.fp8_err_mean,
            "fp8_rel_rms_error_max": self.fp8_err_max,
            "fp8_subnormal_share": self.fp8_subnormal,
        }


@dataclass
class AuditReport:
    """The result of :func:`audit_dataset`; ``problems`` empty means the data decoded clean."""

    out_dir: Path
    samples_total: int
    samples_audited: int
    tokens_audited: int = 0
    bytes_audited: int = 0
    seconds: float = 0.0
    layers: list[LayerSummary] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plot_path: Path | None = None
    storage: str = BF16_STORAGE.describe()  # of the audited samples (the first one's)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """What ``hsx verify --deep --json`` prints."""
        return {
            "out_dir": str(self.out_dir),
            "ok": self.ok,
            "storage": self.storage,
            "samples_total": self.samples_total,
            "samples_audited": self.samples_audited,
            "tokens_audited": self.tokens_audited,
            "bytes_audited": self.bytes_audited,
            "seconds": self.seconds,
            "layers": [layer.to_dict() for layer in self.layers],
            "problems": self.problems,
            "warnings": self.warnings,
            "plot": None if self.plot_path is None else str(self.plot_path),
        }

    def format(self) -> str:
        rate = self.bytes_audited / self.seconds / 1e9 if self.seconds > 0 else 0.0
        lines = [
            f"deep audit of {self.out_dir}: {self.samples_audited} of {self.samples_total} "
            f"samples, {self.tokens_audited} tokens, {self.bytes_audited / 1e9:.2f} GB in "
            f"{self.seconds:.1f} s ({rate:.2f} GB/s)",
            f"storage: {self.storage}",
        ]
        if self.layers:
            lines.append(_layer_table(self.layers))
        lines.extend(_listed("problem", self.problems))
        lines.extend(_listed("warning", self.warnings))
        if self.plot_path is not None:
            lines.append(f"row-norm plot: {self.plot_path}")
        lines.append(
            "deep audit: OK" if self.ok else f"deep audit: {len(self.problems)} problem(s)"
        )
        return "\n".join(lines)


def _layer_table(layers: Sequence[LayerSummary]) -> str:
    head = f"  {'layer':<10} {'rows':>10} {'mean |row|':>12} {'max |row|':>12} {'NaN':>6} "
    head += f"{'Inf':>6} {'zero rows':>10}"
    fp8 = any(s.fp8_err_mean is not None for s in layers)
    if fp8:
        head += f" {'fp8 err mean':>12} {'fp8 err max':>12} {'fp8 subnorm':>11}"
    body = [
        f"  {s.name:<10} {s.rows:>10} {s.mean_norm:>12.4g} {s.max_norm:>12.4g} {s.nan:>6} "
        f"{s.inf:>6} {s.zero_rows:>10}" + (_fp8_columns(s) if fp8 else "")
        for s in layers
    ]
    lines = [head, *body]
    if fp8:
        lines.append(
            "  fp8 err: estimated relative RMS error of each stored FP8 vector (from its "
            "values: rounding to e4m3fn); subnorm: share of its FP8 values stored as "
            "subnormals or zero (outliers excluded); bf16 slots: -"
        )
    return "\n".join(lines)


def _fp8_columns(s: LayerSummary) -> str:
    share = s.fp8_subnormal
    subnormal = f" {'-':>11}" if share is None else f" {share:>11.3%}"
    return _err_columns(s.fp8_err_mean, s.fp8_err_max) + subnormal


def _err_columns(mean: float | None, high: float | None) -> str:
    if mean is None or high is None:
        return f" {'-':>12} {'-':>12}"
    return f" {mean:>12.3%} {high:>12.3%}"


def _listed(kind: str, items: Sequence[str]) -> list[str]:
    shown = [f"{kind}: {text}" for text in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        shown.append(f"... and {len(items) - MAX_LISTED} more {kind}s")
    return shown


def choose(entries: Sequence[ManifestEntry], fraction: float, seed: int) -> list[ManifestEntry]:
    """A stable sample of the entries: the same ids for the same fraction and seed."""
    if not 0.0 < fraction <= 1.0:
        raise DatasetError(f"sample fraction is {fraction}, expected a number in (0, 1]")
    if fraction >= 1.0:
        return list(entries)
    limit = fraction * 2.0**64
    chosen = [
        e
        for e in entries
        if xxhash.xxh3_64_intdigest(f"audit\0{seed}\0{canonical_id(e.id)}".encode()) < limit
    ]
    return chosen or list(entries[:1])


def _bounded_map(fn: Callable[[_T], _R], items: Iterable[_T], workers: int) -> Iterator[_R]:
    """``map`` over a thread pool, in order, with at most ``2 × workers`` tasks in flight."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hsx-audit") as pool:
        yield from ordered_map(pool, fn, items, 2 * workers)


@dataclass
class _Totals:
    """Running sums over the audited samples that share the first sample's shape."""

    names: list[str]
    shape: tuple[int, tuple[int, ...]]  # hidden_size, aux_layers
    nan: np.ndarray
    inf: np.ndarray
    zero_rows: np.ndarray
    rows: np.ndarray
    norm_sum: np.ndarray
    norm_max: np.ndarray
    hist: np.ndarray
    storage: Storage = BF16_STORAGE
    quant: QuantStats | None = None
    sample_means: list[np.ndarray] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)

    @classmethod
    def first(cls, stats: SampleStats) -> _Totals:
        layers = len(stats.layer_names)
        fp8 = stats.storage.is_fp8
        return cls(
            names=stats.layer_names,
            shape=(stats.hidden_size, stats.aux_layers),
            storage=stats.storage,
            quant=QuantStats.empty(stats.storage.quantized, layers) if fp8 else None,
            nan=np.zeros(layers, dtype=np.int64),
            inf=np.zeros(layers, dtype=np.int64),
            zero_rows=np.zeros(layers, dtype=np.int64),
            rows=np.zeros(layers, dtype=np.int64),
            norm_sum=np.zeros(layers),
            norm_max=np.zeros(layers),
            hist=np.zeros_like(stats.hist),
        )

    def add(self, stats: SampleStats) -> None:
        self.nan += stats.nan
        self.inf += stats.inf
        self.zero_rows += stats.zero_rows
        self.rows += stats.rows
        self.norm_sum += stats.norm_sum
        self.norm_max = np.maximum(self.norm_max, stats.norm_max)
        self.hist += stats.hist
        if self.quant is not None and stats.quant is not None:
            self.quant.add(stats.quant)
        self.sample_means.append(stats.mean_norm)
        self.sample_ids.append(f"{stats.path} (id {stats.sample_id!r})")

    def summary(self) -> list[LayerSummary]:
        mean = np.divide(self.norm_sum, np.maximum(self.rows, 1))
        quant = self.quant
        return [
            LayerSummary(
                name,
                int(self.rows[i]),
                float(mean[i]),
                float(self.norm_max[i]),
                int(self.nan[i]),
                int(self.inf[i]),
                int(self.zero_rows[i]),
                fp8_err_mean=(float(quant.err_mean[i]) if quant and i in quant.slots else None),
                fp8_err_max=float(quant.err_max[i]) if quant and i in quant.slots else None,
                fp8_subnormal=(
                    float(quant.subnormal_share[i]) if quant and i in quant.slots else None
                ),
            )
            for i, name in enumerate(self.names)
        ]


def _scan_entry(out_dir: Path, entry: ManifestEntry) -> SampleStats | str:
    path = out_dir / entry.path
    try:
        size = path.stat().st_size
        if size != entry.size:
            return f"{path}: {size} bytes, the manifest says {entry.size}; run hsx verify"
        return scan_file(path, num_tokens=entry.num_tokens)
    except FileNotFoundError:
        return f"{path}: listed in the manifest but missing; run hsx verify"
    except DatasetError as exc:
        return str(exc)


def audit_dataset(
    out_dir: Path,
    *,
    sample_fraction: float = 1.0,
    plot_path: Path | None = None,
    seed: int = 0,
    workers: int = 2,
    progress: Progress | None = None,
) -> AuditReport:
    """Decode the samples of ``out_dir`` (all shards; a stable ``sample_fraction`` of them)
    and report faults and per-layer norm statistics; write a PNG to ``plot_path`` if given."""
    started = time.monotonic()
    entries = read_manifest(out_dir)
    chosen = choose(sorted(entries, key=lambda e: canonical_id(e.id)), sample_fraction, seed)
    report = AuditReport(out_dir, len(entries), len(chosen))
    totals: _Totals | None = None
    results = _bounded_map(lambda e: (e, _scan_entry(out_dir, e)), chosen, max(1, workers))
    for count, (entry, result) in enumerate(results, start=1):
        if isinstance(result, str):
            report.problems.append(result)
        else:
            report.tokens_audited += result.num_tokens
            report.bytes_audited += entry.size
            report.problems.extend(result.problems())
            totals = totals or _Totals.first(result)
            if (result.hidden_size, result.aux_layers) != totals.shape:
                report.problems.append(_shape_problem(result, totals))
            elif result.storage != totals.storage:
                report.problems.append(_storage_problem(result, totals))
            else:
                totals.add(result)
        if progress is not None:
            progress(count, len(chosen))
    if not entries:
        report.warnings.append(f"{out_dir} has no samples in its manifest")
    if totals is not None:
        report.storage = totals.storage.describe()
        report.layers = totals.summary()
        report.warnings.extend(norm_warnings(totals.names, totals.sample_means, totals.sample_ids))
        report.warnings.extend(depth_warnings(report.layers, totals.shape[1]))
        if totals.quant is not None:
            report.warnings.extend(fp8_warnings(totals.quant, totals.names, totals.storage.scales))
        if plot_path is not None:
            _plot_norms(plot_path, totals, title=f"{out_dir} ({report.samples_audited} samples)")
            report.plot_path = plot_path
    report.seconds = time.monotonic() - started
    return report


def _shape_problem(stats: SampleStats, totals: _Totals) -> str:
    hidden, aux = totals.shape
    return (
        f"{stats.path} (id {stats.sample_id!r}): hidden_size {stats.hidden_size}, aux_layers "
        f"{list(stats.aux_layers)}; other samples have {hidden}, {list(aux)} (mixed configs)"
    )


def _storage_problem(stats: SampleStats, totals: _Totals) -> str:
    return (
        f"{stats.path} (id {stats.sample_id!r}): stored as {stats.storage.describe()}; other "
        f"samples are {totals.storage.describe()} (files of two runs)"
    )


def norm_warnings(
    names: Sequence[str], sample_means: Sequence[np.ndarray], sample_ids: Sequence[str]
) -> list[str]:
    """Samples whose mean row norm in some layer is ``OUTLIER_FACTOR`` off the median."""
    if len(sample_means) < MIN_SAMPLES_FOR_OUTLIERS:
        return []
    means = np.stack(sample_means)  # [samples, L]
    median = np.median(means, axis=0)
    ratio = np.divide(means, np.where(median > 0, median, 1.0))
    off = (ratio > OUTLIER_FACTOR) | (ratio < 1.0 / OUTLIER_FACTOR)
    found = []
    for s, layer in zip(*np.nonzero(off), strict=True):
        found.append(
            f"{sample_ids[s]}: mean row norm of {names[layer]} is {means[s, layer]:.4g}, "
            f"{ratio[s, layer]:.3g}× the median {median[layer]:.4g} (another model or "
            "config, or a norm / un-norm mix-up?)"
        )
    return found


def depth_warnings(layers: Sequence[LayerSummary], aux_layers: Sequence[int]) -> list[str]:
    """Residual streams grow with depth: an aux layer with under half the mean row norm of
    a shallower one suggests wrong layer ids or a wrong order."""
    found = []
    order = sorted(range(len(aux_layers)), key=lambda i: aux_layers[i])
    strongest: LayerSummary | None = None
    for index in order:
        layer = layers[index]
        if not layer.rows:
            continue
        if strongest is not None and layer.mean_norm < 0.5 * strongest.mean_norm:
            found.append(
                f"{layer.name} has mean row norm {layer.mean_norm:.4g}, under half of "
                f"{strongest.name}'s {strongest.mean_norm:.4g}; residual norms usually grow "
                "with depth (aux layer ids or order wrong?)"
            )
        if strongest is None or layer.mean_norm > strongest.mean_norm:
            strongest = layer
    return found


def _plot_norms(path: Path, totals: _Totals, *, title: str) -> None:
    """Two panels: the row-norm distribution per layer, and each sample's mean per layer."""
    # matplotlib is optional (the [plot] extra): only --plot needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, whatever pyplot's backend is; no global state touched
    dist, per_sample = fig.subplots(2, 1)
    edges = 10.0**NORM_EDGES
    for layer, name in enumerate(totals.names):
        counts = totals.hist[layer]
        if counts.sum():
            dist.stairs(counts / counts.sum(), edges, label=name)
    used = np.nonzero(totals.hist.sum(axis=0))[0]
    if used.size:  # zoom on the populated decades, not the whole 1e-3..1e6 range
        dist.set_xlim(edges[max(used[0] - 4, 0)], edges[min(used[-1] + 5, len(edges) - 1)])
    dist.set_xscale("log")
    dist.set_xlabel("L2 norm of a hidden-state row")
    dist.set_ylabel("share of rows")
    dist.set_title(f"row-norm distribution per layer — {title}")
    dist.legend()
    means = np.stack(totals.sample_means)
    for layer, name in enumerate(totals.names):
        per_sample.plot(np.arange(len(means)), means[:, layer], ".", markersize=3, label=name)
    per_sample.set_yscale("log")
    per_sample.set_xlabel("sample (in id order)")
    per_sample.set_ylabel("mean row norm")
    per_sample.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def inspect_file(path: Path) -> str:
    """Shapes, dtypes, metadata and statistics of one sample file, as text."""
    stats = scan_file(path, values=True)
    header, stored = dataset.read_tensors(path, (dataset.INPUT_IDS,))
    ids = stored[dataset.INPUT_IDS]
    header_bytes = read_header(path)[1]
    hidden_offset = header_bytes + 8 * header.num_tokens
    shown = " ".join(str(int(x)) for x in ids[:8]) + (" …" if header.num_tokens > 8 else "")
    t, layers, size = header.num_tokens, header.num_layers, header.hidden_size
    mask = (
        f"U8    [{t}]  {stats.mask_ones} ones of {t}"
        if stats.mask_ones is not None
        else f"not stored (the input gave none): readers yield {t} ones"
    )
    lines = [
        str(path),
        "  metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(header.metadata.items())),
        f"  file: {path.stat().st_size} bytes; header {header_bytes} bytes; hidden_states at "
        f"{hidden_offset} ({'4 KiB aligned' if hidden_offset % 4096 == 0 else 'unaligned'})",
        f"  storage: {header.storage.describe()}",
        f"  input_ids      I64   [{t}]  min {int(ids.min()) if t else '-'} max "
        f"{int(ids.max()) if t else '-'}; first: {shown}",
        *_section_lines(header.storage, t, layers, size),
        f"  loss_mask      {mask}",
        _sample_table(stats),
    ]
    problems = stats.problems()
    lines.extend(f"  problem: {p}" for p in problems)
    lines.append("  problems: none" if not problems else f"  {len(problems)} problem(s)")
    return "\n".join(lines)


def _section_lines(storage: Storage, t: int, layers: int, size: int) -> list[str]:
    """One line per hidden section of the file (bf16: the one ``hidden_states``)."""
    names = _section_slots(storage, layers)
    lines = []
    for section in storage.sections(layers, size):
        shape = ", ".join(map(str, (t, *section.row_shape)))
        lines.append(
            f"  {section.name:<14} {section.dtype:<5} [{shape}]{names.get(section.name, '')}"
        )
    return lines


def _section_slots(storage: Storage, layers: int) -> dict[str, str]:
    """Which layer slots each FP8 section holds, as the inspect line's suffix."""
    if not storage.is_fp8:
        return {}
    quantized = "  slots " + ",".join(map(str, storage.quantized))
    return {
        "hidden_states": quantized,
        "hidden_states_scales": quantized + " (one float32 scale per token and slot)",
        "hidden_states_outlier_index": quantized
        + f" (the channels of each vector's {storage.outliers} outliers; 65535: unused)",
        "hidden_states_outlier_values": quantized + " (their values, exact)",
        "hidden_states_unquantized": "  slots " + ",".join(map(str, storage.kept(layers))),
    }


def _sample_table(stats: SampleStats) -> str:
    head = f"  {'layer':<10} {'mean |row|':>11} {'max |row|':>11} {'min value':>11} "
    head += f"{'max value':>11} {'NaN':>5} {'Inf':>5} {'zero rows':>9}"
    quant = stats.quant
    if quant is not None:
        head += f" {'fp8 err mean':>12} {'fp8 err max':>12}"
    mean = stats.mean_norm
    rows = []
    for i, name in enumerate(stats.layer_names):
        row = (
            f"  {name:<10} {mean[i]:>11.4g} {stats.norm_max[i]:>11.4g} "
            f"{stats.value_min[i]:>11.4g} {stats.value_max[i]:>11.4g} {int(stats.nan[i]):>5} "
            f"{int(stats.inf[i]):>5} {int(stats.zero_rows[i]):>9}"
        )
        if quant is not None:
            fp8 = i in quant.slots
            row += _err_columns(
                float(quant.err_mean[i]) if fp8 else None, float(quant.err_max[i]) if fp8 else None
            )
        rows.append(row)
    return "\n".join([head, *rows])


def _inspectable(path: Path) -> Path:
    """``path`` if it is a sample file; otherwise a DatasetError saying what to give."""
    if path.is_dir():
        first = next(iter(sorted(path.rglob(f"*{FILE_SUFFIX}"))), None)
        hint = f", e.g. hsx inspect {first}" if first is not None else ""
        raise DatasetError(
            f"{path} is a directory; give sample files (data/…/*{FILE_SUFFIX}){hint}, "
            "or use hsx status / hsx verify for a whole dataset"
        )
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    if not path.is_file():
        raise DatasetError(f"{path} is not a regular file")
    return path


def inspect_path(path: Path) -> str:
    """What ``hsx inspect`` shows of one sample file (:func:`inspect_file`), or
    :class:`DatasetError` saying why it cannot (a directory, no such file, unreadable)."""
    try:
        return inspect_file(_inspectable(path))
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read it ({exc.strerror})") from None
