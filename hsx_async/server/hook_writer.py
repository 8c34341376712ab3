"""Background part writers for the server hook (issue 16): the scheduler thread hands a
pass over, a few threads in the same process write it.

SGLang's scheduler thread must not spend a pass's worth of time copying bytes to
/dev/shm. :class:`~hsx_async.server.dumper.PrefillDumper` plans the pass on the calling
thread (pure bookkeeping) and gives :meth:`BackgroundWriter.submit` the pass's jobs and a
reference to its host rows; the writer threads do the file work
(:func:`~hsx_async.server.dumpwrite.write_job`, the one way a dump is written), including
rounding a float32 model's rows to bfloat16 (issue 28).

- **Order.** Every job of a rid goes to the same thread (its lane), whose queue is FIFO:
  a rid's parts are written in order, and its ``meta.json`` (carried by its last job) is
  committed only after all of them.
- **Failure.** A failed write marks the rid's :class:`RequestDump` ``failed``: the lane
  skips the rid's later jobs and its commit, and the scheduler's next pass poisons the rid
  in the registry, exactly as a synchronous failure does. Other rids are untouched.
- **Memory.** A pass's rows stay referenced until its last job is done, and not a moment
  longer: no writer thread keeps a reference to them once its job is done (each job's rows
  live only in the frame that writes it), so what the writers hold is what the budget
  counts (issue 24). The bytes so held are bounded by ``queue_bytes``. When a pass would
  exceed it, :meth:`submit` blocks (a log line, and ``stats.stalls``/``stats.stall_s``)
  until the writers free room. A single pass larger than the budget is let through when
  nothing else is queued.
- **Shutdown.** :meth:`close` stops intake, lets the writers drain until a deadline, then
  abandons what is left: an abandoned job writes nothing, so no part or ``meta.json``
  appears for it; a write in progress completes (each file is written under a hidden
  temporary name and renamed, so no visible name is ever a partial file).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx_async.errors import DumpError
from hsx_async.server.dumpwrite import JobOutcome, PartJob, Tamper, write_job
from hsx_async.server.hook_core import Reject
from hsx_async.server.rows import PassRows, pass_nbytes

logger = logging.getLogger(__name__)

# Seconds between two "write queue full" log lines (the counter counts every stall).
_STALL_LOG_EVERY_S = 10.0
_MIB = 1 << 20


@dataclass(slots=True)
class WriterStats:
    """Counters of a :class:`BackgroundWriter` (read them under no lock: plain ints)."""

    passes: int = 0
    parts_written: int = 0
    bytes_written: int = 0
    committed: int = 0
    failed: int = 0
    skipped: int = 0  # later jobs of a rid whose earlier write had failed
    abandoned: int = 0  # jobs dropped at shutdown
    queued_bytes: int = 0  # host bytes of passes still referenced by queued jobs
    peak_queued_bytes: int = 0
    stalls: int = 0  # submits that had to wait for room
    stall_s: float = 0.0


class _Pass:
    """A pass's rows and how many of its jobs still need them."""

    __slots__ = ("hidden", "nbytes", "pending")

    def __init__(self, hidden: PassRows, nbytes: int, pending: int) -> None:
        self.hidden: PassRows | None = hidden
        self.nbytes = nbytes
        self.pending = pending


_Item = tuple[_Pass, PartJob] | None


def _log_reject(reject: Reject) -> None:
    logger.warning("hsx: no dump for rid %s: %s", reject.rid, reject.reason)


class BackgroundWriter:
    """``threads`` writer threads over per-thread FIFO lanes, with a byte budget."""

    def __init__(
        self,
        root: Path,
        *,
        threads: int,
        queue_bytes: int,
        on_reject: Callable[[Reject], None] = _log_reject,
        name: str = "hsx-writer",
        tamper: Tamper | None = None,
    ) -> None:
        if threads < 1 or queue_bytes < 1:
            raise ValueError("a BackgroundWriter needs at least one thread and one byte")
        self.root = root
        self.queue_bytes = queue_bytes
        self.tamper = tamper  # the fake server's faults; hooks pass none
        self.stats = WriterStats()
        self._on_reject = on_reject
        self._cond = threading.Condition()
        self._closed = False
        self._abandon = threading.Event()
        self._in_flight = 0  # jobs submitted and not yet done
        self._last_stall_log = -_STALL_LOG_EVERY_S
        self._lanes: list[queue.SimpleQueue[_Item]] = [queue.SimpleQueue() for _ in range(threads)]
        self._threads = [
            threading.Thread(target=self._run, args=(lane,), name=f"{name}-{i}", daemon=True)
            for i, lane in enumerate(self._lanes)
        ]
        for thread in self._threads:
            thread.start()

    # -- the scheduler thread's side ---------------------------------------------------

    def submit(self, hidden: PassRows, jobs: Sequence[PartJob]) -> None:
        """Queue a pass's jobs; blocks while the budget is full. DumpError once closed."""
        if not jobs:
            return
        nbytes = pass_nbytes(hidden)
        with self._cond:
            self._wait_for_room(nbytes)
            if self._closed:
                raise DumpError("the hsx dump writers are shut down")
            self.stats.passes += 1
            self.stats.queued_bytes += nbytes
            self.stats.peak_queued_bytes = max(
                self.stats.peak_queued_bytes, self.stats.queued_bytes
            )
            self._in_flight += len(jobs)
            ticket = _Pass(hidden, nbytes, len(jobs))
        for job in jobs:
            self._lanes[self._lane(job.write.rid)].put((ticket, job))

    def _lane(self, rid: str) -> int:
        return zlib.crc32(rid.encode()) % len(self._lanes)

    def _wait_for_room(self, nbytes: int) -> None:
        """With the lock held: wait until ``nbytes`` more fit (or nothing is queued)."""

        def full() -> bool:
            used = self.stats.queued_bytes
            return used > 0 and used + nbytes > self.queue_bytes and not self._closed

        if not full():
            return
        started = time.monotonic()
        self.stats.stalls += 1
        if started - self._last_stall_log >= _STALL_LOG_EVERY_S:
            self._last_stall_log = started
            logger.warning(
                "hsx: dump write queue full (%d MiB queued, %s=%d MiB): the scheduler waits "
                "for the writers (stall %d)",
                self.stats.queued_bytes // _MIB,
                "HSX_WRITE_QUEUE_MB",
                self.queue_bytes // _MIB,
                self.stats.stalls,
            )
        self._cond.notify_all()  # wake wait_for() watchers: a stall began
        while full():
            self._cond.wait()
        self.stats.stall_s += time.monotonic() - started

    # -- the writer threads -------------------------------------------------------------

    def _run(self, lane: queue.SimpleQueue[_Item]) -> None:
        while (item := lane.get()) is not None:
            ticket, job = item
            outcome = self._write(ticket, job)
            self._done(ticket, job, outcome)

    def _write(self, ticket: _Pass, job: PartJob) -> JobOutcome | None:
        """Write one job (None: abandoned). The pass's rows are referenced only in this
        frame, so none outlive the job: after :meth:`_done` of a pass's last job (and so
        after :meth:`flush`) no writer thread holds any of its buffers."""
        hidden = ticket.hidden
        if self._abandon.is_set() or hidden is None:
            job.dump.failed = True
            return None
        try:
            return write_job(self.root, job, hidden, self.tamper)
        except Exception:  # a bug, not an I/O error: keep the lane alive
            job.dump.failed = True
            logger.exception("hsx: dump writer failed on rid %s", job.write.rid)
            return JobOutcome(wrote=False, committed=False, reject=None)

    def _done(self, ticket: _Pass, job: PartJob, outcome: JobOutcome | None) -> None:
        with self._cond:
            stats = self.stats
            if outcome is None:
                stats.abandoned += 1
            elif outcome.wrote:
                stats.parts_written += 1
                stats.bytes_written += _part_bytes(ticket, job)
                stats.committed += outcome.committed
            elif outcome.reject is not None:
                stats.failed += 1
            else:
                stats.skipped += 1
            ticket.pending -= 1
            if ticket.pending == 0:
                ticket.hidden = None  # the pass's rows may go
                stats.queued_bytes -= ticket.nbytes
            self._in_flight -= 1
            self._cond.notify_all()
        if outcome is not None and outcome.reject is not None:
            self._on_reject(outcome.reject)

    # -- waiting and shutdown -----------------------------------------------------------

    def wait_for(self, predicate: Callable[[WriterStats], bool], timeout: float) -> bool:
        """Wait until ``predicate(stats)`` holds (checked at every change); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.stats), timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted job is done; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def close(self, drain_s: float = 10.0, stop_s: float = 5.0) -> int:
        """Stop intake, drain for up to ``drain_s``, then abandon the rest; returns the
        number of jobs abandoned. Waits up to ``stop_s`` more for a write in progress."""
        with self._cond:
            if self._closed:
                return self.stats.abandoned
            self._closed = True
            self._cond.notify_all()
        for lane in self._lanes:
            lane.put(None)
        deadline = time.monotonic() + drain_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            self._abandon.set()
            deadline = time.monotonic() + stop_s
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.stats.abandoned:
            logger.warning(
                "hsx: shut down with %d dump parts unwritten; their requests get no "
                "meta.json (the client retries them)",
                self.stats.abandoned,
            )
        return self.stats.abandoned

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)


def _part_bytes(ticket: _Pass, job: PartJob) -> int:
    hidden = ticket.hidden
    if hidden is None:
        return 0
    layers = len(hidden.aux_layers) + 1
    return job.write.rows * job.write.storage.row_bytes(layers, hidden.hidden_size)
