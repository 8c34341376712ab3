"""The one dump path of every hook and server: plan a forward pass's parts on the calling
thread (:class:`~hsx_async.server.hook_core.DumpRegistry`, pure), then write them
(:func:`~hsx_async.server.dumpwrite.write_job`) now or through a :class:`PartSink` (the
SGLang hook's :class:`~hsx_async.server.hook_writer.BackgroundWriter`), so the engine's
scheduler thread only does bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hsx_async.errors import DumpError
from hsx_async.protocol import POST_NORM
from hsx_async.server.dumpwrite import PartJob, Tamper, write_job
from hsx_async.server.hook_core import DumpRegistry, HookConfig, PartWrite, Reject, ReqView
from hsx_async.server.rows import EncodedPass, PassRows, check_encoded, check_hidden


@dataclass(slots=True)
class BatchReport:
    """What one :meth:`PrefillDumper.dump_batch` did. Written synchronously: the parts
    written and the rids committed. With a sink: the parts handed to it (``queued``); their
    writes and commits happen later, and its failures are reported through the sink (a
    :class:`~hsx_async.server.hook_writer.BackgroundWriter`'s ``on_reject``)."""

    parts: list[PartWrite] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    queued: list[PartWrite] = field(default_factory=list)
    notes: list[Reject] = field(default_factory=list)  # FP8 requests dumped as bfloat16


class PartSink(Protocol):
    """Where :class:`PrefillDumper` hands a pass's jobs when it does not write them itself
    (:class:`hsx_async.server.hook_writer.BackgroundWriter`). ``submit`` raises DumpError
    when it takes nothing more (shut down): nothing of that pass is written."""

    def submit(self, hidden: PassRows, jobs: Sequence[PartJob]) -> None: ...


class PrefillDumper:
    """Plans, slices, writes and commits the dumps of successive forward passes.

    Without ``sink`` it writes each pass's parts before :meth:`dump_batch` returns. With
    one, :meth:`dump_batch` only plans (bookkeeping on the calling thread) and hands the
    pass's jobs and a reference to its rows to ``sink``, whose threads write them in order
    per request and commit ``meta.json`` after a request's last part. ``final_state`` is
    what the hook's last layer slot holds (PROTOCOL §3); ``tamper``: the fake server's
    faults, for a dumper that writes itself.
    """

    def __init__(
        self,
        config: HookConfig,
        *,
        model: str | None = None,
        sink: PartSink | None = None,
        final_state: str = POST_NORM,
        tamper: Tamper | None = None,
    ) -> None:
        self.config = config
        self.model = model if model is not None else (config.model or "")
        self.registry = DumpRegistry(config.max_open)
        self.sink = sink
        self.final_state = final_state
        self.tamper = tamper

    def dump_batch(self, reqs: Sequence[ReqView], load: Callable[[], PassRows]) -> BatchReport:
        """Write (or queue) this pass's parts. ``load`` is called only when some part is
        due, and may raise :class:`DumpError` to refuse the pass (its marked requests get
        no dump)."""
        plan = self.registry.plan(reqs)
        report = BatchReport(rejects=plan.rejects, notes=plan.notes)
        if not plan.writes:
            return report
        try:
            hidden = load()
            if isinstance(hidden, EncodedPass):
                check_encoded(hidden, plan.total_rows, plan.writes)
            else:
                check_hidden(hidden, plan.total_rows)
        except DumpError as exc:
            for write in plan.writes:
                self.registry.poison(write.rid, last=write.last)
                report.rejects.append(Reject(write.rid, str(exc)))
            return report
        jobs = [self._job(write, hidden) for write in plan.writes]
        if self.sink is not None:
            try:
                self.sink.submit(hidden, jobs)
            except DumpError as exc:  # shut down: nothing of this pass is written
                for job in jobs:
                    job.dump.failed = True
                    self.registry.poison(job.write.rid, last=job.write.last)
                    report.rejects.append(Reject(job.write.rid, str(exc)))
                return report
            report.queued = list(plan.writes)
            return report
        for job in jobs:
            self._write_now(job, hidden, report)
        return report

    def _job(self, write: PartWrite, hidden: PassRows) -> PartJob:
        # Recorded when planned, not when written: the next pass's plan must see this
        # part even while a sink still holds it.
        dump = self.registry.entry(write.rid)
        done = self.registry.record(write)
        meta = None
        if done is not None:
            meta = done.meta(
                hidden_size=hidden.hidden_size,
                aux_layers=hidden.aux_layers,
                model=self.model,
                server=self.config.server,
                final_state=self.final_state,
            )
        return PartJob(write=write, dump=dump, meta=meta)

    def _write_now(self, job: PartJob, hidden: PassRows, report: BatchReport) -> None:
        outcome = write_job(self.config.dump_root, job, hidden, self.tamper)
        if outcome.wrote:
            report.parts.append(job.write)
        if outcome.committed:
            report.committed.append(job.write.rid)
        if outcome.reject is not None:
            self.registry.poison(job.write.rid, last=job.write.last)
            report.rejects.append(outcome.reject)
