"""The hsx protocol (``PROTOCOL.md``, version 5; requests, dumps and files as in version 4,
``PROTOCOL_VERSION``): names, patterns and dump checks.

Pure functions only: nothing here touches a socket or a file. The client, the built-in
servers and the SGLang hook all import this module, so a rule lives in exactly one place.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hsx_async.errors import CacheHitError, ConfigError, DumpError, HsxRequestError

PROTOCOL_VERSION = 4
# Versions a client accepts in meta.json: version 1 differs only in having no final_state,
# version 2 only in having no FP8 storage (its dumps are bfloat16), version 3 only in
# knowing one FP8 layout (per_token_slot).
ACCEPTED_VERSIONS = (1, 2, 3, 4)

# Which final hidden state the last layer slot holds (PROTOCOL §3): the output of the
# model's final norm (the LM head's input, what SGLang's logits processor sees), or the
# residual stream entering it. Version-1 dumps and datasets name none: post-norm.
POST_NORM = "post_norm"
PRE_NORM = "pre_norm"
FINAL_STATES = (POST_NORM, PRE_NORM)
# The final norm's kind (provenance.json final_norm): RMSNorm scaling by its stored w
# (Llama, Qwen2/3, DeepSeek, ...) or by 1 + w (Gemma, Qwen3.5/Qwen3-Next).
RMS = "rms"
RMS_ONE_PLUS = "rms_one_plus"
NORM_KINDS = (RMS, RMS_ONE_PLUS)
# Hugging Face model_type values (config.json or its text_config) whose norm is 1 + w.
ONE_PLUS_MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
    }
)


def final_norm_kind(model_type: object) -> str:
    return RMS_ONE_PLUS if model_type in ONE_PLUS_MODEL_TYPES else RMS


NS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
RID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NS_RE = re.compile(NS_PATTERN)
_RID_RE = re.compile(RID_PATTERN)
_PART_RE = re.compile(r"part-([0-9]{10})-([0-9]{10})\.bin")  # ASCII digits only

META_NAME = "meta.json"
BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
DTYPES = (BF16, FP8)
DTYPE = BF16  # what every version-1/2 dump and dataset holds
BYTES_PER_ELEMENT = 2
SCALE_BYTES = 4  # one float32 scale per (token, quantized layer slot)
# The FP8 layouts (meta.json, file metadata, provenance.json "scales"), PROTOCOL §3.
# per_token_slot (version 3): one float32 scale per (token, quantized slot) vector, from
# its largest |value|. A few massive channels (attention sinks: 1,000-30,000x the row's
# median) then push the rest of their row towards e4m3fn's subnormals (bench/fp8.py).
PER_TOKEN_SLOT = "per_token_slot"
# per_token_slot_outliers16 (version 4): each vector's OUTLIERS largest |values| are kept
# exactly, in bfloat16 with their channel index, beside the FP8 values, and the scale comes
# from the largest of the others: 4 + 4 x 16 bytes per vector instead of 4.
PER_TOKEN_SLOT_OUTLIERS16 = "per_token_slot_outliers16"
SCALE_LAYOUTS = (PER_TOKEN_SLOT_OUTLIERS16, PER_TOKEN_SLOT)
OUTLIERS = 16  # per vector, in PER_TOKEN_SLOT_OUTLIERS16
OUTLIER_NONE = 0xFFFF  # the index of an unused outlier entry (its value is +0)
CUSTOM_PARAM_NS = "hsx_ns"
# The storage a request asks the hook for (PROTOCOL §2). Version 3's keys name a
# per_token_slot storage; version 4's hsx_storage names any (a version-3 hook does not
# know it and dumps bfloat16, which the client quantizes, rather than another layout).
# A hook that does not know them dumps bfloat16, and the client quantizes (§3).
CUSTOM_PARAM_DTYPE = "hsx_dtype"
CUSTOM_PARAM_QUANTIZED = "hsx_quantized"
CUSTOM_PARAM_STORAGE = "hsx_storage"
# Tensor names of a dataset file (§4); the dump's part sections have the same names.
HIDDEN = "hidden_states"
SCALES = "hidden_states_scales"
OUTLIER_INDEX = "hidden_states_outlier_index"
OUTLIER_VALUES = "hidden_states_outlier_values"
UNQUANTIZED = "hidden_states_unquantized"
DEFAULT_DUMP_ROOT = "/dev/shm/hsx"


def valid_ns(ns: object) -> bool:
    """A namespace is safe to join to the dump root (no '/', no '..', no NUL)."""
    # fullmatch: '$' alone would accept a trailing newline.
    return isinstance(ns, str) and _NS_RE.fullmatch(ns) is not None


def valid_rid(rid: object) -> bool:
    return isinstance(rid, str) and _RID_RE.fullmatch(rid) is not None


# A request-supplied name in a message or log line is shown as repr(), cut to this length.
_SHOWN_CHARS = 80
_EXAMPLE_AUX_LAYERS = (2, 30, 58)


def shown(value: object) -> str:
    """A request-supplied value made safe and short for an error message or a log line."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def check_aux_layers(
    layers: Sequence[object], *, key: str, num_layers: int | None = None
) -> tuple[int, ...]:
    """The one aux-layer rule, for the client's config, every hook and every server.

    Layer k is the residual stream entering decoder layer k (Hugging Face
    ``hidden_states[k]``). A valid list names at least one layer, each an integer ≥ 0, in
    strictly ascending order (the engines capture in layer order whatever order they are
    given, so any other order would label the slots of a row wrongly, and a layer named
    twice would be captured once), and, where the model's size is known, each below its
    ``num_layers`` decoder layers. Returns the layers; raises :class:`ConfigError` on
    ``key`` saying what to change.
    """
    if not layers:
        example = _EXAMPLE_AUX_LAYERS if num_layers is None else _example_layers(num_layers)
        raise ConfigError(key, f"names no layer; list at least one, e.g. {list(example)}")
    if not all(type(k) is int for k in layers):
        raise ConfigError(key, f"{shown(list(layers))} is not a list of integer layer ids")
    ints = tuple(k for k in layers if type(k) is int)
    if any(k < 0 for k in ints):
        raise ConfigError(
            key, f"{list(ints)} names a negative layer; layer ids are ≥ 0 (k: the input of layer k)"
        )
    if any(b <= a for a, b in pairwise(ints)):
        raise ConfigError(
            key,
            f"{list(ints)} is not strictly ascending; list each layer once, lowest first: "
            f"{sorted(set(ints))}",
        )
    if num_layers is not None and ints[-1] >= num_layers:
        raise ConfigError(
            key,
            f"{list(ints)} does not fit a model with {num_layers} layers: name layers 0.."
            f"{num_layers - 1} (layer k is the input of decoder layer k; the final state is "
            "added after the aux layers), e.g. "
            f"{list(_example_layers(num_layers))}",
        )
    return ints


def parse_aux_layers(text: str, *, key: str, num_layers: int | None = None) -> tuple[int, ...]:
    """``"2,30,58"`` → ``(2, 30, 58)``, checked by :func:`check_aux_layers` (blank text
    names no layer)."""
    try:
        layers = [int(item) for item in text.split(",")] if text.strip() else []
    except ValueError:
        raise ConfigError(key, f"{text!r} is not a comma-separated list of integers") from None
    return check_aux_layers(layers, key=key, num_layers=num_layers)


def _example_layers(n: int) -> tuple[int, ...]:
    """SGLang's EAGLE-3 default for an n-layer model, where it is three distinct layers."""
    return (2, n // 2, n - 3) if n >= 8 else tuple(range(n))[:3]


def marked_ns(custom_params: object) -> object | None:
    """The ``hsx_ns`` a request's ``custom_params`` carries, as sent (not yet checked), or
    None: an ordinary request, served as usual and dumping nothing (PROTOCOL §2)."""
    if not isinstance(custom_params, Mapping):
        return None
    return custom_params.get(CUSTOM_PARAM_NS)


def check_hsx_request(ns: object, rid: object, *, max_new_tokens: object = 0) -> tuple[str, str]:
    """PROTOCOL §2's rule for a marked request, the same in every hook and server: its
    namespace and rid match their patterns (so no path built from them can leave the dump
    root) and it is prefill-only (``max_new_tokens`` 0; the vLLM form has no such field:
    vLLM has no prefill-only request, so it leaves it out). Returns ``(ns, rid)``; raises
    :class:`HsxRequestError` with the one reason text otherwise: nothing is dumped for the
    request, and a server that can answers 400 with it."""
    if not valid_ns(ns):
        raise HsxRequestError(f"{CUSTOM_PARAM_NS} {shown(ns)} does not match {NS_PATTERN}")
    if not valid_rid(rid):
        raise HsxRequestError(f"rid {shown(rid)} does not match {RID_PATTERN}")
    if type(max_new_tokens) is not int or max_new_tokens != 0:
        raise HsxRequestError(
            f"max_new_tokens is {shown(max_new_tokens)}; an hsx request must be prefill-only "
            "(max_new_tokens 0)"
        )
    assert isinstance(ns, str) and isinstance(rid, str)  # narrowed by valid_ns/valid_rid
    return ns, rid


def num_layers(aux_layers: Sequence[int]) -> int:
    """L: the aux layers plus the final (post-norm) hidden state."""
    return len(aux_layers) + 1


def row_bytes(hidden_size: int, aux_layers: Sequence[int]) -> int:
    """Bytes of one token's rows in a dump: L × H bf16 values."""
    return num_layers(aux_layers) * hidden_size * BYTES_PER_ELEMENT


@dataclass(frozen=True, slots=True)
class Section:
    """One tensor of a sample's rows: per token it holds ``row_shape`` values of ``dtype``
    (a safetensors dtype code). A dump part is its sections back to back for its rows; a
    dataset file holds each section as one tensor over all rows (PROTOCOL §3, §4)."""

    name: str
    dtype: str  # "BF16" | "F8_E4M3" | "F32" | "U16"
    row_shape: tuple[int, int]
    row_bytes: int


@dataclass(frozen=True, slots=True)
class Storage:
    """How hidden states are stored (PROTOCOL §3, §4): ``bfloat16`` (all slots, bit-exact),
    or ``float8_e4m3fn`` for the layer slots in ``quantized`` (indices into the L axis,
    ascending), each (token, slot) vector with its own float32 scale in the layout
    ``scales`` names (:data:`SCALE_LAYOUTS`; default, for FP8: version 3's
    ``per_token_slot``); the other slots stay bfloat16."""

    dtype: str = BF16
    quantized: tuple[int, ...] = ()
    scales: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        q = self.quantized
        if self.dtype == BF16 and (q or self.scales):
            raise ValueError("a bfloat16 storage quantizes no slot and has no scales")
        if self.dtype == FP8 and (not q or list(q) != sorted(set(q)) or q[0] < 0):
            raise ValueError(f"quantized slots {list(q)} are not ascending, distinct and ≥ 0")
        if self.dtype == FP8 and not self.scales:
            object.__setattr__(self, "scales", PER_TOKEN_SLOT)  # frozen: set once, here
        if self.dtype == FP8 and self.scales not in SCALE_LAYOUTS:
            raise ValueError(
                f"scales {self.scales!r} is not one of {', '.join(map(repr, SCALE_LAYOUTS))}"
            )

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def outliers(self) -> int:
        """Values per vector kept exactly beside the FP8 ones (0: none)."""
        return OUTLIERS if self.scales == PER_TOKEN_SLOT_OUTLIERS16 else 0

    def check_slots(self, layers: int) -> None:
        if self.quantized and self.quantized[-1] >= layers:
            raise ValueError(
                f"quantized slot {self.quantized[-1]} is past the {layers} layer slots"
            )

    def kept(self, layers: int) -> tuple[int, ...]:
        """The slots stored as bfloat16, ascending."""
        quantized = set(self.quantized)
        return tuple(i for i in range(layers) if i not in quantized)

    def sections(self, layers: int, hidden_size: int) -> tuple[Section, ...]:
        if not self.is_fp8:
            return (Section(HIDDEN, "BF16", (layers, hidden_size), layers * hidden_size * 2),)
        lq, lk, k = len(self.quantized), layers - len(self.quantized), self.outliers
        out = [
            Section(HIDDEN, "F8_E4M3", (lq, hidden_size), lq * hidden_size),
            Section(SCALES, "F32", (lq, 1), lq * SCALE_BYTES),
        ]
        if k:
            out.append(Section(OUTLIER_INDEX, "U16", (lq, k), lq * k * 2))
            out.append(Section(OUTLIER_VALUES, "BF16", (lq, k), lq * k * 2))
        if lk:
            out.append(Section(UNQUANTIZED, "BF16", (lk, hidden_size), lk * hidden_size * 2))
        return tuple(out)

    def row_bytes(self, layers: int, hidden_size: int) -> int:
        return sum(s.row_bytes for s in self.sections(layers, hidden_size))

    def describe(self) -> str:
        if not self.is_fp8:
            return BF16
        return f"{FP8} (slots {','.join(map(str, self.quantized))}; scales {self.scales})"


BF16_STORAGE = Storage()


def parse_storage(dtype: object, quantized: object, where: str, scales: object = None) -> Storage:
    """A storage as meta.json, a file's metadata, provenance.json or a request names it;
    absent (None, None) is bfloat16 (versions 1 and 2). ``scales``: the layout an FP8
    storage names (absent: version 3's, ``per_token_slot``)."""
    if dtype is None or dtype == BF16:
        if quantized not in (None, [], ()):
            raise DumpError(f"{where}: a bfloat16 storage lists quantized slots {quantized!r}")
        return BF16_STORAGE
    if dtype != FP8:
        raise DumpError(f"{where}: dtype is {dtype!r}, expected one of {', '.join(DTYPES)}")
    if scales is not None and scales not in SCALE_LAYOUTS:
        raise DumpError(
            f"{where}: scales is {scales!r}; this hsx reads "
            f"{' and '.join(map(repr, SCALE_LAYOUTS))} only: read it with the hsx that wrote it"
        )
    if not isinstance(quantized, list | tuple) or not all(type(x) is int for x in quantized):
        raise DumpError(f"{where}: quantized is {quantized!r}, expected a list of slot indices")
    try:
        return Storage(FP8, tuple(quantized), str(scales or PER_TOKEN_SLOT))
    except ValueError as exc:
        raise DumpError(f"{where}: {exc}") from None


def storage_metadata(storage: Storage) -> dict[str, str]:
    """The ``__metadata__`` strings of a dataset file that name its storage (§4)."""
    if not storage.is_fp8:
        return {"dtype": BF16}
    return {
        "dtype": FP8,
        "quantized": ",".join(map(str, storage.quantized)),
        "scales": storage.scales,
    }


def storage_from_metadata(meta: dict[str, str], where: str) -> Storage:
    """The inverse of :func:`storage_metadata`; a file without ``dtype`` is bfloat16."""
    raw = meta.get("quantized")
    slots: list[int] | None = None
    if raw is not None:
        try:
            slots = [int(x) for x in raw.split(",")] if raw else []
        except ValueError:
            raise DumpError(f"{where}: quantized {raw!r} is not a list of slot indices") from None
    return parse_storage(meta.get("dtype"), slots, where, meta.get("scales"))


def part_name(start: int, end: int) -> str:
    return f"part-{start:010d}-{end:010d}.bin"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(start, end) of a visible part file name, None for anything else."""
    m = _PART_RE.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


def request_dir(root: Path, ns: str, rid: str) -> Path:
    """``<root>/<ns>/<rid>``; refuses names that could leave the root."""
    if not valid_ns(ns):
        raise DumpError(f"namespace {ns!r} does not match {NS_PATTERN}")
    if not valid_rid(rid):
        raise DumpError(f"rid {rid!r} does not match {RID_PATTERN}")
    return root / ns / rid


def check_tiling(parts: Sequence[tuple[int, int]], num_tokens: int) -> None:
    """The parts, in order, must cover ``[0, num_tokens)`` with no gap and no overlap."""
    if num_tokens <= 0:
        raise DumpError(f"num_tokens is {num_tokens}, expected at least 1")
    if not parts:
        raise DumpError("meta.json lists no parts")
    expected = 0
    for start, end in parts:
        if start != expected:
            kind = "gap" if start > expected else "overlap"
            raise DumpError(f"parts have a {kind} at row {expected}: next part is [{start}, {end})")
        if end <= start:
            raise DumpError(f"part [{start}, {end}) is empty or reversed")
        expected = end
    if expected != num_tokens:
        raise DumpError(f"parts cover [0, {expected}) but num_tokens is {num_tokens}")


@dataclass(frozen=True, slots=True)
class DumpMeta:
    """A parsed ``meta.json`` (PROTOCOL §3)."""

    rid: str
    num_tokens: int
    hidden_size: int
    aux_layers: tuple[int, ...]
    parts: tuple[tuple[int, int], ...]
    model: str
    server: str
    final_state: str = POST_NORM
    storage: Storage = BF16_STORAGE
    protocol: int = PROTOCOL_VERSION  # the writing hook's version (meta.json "protocol")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's rows in this dump's parts."""
        return self.storage.row_bytes(num_layers(self.aux_layers), self.hidden_size)

    def to_json(self) -> bytes:
        raw: dict[str, Any] = {
            "protocol": self.protocol,
            "rid": self.rid,
            "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size,
            "aux_layers": list(self.aux_layers),
            "dtype": self.storage.dtype,
            "parts": [list(p) for p in self.parts],
            "model": self.model,
            "server": self.server,
            "final_state": self.final_state,
        }
        if self.storage.is_fp8:
            raw["quantized"] = list(self.storage.quantized)
            raw["scales"] = self.storage.scales
        return orjson.dumps(raw)


def _int_field(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if type(value) is not int:
        raise DumpError(f"meta.json field {key!r} is {value!r}, expected an integer")
    return value


def parse_meta(data: bytes) -> DumpMeta:
    """Parse and type-check ``meta.json``; semantic checks are in :func:`check_meta`."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise DumpError(f"meta.json is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise DumpError("meta.json is not a JSON object")
    if type(raw.get("protocol")) is not int or raw.get("protocol") not in ACCEPTED_VERSIONS:
        raise DumpError(
            f"meta.json protocol is {raw.get('protocol')!r}, expected one of {ACCEPTED_VERSIONS}"
        )
    storage = parse_storage(raw.get("dtype"), raw.get("quantized"), "meta.json", raw.get("scales"))
    if raw.get("dtype") != DTYPE and raw["protocol"] < 3:
        raise DumpError(f"meta.json dtype is {raw.get('dtype')!r}, expected {DTYPE!r}")
    if storage.is_fp8 and storage.scales != PER_TOKEN_SLOT and raw["protocol"] < 4:
        raise DumpError(
            f"meta.json scales is {storage.scales!r}, which protocol {raw['protocol']} "
            f"does not define (expected {PER_TOKEN_SLOT!r})"
        )
    layers = raw.get("aux_layers")
    if not isinstance(layers, list) or not all(type(x) is int for x in layers):
        raise DumpError(f"meta.json aux_layers is {layers!r}, expected a list of integers")
    parts_raw = raw.get("parts")
    if not isinstance(parts_raw, list):
        raise DumpError("meta.json parts is not a list")
    parts: list[tuple[int, int]] = []
    for p in parts_raw:
        if not (isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)):
            raise DumpError(f"meta.json part {p!r} is not [start, end]")
        parts.append((p[0], p[1]))
    rid = raw.get("rid")
    if not isinstance(rid, str):
        raise DumpError("meta.json rid is missing")
    return DumpMeta(
        rid=rid,
        num_tokens=_int_field(raw, "num_tokens"),
        hidden_size=_int_field(raw, "hidden_size"),
        aux_layers=tuple(layers),
        parts=tuple(parts),
        model=str(raw.get("model", "")),
        server=str(raw.get("server", "")),
        final_state=parse_final_state(raw.get("final_state"), "meta.json final_state"),
        storage=storage,
        protocol=raw["protocol"],
    )


def parse_final_state(value: object, where: str) -> str:
    """``post_norm`` or ``pre_norm``; absent (None) means post-norm (version 1)."""
    if value is None:
        return POST_NORM
    if value not in FINAL_STATES:
        raise DumpError(f"{where} is {value!r}, expected one of {', '.join(FINAL_STATES)}")
    return str(value)


def check_meta(
    meta: DumpMeta, *, rid: str, num_tokens: int, hidden_size: int, aux_layers: Sequence[int]
) -> None:
    """The checks of PROTOCOL §3 that need no file system."""
    if meta.rid != rid:
        raise DumpError(f"meta.json rid is {meta.rid!r}, expected {rid!r}")
    if meta.num_tokens != num_tokens:
        raise DumpError(f"meta.json num_tokens is {meta.num_tokens}, the request had {num_tokens}")
    if meta.hidden_size != hidden_size:
        raise DumpError(
            f"meta.json hidden_size is {meta.hidden_size}, config [model].hidden_size is "
            f"{hidden_size}"
        )
    if list(meta.aux_layers) != list(aux_layers):
        raise DumpError(
            f"meta.json aux_layers is {list(meta.aux_layers)}, config [model].aux_layers is "
            f"{list(aux_layers)}"
        )
    if meta.storage.is_fp8 and meta.storage.quantized[-1] >= num_layers(aux_layers):
        raise DumpError(
            f"meta.json quantized slot {meta.storage.quantized[-1]} is past the "
            f"{num_layers(aux_layers)} layer slots"
        )
    check_tiling(meta.parts, meta.num_tokens)


def check_storage(meta: DumpMeta, wanted: Storage) -> None:
    """A dump holds the dataset's storage, or bfloat16 (which the client quantizes); an
    FP8 dump of other slots, or one for a bfloat16 dataset, cannot be turned into it."""
    if meta.storage == wanted or not meta.storage.is_fp8:
        return
    raise DumpError(
        f"the dump is stored as {meta.storage.describe()} but this dataset is "
        f"{wanted.describe()}; the hook honours the request's {CUSTOM_PARAM_DTYPE} "
        f"and {CUSTOM_PARAM_QUANTIZED}, so the server's hook is not hsx's"
    )


def check_part_sizes(meta: DumpMeta, sizes: dict[tuple[int, int], int], per_row: int) -> None:
    """Every listed part exists with exactly ``rows × row bytes`` (its storage's sections
    for one row: L × H × 2 for bfloat16); nothing else is there."""
    for start, end in meta.parts:
        size = sizes.get((start, end))
        if size is None:
            raise DumpError(f"part {part_name(start, end)} is listed in meta.json but missing")
        expected = (end - start) * per_row
        if size != expected:
            raise DumpError(
                f"part {part_name(start, end)} has {size} bytes, expected {expected} "
                f"({end - start} rows × {per_row} bytes)"
            )
    extra = sorted(set(sizes) - set(meta.parts))
    if extra:
        raise DumpError(f"part {part_name(*extra[0])} is not listed in meta.json")


# A scale is max(amax(|x|) / 448, 2^-126) (§3): positive, normal and finite. As bits: sign
# clear and a biased exponent of 1..254, i.e. 0x00800000 (2^-126) to 0x7F7FFFFF (float32's
# largest), one unsigned compare after an offset.
_SCALE_LOWEST_BITS = 0x00800000
_SCALE_BITS_SPAN = 0x7F800000 - _SCALE_LOWEST_BITS

SectionCheck = Callable[[bytes | bytearray | memoryview], "str | None"]


def section_check(section: Section, hidden_size: int = OUTLIER_NONE) -> SectionCheck | None:
    """The check a dump's bytes of ``section`` must pass before they are written to the
    dataset, or None where any bytes of the right size are valid (bfloat16 and e4m3fn
    values): the FP8 scales must be what the quantization rule makes (§3), and in the
    outliers layout each vector's outlier channels ascending, below ``hidden_size`` and the
    unused ones last, and the outlier values finite (a non-finite input row, which the
    other layout's scale refuses the same way). The check takes a block of the section's
    bytes (whole vectors: a multiple of :func:`check_unit` bytes) and returns what is
    wrong, or None."""
    if section.name == SCALES:
        return _check_scales
    if section.name == OUTLIER_INDEX:
        return functools.partial(_check_outlier_index, per_vector=section.row_shape[1],
                                 hidden_size=hidden_size)  # fmt: skip
    if section.name == OUTLIER_VALUES:
        return _check_outlier_values
    return None


def check_unit(section: Section) -> int:
    """The bytes a block given to :func:`section_check`'s check is a multiple of: one
    vector's entries of the section (a float32 scale; 16 uint16 channels)."""
    return section.row_bytes // section.row_shape[0]


def _check_outlier_index(
    data: bytes | bytearray | memoryview, *, per_vector: int, hidden_size: int
) -> str | None:
    index = np.frombuffer(data, dtype="<u2").reshape(-1, per_vector)
    used = index != OUTLIER_NONE
    past = used & (index >= hidden_size)
    # used entries strictly ascending; after the first unused entry, only unused ones
    disorder = (used[:, 1:] & (index[:, 1:] <= index[:, :-1])) | (used[:, 1:] & ~used[:, :-1])
    bad = past.any(axis=1) | disorder.any(axis=1)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    first = index[int(np.argmax(bad))].tolist()
    return (
        f"{count} FP8 vectors' outlier channels are past the hidden size {hidden_size} or "
        f"not ascending (first: {first}); the quantization rule lists them ascending, the "
        "unused ones (65535) last"
    )


def _check_outlier_values(data: bytes | bytearray | memoryview) -> str | None:
    bits = np.frombuffer(data, dtype="<u2")
    bad = (bits & np.uint16(0x7F80)) == np.uint16(0x7F80)  # bfloat16 Inf or NaN
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    return (
        f"{count} FP8 outlier values are not finite: the rows they were quantized from "
        "were not finite"
    )


def _check_scales(data: bytes | bytearray | memoryview) -> str | None:
    """float32 scales that no quantizer makes: negative, zero, subnormal (< 2^-126),
    infinite or NaN (a negative scale flips the sign of its vector, NaN poisons it)."""
    bits = np.frombuffer(data, dtype="<u4")
    bad = (bits - np.uint32(_SCALE_LOWEST_BITS)) >= np.uint32(_SCALE_BITS_SPAN)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    first = float(bits[int(np.argmax(bad)) :].view("<f4")[0])
    return (
        f"{count} FP8 scales are negative, zero, subnormal or not finite (first: {first!r}); "
        "the quantization rule makes max(amax / 448, 2^-126)"
    )


# e4m3fn's largest finite magnitude, 448, as a code (sign bit clear): an outlier's own q.
_CODE_448 = 0x7E
_BF16_NON_FINITE = 0x7F80  # exponent bits all set: Inf or NaN


def saturated_codes(
    index: np.ndarray, value_bits: np.ndarray, scale_bits: np.ndarray, hidden_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The rule's outliers saturate their own FP8 value (§3: ``m > r``, so ``|x| / scale``
    is at least 448): for outlier entries ``[..., K]`` (channels; values as bfloat16 bits,
    uint16) of vectors with float32 scales ``[...]`` (as bits, uint32), which entries the
    rule fixes — a used channel below ``hidden_size``, a finite value (a non-finite one is
    refused as such), a scale above the floor (there ``|x| / scale`` may stay below 448) —
    and the e4m3fn code each one's own q must hold there: ±448 with its value's sign.
    One rule for the copy (as it copies) and ``hsx verify --deep``."""
    used = index < hidden_size
    finite = (value_bits & _BF16_NON_FINITE) != _BF16_NON_FINITE
    floor = scale_bits == _SCALE_LOWEST_BITS
    checked: np.ndarray = used & finite & ~floor[..., None]
    codes: np.ndarray = (((value_bits >> 8) & 0x80) | _CODE_448).astype(np.uint8)
    return checked, codes


def storage_params(storage: Storage) -> dict[str, Any]:
    """What a request adds to ``custom_params`` (vLLM: ``kv_transfer_params``) to ask the
    hook for ``storage`` (PROTOCOL §2); nothing for bfloat16. A ``per_token_slot`` storage
    in version 3's keys, which a version-3 hook honours too; any other in ``hsx_storage``,
    which a version-3 hook does not know: it dumps bfloat16 and the client quantizes."""
    if not storage.is_fp8:
        return {}
    if storage.scales == PER_TOKEN_SLOT:
        return {CUSTOM_PARAM_DTYPE: storage.dtype, CUSTOM_PARAM_QUANTIZED: list(storage.quantized)}
    return {
        CUSTOM_PARAM_STORAGE: {
            "dtype": storage.dtype,
            "quantized": list(storage.quantized),
            "scales": storage.scales,
        }
    }


def requested_storage(params: dict[str, Any], layers: int) -> tuple[Storage, str]:
    """The storage a request asks for, as the hook reads it: (storage, '') or, for a
    request it cannot honour, (bfloat16, why): the client then quantizes itself."""
    try:
        storage = _requested(params)
        storage.check_slots(layers)
    except (DumpError, ValueError) as exc:
        return BF16_STORAGE, str(exc)
    return storage, ""


def _requested(params: dict[str, Any]) -> Storage:
    asked = params.get(CUSTOM_PARAM_STORAGE)
    if asked is not None:
        if not isinstance(asked, dict):
            raise DumpError(f"request: {CUSTOM_PARAM_STORAGE} is {asked!r}, expected an object")
        return parse_storage(
            asked.get("dtype"), asked.get("quantized"), "request", asked.get("scales")
        )
    dtype = params.get(CUSTOM_PARAM_DTYPE)
    if dtype is None or dtype == BF16:
        return BF16_STORAGE
    return parse_storage(dtype, params.get(CUSTOM_PARAM_QUANTIZED), "request")


def generate_body(
    rid: str, ns: str, input_ids: Any, storage: Storage = BF16_STORAGE
) -> dict[str, Any]:
    """The ``POST /generate`` body of PROTOCOL §2 (``input_ids`` may be a numpy array)."""
    custom = {CUSTOM_PARAM_NS: ns, **storage_params(storage)}
    return {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 0, "custom_params": custom},
        "stream": False,
    }


def check_response(body: object, *, rid: str, num_tokens: int) -> None:
    """The response checks of PROTOCOL §2."""
    if not isinstance(body, dict):
        raise DumpError("response is not a JSON object")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise DumpError("response has no meta_info")
    if meta.get("id") != rid:
        raise DumpError(f"response meta_info.id is {meta.get('id')!r}, expected {rid!r}")
    # ``type(...) is int``: a JSON boolean is an int to Python (True == 1, False == 0).
    prompt = meta.get("prompt_tokens")
    if type(prompt) is not int or prompt != num_tokens:
        raise DumpError(
            f"response meta_info.prompt_tokens is {prompt!r}, the request had {num_tokens} tokens"
        )
    cached = meta.get("cached_tokens", 0)
    if cached is not None and (type(cached) is not int or cached != 0):
        raise CacheHitError(
            f"response meta_info.cached_tokens is {cached!r}: a prefix-cache hit skips rows; "
            "start the server with --disable-radix-cache"
        )
