"""``hsx export``: the dataset in the on-disk format of an existing EAGLE-3 trainer.

Streaming and resumable: one sample at a time (memory bounded by one sample), each output
written under a temporary name, fsynced and renamed into place, then recorded in
``hsx-export.jsonl`` in the destination. A rerun skips every output whose record, size and
source hash still match, and redoes the rest; a crash leaves at most a temporary file,
removed on the next run. Output indices are assigned once per sample id (in id order) and
kept across runs, so a resumed or extended export never renumbers a file.

Formats, matched against the trainers' own code (read, not copied):

``specforge`` — sgl-project/SpecForge (commit a6b6b02):
    ``scripts/prepare_hidden_states.py`` (``HiddenStatesGenerator._get_file_path``,
    ``_save_tensor_sync``) writes ``rows_{g}-{g + 2000}/data_{idx}.ckpt`` (``g`` = ``idx``
    rounded down to the group size, 2000 by default) with ``torch.save`` of a dict built by
    ``OfflineCaptureLayout.materialize`` (``specforge/algorithms/common/providers.py``):
    ``input_ids`` int64 ``[T]``, ``loss_mask`` int64 ``[T]``, ``aux_hidden_state``
    ``[1, T, 3H]`` and ``hidden_state`` ``[1, T, H]`` in the model dtype (bf16). The reader
    (``specforge/runtime/data_plane/offline_reader.py``: ``list_feature_files`` walks the
    tree for ``*.ckpt``; ``feature_store.load_feature_file``: ``torch.load(path,
    weights_only=False, mmap=True)``) and the EAGLE-3 normalizer
    (``specforge/algorithms/eagle3/data.py``) use exactly these keys and shapes. The trainer
    zeroes the last ``loss_mask`` position itself, so the mask is exported as stored (all
    ones when the input had none).

``speculators`` — vllm-project/speculators (commit c05b95b):
    ``hs_connectors/src/hs_connectors/transfer.py`` (``FileTransfer.get_cached``) loads
    ``<data>/hidden_states/hs_{idx}.safetensors`` with ``safetensors.torch.load_file``;
    ``src/speculators/train/data.py`` (``ArrowDataset._get_raw_data``) takes
    ``hidden_states`` ``[T, n_layers, H]`` (aux layers in order, then the last layer: it
    uses ``[:, :-1].flatten(1)`` and ``[:, -1]``) and ``token_ids`` ``[T]``, which it
    compares with ``torch.equal`` to the int64 ``input_ids`` of its preprocessed dataset
    (``src/speculators/data_generation/preprocessing.py``: columns ``input_ids``,
    ``loss_mask`` (int64) and ``seq_len``). hsx's ``hidden_states`` is that tensor
    unchanged. Row ``idx`` of ``samples.jsonl`` holds those three columns (plus ``hsx_id``)
    for ``hs_{idx}``; speculators reads them from a HuggingFace ``datasets`` directory,
    which ``Dataset.from_json(...)`` + ``save_to_disk`` builds (see the command's output).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import AppendLog, ManifestEntry, read_log, read_manifest
from hsx_async.errors import DatasetError

if TYPE_CHECKING:
    import torch

SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMATS = (SPECFORGE, SPECULATORS)
SPECFORGE_GROUP_SIZE = 2000  # SpecForge's --file-group-size default
EXPORT_LOG = "hsx-export.jsonl"
EXPORT_INFO = "hsx-export.json"
SPECULATORS_ROWS = "samples.jsonl"
TMP_PREFIX = ".hsx-tmp-"
LOCK_NAME = ".hsx-export.lock"

Progress = Callable[[int, int], None]  # (samples handled, total)


def specforge_relpath(index: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """``rows_{g}-{g+group}/data_{index}.ckpt``, as SpecForge's ``_get_file_path``."""
    group = index // group_size * group_size
    return f"rows_{group}-{group + group_size}/data_{index}.ckpt"


def speculators_relpath(index: int) -> str:
    """``hidden_states/hs_{index}.safetensors``, as speculators' ``FileTransfer``."""
    return f"hidden_states/hs_{index}.safetensors"


def relpath_for(fmt: str, index: int, group_size: int) -> str:
    return specforge_relpath(index, group_size) if fmt == SPECFORGE else speculators_relpath(index)


@dataclass(frozen=True, slots=True)
class ExportRecord:
    """One line of ``hsx-export.jsonl``: an output that is complete and durable."""

    index: int
    id: str
    path: str
    size: int
    source_xxh3_64: str

    def to_line(self) -> bytes:
        return (
            orjson.dumps(
                {
                    "index": self.index,
                    "id": self.id,
                    "path": self.path,
                    "bytes": self.size,
                    "source_xxh3_64": self.source_xxh3_64,
                }
            )
            + b"\n"
        )


@dataclass(frozen=True, slots=True)
class ExportResult:
    fmt: str
    dest: Path
    total: int
    written: int
    skipped: int
    bytes_written: int
    seconds: float


def _record(raw: Any, where: str) -> ExportRecord:
    try:
        return ExportRecord(
            index=int(raw["index"]),
            id=str(raw["id"]),
            path=str(raw["path"]),
            size=int(raw["bytes"]),
            source_xxh3_64=str(raw["source_xxh3_64"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: export log line is missing or mistypes {exc}") from None


def read_export_log(dest: Path) -> dict[str, ExportRecord]:
    """The latest record per sample id (a redone sample appends a newer line)."""
    path = dest / EXPORT_LOG
    records, _torn = read_log(path)
    return {rec.id: rec for rec in (_record(raw, f"{path}:{n}") for n, raw in records)}


def assign_indices(ids: Sequence[str], done: dict[str, ExportRecord]) -> dict[str, int]:
    """Keep every recorded index; number new ids after the highest one, in the given order."""
    indices = {i: done[i].index for i in ids if i in done}
    following = max((r.index for r in done.values()), default=-1) + 1
    for sample_id in ids:
        if sample_id not in indices:
            indices[sample_id] = following
            following += 1
    return indices


def _claim(dest: Path, fmt: str, group_size: int, out_dir: Path) -> None:
    """Record what this directory is an export of; refuse to mix formats in one directory."""
    info = {"format": fmt, "file_group_size": group_size, "source": str(out_dir.resolve())}
    path = dest / EXPORT_INFO
    if path.exists():
        try:
            old = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            raise DatasetError(f"{path} is not valid JSON; export into another directory") from None
        if (old.get("format"), old.get("file_group_size")) != (fmt, group_size):
            raise DatasetError(
                f"{dest} holds a {old.get('format')} export (file_group_size "
                f"{old.get('file_group_size')}); export to another --to directory"
            )
        return
    _write_durably(path, lambda tmp: tmp.write_bytes(orjson.dumps(info) + b"\n"))


def _fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(final: Path, write: Callable[[Path], object]) -> int:
    """``write(tmp)`` then fsync, rename over ``final``, fsync the directory; the size."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(TMP_PREFIX + final.name)
    try:
        write(tmp)
        _fsync_path(tmp)
        tmp.replace(final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_path(final.parent, os.O_DIRECTORY)
    return final.stat().st_size


def _specforge_record(sample_path: Path, entry: ManifestEntry) -> dict[str, torch.Tensor]:
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    _, stored = dataset.read_tensors(
        sample_path,
        (dataset.INPUT_IDS, dataset.HIDDEN_STATES, dataset.LOSS_MASK),
        num_tokens=entry.num_tokens,
    )
    final, aux = dataset.split_layers(stored[dataset.HIDDEN_STATES])
    mask = stored.get(dataset.LOSS_MASK)
    # clone(): torch.save writes a tensor's whole storage, and these views share the
    # mapping of the entire sample file.
    compact = torch.contiguous_format
    return {  # key order of SpecForge's OfflineCaptureLayout: passthrough, aux, last
        "input_ids": stored[dataset.INPUT_IDS].clone(),
        "loss_mask": (
            torch.ones(entry.num_tokens, dtype=torch.int64)
            if mask is None
            else mask.to(torch.int64)
        ),
        "aux_hidden_state": aux.clone(memory_format=compact).unsqueeze(0),
        "hidden_state": final.clone(memory_format=compact).unsqueeze(0),
    }


def _write_specforge(sample_path: Path, entry: ManifestEntry, tmp: Path) -> None:
    import torch  # noqa: PLC0415 - torch stays out of hsx --help

    record = _specforge_record(sample_path, entry)
    with tmp.open("wb") as fh:
        torch.save(record, fh)


def _write_speculators(sample_path: Path, entry: ManifestEntry, tmp: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 - torch stays out of hsx --help

    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    header, stored = dataset.read_tensors(
        sample_path, (dataset.INPUT_IDS, dataset.HIDDEN_STATES), num_tokens=entry.num_tokens
    )
    tensors = {
        "hidden_states": stored[dataset.HIDDEN_STATES],  # [T, L, H] as stored, no copy
        "token_ids": stored[dataset.INPUT_IDS].clone(),
    }
    meta = {"hsx_id": canonical_id(entry.id), "aux_layers": header.metadata.get("aux_layers", "")}
    save_file(tensors, str(tmp), metadata=meta)


def _remove_stale_temps(dest: Path) -> None:
    """Temporary files left by a crash: never a complete output, always safe to drop."""
    for path in dest.rglob(TMP_PREFIX + "*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _is_complete(dest: Path, record: ExportRecord | None, entry: ManifestEntry, rel: str) -> bool:
    if record is None or record.path != rel or record.source_xxh3_64 != entry.xxh3_64:
        return False
    try:
        return (dest / rel).stat().st_size == record.size
    except FileNotFoundError:
        return False


def _check_stale(done: dict[str, ExportRecord], ids: set[str], dest: Path) -> None:
    stale = sorted(set(done) - ids)
    if stale:
        raise DatasetError(
            f"{dest} holds exports of {len(stale)} sample(s) no longer in the dataset (e.g. "
            f"{stale[0]!r}); export into an empty directory"
        )


@contextlib.contextmanager
def _exclusive(dest: Path) -> Iterator[None]:
    """One export at a time per destination: two would race on indices and the log."""
    fd = os.open(dest / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatasetError(f"another hsx export is writing to {dest}; wait for it") from None
        yield
    finally:
        os.close(fd)


def _check_args(out_dir: Path, dest: Path, fmt: str, file_group_size: int) -> None:
    if fmt not in FORMATS:
        raise DatasetError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if file_group_size < 1:
        raise DatasetError(f"file_group_size is {file_group_size}, expected at least 1")
    if dest.resolve() == out_dir.resolve():
        raise DatasetError("--to must not be the dataset directory itself")


@dataclass
class _Run:
    """One export pass: where from, where to, and what is already there."""

    out_dir: Path
    dest: Path
    fmt: str
    group_size: int
    done: dict[str, ExportRecord]
    indices: dict[str, int]
    written: int = 0
    skipped: int = 0
    nbytes: int = 0

    def sample(self, entry: ManifestEntry, sample_id: str, log: AppendLog) -> None:
        rel = relpath_for(self.fmt, self.indices[sample_id], self.group_size)
        if _is_complete(self.dest, self.done.get(sample_id), entry, rel):
            self.skipped += 1
            return
        write = _write_specforge if self.fmt == SPECFORGE else _write_speculators
        source = self.out_dir / entry.path
        size = _write_durably(self.dest / rel, functools.partial(write, source, entry))
        log.append(
            [ExportRecord(self.indices[sample_id], sample_id, rel, size, entry.xxh3_64).to_line()]
        )
        self.written += 1
        self.nbytes += size


def export_dataset(
    out_dir: Path,
    dest: Path,
    *,
    fmt: str,
    file_group_size: int = SPECFORGE_GROUP_SIZE,
    progress: Progress | None = None,
) -> ExportResult:
    """Export every sample of ``out_dir`` (all shards) into ``dest`` in format ``fmt``."""
    from hsx_async.dataset.reader import select_entries  # noqa: PLC0415 - torch stays out of hsx --help

    _check_args(out_dir, dest, fmt, file_group_size)
    started = time.monotonic()
    entries = select_entries(read_manifest(out_dir))
    ids = [canonical_id(e.id) for e in entries]
    dest.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest):
        _claim(dest, fmt, file_group_size, out_dir)
        _remove_stale_temps(dest)
        done = read_export_log(dest)
        _check_stale(done, set(ids), dest)
        run = _Run(out_dir, dest, fmt, file_group_size, done, assign_indices(ids, done))
        log = AppendLog(dest / EXPORT_LOG)
        try:
            for count, (entry, sample_id) in enumerate(zip(entries, ids, strict=True), start=1):
                run.sample(entry, sample_id, log)
                if progress is not None:
                    progress(count, len(entries))
        finally:
            log.close()
        if fmt == SPECULATORS:
            write_speculators_rows(out_dir, dest, entries, run.indices)
    seconds = time.monotonic() - started
    return ExportResult(fmt, dest, len(entries), run.written, run.skipped, run.nbytes, seconds)


def write_speculators_rows(
    out_dir: Path, dest: Path, entries: Sequence[ManifestEntry], indices: dict[str, int]
) -> None:
    """``samples.jsonl``: row ``i`` = input_ids, loss_mask, seq_len of ``hs_i``."""
    from hsx_async.dataset import reader as dataset  # noqa: PLC0415 - torch stays out of hsx --help

    order = sorted(entries, key=lambda e: indices[canonical_id(e.id)])
    if [indices[canonical_id(e.id)] for e in order] != list(range(len(order))):
        raise DatasetError(f"{dest}: export indices have gaps; export into an empty directory")

    def rows(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            for entry in order:
                sample = dataset.read_sample(
                    out_dir / entry.path,
                    (dataset.INPUT_IDS, dataset.LOSS_MASK),
                    num_tokens=entry.num_tokens,
                )
                row = {
                    "input_ids": sample[dataset.INPUT_IDS].tolist(),
                    "loss_mask": sample[dataset.LOSS_MASK].tolist(),
                    "seq_len": entry.num_tokens,
                    "hsx_id": canonical_id(entry.id),
                }
                fh.write(orjson.dumps(row) + b"\n")

    _write_durably(dest / SPECULATORS_ROWS, rows)


_SPECULATORS_HINT = """\
speculators reads input_ids/loss_mask/seq_len from a HuggingFace datasets directory; build it
next to hidden_states/ with:
  python -c "import datasets; d = datasets.Dataset.from_json('{rows}'); \
d.set_format('torch'); d.save_to_disk('{dest}')"
then train with --data-path {dest}"""


def _run(args: argparse.Namespace) -> int:
    def report(done: int, total: int) -> None:
        if done % 1000 == 0 or done == total:
            print(f"hsx export: {done}/{total} samples", file=sys.stderr)

    result = export_dataset(
        args.out_dir,
        args.dest,
        fmt=args.format,
        file_group_size=args.file_group_size,
        progress=report,
    )
    print(
        f"exported {result.total} samples to {result.dest} ({result.fmt}): {result.written} "
        f"written ({result.bytes_written / 1e9:.2f} GB), {result.skipped} already there, "
        f"{result.seconds:.1f} s"
    )
    if result.fmt == SPECULATORS:
        print(_SPECULATORS_HINT.format(rows=result.dest / SPECULATORS_ROWS, dest=result.dest))
    return 0


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the dataset in SpecForge's or speculators' offline format",
        description=(
            "Export every sample of an hsx output directory (all shards) for an existing "
            "trainer. Streaming and resumable: run it again to finish an interrupted export "
            "or to add samples extracted since."
        ),
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT", help="hsx output directory")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target format")
    parser.add_argument(
        "--to", required=True, type=Path, dest="dest", metavar="DIR", help="directory to write"
    )
    parser.add_argument(
        "--file-group-size",
        type=int,
        default=SPECFORGE_GROUP_SIZE,
        metavar="N",
        help="specforge: files per rows_* directory (default: %(default)s, as SpecForge)",
    )
    parser.set_defaults(handler=_run)
