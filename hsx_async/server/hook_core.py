"""The server hook's pure core: its settings, which requests it dumps, and which rows of a
prefill pass belong to which dump (PROTOCOL §2–3). No file, no socket, no engine here.

Every hook and server describes each request of a forward pass as a :class:`ReqView` (in
the pass's row order) and hands them, with the pass's rows, to
:class:`~hsx_async.server.dumper.PrefillDumper`, which plans here (:class:`DumpRegistry`)
and writes through :mod:`hsx_async.server.dumpwrite`. "Layer k" is the residual stream
entering decoder layer k, i.e. Hugging Face ``hidden_states[k]``; the rules a request and a
layer list must follow are :func:`hsx_async.protocol.check_hsx_request` and
:func:`hsx_async.protocol.check_aux_layers`, called here and by every hook.

Rows of a pass are laid out as the model computed them: request after request, each
request's ``rows`` rows together (its extend length), unmarked requests included. A request
may ask for FP8 storage (``custom_params.hsx_dtype``/``hsx_quantized``, PROTOCOL §2); an
unusable one is dumped as bfloat16 (noted once), and the client quantizes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hsx_async.errors import ConfigError, DumpError, HsxRequestError
from hsx_async.protocol import (
    BF16_STORAGE,
    DEFAULT_DUMP_ROOT,
    DumpMeta,
    Storage,
    check_hsx_request,
    parse_aux_layers,
    requested_storage,
    shown,
)

ENV_DUMP_ROOT = "HSX_DUMP_ROOT"
ENV_AUX_LAYERS = "HSX_AUX_LAYERS"
ENV_MODEL_NAME = "HSX_MODEL_NAME"
ENV_WRITER_THREADS = "HSX_WRITER_THREADS"
ENV_WRITE_QUEUE_MB = "HSX_WRITE_QUEUE_MB"
ENV_DEVICE_STACK = "HSX_DEVICE_STACK"
ENV_PASS_ROWS = "HSX_PASS_ROWS"

# Background writer threads per writing scheduler process (0: write on the scheduler
# thread, as before issue 16). Four keep up with ~2 GB/s passes on a host whose tmpfs
# takes ~1.5 GB/s per thread; parts of one request always go to the same thread.
DEFAULT_WRITER_THREADS = 4
# Host memory the passes waiting for the writers may hold, in MiB: about four 16,384-row
# passes at H 7168 with 3 aux layers. Past it the scheduler thread waits (and logs it).
DEFAULT_WRITE_QUEUE_MB = 4096
MAX_WRITER_THREADS = 64
# The most rows one prefill pass holds (give SGLang's --chunked-prefill-size): the hook
# makes page-locked host memory ready for passes of this size before its first pass
# (hsx_async.server.pinned; issue 40). 0: no warm-up. 16,384 is the Kimi-K2.5 deployment's
# pass, the one measured on an H200.
DEFAULT_PASS_ROWS = 16384
MAX_PASS_ROWS = 1 << 22

# The path a pass takes to the host when HSX_DEVICE_STACK is not set, by the model's
# dtype: the one that dumped faster on an H200 (bench/hook_gpu.py, issue 40: Kimi-K2.5's
# shape, 16,384-row passes, 4 writer threads, a 4 GiB queue, /dev/shm, 8 warm-up + 30
# passes; GB/s, scheduler wall / CPU ms per GB):
# - bfloat16: device stack 7.85 GB/s, 38.7 / 24.0 against plain 6.92, 45.2 / 10.0. Faster,
#   and less scheduler wall time, though 2.4x the scheduler CPU (why is not known yet);
# - float32: device stack 8.26 GB/s, 33.1 / 17.2 against plain 5.42, 103 / 8.96 (the plain
#   path copies the aux rows as float32: 1.75 bytes over the bus per byte dumped).
# float16 was not measured; its values cross in 2 bytes, as bfloat16's do, so it follows
# bfloat16. HSX_DEVICE_STACK=0 or 1 overrides the table.
DEVICE_STACK_BY_DTYPE = {"bfloat16": True, "float32": True, "float16": True}

# In-progress dumps kept at once. A request that vanishes between two chunks (an abort
# SGLang never reports back to a prefill batch) would otherwise stay forever; past the cap
# the oldest entry goes, and should that request come back its next chunk no longer
# continues a known dump, so it is refused instead of written wrong.
DEFAULT_MAX_OPEN = 4096


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HookConfig:
    """The hook's settings, read once per server process from ``HSX_*`` variables."""

    dump_root: Path
    aux_layers: tuple[int, ...]
    model: str | None
    server: str
    max_open: int = DEFAULT_MAX_OPEN
    # Used by the SGLang glue to build its BackgroundWriter; a PrefillDumper built from
    # this config alone writes synchronously whatever these say.
    writer_threads: int = DEFAULT_WRITER_THREADS
    write_queue_bytes: int = DEFAULT_WRITE_QUEUE_MB << 20
    # None: by the model's dtype (:func:`device_stack_for`); True/False: the operator's.
    device_stack: bool | None = None
    pass_rows: int = DEFAULT_PASS_ROWS

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, server: str) -> HookConfig:
        raw_layers = env.get(ENV_AUX_LAYERS)
        if raw_layers is None or not raw_layers.strip():
            raise ConfigError(
                ENV_AUX_LAYERS,
                "is not set; give the aux layers as comma-separated ascending integers, "
                "e.g. HSX_AUX_LAYERS=2,30,58 (the same list as the client's [model].aux_layers)",
            )
        model = env.get(ENV_MODEL_NAME, "").strip() or None
        threads = _env_int(env, ENV_WRITER_THREADS, DEFAULT_WRITER_THREADS, 0, MAX_WRITER_THREADS)
        queue_mb = _env_int(env, ENV_WRITE_QUEUE_MB, DEFAULT_WRITE_QUEUE_MB, 1, 1 << 30)
        pass_rows = _env_int(env, ENV_PASS_ROWS, DEFAULT_PASS_ROWS, 0, MAX_PASS_ROWS)
        return cls(
            dump_root=dump_root_from_env(env),
            aux_layers=parse_aux_layers(raw_layers, key=ENV_AUX_LAYERS),
            model=model,
            server=server,
            writer_threads=threads,
            write_queue_bytes=queue_mb << 20,
            device_stack=_env_switch(env, ENV_DEVICE_STACK),
            pass_rows=pass_rows,
        )

    def device_stack_for(self, dtype: str) -> bool:
        """Whether a pass of a model served in ``dtype`` (torch's name, e.g. "bfloat16")
        is stacked on the device: the operator's HSX_DEVICE_STACK, else the measured
        default (:data:`DEVICE_STACK_BY_DTYPE`; a dtype not in it takes the plain path)."""
        if self.device_stack is not None:
            return self.device_stack
        return DEVICE_STACK_BY_DTYPE.get(dtype.removeprefix("torch."), False)


def dump_root_from_env(env: Mapping[str, str]) -> Path:
    """``HSX_DUMP_ROOT``, read the one way every hook and server reads it: unset or blank is
    the default (``/dev/shm/hsx``), anything else must be an absolute path."""
    text = env.get(ENV_DUMP_ROOT, "").strip() or DEFAULT_DUMP_ROOT
    root = Path(text)
    if not root.is_absolute():
        raise ConfigError(ENV_DUMP_ROOT, f"{text!r} is relative; give the absolute dump root")
    return root


def _env_int(env: Mapping[str, str], key: str, default: int, low: int, high: int) -> int:
    text = env.get(key, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(key, f"{text!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(key, f"{value} is out of range; give {low}..{high}")
    return value


def _env_switch(env: Mapping[str, str], key: str) -> bool | None:
    """A switch the operator may leave unset (None: the default applies)."""
    text = env.get(key, "").strip().lower()
    if not text:
        return None
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(key, f"{text!r} is not a switch; give 1 or 0 (or leave it unset)")


# --------------------------------------------------------------------------------------
# What a marked request asks for
# --------------------------------------------------------------------------------------


def request_storage(custom_params: object, layers: int) -> tuple[Storage, str]:
    """The storage a request's ``custom_params`` asks for (PROTOCOL §2): (storage, '') or,
    for a request the hook cannot honour, (bfloat16, why): it is dumped as bfloat16 and the
    client quantizes it."""
    if not isinstance(custom_params, Mapping):
        return BF16_STORAGE, ""
    return requested_storage(dict(custom_params), layers)


def uniform_storage(reqs: Sequence[ReqView]) -> Storage | None:
    """The FP8 storage every marked request of a pass asks for, if they agree on one: the
    pass can then be quantized as a whole where its rows are produced (else None: its rows
    stay bfloat16 and FP8 parts are quantized on the host, part by part)."""
    wanted = {req.storage for req in reqs if req.ns is not None and not req.aborted}
    if len(wanted) != 1:
        return None
    storage = wanted.pop()
    return storage if storage.is_fp8 else None


# --------------------------------------------------------------------------------------
# Planning a pass
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReqView:
    """One request of a forward pass, as the hook needs to see it.

    ``start``/``rows``: the prompt rows this pass computed for it (prefix length and extend
    length). ``last_chunk``: no later chunk of this prompt is scheduled. ``retracted``: the
    server discards this pass for the request and will compute the prompt again from row
    0. ``aborted``: the request finished, is being aborted or has its output discarded.
    ``storage``: how its rows are dumped (:func:`request_storage`); ``storage_note``: why
    an FP8 request is dumped as bfloat16 instead (logged once, at its first pass).
    """

    rid: object
    ns: object | None
    num_tokens: int
    max_new_tokens: object
    start: int
    rows: int
    last_chunk: bool = True
    retracted: bool = False
    aborted: bool = False
    storage: Storage = BF16_STORAGE
    storage_note: str = ""


@dataclass(frozen=True, slots=True)
class PartWrite:
    """Rows ``[start, end)`` of request ``rid``: the pass's rows from ``batch_row`` on."""

    ns: str
    rid: str
    batch_row: int
    start: int
    end: int
    last: bool
    storage: Storage = BF16_STORAGE

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Reject:
    """A marked request the hook writes nothing (more) for, and why (for the server log)."""

    rid: str
    reason: str


@dataclass(slots=True)
class BatchPlan:
    writes: list[PartWrite] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    total_rows: int = 0
    # Requests dumped as bfloat16 although they asked for FP8, and why (for the log).
    notes: list[Reject] = field(default_factory=list)


class DumpRegistry:
    """Dumps in progress, keyed by rid, across the passes of a chunked prefill.

    An entry is a :class:`RequestDump` while the request's parts continue each other, or
    None once the request is refused ("poisoned"): its later chunks are skipped silently
    and nothing is ever committed for it. Entries go when the prompt's last chunk is seen,
    when the request is aborted or retracted, or when the cap evicts them.
    """

    def __init__(self, max_open: int = DEFAULT_MAX_OPEN) -> None:
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        self._max_open = max_open
        self._open: dict[str, RequestDump | None] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, rid: object) -> bool:
        return rid in self._open

    def plan(self, reqs: Sequence[ReqView]) -> BatchPlan:
        """Decide the parts of one pass; updates the registry for aborts and retractions."""
        plan = BatchPlan()
        for req in reqs:
            batch_row = plan.total_rows
            plan.total_rows += req.rows
            if req.ns is None:
                continue
            outcome = self._plan_one(req, batch_row, plan)
            if isinstance(outcome, PartWrite):
                plan.writes.append(outcome)
            elif outcome is not None:
                plan.rejects.append(outcome)
        return plan

    def _plan_one(self, req: ReqView, batch_row: int, plan: BatchPlan) -> PartWrite | Reject | None:
        # Requests the hook never dumps keep no state: they are reported on their first
        # pass (row 0) and skipped silently on later chunks and mixed-in decode steps.
        names = _dumpable_names(req)
        if isinstance(names, str):
            return Reject(shown(req.rid), names) if req.start == 0 else None
        ns, rid = names
        if req.aborted or req.retracted:
            # Aborted: no commit, ever. Retracted: the server recomputes the prompt from
            # row 0, and the parts are written again under the same names.
            self._open.pop(rid, None)
            return None
        if rid in self._open:
            dump = self._open[rid]
            if dump is not None and dump.failed:
                # A background write of an earlier part failed (and was reported then).
                self.poison(rid, last=req.last_chunk)
                dump = None
            if dump is None:
                if req.last_chunk:
                    del self._open[rid]
                return None
        else:
            if req.start != 0:
                return self._refuse(
                    rid,
                    req.last_chunk,
                    f"the first pass starts at prompt row {req.start}, so rows "
                    f"[0, {req.start}) came from the prefix cache (start SGLang with "
                    "--disable-radix-cache)",
                )
            dump = RequestDump(rid=rid, ns=ns, num_tokens=req.num_tokens, storage=req.storage)
            self._insert(rid, dump, plan.rejects)
            if req.storage_note:
                plan.notes.append(
                    Reject(rid, f"dumped as bfloat16 (the client quantizes): {req.storage_note}")
                )
        return self._continue(dump, req, batch_row)

    def _continue(self, dump: RequestDump, req: ReqView, batch_row: int) -> PartWrite | Reject:
        end = req.start + req.rows
        if req.start != dump.rows_done or req.rows <= 0 or end > dump.num_tokens:
            return self._refuse(
                dump.rid,
                req.last_chunk,
                f"pass computed prompt rows [{req.start}, {end}) but the dump has rows "
                f"[0, {dump.rows_done}) of {dump.num_tokens}",
            )
        if req.last_chunk and end != dump.num_tokens:
            return self._refuse(
                dump.rid,
                True,
                f"last chunk ends at row {end}, the prompt has {dump.num_tokens} tokens",
            )
        return PartWrite(dump.ns, dump.rid, batch_row, req.start, end, req.last_chunk, dump.storage)

    def _insert(self, rid: str, dump: RequestDump, rejects: list[Reject]) -> None:
        while len(self._open) >= self._max_open:
            oldest = next(iter(self._open))
            del self._open[oldest]
            rejects.append(Reject(oldest, f"evicted: more than {self._max_open} dumps in progress"))
        self._open[rid] = dump

    def _refuse(self, rid: str, last: bool, reason: str) -> Reject:
        self.poison(rid, last=last)
        return Reject(rid, reason)

    def poison(self, rid: str, *, last: bool) -> None:
        """Write nothing more for ``rid``; forget it if this was its last chunk."""
        if last:
            self._open.pop(rid, None)
        else:
            self._open[rid] = None

    def entry(self, rid: str) -> RequestDump:
        """The dump in progress for ``rid`` (DumpError if there is none)."""
        dump = self._open.get(rid)
        if dump is None:
            raise DumpError(f"rid {rid}: no dump in progress")
        return dump

    def record(self, write: PartWrite) -> RequestDump | None:
        """The part is on disk. Returns the finished dump when it is the last part."""
        dump = self._open.get(write.rid)
        if dump is None:
            raise DumpError(f"rid {write.rid}: no dump in progress for part {write.start}")
        dump.add_part(write.start, write.end)
        if not write.last:
            return None
        del self._open[write.rid]
        return dump


def _dumpable_names(req: ReqView) -> tuple[str, str] | str:
    """(ns, rid) of a request the hook may dump, else why not (the one rule's reason)."""
    try:
        return check_hsx_request(req.ns, req.rid, max_new_tokens=req.max_new_tokens)
    except HsxRequestError as exc:
        return str(exc)


# --------------------------------------------------------------------------------------
# A dump in progress
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestDump:
    """Rows written so far for one marked request, across chunked-prefill passes.

    Pure bookkeeping: the caller writes the bytes. A retracted request that starts over
    calls :meth:`reset`; parts then get rewritten under the same names.
    """

    rid: str
    ns: str
    num_tokens: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    # Set by a background writer whose write of one of this dump's parts failed: its later
    # parts and its commit are skipped, and the scheduler's next pass poisons the rid. A
    # retried request starts a new RequestDump, so an old failure never leaks into it.
    failed: bool = False
    # How its parts hold the rows (PROTOCOL §3): what the request asked for, or bfloat16.
    storage: Storage = BF16_STORAGE

    @property
    def rows_done(self) -> int:
        return self.parts[-1][1] if self.parts else 0

    def add_part(self, start: int, end: int) -> None:
        if start != self.rows_done or end <= start or end > self.num_tokens:
            raise DumpError(
                f"rid {self.rid}: part [{start}, {end}) does not continue at row "
                f"{self.rows_done} of {self.num_tokens}"
            )
        self.parts.append((start, end))

    @property
    def complete(self) -> bool:
        return self.rows_done == self.num_tokens

    def reset(self) -> None:
        self.parts.clear()

    def meta(
        self,
        *,
        hidden_size: int,
        aux_layers: Sequence[int],
        model: str,
        server: str,
        final_state: str,
    ) -> DumpMeta:
        return DumpMeta(
            rid=self.rid,
            num_tokens=self.num_tokens,
            hidden_size=hidden_size,
            aux_layers=tuple(aux_layers),
            parts=tuple(self.parts),
            model=model,
            server=server,
            final_state=final_state,
            storage=self.storage,
        )
