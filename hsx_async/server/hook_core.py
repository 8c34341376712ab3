"""The server hook's pure core: which rows of a prefill pass belong to which dump, and how a
pass's parts and a request's commit reach the dump root (PROTOCOL §3).

Nothing here knows SGLang. The SGLang glue (:mod:`hsx_async.server.sglang.hook`), the fake
server and the reference server describe each request of a forward pass as a
:class:`ReqView` and hand the pass's hidden rows to :meth:`PrefillDumper.dump_batch`; the
same code then decides, slices, writes and commits for all of them. Written on the calling
thread by default; inside SGLang a :class:`~hsx_async.server.hook_writer.BackgroundWriter`
does the file work, so the scheduler thread only plans (issue 16). Parts are written from
the pass's rows as they lie (row slices with ``writev``), never assembled first.

Rows of a pass are laid out as the model computed them: request after request, each
request's ``rows`` rows together (its extend length), unmarked requests included. Hidden
states arrive as two arrays of 2-byte elements (bfloat16 bit patterns): ``aux`` with the aux
layers of every row, ``[T, K*H]`` or ``[T, K, H]``, and ``final`` with the final (post-norm)
hidden state, ``[T, H]``. "Layer k" is the residual stream entering decoder layer k, i.e.
Hugging Face ``hidden_states[k]``.

A request may ask for FP8 storage (``custom_params.hsx_dtype``/``hsx_quantized``, PROTOCOL
§2): its parts then hold the sections of :func:`hsx_async.quantize.encode_rows` back to
back. A pass whose requests all ask for one FP8 storage can arrive already encoded where
its rows were produced (:class:`EncodedPass`, e.g. on the GPU before the copy to the host);
otherwise its FP8 parts are quantized here from the bfloat16 rows, by the same quantizer.
An unusable request is dumped as bfloat16 (noted once), and the client quantizes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Protocol

import numpy as np

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    CUSTOM_PARAM_NS,
    DEFAULT_DUMP_ROOT,
    DumpMeta,
    Storage,
    part_name,
    requested_storage,
    valid_ns,
    valid_rid,
)
from hsx_async.server.dumpwrite import (
    IOV_MAX,
    RequestDump,
    request_dir_fd,
    write_meta,
    write_part,
    write_part_vectored,
)

ENV_DUMP_ROOT = "HSX_DUMP_ROOT"
ENV_AUX_LAYERS = "HSX_AUX_LAYERS"
ENV_MODEL_NAME = "HSX_MODEL_NAME"
ENV_WRITER_THREADS = "HSX_WRITER_THREADS"
ENV_WRITE_QUEUE_MB = "HSX_WRITE_QUEUE_MB"
ENV_DEVICE_STACK = "HSX_DEVICE_STACK"

# Background writer threads per writing scheduler process (0: write on the scheduler
# thread, as before issue 16). Four keep up with ~2 GB/s passes on a host whose tmpfs
# takes ~1.5 GB/s per thread; parts of one request always go to the same thread.
DEFAULT_WRITER_THREADS = 4
# Host memory the passes waiting for the writers may hold, in MiB: about four 16,384-row
# passes at H 7168 with 3 aux layers. Past it the scheduler thread waits (and logs it).
DEFAULT_WRITE_QUEUE_MB = 4096
MAX_WRITER_THREADS = 64

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
    # Used by the SGLang glue to build its BackgroundWriter; a PrefillDumper built from
    # this config alone writes synchronously whatever these say.
    writer_threads: int = DEFAULT_WRITER_THREADS
    write_queue_bytes: int = DEFAULT_WRITE_QUEUE_MB << 20
    device_stack: bool = False

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
        threads = _env_int(env, ENV_WRITER_THREADS, DEFAULT_WRITER_THREADS, 0, MAX_WRITER_THREADS)
        queue_mb = _env_int(env, ENV_WRITE_QUEUE_MB, DEFAULT_WRITE_QUEUE_MB, 1, 1 << 30)
        return cls(
            dump_root=root,
            aux_layers=parse_aux_layers(raw_layers),
            model=model,
            server=server,
            writer_threads=threads,
            write_queue_bytes=queue_mb << 20,
            device_stack=_env_flag(env, ENV_DEVICE_STACK),
        )


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


def _env_flag(env: Mapping[str, str], key: str) -> bool:
    text = env.get(key, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(key, f"{text!r} is not a switch; give 1 or 0")


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
    attn_tp_size: int = 1


def server_problems(settings: ServerSettings, config: HookConfig) -> list[str]:
    """Every setting that would make dumps wrong or missing, each with its fix."""
    problems: list[str] = []
    if settings.radix_cache:
        problems.append(
            "add --disable-radix-cache: a prefix-cache hit skips the cached rows of a prompt"
        )
    if settings.attn_dp_size > 1 and settings.attn_tp_size > 1:
        # Each DP rank pads its tokens to a multiple of the attention-TP size, and later
        # chunks of a long prompt keep the pad rows: their rows would not match.
        problems.append(
            f"DP attention with attention-TP size {settings.attn_tp_size} (attention DP "
            f"size {settings.attn_dp_size}) is not supported: pad rows shift later chunks. "
            "Give --dp-size equal to --tp-size (attention-TP size 1, e.g. --tp 8 --dp 8 "
            "--enable-dp-attention), or drop --enable-dp-attention"
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


@dataclass(frozen=True, slots=True)
class EncodedPass:
    """A pass's rows already in the sections of one FP8 storage, quantized where they were
    produced (on the device, before the copy to the host: the host buffer carries the
    smaller bytes). ``sections[i]`` is a C-contiguous ``uint8`` array ``[T, row bytes]`` of
    ``storage.sections(L, H)[i]``: a part is the row slice of each, back to back."""

    storage: Storage
    sections: tuple[np.ndarray, ...]
    aux_layers: tuple[int, ...]
    hidden_size: int

    @property
    def nbytes(self) -> int:
        return sum(int(s.nbytes) for s in self.sections)


# What a pass hands the dumper: bfloat16 rows (any storage is written from them; FP8 parts
# are quantized on the host) or rows encoded on the device for one FP8 storage.
PassRows = BatchHidden | EncodedPass


def pass_nbytes(hidden: PassRows) -> int:
    """Host bytes a pass's rows hold (what a background writer's budget counts)."""
    if isinstance(hidden, EncodedPass):
        return hidden.nbytes
    return int(hidden.aux.nbytes + hidden.final.nbytes)


def check_encoded(hidden: EncodedPass, total_rows: int, writes: Sequence[PartWrite]) -> None:
    """Every section holds the pass's rows at its row size, and every part of the pass
    wants exactly this storage."""
    layers = len(hidden.aux_layers) + 1
    wanted = hidden.storage.sections(layers, hidden.hidden_size)
    if len(hidden.sections) != len(wanted):
        raise DumpError(
            f"the pass was encoded into {len(hidden.sections)} sections, its storage "
            f"{hidden.storage.describe()} has {len(wanted)}"
        )
    for got, section in zip(hidden.sections, wanted, strict=True):
        shape = (total_rows, section.row_bytes)
        if got.dtype != np.uint8 or got.shape != shape or not got.flags.c_contiguous:
            raise DumpError(
                f"encoded section {section.name} is {got.dtype} {got.shape}, expected "
                f"uint8 {shape} (C order)"
            )
    for write in writes:
        if write.storage != hidden.storage:
            raise DumpError(
                f"rid {write.rid} asked for {write.storage.describe()} but the pass was "
                f"encoded as {hidden.storage.describe()}"
            )


# Rows quantized at once on the host: the float32 temporaries stay a few MiB per writer
# thread, whatever the part.
_ENCODE_BLOCK_BYTES = 4 << 20


def encoded_part(hidden: PassRows, write: PartWrite) -> list[list[memoryview]]:
    """The bytes of an FP8 part in file order (PROTOCOL §3), as ``writev`` lists:
    ``[fp8][f32 scales][bf16 kept]`` for its rows, exactly
    :func:`hsx_async.quantize.encode_rows` of its bfloat16 rows. Row slices of an
    :class:`EncodedPass`; from bfloat16 rows, quantized here a block of rows at a time
    (the same quantizer, per (row, slot) vector, so the same bytes)."""
    row, count = write.batch_row, write.rows
    if isinstance(hidden, EncodedPass):
        return [[s[row : row + count].reshape(-1).data for s in hidden.sections]]
    layers = len(hidden.aux_layers) + 1
    block = max(1, _ENCODE_BLOCK_BYTES // (layers * hidden.hidden_size * 2))
    sections: list[list[memoryview]] = []
    for first in range(row, row + count, block):
        n = min(block, row + count - first)
        encoded = encode_bits(assemble_rows(hidden, first, n), write.storage)
        sections = sections or [[] for _ in encoded]
        for out, data in zip(sections, encoded, strict=True):
            out.append(data)
    flat = [data for section in sections for data in section]
    return [flat[i : i + IOV_MAX] for i in range(0, len(flat), IOV_MAX)]


def encode_bits(rows: np.ndarray, storage: Storage) -> list[memoryview]:
    """Host rows ``[n, L, H]`` of bfloat16 bit patterns (2-byte elements) as the bytes of
    ``storage``'s sections, in order (:func:`hsx_async.quantize.encode_rows`)."""
    import torch  # noqa: PLC0415 (a bfloat16-only server never loads torch for this)

    from hsx_async.quantize import encode_rows  # noqa: PLC0415 (it imports torch)

    bf16 = torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return [t.view(torch.uint8).numpy().reshape(-1).data for t in encode_rows(bf16, storage)]


def assemble_rows(hidden: BatchHidden, row: int, count: int) -> np.ndarray:
    """Rows ``[row, row+count)`` of the pass as one part: ``[count, K+1, H]``, C order,
    the aux layers in order, then the final hidden state."""
    k, h = len(hidden.aux_layers), hidden.hidden_size
    out = np.empty((count, k + 1, h), dtype=np.dtype("<u2"))
    out[:, :k, :] = hidden.aux[row : row + count].reshape(count, k, h).view("<u2")
    out[:, k, :] = hidden.final[row : row + count].view("<u2")
    return out


def stacked_rows(hidden: BatchHidden) -> memoryview | None:
    """The pass's rows as one ``[T, K+1, H]`` byte buffer, when ``aux`` and ``final`` are
    views of such a buffer (a device-side stack, the reference server); else None.

    Then every part is one contiguous slice of it: written without any host copy.
    """
    aux, final = hidden.aux, hidden.final
    t, h, k = final.shape[0], hidden.hidden_size, len(hidden.aux_layers)
    row = (k + 1) * h * 2
    aux2 = aux
    if aux.ndim == 3 and aux.strides == (row, h * 2, 2):
        aux2 = np.lib.stride_tricks.as_strided(aux, (t, k * h), (row, 2), writeable=False)
    if t == 0 or aux2.ndim != 2 or aux2.strides != (row, 2) or final.strides != (row, 2):
        return None
    aux_at = aux2.__array_interface__["data"][0]
    if final.__array_interface__["data"][0] != aux_at + k * h * 2:
        return None
    # Bytes [aux_at, aux_at + t*row) are each an element of aux or of final: no byte
    # outside the arrays is read.
    flat = np.lib.stride_tricks.as_strided(aux2, (t * row // 2,), (2,), writeable=False)
    return flat.view(np.uint8).data


def part_chunks(hidden: BatchHidden, row: int, count: int) -> Iterator[list[memoryview]]:
    """The bytes of part rows ``[row, row+count)`` in file order, as lists of at most
    :data:`IOV_MAX` buffers for ``writev``, without assembling the part where the
    layout allows it:

    - one slice of the pass's ``[T, K+1, H]`` buffer (see :func:`stacked_rows`);
    - else, with C-contiguous ``aux`` and ``final`` (SGLang's own layout), two slices
      per row: its K aux slices, then its final slice;
    - else one assembled copy (:func:`assemble_rows`).
    """
    k, h = len(hidden.aux_layers), hidden.hidden_size
    stacked = stacked_rows(hidden)
    if stacked is not None:
        size = (k + 1) * h * 2
        yield [stacked[row * size : (row + count) * size]]
        return
    aux, final = hidden.aux, hidden.final
    if not (aux.flags.c_contiguous and final.flags.c_contiguous):
        yield [assemble_rows(hidden, row, count).view(np.uint8).data]
        return
    aux_bytes = aux.reshape(-1).view(np.uint8).data
    final_bytes = final.reshape(-1).view(np.uint8).data
    a, f = k * h * 2, h * 2
    per_call = max(1, IOV_MAX // 2)
    for first in range(row, row + count, per_call):
        last = min(first + per_call, row + count)
        buffers: list[memoryview] = []
        for r in range(first, last):
            buffers.append(aux_bytes[r * a : (r + 1) * a])
            buffers.append(final_bytes[r * f : (r + 1) * f])
        yield buffers


@dataclass(slots=True)
class BatchReport:
    """What one :meth:`PrefillDumper.dump_batch` did. Written synchronously: the parts
    written and the rids committed. With a background writer: the parts handed to it
    (``queued``); their writes and commits happen later, and its failures are reported
    through the writer's ``on_reject``."""

    parts: list[PartWrite] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    queued: list[PartWrite] = field(default_factory=list)
    notes: list[Reject] = field(default_factory=list)  # FP8 requests dumped as bfloat16


@dataclass(frozen=True, slots=True)
class PartJob:
    """One part to write, and, for a request's last part, the ``meta.json`` to commit
    after it. ``dump`` is the request's bookkeeping, shared by all its jobs: a failure
    marks it, and its later jobs then write nothing."""

    write: PartWrite
    dump: RequestDump
    meta: DumpMeta | None


@dataclass(frozen=True, slots=True)
class JobOutcome:
    wrote: bool
    committed: bool
    reject: Reject | None


def run_job(root: Path, job: PartJob, hidden: PassRows, *, assemble: bool = False) -> JobOutcome:
    """Write ``job``'s part (and commit) unless an earlier part of its dump failed."""
    write = job.write
    if job.dump.failed:
        return JobOutcome(wrote=False, committed=False, reject=None)
    try:
        with request_dir_fd(root, write.ns, write.rid) as dir_fd:
            if isinstance(hidden, EncodedPass) or write.storage.is_fp8:
                write_part_vectored(dir_fd, write.start, write.end, encoded_part(hidden, write))
            elif assemble:  # the pre-issue-16 path: one copy to lay the part out, then write
                write_part(
                    dir_fd,
                    write.start,
                    write.end,
                    assemble_rows(hidden, write.batch_row, write.rows).data,
                )
            else:
                chunks = part_chunks(hidden, write.batch_row, write.rows)
                write_part_vectored(dir_fd, write.start, write.end, chunks)
            if job.meta is not None:
                write_meta(dir_fd, job.meta)
    except (DumpError, OSError) as exc:
        job.dump.failed = True
        reason = f"writing {part_name(write.start, write.end)}: {exc}"
        return JobOutcome(wrote=False, committed=False, reject=Reject(write.rid, reason))
    return JobOutcome(wrote=True, committed=job.meta is not None, reject=None)


class PartSink(Protocol):
    """Where :class:`PrefillDumper` hands a pass's jobs when it does not write them itself
    (:class:`hsx_async.server.hook_writer.BackgroundWriter`)."""

    def submit(self, hidden: PassRows, jobs: Sequence[PartJob]) -> None: ...


class PrefillDumper:
    """Plans, slices, writes and commits the dumps of successive forward passes.

    Without ``background`` it writes each pass's parts before :meth:`dump_batch` returns.
    With one, :meth:`dump_batch` only plans (bookkeeping on the calling thread) and hands
    the pass's jobs and a reference to its rows to ``background``, whose threads write
    them in order per request and commit ``meta.json`` after a request's last part.
    ``assemble`` keeps the pre-issue-16 copy (assemble each part, then write it) for the
    before/after bench.
    """

    def __init__(
        self,
        config: HookConfig,
        *,
        model: str | None = None,
        background: PartSink | None = None,
        assemble: bool = False,
    ) -> None:
        self.config = config
        self.model = model if model is not None else (config.model or "")
        self.registry = DumpRegistry(config.max_open)
        self.background = background
        self.assemble = assemble

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
        if self.background is not None:
            try:
                self.background.submit(hidden, jobs)
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
        # part even while a background writer still holds it.
        dump = self.registry.entry(write.rid)
        done = self.registry.record(write)
        meta = None
        if done is not None:
            meta = done.meta(
                hidden_size=hidden.hidden_size,
                aux_layers=list(hidden.aux_layers),
                model=self.model,
                server=self.config.server,
            )
        return PartJob(write=write, dump=dump, meta=meta)

    def _write_now(self, job: PartJob, hidden: PassRows, report: BatchReport) -> None:
        outcome = run_job(self.config.dump_root, job, hidden, assemble=self.assemble)
        if outcome.wrote:
            report.parts.append(job.write)
        if outcome.committed:
            report.committed.append(job.write.rid)
        if outcome.reject is not None:
            self.registry.poison(job.write.rid, last=job.write.last)
            report.rejects.append(outcome.reject)
