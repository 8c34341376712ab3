"""The vLLM side of hsx, without vLLM: which requests are marked, which layers vLLM must
capture, and one request's dump written as PROTOCOL §3 says.

How vLLM gives hidden states: with the ``extract_hidden_states`` speculative method, the
target model hands the residual stream at the layer ids ``eagle_aux_hidden_state_layer_ids``
(id k = the stream entering decoder layer k = Hugging Face ``hidden_states[k]``; id n, for
an n-layer model, is the output of the last layer *before* the final norm) to a
cache-only attention layer, which stores ``[tokens, ids, hidden]`` in paged KV-cache blocks.
A KV connector reads a finished request's rows back from those blocks. So hsx asks vLLM for
``aux_layers + [n]``, and the dump's last layer is the **pre-norm** final state: meta.json
says ``"final_state": "pre_norm"`` (the SGLang hook writes the post-norm state). Prefix
caching must be off: a request that reused cached blocks would carry another request's
rows.

A marked request carries ``kv_transfer_params = {"hsx_ns": ns, "hsx_rid": rid}``
(vLLM passes a completion request's ``kv_transfer_params`` to the connector); both are
checked against the protocol patterns before any path is built from them. It may add
``hsx_dtype``/``hsx_quantized`` (PROTOCOL §2): the connector then quantizes the rows on the
device before their copy to the host and writes the FP8 sections; an unusable request is
dumped as bfloat16 (the client quantizes it).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx_async.errors import ConfigError, DumpError
from hsx_async.protocol import (
    BF16_STORAGE,
    CUSTOM_PARAM_NS,
    DEFAULT_DUMP_ROOT,
    NS_PATTERN,
    RID_PATTERN,
    DumpMeta,
    Storage,
    parse_storage,
    requested_storage,
    valid_ns,
    valid_rid,
)
from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part_vectored

# kv_transfer_params keys of a marked request (PROTOCOL §2, vLLM form).
PARAM_NS = CUSTOM_PARAM_NS
PARAM_RID = "hsx_rid"
FINAL_STATE = "pre_norm"


@dataclass(frozen=True, slots=True)
class Target:
    """Where one marked request's dump goes, and how its rows are stored (``note``: why
    an FP8 request is dumped as bfloat16 instead)."""

    ns: str
    rid: str
    storage: Storage = BF16_STORAGE
    note: str = ""

    @property
    def path(self) -> str:
        """What travels from vLLM's scheduler to its worker (``PendingSave.filename``):
        ``ns/rid``, then ``/dtype:slots:scales`` for FP8."""
        if not self.storage.is_fp8:
            return f"{self.ns}/{self.rid}"
        slots = ",".join(map(str, self.storage.quantized))
        return f"{self.ns}/{self.rid}/{self.storage.dtype}:{slots}:{self.storage.scales}"


def parse_target_path(text: str) -> Target:
    """The inverse of :attr:`Target.path` (DumpError for anything else)."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not (valid_ns(parts[0]) and valid_rid(parts[1])):
        raise DumpError(f"dump target {text!r} is not ns/rid[/dtype:slots:scales]")
    if len(parts) == 2:
        return Target(parts[0], parts[1])
    dtype, _, rest = parts[2].partition(":")
    slots, _, scales = rest.partition(":")
    try:
        quantized = [int(x) for x in slots.split(",")]
    except ValueError:
        raise DumpError(f"dump target {text!r} names no quantized slots") from None
    where = f"dump target {text!r}"
    return Target(parts[0], parts[1], parse_storage(dtype, quantized, where, scales or None))


def marked_target(params: object, layers: int = 0) -> Target | str | None:
    """The dump target of a request's ``kv_transfer_params``: a :class:`Target`; ``None``
    for an ordinary request (no hsx keys: served as usual, nothing dumped); or the reason
    a marked request is refused (nothing is written for it). ``layers`` (L, the capture
    ids) checks the storage it asks for; 0 dumps every request as bfloat16."""
    if not isinstance(params, Mapping) or (PARAM_NS not in params and PARAM_RID not in params):
        return None
    ns, rid = params.get(PARAM_NS), params.get(PARAM_RID)
    if not valid_ns(ns):
        return f"hsx_ns {ns!r} does not match {NS_PATTERN}"
    if not valid_rid(rid):
        return f"hsx_rid {rid!r} does not match {RID_PATTERN}"
    assert isinstance(ns, str) and isinstance(rid, str)  # narrowed by valid_ns/valid_rid
    assert isinstance(params, Mapping)
    storage, note = requested_storage(dict(params), layers) if layers else (BF16_STORAGE, "")
    return Target(ns, rid, storage, note)


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The layers the connector was started for."""

    aux_layers: tuple[int, ...]
    num_layers: int
    hidden_size: int

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """What ``eagle_aux_hidden_state_layer_ids`` must be: the aux layers, then n."""
        return (*self.aux_layers, self.num_layers)


def layer_plan(capture_ids: Sequence[int] | None, num_layers: int, hidden_size: int) -> LayerPlan:
    """Check vLLM's ``eagle_aux_hidden_state_layer_ids`` and derive the aux layers.

    vLLM sorts and de-duplicates the ids, so they must be strictly ascending as given, and
    the last must be n (the final state) for the dump to hold L = aux + 1 layers."""
    ids = list(capture_ids or [])
    example = f"[2, {num_layers // 2}, {num_layers - 3}, {num_layers}]"
    if len(ids) < 2 or ids[-1] != num_layers:
        raise ConfigError(
            "speculative-config",
            f"eagle_aux_hidden_state_layer_ids is {ids}; hsx needs the aux layers followed by "
            f"{num_layers} (the final state of this {num_layers}-layer model), e.g. {example}",
        )
    if any(b <= a for a, b in itertools.pairwise(ids)) or ids[0] < 0:
        raise ConfigError(
            "speculative-config",
            f"eagle_aux_hidden_state_layer_ids {ids} must be non-negative and strictly ascending",
        )
    return LayerPlan(tuple(ids[:-1]), num_layers, hidden_size)


def check_prefix_caching(enabled: bool) -> None:
    if enabled:
        raise ConfigError(
            "vllm",
            "prefix caching is on: a cache hit would dump another request's rows. Start "
            "vLLM with --no-enable-prefix-caching",
        )


def dump_root() -> Path:
    root = os.environ.get("HSX_DUMP_ROOT", DEFAULT_DUMP_ROOT)
    if not Path(root).is_absolute():
        raise ConfigError("HSX_DUMP_ROOT", f"{root!r} is relative; give an absolute path")
    return Path(root)


def write_dump(
    root: Path,
    target: Target,
    rows: memoryview | Sequence[memoryview],
    *,
    num_tokens: int,
    plan: LayerPlan,
    model: str,
    server: str,
) -> None:
    """One part with every row, then ``meta.json`` (vLLM hands over a finished request's
    rows at once, so there is no chunk bookkeeping: the part is ``[0, num_tokens)``).
    ``rows``: the bfloat16 rows, or, for an FP8 target, its sections' bytes in order
    (:func:`hsx_async.quantize.encode_rows`)."""
    buffers = [rows] if isinstance(rows, memoryview) else list(rows)
    layers = len(plan.capture_ids)
    per_row = target.storage.row_bytes(layers, plan.hidden_size)
    expected, got = num_tokens * per_row, sum(b.nbytes for b in buffers)
    if got != expected:
        raise DumpError(
            f"rid {target.rid}: {got} bytes of rows, expected {expected} "
            f"({num_tokens} tokens × {layers} layers × {plan.hidden_size} as "
            f"{target.storage.describe()}: {per_row} bytes a row)"
        )
    meta = DumpMeta(
        rid=target.rid,
        num_tokens=num_tokens,
        hidden_size=plan.hidden_size,
        aux_layers=plan.aux_layers,
        parts=((0, num_tokens),),
        model=model,
        server=server,
        final_state=FINAL_STATE,
        storage=target.storage,
    )
    with request_dir_fd(root, target.ns, target.rid) as fd:
        write_part_vectored(fd, 0, num_tokens, [[b.cast("B") for b in buffers]])
        write_meta(fd, meta)
