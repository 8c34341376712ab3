"""What a run does before its first request: check and record provenance, resume from the
manifest (checking its tail, deleting orphans), open the logs. (Servers are admitted by
:mod:`hsx_async.run.servers.admission`, once the run is going.)"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import structlog

from hsx_async.config import Config, flatten_public
from hsx_async.dataset.manifest import MANIFEST, QUARANTINE, AppendLog, DoneSet, load_done, log_name
from hsx_async.dataset.provenance import (
    PROVENANCE,
    Provenance,
    check_and_record,
    check_shard_layout,
    directory_lock,
    read_provenance,
    remove_stale_temps,
)
from hsx_async.run.daemon.resume import check_entries, clean_orphans
from hsx_async.run.daemon.spool import prepare_spool
from hsx_async.run.report.numbers import REPORT_JSON, REPORT_PNG
from hsx_async.run.servers.identity import Identity, JobRecord
from hsx_async.run.source import fingerprint_input

log = structlog.get_logger("hsx.startup")


def provenance_for(
    config: Config,
    input_fp: dict[str, Any],
    model: str = "",
    server: str = "",
    final_norm: dict[str, Any] | None = None,
) -> Provenance:
    """The record of this job: what the dataset layer needs, taken from the job's config
    (the dataset layer never sees the config type)."""
    return Provenance(
        input=input_fp,
        hidden_size=config.model.hidden_size,
        aux_layers=list(config.model.aux_layers),
        config=flatten_public(config),
        model=model,
        server=server,
        final_norm=final_norm,
        storage=config.storage,
    )


def prepare_output(
    config: Config, stack: contextlib.ExitStack, *, allow_provenance_change: bool
) -> tuple[DoneSet, AppendLog, AppendLog]:
    """Blocking. Under the directory lock: the shard layout is checked, provenance recorded
    and this run's logs created (so a run starting next sees them), then the directory is
    made to agree with its manifests (resume). The logs close with ``stack``."""
    out, shard = config.output.dir, config.shard
    old = read_provenance(out)
    recorded = old.get("input", {}).get("bytes") if old else None
    input_fp = fingerprint_input(
        config.input.path, prefix=recorded if type(recorded) is int else None
    )
    record = provenance_for(config, input_fp)
    with directory_lock(out):
        remove_stale_temps(out, (PROVENANCE, REPORT_JSON, REPORT_PNG))
        check_shard_layout(out, shard.count)
        done = load_done(out)
        # What no sample (or line) was made under binds nothing: a rerun corrected after a
        # job fault (wrong layers, say) replaces the record instead of being refused.
        check_and_record(
            out,
            record,
            allow_change=allow_provenance_change,
            samples=bool(done.manifest),
            lines=bool(done.manifest or done.lines),
        )
        manifest = AppendLog(out / log_name(MANIFEST, shard.index, shard.count))
        stack.callback(manifest.close)
        quarantine = AppendLog(out / log_name(QUARANTINE, shard.index, shard.count))
        stack.callback(quarantine.close)
        check_entries(out, done.manifest)
        clean_orphans(out, done.manifest, shard)
        prepare_spool(config)  # the consumers' registry; a cut-short retirement finished
    return done, manifest, quarantine


def job_record(out: Path, done: DoneSet) -> JobRecord:
    """What the dataset says about the servers its samples came from (blocking)."""
    prov = read_provenance(out) or {}
    if not done.manifest:
        return JobRecord()
    model = prov.get("model")
    return JobRecord(
        identity=Identity.from_record(prov.get("identity")),
        model=model if isinstance(model, str) else "",
        has_samples=True,
    )
