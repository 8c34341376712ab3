"""The export itself, the same for every format (:mod:`.formats`): streaming and resumable.

One sample at a time (memory bounded by one sample), each output written under a temporary
name, fsynced and renamed into place, then recorded in ``hsx-export.jsonl`` in the
destination (:mod:`.log`). A rerun skips every output whose record, size and source hash
still match, and redoes the rest; a crash leaves at most a temporary file, removed on the
next run. Output indices are assigned once per sample id (in id order) and kept across
runs, so a resumed or extended export never renumbers a file.

The final state (the last layer slot): each trainer reads one kind (its format's
``final_state``). A dataset records which kind it holds (PROTOCOL §4); where it differs
from the trainer's, the export converts it with the final norm read from ``--model``
(:mod:`hsx_async.dataset.target`), and refuses without one rather than hand a trainer a
wrong target. ``hsx-export.json`` records the kind and the hidden-state dtype written, so
an old, unconverted export is never silently extended and a resumed export never mixes
dtypes. Every format gets ``draft-config.json`` (:mod:`.draft`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from hsx_async.dataset.durable import exclusive_lock
from hsx_async.dataset.export.draft import DRAFT_CONFIG, describe_ids, draft_config, draft_ids_for
from hsx_async.dataset.export.format import TMP_PREFIX, ExportFormat, export_format, write_output
from hsx_async.dataset.export.fp8 import requantized_slots
from hsx_async.dataset.export.log import EXPORT_LOG, ExportRecord, assign_indices, read_export_log
from hsx_async.dataset.export.plan import (
    AUTO,
    ExportPlan,
    check_dtype_choice,
    dataset_facts,
    find_target,
    plan_conversion,
)
from hsx_async.dataset.export.specforge import GROUP_SIZE as SPECFORGE_GROUP_SIZE
from hsx_async.dataset.inspection import require_dataset
from hsx_async.dataset.layout import canonical_id
from hsx_async.dataset.manifest import AppendLog, ManifestEntry, read_manifest
from hsx_async.dataset.reader import select_entries
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, FP8, POST_NORM

EXPORT_INFO = "hsx-export.json"
LOCK_NAME = ".hsx-export.lock"

Progress = Callable[[int, int], None]  # (samples handled, total)


@dataclass(frozen=True, slots=True)
class ExportResult:
    fmt: str
    dest: Path
    total: int
    written: int
    skipped: int
    bytes_written: int
    seconds: float
    ids_line: str = ""  # the draft-config ids for the target's family (DraftIds.describe)
    converted: bool = False  # the final state was converted with the model's final norm
    dtype: str = BF16  # what the hidden states were written as
    dtype_why: str = ""  # why, when --dtype auto chose bfloat16 for an FP8 dataset
    requantized: tuple[int, ...] = ()  # FP8 written: the slots quantized by the export


def _claim(dest: Path, fmt: ExportFormat, group_size: int, out_dir: Path, dtype: str) -> None:
    """Record what this directory is an export of; refuse to mix formats, final-state
    kinds or hidden-state dtypes in one directory."""
    name, want = fmt.name, fmt.final_state
    info = {
        "format": name,
        "file_group_size": group_size,
        "source": str(out_dir.resolve()),
        "final_state": want,
        "hidden_states_dtype": dtype,
    }
    path = dest / EXPORT_INFO
    if path.exists():
        try:
            old = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            raise DatasetError(f"{path} is not valid JSON; export into another directory") from None
        if (old.get("format"), old.get("file_group_size")) != (name, group_size):
            raise DatasetError(
                f"{dest} holds a {old.get('format')} export (file_group_size "
                f"{old.get('file_group_size')}); export to another --to directory"
            )
        # Exports before hsx recorded the kind wrote the stored (post-norm) state as is.
        if old.get("final_state", POST_NORM) != want:
            raise DatasetError(
                f"{dest} holds a {name} export with the {old.get('final_state', POST_NORM)} "
                f"final state, but {name} reads the {want} one (an export made before hsx "
                "converted it trains on wrong teacher logits); export into a new --to directory"
            )
        # Exports before hsx knew FP8 wrote bfloat16.
        if old.get("hidden_states_dtype", BF16) != dtype:
            raise DatasetError(
                f"{dest} holds a {name} export written as {old.get('hidden_states_dtype', BF16)}"
                f", this one would write {dtype}: one directory holds one dtype (its trainer "
                f"is started with one hidden-states backend). Pass --dtype "
                f"{old.get('hidden_states_dtype', BF16)} to extend it, or export into a new "
                "--to directory"
            )
        return
    write_output(path, lambda tmp: tmp.write_bytes(orjson.dumps(info) + b"\n"))


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
    with exclusive_lock(dest / LOCK_NAME, f"another hsx export is writing to {dest}; wait for it"):
        yield


def _check_args(out_dir: Path, dest: Path, fmt: str, file_group_size: int) -> ExportFormat:
    found = export_format(fmt)
    found.check_ready()  # a missing extra: refused before hours of writing
    require_dataset(out_dir)  # before anything is created at dest
    if file_group_size < 1:
        raise DatasetError(f"file_group_size is {file_group_size}, expected at least 1")
    if dest.resolve() == out_dir.resolve():
        raise DatasetError("--to must not be the dataset directory itself")
    return found


@dataclass
class _Run:
    """One export pass: where from, where to, and what is already there."""

    out_dir: Path
    dest: Path
    fmt: ExportFormat
    plan: ExportPlan
    done: dict[str, ExportRecord]
    indices: dict[str, int]
    written: int = 0
    skipped: int = 0
    nbytes: int = 0

    def sample(self, entry: ManifestEntry, sample_id: str, log: AppendLog) -> None:
        rel = self.fmt.relpath(self.indices[sample_id], self.plan.group_size)
        if _is_complete(self.dest, self.done.get(sample_id), entry, rel):
            self.skipped += 1
            return
        write = functools.partial(self.fmt.write, self.out_dir / entry.path, entry, self.plan)
        size = write_output(self.dest / rel, write)
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
    model: Path | None = None,
    dtype: str = AUTO,
    progress: Progress | None = None,
) -> ExportResult:
    """Export every sample of ``out_dir`` (all shards) into ``dest`` in format ``fmt``;
    ``dtype`` (``auto``, ``bfloat16``, ``float8_e4m3fn``): each format's dtype rule."""
    form = _check_args(out_dir, dest, fmt, file_group_size)
    started = time.monotonic()
    entries = select_entries(read_manifest(out_dir))
    facts = dataset_facts(out_dir, entries)
    form.check_aux(facts)
    target = find_target(model, facts)
    conv = plan_conversion(form.name, form.final_state, facts, target, model is not None)
    check_dtype_choice(dtype)
    written_dtype, dtype_why = form.dtype_rule(dtype, facts, conv)
    plan = ExportPlan(conv, written_dtype, file_group_size)
    ids_answer = draft_ids_for(target, facts)
    sample_ids = [canonical_id(e.id) for e in entries]
    dest.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest):
        _claim(dest, form, file_group_size, out_dir, written_dtype)
        _remove_stale_temps(dest)
        done = read_export_log(dest)
        _check_stale(done, set(sample_ids), dest)
        run = _Run(out_dir, dest, form, plan, done, assign_indices(sample_ids, done))
        log = AppendLog(dest / EXPORT_LOG)
        try:
            for count, (entry, sample_id) in enumerate(
                zip(entries, sample_ids, strict=True), start=1
            ):
                run.sample(entry, sample_id, log)
                if progress is not None:
                    progress(count, len(entries))
        finally:
            log.close()
        form.finish(out_dir, dest, entries, run.indices)
        snippet = orjson.dumps(draft_config(form, ids_answer, facts), option=orjson.OPT_INDENT_2)
        write_output(dest / DRAFT_CONFIG, lambda tmp: tmp.write_bytes(snippet + b"\n"))
    return ExportResult(
        form.name,
        dest,
        len(entries),
        run.written,
        run.skipped,
        run.nbytes,
        time.monotonic() - started,
        ids_line=describe_ids(ids_answer, facts),
        converted=conv.gain is not None,
        dtype=written_dtype,
        dtype_why=dtype_why,
        requantized=(
            requantized_slots(facts.storage, facts.layers, conv) if written_dtype == FP8 else ()
        ),
    )
