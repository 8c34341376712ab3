"""The server hook's pure core: which rows of a prefill pass belong to which dump, and how a
pass's parts and a request's commit reach the dump root (PROTOCOL §3).

Nothing here knows SGLang. The SGLang glue (:mod:`hsx_async.server.sglang.hook`), the fake
server and the reference server describe each request of a forward pass as a
:class:`ReqView` and hand the pass's hidden rows to :meth:`PrefillDumper.dump_batch`; the
same code then decides, slices, writes and commits for all of them.

Rows of a pass are laid out as the model computed them: request after request, each
request's ``rows`` rows together (its extend length), unmarked requests included. Hidden
states arrive as two arrays of 2-byte elements (bfloat16 bit patterns): ``aux`` with the aux
layers of every row, ``[T, K*H]`` or ``[T, K, H]``, and ``final`` with the final (post-norm)
hidden state, ``[T, H]``. "Layer k" is the residual stream entering decoder layer k, i.e.
Hugging Face ``hidden_states[k]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import (
    CUSTOM_PARAM_NS,
    DEFAULT_DUMP_ROOT,
    part_name,
    valid_ns,
    valid_rid,
)
from hsx_async.server.dumpwrite import RequestDump, request_dir_fd, write_meta, write_part

ENV_DUMP_ROOT = "HSX_DUMP_ROOT"
ENV_AUX_LAYERS = "HSX_AUX_LAYERS"
ENV_MODEL_NAME = "HSX_MODEL_NAME"

# In-progress dumps kept at once. A request that vanishes between two chunks (an abort
# SGLang never reports back to a prefill batch) would otherwise stay forever; past the cap
# the oldest entry goes, and should that request come back its next chunk no longer
# continues a known dump, so it is refused instead of written wrong.
DEFAULT_MAX_OPEN = 4096

_SHOWN_NAME_CHARS = 80


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

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, server: str) -> HookConfig:
        root_text = env.get(ENV_DUMP_ROOT, "").strip() or DEFAULT_DUMP_ROOT
        root = Path(root_text)
        if not root.is_absolute():
            raise ConfigError(
                ENV_DUMP_ROOT, f"{root_text!r} is relative; give the absolute dump root"
            )
        raw_layers = env.get(ENV_AUX_LAYERS)
        if raw_layers is None or not raw_layers.strip():
            raise ConfigError(
                ENV_AUX_LAYERS,
                "is not set; give the aux layers as comma-separated ascending integers, "
                "e.g. HSX_AUX_LAYERS=2,30,58 (the same list as the client's [model].aux_layers)",
            )
        model = env.get(ENV_MODEL_NAME, "").strip() or None
        return cls(
            dump_root=root, aux_layers=parse_aux_layers(raw_layers), model=model, server=server
        )


def parse_aux_layers(text: str) -> tuple[int, ...]:
    """``"2,30,58"`` → ``(2, 30, 58)``: non-negative, strictly ascending, at least one.

    Ascending because the model captures in layer order whatever order it is given: any
    other order would label the slices of a row wrongly.
    """
    items = [item.strip() for item in text.split(",")]
    try:
        layers = tuple(int(item) for item in items)
    except ValueError:
        raise ConfigError(
            ENV_AUX_LAYERS, f"{text!r} is not a comma-separated list of integers"
        ) from None
    if any(k < 0 for k in layers):
        raise ConfigError(ENV_AUX_LAYERS, f"{text!r} names a negative layer")
    if any(b <= a for a, b in pairwise(layers)):
        raise ConfigError(
            ENV_AUX_LAYERS,
            f"{text!r} is not strictly ascending; list each layer once, lowest first",
        )
    return layers


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The SGLang settings the hook depends on, as the glue read them from the server."""

    radix_cache: bool
    attn_dp_size: int
    pp_size: int
    two_batch_overlap: bool
    moe_a2a_backend: str
    aux_capture: str | None
    aux_layer_ids_flag: tuple[int, ...] | None
    disaggregation_mode: str


def server_problems(settings: ServerSettings, config: HookConfig) -> list[str]:
    """Every setting that would make dumps wrong or missing, each with its fix."""
    problems: list[str] = []
    if settings.radix_cache:
        problems.append(
            "add --disable-radix-cache: a prefix-cache hit skips the cached rows of a prompt"
        )
    if settings.attn_dp_size > 1:
        problems.append(
            "DP attention is not supported (attention DP size "
            f"{settings.attn_dp_size}): run one server per data-parallel replica instead"
        )
    if settings.pp_size > 1:
        problems.append(
            f"pipeline parallelism is not supported (--pp-size {settings.pp_size}): only the "
            "last stage sees the aux layers"
        )
    if settings.two_batch_overlap:
        problems.append("drop --enable-two-batch-overlap: it splits a pass into micro-batches")
    if settings.moe_a2a_backend.startswith("deepep"):
        problems.append(
            f"--moe-a2a-backend {settings.moe_a2a_backend} is not supported (DeepEP): use "
            "the default all-to-all backend"
        )
    if settings.disaggregation_mode not in ("null", "none", ""):
        problems.append(
            f"PD disaggregation (--disaggregation-mode {settings.disaggregation_mode}) is "
            "not supported: its prefill results bypass the hooked processor"
        )
    problems.extend(_aux_capture_problems(settings, config))
    return problems


def _aux_capture_problems(settings: ServerSettings, config: HookConfig) -> list[str]:
    if settings.aux_capture is None:
        return [
            "add --enable-return-aux-hidden-states --speculative-algorithm EAGLE3: without "
            "aux capture the forward keeps no aux layers"
        ]
    problems = []
    if settings.aux_capture != "eagle3":
        problems.append(
            f"aux capture convention is {settings.aux_capture!r}: use "
            "--speculative-algorithm EAGLE3 with --enable-return-aux-hidden-states"
        )
    flag = settings.aux_layer_ids_flag
    if flag is not None and len(flag) != len(config.aux_layers):
        problems.append(
            f"--return-aux-hidden-state-layer-ids names {len(flag)} layers but "
            f"{ENV_AUX_LAYERS} names {len(config.aux_layers)}: drop the flag, the hook sets "
            "the captured layers itself"
        )
    return problems


def check_server_settings(settings: ServerSettings, config: HookConfig) -> None:
    """Refuse to start on a server whose settings break dumps (all problems in one error)."""
    problems = server_problems(settings, config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            "", f"the hsx hook cannot dump hidden states from this SGLang server:\n{lines}"
        )


# --------------------------------------------------------------------------------------
# Which requests are marked
# --------------------------------------------------------------------------------------


def request_namespace(custom_params: object) -> object | None:
    """The request's ``hsx_ns`` as sent (not yet validated); None for ordinary traffic."""
    if not isinstance(custom_params, Mapping):
        return None
    return custom_params.get(CUSTOM_PARAM_NS)


def wants_dump(rid: object, custom_params: object, max_new_tokens: object) -> bool:
    """A valid, prefill-only request with a valid namespace: one the hook will dump."""
    ns = request_namespace(custom_params)
    return ns is not None and valid_ns(ns) and valid_rid(rid) and max_new_tokens == 0


def shown(name: object) -> str:
    """A request-supplied name made safe and short for a log line."""
    text = repr(name)
    return text if len(text) <= _SHOWN_NAME_CHARS else text[: _SHOWN_NAME_CHARS - 3] + "..."


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


@dataclass(frozen=True, slots=True)
class PartWrite:
    """Rows ``[start, end)`` of request ``rid``: the pass's rows from ``batch_row`` on."""

    ns: str
    rid: str
    batch_row: int
    start: int
    end: int
    last: bool

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
            outcome = self._plan_one(req, batch_row, plan.rejects)
            if isinstance(outcome, PartWrite):
                plan.writes.append(outcome)
            elif outcome is not None:
                plan.rejects.append(outcome)
        return plan

    def _plan_one(
        self, req: ReqView, batch_row: int, rejects: list[Reject]
    ) -> PartWrite | Reject | None:
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
            dump = RequestDump(rid=rid, ns=ns, num_tokens=req.num_tokens)
            self._insert(rid, dump, rejects)
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
        return PartWrite(dump.ns, dump.rid, batch_row, req.start, end, req.last_chunk)

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
    """(ns, rid) of a request the hook may dump, else why not."""
    ns, rid = req.ns, req.rid
    if not (isinstance(ns, str) and valid_ns(ns)):
        return f"hsx_ns {shown(ns)} is not a valid namespace"
    if not (isinstance(rid, str) and valid_rid(rid)):
        return "rid is not valid for a dump directory"
    if req.max_new_tokens != 0:
        return (
            f"max_new_tokens is {req.max_new_tokens!r}; hsx requests must be prefill-only "
            "(max_new_tokens=0)"
        )
    return ns, rid


# --------------------------------------------------------------------------------------
# Rows → bytes → files
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchHidden:
    """A pass's hidden rows (2-byte elements: bfloat16 bit patterns) and their layers."""

    aux: np.ndarray
    final: np.ndarray
    aux_layers: tuple[int, ...]

    @property
    def hidden_size(self) -> int:
        return int(self.final.shape[-1])


def check_hidden(hidden: BatchHidden, total_rows: int) -> None:
    """The arrays hold exactly the pass's rows, K aux slices and one final slice each."""
    aux, final = hidden.aux, hidden.final
    if final.ndim != 2 or aux.ndim not in (2, 3):
        raise DumpError(
            f"hidden arrays have shapes {aux.shape} (aux) and {final.shape} (final); "
            "expected [T, K*H] or [T, K, H] and [T, H]"
        )
    if any(a.dtype.itemsize != 2 or a.dtype.byteorder == ">" for a in (aux, final)):
        raise DumpError(
            f"hidden arrays are {aux.dtype}/{final.dtype}, expected little-endian bfloat16 bits"
        )
    if aux.shape[0] != total_rows or final.shape[0] != total_rows:
        raise DumpError(
            f"the pass produced {aux.shape[0]} aux and {final.shape[0]} final rows, its "
            f"requests account for {total_rows}"
        )
    per_row = int(np.prod(aux.shape[1:]))
    expected = len(hidden.aux_layers) * hidden.hidden_size
    if per_row != expected:
        raise DumpError(
            f"aux rows hold {per_row} values, expected {len(hidden.aux_layers)} layers × "
            f"{hidden.hidden_size} (the model captured a different number of layers)"
        )


def assemble_rows(hidden: BatchHidden, row: int, count: int) -> np.ndarray:
    """Rows ``[row, row+count)`` of the pass as one part: ``[count, K+1, H]``, C order,
    the aux layers in order, then the final hidden state."""
    k, h = len(hidden.aux_layers), hidden.hidden_size
    out = np.empty((count, k + 1, h), dtype=np.dtype("<u2"))
    out[:, :k, :] = hidden.aux[row : row + count].reshape(count, k, h).view("<u2")
    out[:, k, :] = hidden.final[row : row + count].view("<u2")
    return out


@dataclass(slots=True)
class BatchReport:
    parts: list[PartWrite] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)


class PrefillDumper:
    """Plans, slices, writes and commits the dumps of successive forward passes."""

    def __init__(self, config: HookConfig, *, model: str | None = None) -> None:
        self.config = config
        self.model = model if model is not None else (config.model or "")
        self.registry = DumpRegistry(config.max_open)

    def dump_batch(self, reqs: Sequence[ReqView], load: Callable[[], BatchHidden]) -> BatchReport:
        """Write this pass's parts. ``load`` is called only when some part is due, and may
        raise :class:`DumpError` to refuse the pass (its marked requests get no dump)."""
        plan = self.registry.plan(reqs)
        report = BatchReport(rejects=plan.rejects)
        if not plan.writes:
            return report
        try:
            hidden = load()
            check_hidden(hidden, plan.total_rows)
        except DumpError as exc:
            for write in plan.writes:
                self.registry.poison(write.rid, last=write.last)
                report.rejects.append(Reject(write.rid, str(exc)))
            return report
        for write in plan.writes:
            self._write(write, hidden, report)
        return report

    def _write(self, write: PartWrite, hidden: BatchHidden, report: BatchReport) -> None:
        data = assemble_rows(hidden, write.batch_row, write.rows)
        try:
            with request_dir_fd(self.config.dump_root, write.ns, write.rid) as dir_fd:
                write_part(dir_fd, write.start, write.end, data.data)
                report.parts.append(write)
                done = self.registry.record(write)
                if done is not None:
                    meta = done.meta(
                        hidden_size=hidden.hidden_size,
                        aux_layers=list(hidden.aux_layers),
                        model=self.model,
                        server=self.config.server,
                    )
                    write_meta(dir_fd, meta)
                    report.committed.append(write.rid)
        except (DumpError, OSError) as exc:
            self.registry.poison(write.rid, last=write.last)
            report.rejects.append(
                Reject(write.rid, f"writing {part_name(write.start, write.end)}: {exc}")
            )
